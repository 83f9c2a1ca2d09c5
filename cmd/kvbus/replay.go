package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/term"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/cluster"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/workers"
	"github.com/nats-io/nats-server/v2/server"
)

// progressOut is standard error when it is a terminal, else nil: long runs
// show a progress bar on a terminal and stay quiet otherwise.
func progressOut() io.Writer {
	if term.IsTerminal(int(os.Stderr.Fd())) {
		return os.Stderr
	}
	return nil
}

type captureCmd struct {
	Record captureRecordCmd `cmd:"" default:"withargs" help:"Copy requests from the bus into a capture file (the default)."`
	Stats  captureStatsCmd  `cmd:"" help:"Summarise a capture file."`
}

type captureRecordCmd struct {
	busFlags `embed:""`
	Out      string        `name:"out" required:"" type:"path" help:"Capture file to write."`
	Follow   bool          `name:"follow" help:"Keep capturing new requests until interrupted."`
	Since    time.Time     `name:"since" format:"2006-01-02T15:04:05Z07:00" help:"Start at requests logged at or after this time (RFC 3339)."`
	FromSeq  uint64        `name:"from-seq" help:"Start at this sequence of the request log."`
	Until    time.Time     `name:"until" format:"2006-01-02T15:04:05Z07:00" help:"Stop at requests logged after this time (RFC 3339)."`
	For      time.Duration `name:"for" help:"With --follow, stop after this long."`
}

func (c *captureRecordCmd) Run(ctx context.Context) error {
	log := c.logger()
	onStop(ctx, log, func() stopPlan {
		return stopPlan{doing: "closing " + c.Out + " with the requests captured so far", inFlight: -1}
	})
	if c.For > 0 && !c.Follow {
		return errors.New("--for bounds a --follow capture: add --follow, or bound a capture of the log with --until")
	}
	cfg := replay.CaptureConfig{Subjects: c.subjects(), Follow: c.Follow, Since: c.Since, FromSeq: c.FromSeq, Until: c.Until, Logger: log}
	if err := cfg.Validate(); err != nil {
		return err
	}
	out, err := createOutput(c.Out)
	if err != nil {
		return err
	}
	ctx, nc, err := connect(ctx, c.natsFlags, "kvbus-capture", "", log)
	if err != nil {
		out.discard()
		return err
	}
	defer drain(nc)
	if c.For > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.For)
		defer cancel()
	}
	cfg.Conn = nc
	n, err := replay.Capture(ctx, cfg, out)
	if err != nil && n == 0 {
		out.discard() // an existing file stays as it was
		return err
	}
	if n == 0 {
		// A file of no request replays nothing, and would have replaced
		// an earlier capture of the same name.
		out.discard()
		if c.Follow {
			return fmt.Errorf("no request was logged while the capture followed the log: %s is left as it was (nothing was written)", c.Out)
		}
		return fmt.Errorf("the request log holds no request in the range asked for: %s is left as it was (nothing was written); check --since, --from-seq and --until (without them capture copies the whole log)", c.Out)
	}
	if cerr := out.commit(); cerr != nil {
		return errors.Join(err, cerr)
	}
	if err != nil {
		return fmt.Errorf("%w (the %d requests captured before it are in %s)", err, n, c.Out)
	}
	log.Info("capture done", "file", c.Out, "requests", n)
	return nil
}

type captureStatsCmd struct {
	File string `arg:"" type:"existingfile" help:"Capture file."`
}

func (c *captureStatsCmd) Run() error {
	f, err := os.Open(c.File)
	if err != nil {
		return err
	}
	defer f.Close()
	s, err := replay.Stats(f)
	if s != nil {
		s.Write(os.Stdout)
	}
	return err
}

// traceFlags say which part of a trace to replay, and how.
type traceFlags struct {
	Format        string  `name:"format" enum:"auto,capture,mooncake,tracelab,azure" default:"auto" help:"Trace format: auto (told by the file's content), capture (kvbus capture), mooncake (JSONL), tracelab (JSONL round trace) or azure (LLM inference CSV)."`
	Speed         float64 `name:"speed" positive:"" default:"1" help:"Replay speed: the trace clock is divided by this."`
	Mode          string  `name:"mode" enum:"open,session" default:"open" help:"open: each request at its trace time; session: closed loop per session (a turn waits for the previous answer plus the original gap / speed)."`
	Limit         int     `name:"limit" help:"Replay at most this many requests (after --skip)."`
	Skip          int     `name:"skip" help:"Skip this many requests first."`
	InferSessions bool    `name:"infer-sessions" help:"Give sessions to a trace without them: a request continues the session whose previous prompt it extends."`
	JSON          string  `name:"json" type:"path" help:"Also write the report(s) as JSON to this file."`
	HTML          string  `name:"html" type:"path" help:"Also write one self-contained HTML page of plots (TTFT CDF, hit ratio by turn against the ideal, local/remote cache, requests per group over time) to this file."`
}

// write writes the reports as JSON and HTML where the flags say.
func (f traceFlags) write(title string, reports []*replay.Report) error {
	if f.JSON != "" {
		if err := replay.WriteJSON(f.JSON, reports); err != nil {
			return err
		}
	}
	if f.HTML != "" {
		return replay.WriteHTMLFile(f.HTML, title, reports)
	}
	return nil
}

// check fails on flags no run can use, and when --json or --html cannot be
// written: before a run, not after it.
func (f traceFlags) check() error {
	if f.Speed <= 0 || math.IsInf(f.Speed, 0) || math.IsNaN(f.Speed) {
		return fmt.Errorf("--speed %v must be a positive number", f.Speed)
	}
	if f.Limit < 0 || f.Skip < 0 {
		return fmt.Errorf("--limit (%d) and --skip (%d) cannot be negative (0: no limit, none skipped)", f.Limit, f.Skip)
	}
	return checkOutputs(map[string]string{"--json": f.JSON, "--html": f.HTML})
}

// load reads the part of the trace to replay; what a damaged capture left
// out is logged. blockSize is the cluster's, by which --infer-sessions
// matches a capture's prompts.
func (f traceFlags) load(path string, blockSize int, log *slog.Logger) (*replay.Trace, error) {
	tr, err := replay.ReadTraceFile(path, f.Format)
	if err != nil {
		return nil, err
	}
	for _, d := range tr.Damage {
		log.Warn("damaged "+tr.Format+" file: replaying what it holds", "file", path, "left_out", d)
	}
	if len(tr.Items) == 0 {
		return nil, fmt.Errorf("%s holds no request to replay (read as a %s file): check that it is the file you meant", path, tr.Format)
	}
	if f.InferSessions {
		// A trace's prompts are made of its 512-token blocks; a capture's
		// are real prompts, matched as the schedulers match them, by the
		// cluster's blocks (512-token ones made a session of every request
		// shorter than a block, and one session of every conversation
		// that opened with the same long system prompt).
		blockTokens := replay.MooncakeBlockTokens
		if tr.Format == replay.FormatCapture {
			blockTokens = blockSize
		}
		replay.InferSessions(tr, blockTokens)
	}
	if total := len(tr.Items); f.Skip >= total {
		return nil, fmt.Errorf("--skip %d leaves none of the %d requests of %s: give a smaller --skip", f.Skip, total, path)
	}
	if f.Skip > 0 {
		tr.Items = tr.Items[f.Skip:]
	}
	if f.Limit > 0 && f.Limit < len(tr.Items) {
		tr.Items = tr.Items[:f.Limit]
	}
	// Times are relative to the first replayed request.
	first := tr.Items[0].At
	for i := range tr.Items {
		tr.Items[i].At -= first
	}
	return tr, nil
}

type replayCmd struct {
	busFlags   `embed:""`
	traceFlags `embed:""`
	File       string        `arg:"" type:"existingfile" help:"Capture file or trace to replay."`
	Target     string        `name:"target" required:"" help:"nats://HOST:PORT (publish Requests onto the bus) or http://HOST:PORT (through the frontend)."`
	Model      string        `name:"model" help:"Model every request asks for, a capture's included (replaying a capture on a cluster that serves another model name). Default: each captured request's own model; kvbus-sim for a trace."`
	Policy     string        `name:"policy-label" default:"replay" help:"Label of the report's policy column."`
	BlockSize  int           `name:"block-size" positive:"" default:"16" help:"The cluster's block size, for ideal_hit_ratio (and --infer-sessions of a capture)."`
	Timeout    time.Duration `name:"timeout" positive:"" default:"10m" help:"Deadline of one request."`
	APIKey     string        `name:"api-key" env:"KVBUS_API_KEY,OPENAI_API_KEY" help:"With an http:// target, the frontend's --api-key, sent as a bearer token."`
}

func (c *replayCmd) Run(ctx context.Context) error {
	log := c.logger()
	onStop(ctx, log, func() stopPlan {
		return stopPlan{doing: "abandoning the requests in flight and reporting those sent so far", inFlight: -1}
	})
	if c.BlockSize < 1 {
		return errors.New("--block-size must be at least 1")
	}
	if err := c.check(); err != nil {
		return err
	}
	tr, err := c.load(c.File, c.BlockSize, log)
	if err != nil {
		return err
	}
	u, err := url.Parse(c.Target)
	if err != nil {
		// url's error quotes the URL, password and all.
		return fmt.Errorf("--target %s: not a URL; want nats://HOST:PORT or http://HOST:PORT", bus.RedactURLs(c.Target))
	}
	natsURL := c.NATSURL
	if u.Scheme == "nats" || u.Scheme == "tls" {
		natsURL = c.Target
	}
	nf := c.natsFlags
	nf.NATSURL = natsURL
	bc := nf.config("kvbus-replay", "", log)
	overHTTP := u.Scheme != "nats" && u.Scheme != "tls"
	if overHTTP {
		// The bus only tells which group served each request, and how
		// much of its cache came from other groups: a replay through the
		// frontend does not wait long for it.
		bc.ConnectTimeout = 2 * time.Second
		log.Info("connecting to NATS to learn each request's group (give --nats-url the cluster's)", "nats_url", bus.RedactURLs(natsURL))
	}
	nc, err := bus.Connect(ctx, bc)
	if err != nil {
		if !overHTTP {
			return err
		}
		log.Warn("replaying over HTTP without the bus: groups and the local/remote split of cached tokens will not be reported", "err", err)
	} else {
		defer drain(nc)
	}
	r, err := replay.New(replay.Config{
		Target: c.Target, Conn: nc, Subjects: c.subjects(), Model: c.Model, Speed: c.Speed, Mode: c.Mode,
		Timeout: c.Timeout, APIKey: c.APIKey, Progress: progressOut(), Logger: log,
	})
	if err != nil {
		return err
	}
	log.Info("replaying", "file", c.File, "format", tr.Format, "requests", len(tr.Items), "sessions", tr.Sessions(), "target", bus.RedactURLs(c.Target), "speed", c.Speed, "mode", c.Mode)
	results, elapsed, err := r.Run(ctx, tr.Items)
	// Each request's model seeds its block hashes, as the replay asks for
	// it: --model, else a captured request's own.
	rep := replay.Summarize(c.Policy, results, replay.IdealHitRatio(tr.Items, c.Model, c.BlockSize), elapsed)
	rep.Trace = c.File
	if rep.Failed == 0 && rep.HitRatio != nil && *rep.HitRatio > rep.IdealHitRatio+1e-9 {
		// The ideal counts only what the replay itself stored. (With
		// failures the two count different requests: outcome says so.)
		log.Warn("hit_ratio is over ideal_hit_ratio: the cluster's cache held prompts of this trace before the replay (an earlier replay of it?); for a measurement, replay onto a cluster started afresh, or use kvbus bench",
			"hit_ratio", *rep.HitRatio, "ideal_hit_ratio", rep.IdealHitRatio)
	}
	if werr := replay.WriteTable(os.Stdout, []*replay.Report{rep}); werr != nil {
		return werr
	}
	if werr := c.write("kvbus replay: "+c.File, []*replay.Report{rep}); werr != nil {
		return werr
	}
	if err != nil {
		if ctx.Err() != nil {
			return interrupted(results, err)
		}
		return err
	}
	return outcome(log, rep)
}

// interrupted is the error of a replay stopped (Ctrl-C) before its end:
// what the report printed before it holds.
func interrupted(results []replay.Result, err error) error {
	sent := 0
	for _, r := range results {
		if r.ReqID != "" {
			sent++
		}
	}
	return fmt.Errorf("replay interrupted: the report holds what happened to the %d of the %d requests sent before it "+
		"(those in flight count as failed: \"stopped\"); the %d never sent count as failed too (\"not sent\"): %w",
		sent, len(results), len(results)-sent, err)
}

// policyLabel is " (policy P)", or "" for a replay without a label.
func policyLabel(p string) string {
	if p == "" {
		return ""
	}
	return " (policy " + p + ")"
}

// outcome fails a run in which no request succeeded (a script must not
// take it for a measurement), naming the most frequent error, and warns
// that a run's hit ratios count only the requests that succeeded.
func outcome(log *slog.Logger, reports ...*replay.Report) error {
	for _, rep := range reports {
		if rep.Failed == 0 {
			continue
		}
		worst, n := "", 0
		for e, k := range rep.Errors {
			if k > n || (k == n && e < worst) {
				worst, n = e, k
			}
		}
		if rep.OK == 0 {
			return fmt.Errorf("none of the %d requests succeeded%s; the most frequent error (%d of them): %s", rep.Requests, policyLabel(rep.Policy), n, worst)
		}
		log.Warn("some requests failed: latencies and hit_ratio count only those that succeeded, ideal_hit_ratio every request of the trace",
			"policy", rep.Policy, "failed", rep.Failed, "of", rep.Requests, "most_frequent_error", worst)
	}
	return nil
}

type tapCmd struct {
	busFlags `embed:""`
	Session  string `name:"session" help:"Only this session's messages (requests, ReqMetas, results, outputs)."`
	Subject  string `name:"subject" help:"Subject to tap (default: every kvbus subject)."`
}

func (c *tapCmd) Run(ctx context.Context) error {
	log := c.logger()
	if err := checkTapSubject(c.Subject); err != nil {
		return err
	}
	ctx, nc, err := connect(ctx, c.natsFlags, "kvbus-tap", "", log)
	if err != nil {
		return err
	}
	defer closeConn(nc)
	return roleErr(ctx, replay.Tap(ctx, replay.TapConfig{Conn: nc, Subjects: c.subjects(), SessionID: c.Session, Subject: c.Subject}, os.Stdout))
}

// checkTapSubject refuses a --subject NATS would refuse, before tapping
// (NATS said only "nats: invalid subject", naming no flag), by the server's
// own rule.
func checkTapSubject(subject string) error {
	if subject == "" || server.IsValidSubject(subject) {
		return nil
	}
	return fmt.Errorf("--subject %q is not a NATS subject: give dot-separated tokens, none empty or with spaces, * for one token and > only as the last (kvbus.meta.>)", subject)
}

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
	if err := fitStores(c.Payload, c.Capacity, c.Groups*c.Ranks, capacity); err != nil {
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

// reportCmd redraws the plots of a JSON report.
type reportCmd struct {
	HTML string `name:"html" type:"path" required:"" help:"Write the HTML page here."`
	File string `arg:"" name:"report.json" type:"existingfile" help:"A report written by kvbus bench or kvbus replay with --json."`
}

func (c *reportCmd) Run() error {
	reports, err := replay.ReadJSONFile(c.File)
	if err != nil {
		return err
	}
	return replay.WriteHTMLFile(c.HTML, "kvbus report: "+c.File, reports)
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
