package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvbus/kvbus/cluster"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/workers"
)

type benchCmd struct {
	logFlags   `embed:""`
	pprofFlags `embed:""`
	traceFlags `embed:""`
	Trace      string        `name:"trace" required:"" type:"existingfile" help:"Trace or capture file."`
	Policies   string        `name:"policies" default:"kv,session,round-robin,random" help:"Comma-separated policies to compare."`
	Groups     int           `name:"groups" positive:"" default:"4" help:"Worker groups."`
	Ranks      int           `name:"ranks" positive:"" default:"4" help:"Ranks per group."`
	Profile    string        `name:"model-profile" default:"llama-3.1-8b" help:"KV shape of the model."`
	Capacity   string        `name:"kv-capacity" default:"8Mtok" help:"Block store capacity per rank (size or tokens)."`
	Payload    string        `name:"kv-payload" enum:"bytes,accounting" default:"accounting" help:"What a rank keeps per block: accounting (an 8-byte digest, charged the full size) or bytes (the full deterministic bytes, as serve keeps by default: memory of --kv-capacity per rank)."`
	Evict      string        `name:"evict" enum:"lru,session" default:"lru" help:"Eviction: lru, or session (evict a session's blocks together, as serve's --evict)."`
	Epsilon    float64       `name:"session-epsilon" default:"0.25" help:"Bounded-load slack of the session policy."`
	BlockSize  int           `name:"block-size" positive:"" default:"16" help:"Tokens per KV block."`
	Prefill    time.Duration `name:"prefill-per-token" default:"60us" help:"Sim engine: prefill time per uncached token (scaled by 1/--speed)."`
	Load       time.Duration `name:"load-per-token" default:"5us" help:"Sim engine: load time per cached token (scaled by 1/--speed)."`
	RemoteLoad time.Duration `name:"remote-load-per-token" default:"15us" help:"Sim engine: load time per token read from another group's segment of the pool (scaled by 1/--speed)."`
	Pools      string        `name:"pool" default:"global" help:"Comma-separated KV pool modes to run each policy with: local, global (e.g. local,global for a side-by-side table)."`
	Decode     time.Duration `name:"decode-per-token" default:"10ms" help:"Sim engine: time per output token after the first, which the prefill yields (scaled by 1/--speed)."`
	Timeout    time.Duration `name:"timeout" positive:"" default:"10m" help:"Deadline of one request."`
	Runs       int           `name:"runs" positive:"" default:"1" help:"Run each policy and pool this many times, each on a fresh cluster, and report the requests of all runs together (a short trace's p95 is otherwise one request)."`
}

func (c *benchCmd) Run(ctx context.Context) error {
	log := c.logger()
	onStop(ctx, log, func() stopPlan {
		return stopPlan{doing: "ending the policy running, then reporting those that finished", inFlight: -1}
	})
	if c.BlockSize < 1 || c.Runs < 1 || c.Groups < 1 || c.Ranks < 1 {
		return fmt.Errorf("--block-size (%d), --runs (%d), --groups (%d) and --ranks (%d) must be at least 1", c.BlockSize, c.Runs, c.Groups, c.Ranks)
	}
	if err := c.check(); err != nil {
		return err
	}
	policies, pools, err := c.runs()
	if err != nil {
		return err
	}
	profile, err := workers.LookupModelProfile(c.Profile)
	if err != nil {
		return err
	}
	capacity, err := kvCapacity(c.Capacity, profile.BytesPerTokenPerRank(c.Ranks), c.BlockSize)
	if err != nil {
		return err
	}
	if err := fitStores(c.Payload, c.Capacity, c.Groups*c.Ranks, capacity, rolesCluster); err != nil {
		return err
	}
	tr, err := c.load(c.Trace, c.BlockSize, log)
	if err != nil {
		return err
	}
	if models := tr.Models(); len(models) > 1 {
		// The bench clusters serve one model on every group.
		return fmt.Errorf("%s asks for %d models (%s): a bench cluster serves one; bench a capture of one model, or replay this one with kvbus replay onto a cluster serving them",
			c.Trace, len(models), quoteList(models))
	}
	stopPprof, err := c.startPprof(ctx, log)
	if err != nil {
		return err
	}
	defer stopPprof()
	// The bench's replay gives no --model: a captured request asks for
	// its own.
	ideal := replay.IdealHitRatio(tr.Items, "", c.BlockSize)
	var reports []*replay.Report
	for _, policy := range policies {
		for _, pool := range pools {
			log.Info("bench: starting a cluster", "policy", policy, "pool", pool, "groups", c.Groups, "ranks", c.Ranks,
				"requests", len(tr.Items), "speed", c.Speed)
			rep, err := c.runOne(ctx, tr, policy, pool, capacity, ideal)
			if err != nil {
				switch {
				case ctx.Err() != nil && len(reports) == 0:
					return fmt.Errorf("bench interrupted in policy %s, pool %s, before any policy finished: nothing to report "+
						"(a shorter bench: --limit, a higher --speed, fewer --policies): %w", policy, pool, err)
				case ctx.Err() != nil:
					err = fmt.Errorf("bench interrupted in policy %s, pool %s: the report holds the policies that finished before it (%d): %w",
						policy, pool, len(reports), err)
				default:
					err = fmt.Errorf("policy %s, pool %s: %w", policy, pool, err)
				}
				if len(reports) == 0 {
					return err
				}
				// Interrupted (or failed): the runs that finished are
				// still reported.
				log.Warn("bench stopped; reporting the runs that finished", "finished", len(reports), "err", err)
				return errors.Join(err, c.report(reports))
			}
			rep.Trace = c.Trace
			if len(pools) > 1 {
				rep.Policy += "/" + pool
			}
			reports = append(reports, rep)
		}
	}
	if err := c.report(reports); err != nil {
		return err
	}
	return outcome(log, reports...)
}

// report prints the table and writes the files of the runs done.
func (c *benchCmd) report(reports []*replay.Report) error {
	if err := replay.WriteTable(os.Stdout, reports); err != nil {
		return err
	}
	return c.write("kvbus bench: "+c.Trace, reports)
}

// runs returns the policies and pools to bench, each checked before any
// cluster runs: a typo in the last one must not cost the runs before it.
func (c *benchCmd) runs() (policies, pools []string, err error) {
	for p := range strings.SplitSeq(c.Policies, ",") {
		p = strings.TrimSpace(p)
		if _, err := scheduler.NewPolicy(p, c.Epsilon); err != nil {
			return nil, nil, fmt.Errorf("--policies: %w", err)
		}
		if slices.Contains(policies, p) {
			// Two columns of one name, and two reports no reader of the
			// JSON can tell apart.
			return nil, nil, fmt.Errorf("--policies names %s twice: to run a policy again, give --runs", p)
		}
		policies = append(policies, p)
	}
	for p := range strings.SplitSeq(c.Pools, ",") {
		switch p = strings.TrimSpace(p); p {
		case scheduler.PoolLocal, scheduler.PoolGlobal:
			if slices.Contains(pools, p) {
				return nil, nil, fmt.Errorf("--pool names %s twice: to run a pool again, give --runs", p)
			}
			pools = append(pools, p)
		default:
			return nil, nil, fmt.Errorf("--pool: %q must be %s or %s", p, scheduler.PoolLocal, scheduler.PoolGlobal)
		}
	}
	return policies, pools, nil
}

func (c *benchCmd) runOne(ctx context.Context, tr *replay.Trace, policy, pool string, capacity int64, ideal float64) (*replay.Report, error) {
	var all []replay.Result
	var total time.Duration
	for run := range c.Runs {
		if c.Runs > 1 {
			c.logger().Info("bench: run", "policy", policy, "pool", pool, "run", run+1, "of", c.Runs)
		}
		results, elapsed, err := c.runCluster(ctx, tr, policy, pool, capacity)
		if err != nil {
			return nil, err
		}
		all = append(all, results...)
		total += elapsed
	}
	rep := replay.Summarize(policy, all, ideal, total)
	groups := make([]string, c.Groups)
	for i := range groups {
		groups[i] = cluster.GroupName(i)
	}
	rep.CountGroups(groups)
	if profile, err := workers.LookupModelProfile(c.Profile); err == nil {
		// Every rank of the group reads its shard of each remote token.
		n := rep.RemoteTokens * int64(profile.BytesPerTokenPerRank(c.Ranks)*c.Ranks)
		rep.RemoteBytes = &n
	}
	return rep, nil
}

// runCluster replays the trace once on a fresh in-process cluster.
func (c *benchCmd) runCluster(ctx context.Context, tr *replay.Trace, policy, pool string, capacity int64) ([]replay.Result, time.Duration, error) {
	log := c.logger()
	quiet := c.logFlags
	quiet.LogLevel = "warn" // the cluster's per-request lines would drown the table
	cl, err := cluster.Start(ctx, cluster.Config{
		// The model the requests ask for: a capture's own (a production
		// cluster's name), replay.DefaultModel for a trace's.
		Groups: c.Groups, Ranks: c.Ranks, Model: tr.Models()[0], ModelProfile: c.Profile,
		KVCapacity: capacity, Payload: c.Payload, Evict: c.Evict, BlockSize: c.BlockSize,
		Sim: workers.SimConfig{
			Profile:   workers.SimProfile{PrefillPerToken: c.Prefill, LoadPerToken: c.Load, RemoteLoadPerToken: c.RemoteLoad, DecodePerToken: c.Decode},
			TimeScale: 1 / c.Speed,
		},
		HeartbeatInterval: 250 * time.Millisecond, Policy: policy, Pool: pool, SessionEpsilon: &c.Epsilon, RequestTimeout: c.Timeout,
		Logger: quiet.logger(),
	})
	if err != nil {
		return nil, 0, err
	}
	defer func() {
		cl.Stop()
		if err := cl.Wait(); err != nil {
			log.Warn("bench cluster stopped with an error", "policy", policy, "err", err)
		}
	}()
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := cl.WaitReady(wctx); err != nil {
		return nil, 0, err
	}
	nc, err := cl.Connect("kvbus-bench-replay")
	if err != nil {
		return nil, 0, err
	}
	// No Model: a capture's requests keep their own model, a trace's ask
	// for replay.DefaultModel: the one this cluster serves.
	r, err := replay.New(replay.Config{
		Target: cl.NATSURL, Conn: nc, Speed: c.Speed, Mode: c.Mode, Timeout: c.Timeout,
		Progress: progressOut(), Logger: log,
	})
	if err != nil {
		return nil, 0, err
	}
	return r.Run(ctx, tr.Items)
}

// quoteList is "a", "b", "c".
func quoteList(ss []string) string {
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = strconv.Quote(s)
	}
	return strings.Join(q, ", ")
}
