package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

type workerCmd struct {
	busFlags           `embed:""`
	modelFlags         `embed:""`
	engineFlags        `embed:""`
	engineAdapterFlags `embed:""`
	BlockSize          int           `name:"block-size" positive:"" default:"16" help:"Tokens per KV block: the schedulers' --block-size, and the engine's with --engine openai."`
	Rank               string        `name:"rank" help:"'auto' claims the first free (group, rank) slot through the KVBUS_RANKS bucket (groups g0, g1, … filled in order, --tp-size ranks each; with --group, a rank of that group only); otherwise --group and --tp-rank say it."`
	SlotTTL            time.Duration `name:"slot-ttl" positive:"" min:"100ms" default:"10s" help:"With --rank auto: a slot whose worker stopped refreshing it is free again after this (at least 100ms, JetStream's least)."`
	Group              string        `name:"group" help:"Worker group: one engine instance (a DP replica); default g0. With --rank auto: claim a rank of this group only (for a key of one group, worker-<group>.nk)."`
	TPRank             int           `name:"tp-rank" default:"0" help:"Tensor-parallel rank; rank 0 is the driver and runs the engine."`
	TPSize             int           `name:"tp-size" positive:"" default:"4" help:"Tensor-parallel size: the group's world size."`
	EPRank             int           `name:"ep-rank" negative:"allowed" default:"-1" help:"Expert-parallel rank (default: the TP rank)."`
	EPSize             int           `name:"ep-size" default:"0" help:"Expert-parallel size (default: the TP size)."`
	MetricsAddr        string        `name:"metrics-addr" default:":9090" help:"Address of /metrics and /healthz (empty: off)."`
}

func (c *workerCmd) Run(ctx context.Context) (err error) {
	defer func() { err = c.replicasAdvice(err) }()
	if err := c.checkReplicas(); err != nil {
		return err
	}
	log := c.logger()
	onStop(ctx, log, nil)
	if err := distinctListeners(listener{"--metrics-addr", c.MetricsAddr}, listener{"--pprof-addr", c.PprofAddr}); err != nil {
		return err
	}
	stopPprof, err := c.startPprof(ctx, log)
	if err != nil {
		return err
	}
	defer stopPprof()
	if c.Rank != "" && c.Rank != "auto" {
		return fmt.Errorf("--rank %q: want auto, or give --group and --tp-rank", c.Rank)
	}
	model, err := c.one()
	if err != nil {
		return err
	}
	if c.Group != "" {
		if err := messages.ValidateGroup(c.Group); err != nil {
			return fmt.Errorf("--group: %w", err)
		}
	} else if c.Rank != "auto" {
		c.Group = "g0"
	}
	if err := c.checkSizes(c.TPSize, c.BlockSize, c.Engine == workers.EngineOpenAI); err != nil {
		return err
	}
	if err := c.checkIdentity(); err != nil {
		return err
	}
	// An engine's configuration is checked before anything connects.
	var (
		engine   workers.Engine
		kvEvents *vllmevents.Config
	)
	switch c.Engine {
	case workers.EngineOpenAI:
		if c.TPSize != 1 {
			return fmt.Errorf("--engine openai: a group fronts one engine, which does its own tensor parallelism: give --tp-size 1 (got %d)", c.TPSize)
		}
		if len(c.EngineURL) != 1 {
			return errors.New("--engine openai needs one --engine-url http://HOST:PORT (the engine's base URL)")
		}
		oc, ev, err := c.openAI(0)
		if err != nil {
			return err
		}
		oc.Logger = log
		if engine, err = workers.NewOpenAIEngine(oc); err != nil {
			return err
		}
		if kvEvents = ev; ev == nil {
			log.Warn("no --kv-events: kvbus cannot see the engine's cache, so placement cannot follow it; give vLLM --kv-events-config and kvbus --kv-events")
		}
	default:
		if err := c.openAIOnly(false); err != nil {
			return err
		}
		sim, err := c.engine()
		if err != nil {
			return err
		}
		engine = sim
	}
	metrics, err := listenMetrics(log, c.MetricsAddr)
	if err != nil {
		return err
	}
	// Closed last, after the slot's release and the NATS drain below.
	defer metrics.close()
	// A worker of one group reads the inbox of that group (which
	// worker-<group>.nk allows); one that claims a slot in any group may
	// serve any.
	inbox := bus.InboxPrefix(auth.RoleWorker, c.Group)
	ctx, nc, err := connect(ctx, c.natsFlags, "kvbus-worker", inbox, log)
	if err != nil {
		return err
	}
	defer drain(nc)
	var slot *workers.Slot
	if c.Rank == "auto" {
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		// The slot is claimed through JetStream, whose answers come to the
		// reply inbox: a key that may not read it (a key of one group
		// without --group, another role's) would wait for them for ever,
		// saying nothing. Say now which key or flag it needs.
		if err := checkRankAutoKey(ctx, nc, c.subjects(), c.Group); err != nil {
			return err
		}
		owner, _ := os.Hostname()
		names, err := bus.ResolveNames(ctx, js, c.subjects())
		if err != nil {
			return err
		}
		if slot, err = workers.ClaimSlot(ctx, js, workers.SlotConfig{Bucket: names.SlotBucket, Group: c.Group, Model: model, Size: c.TPSize, TTL: c.SlotTTL, Owner: owner, Replicas: c.Replicas, Logger: log}); err != nil {
			return err
		}
		c.Group, c.TPRank, c.EPRank = slot.Group, slot.Rank, slot.Rank
		defer func() {
			rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			if err := slot.Release(rctx); err != nil {
				log.Warn("cannot release the worker slot; it expires after --slot-ttl", "group", slot.Group, "tp_rank", slot.Rank, "err", err)
			}
		}()
	}
	if c.EPRank < 0 {
		c.EPRank = c.TPRank
	}
	if c.EPSize == 0 {
		c.EPSize = c.TPSize
	}
	reg := newRegistry()
	wm, hm := workers.NewMetrics(reg), bus.NewHandlerMetrics(reg)
	onStop(ctx, log, func() stopPlan { return c.stopPlan(reg, c.handoffOn(), slot != nil) })
	r := newRoles(ctx)
	var current atomic.Pointer[workers.Rank] // the rank running, for /healthz
	ready := func() (bool, string) {
		if rank := current.Load(); rank != nil {
			return rank.Ready()
		}
		return false, "starting: no rank yet"
	}
	metrics.serve(reg, metricsProbe{nc: nc, ready: ready, stopping: r.ctx.Done(),
		drainReason: "worker stopping: its group takes no new requests; it finishes those in flight"}, func(err error) { r.fail("metrics", err) })
	r.run("worker", func(ctx context.Context) error {
		for {
			rank, err := newRank(nc, c.busFlags, c.modelFlags, c.engineFlags, engine, c.Group, c.TPRank, c.TPSize, c.EPRank, c.EPSize, log,
				wm, hm, func(rc *workers.RankConfig) {
					rc.EngineCache, rc.KVEvents, rc.BlockSize = c.Engine == workers.EngineOpenAI, kvEvents, c.BlockSize
				})
			if err != nil {
				return err
			}
			current.Store(rank)
			ranks := newRoles(ctx)
			ranks.run("rank", rank.Run)
			if slot != nil {
				ranks.run("slot", slot.Hold) // losing the slot stops the worker
			}
			err = ranks.wait()
			if slot == nil || !errors.Is(err, workers.ErrRegrouped) || ctx.Err() != nil {
				return err
			}
			// The slot moved to make a whole group: the worker is that
			// rank now, with an empty store.
			c.Group, c.TPRank, c.EPRank = slot.Group, slot.Rank, slot.Rank
		}
	})
	return roleErr(ctx, r.wait())
}

// checkIdentity refuses, before anything connects, a rank no group can
// have (the rank's own check ran only after connecting, so with NATS not
// up yet the worker said "cannot connect" and nothing of its flags), and a
// --tp-rank or --ep-rank given with --rank auto, which picks the rank
// itself (it claimed rank 0 for --tp-rank 2 without a word).
func (c *workerCmd) checkIdentity() error {
	if c.EPRank < -1 {
		// Only -1 means "the TP rank"; -2 was taken for it without a word.
		return fmt.Errorf("--ep-rank %d: give a rank from 0, or -1 (the default) for the TP rank", c.EPRank)
	}
	if c.Rank == "auto" {
		// Named as given: an --ep-rank left at its default is no mistake.
		var given []string
		if c.TPRank != 0 {
			given = append(given, fmt.Sprintf("--tp-rank %d", c.TPRank))
		}
		if c.EPRank >= 0 {
			given = append(given, fmt.Sprintf("--ep-rank %d", c.EPRank))
		}
		if len(given) > 0 {
			return fmt.Errorf("--rank auto claims a free rank itself: drop %s, or drop --rank auto and give --group and --tp-rank", strings.Join(given, " and "))
		}
		return nil
	}
	if c.TPRank >= c.TPSize {
		return fmt.Errorf("--tp-rank %d must be below --tp-size %d (ranks of a group of %d are 0 to %d)", c.TPRank, c.TPSize, c.TPSize, c.TPSize-1)
	}
	ep, epSize := c.EPRank, c.EPSize
	if ep < 0 {
		ep = c.TPRank
	}
	if epSize == 0 {
		epSize = c.TPSize
	}
	if ep >= epSize {
		return fmt.Errorf("--ep-rank %d (the TP rank when not given) must be below --ep-size %d (the TP size when not given)", ep, epSize)
	}
	return nil
}

// checkRankAutoKey checks, before a --rank auto worker claims a slot, that
// its key may read what the slot's group needs (every group's ReqMetas
// without --group) and its reply inbox. Without --group, a refusal also
// names --group: a key of one group (worker-<g>.nk) claims with --rank auto
// --group <g>.
func checkRankAutoKey(ctx context.Context, nc *nats.Conn, subj messages.Subjects, group string) error {
	g := group
	if g == "" {
		g = "*"
	}
	err := bus.CheckPermissions(ctx, nc, bus.RoleCheck{Role: "worker", Group: group, Subscribe: []string{subj.MetaGroup(g)}})
	if err != nil && group == "" {
		return fmt.Errorf("%w. --rank auto without --group may claim a rank of any group, so it needs the key of any group; "+
			"with a key of one group (DIR/worker-<g>.nk) add --group <g>", err)
	}
	return err
}

// stopPlan: a rank finishes its requests within --shutdown-timeout, hands
// its blocks to other groups (--drain-handoff: one more
// --shutdown-timeout at most, after up to 5 heartbeat intervals to see
// who is draining), releases its --rank auto slot (2 s at most) and
// drains NATS.
func (c *workerCmd) stopPlan(reg *prometheus.Registry, handoff, autoSlot bool) stopPlan {
	n := gaugeSum(reg, "kvbus_worker_queue_depth")
	p := stopPlan{inFlight: n, upTo: c.ShutdownTimeout + drainTimeout, bound: "--shutdown-timeout + 5s NATS drain"}
	p.doing = fmt.Sprintf("finishing %s in flight (its group takes no new ones) within --shutdown-timeout", requests(n))
	if handoff {
		p.doing += ", handing its blocks to other groups (--drain-handoff)"
		p.upTo += c.ShutdownTimeout + 5*c.HeartbeatEvery
		p.bound = "2 × --shutdown-timeout + 5 × --heartbeat-interval + 5s NATS drain"
	}
	if autoSlot {
		p.doing += ", releasing its slot"
		p.upTo += 2 * time.Second
		p.bound += " + 2s slot release"
	}
	p.doing += ", then draining NATS"
	return p
}

func newRank(nc *nats.Conn, b busFlags, m modelFlags, e engineFlags, engine workers.Engine, group string, tp, tpSize, ep, epSize int,
	log *slog.Logger, wm *workers.Metrics, hm *bus.HandlerMetrics, with func(*workers.RankConfig)) (*workers.Rank, error) {
	profile, err := workers.LookupModelProfile(e.ModelProfile)
	if err != nil {
		return nil, err
	}
	capacity, err := workers.ParseCapacity(e.KVCapacity, profile.BytesPerTokenPerRank(tpSize))
	if err != nil {
		return nil, fmt.Errorf("--kv-capacity: %w", err)
	}
	handoff, err := e.drainHandoff(profile.BytesPerTokenPerRank(tpSize))
	if err != nil {
		return nil, err
	}
	replay, err := e.streamReplay()
	if err != nil {
		return nil, err
	}
	model, err := m.one()
	if err != nil {
		return nil, err
	}
	cfg := workers.RankConfig{
		Conn: nc, Subjects: b.subjects(), Group: group, TPRank: tp, TPSize: tpSize, EPRank: ep, EPSize: epSize,
		Model: model, Profile: profile, CapacityBytes: capacity, Payload: e.KVPayload, Evict: e.Evict, Engine: engine,
		HeartbeatInterval: e.HeartbeatEvery, ShutdownTimeout: e.ShutdownTimeout, SaveWait: e.SaveWait, DrainHandoff: handoff,
		ReplayBytes: replay, Logger: log, Metrics: wm, HandlerMetrics: hm,
	}
	if with != nil {
		with(&cfg)
	}
	return workers.NewRank(cfg)
}
