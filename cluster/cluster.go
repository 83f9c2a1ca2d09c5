// Package cluster runs a whole kvbus in one process: an embedded NATS server
// (or an external one), scheduler replicas, worker groups of ranks and,
// optionally, the HTTP frontend. `kvbus serve`, `kvbus bench` and testenv
// build on it. Every role has its own NATS connection, as separate processes
// would.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/workers"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// Config describes an in-process cluster. Zero values take the defaults
// noted.
type Config struct {
	// NATSURL, if set, is an external server; otherwise an embedded server
	// listens on NATSAddr (default 127.0.0.1:0, a free port) with JetStream
	// in DataDir (default a temporary directory).
	NATSURL  string
	NATSAddr string
	DataDir  string
	Subjects messages.Subjects

	Groups int // default 1
	Ranks  int // ranks per group, default 4
	Model  string
	// ModelProfile names the KV shape (default "llama-3.1-8b").
	ModelProfile string
	// KVCapacity per rank in bytes (default 1 GiB); Payload and Evict as the
	// workers' --kv-payload and --evict.
	KVCapacity        int64
	Payload, Evict    string
	Sim               workers.SimConfig
	HeartbeatInterval time.Duration // default 1 s
	ShutdownTimeout   time.Duration // ranks' drain, default 10 s
	SaveWait          time.Duration // ranks' --save-wait
	DrainHandoff      int64         // ranks' --drain-handoff in bytes (0: off)
	StreamReplay      int64         // drivers' --stream-replay in bytes (0: the default, negative: off)
	// StoreDelays slows the store thread of the ranks with these tp_ranks
	// (fault injection: a rank that saves late).
	StoreDelays map[int]time.Duration
	// DropReqMetas makes the ranks with these tp_ranks ignore their first
	// N ReqMetas (fault injection: lost core NATS messages).
	DropReqMetas map[int]int
	// DelayFirstReqMeta makes the ranks with these tp_ranks (in every
	// group) handle their first ReqMeta this late.
	DelayFirstReqMeta map[int]time.Duration
	// Engines, if set, puts a model server behind each group (--engine
	// openai) instead of the sim: group gi fronts Engines[i] with one rank,
	// and Groups and Ranks are ignored.
	Engines []EngineBackend
	// AuthDir, if set, holds the keys `kvbus auth init` wrote: the embedded
	// server loads its nats-auth.conf and every role connects with its own
	// key (frontend, scheduler, worker; admin for other connections).
	AuthDir string
	// MaxPayload of the embedded server (default: bus.StartServer's).
	MaxPayload int32

	Schedulers int    // replicas, default 1
	Policy     string // default "kv"
	// SessionEpsilon is the session policy's slack; nil: 0.25 (0 is a
	// value: no slack).
	SessionEpsilon   *float64
	BlockSize        int
	HeartbeatTimeout time.Duration
	RequestTimeout   time.Duration
	SessionTTL       time.Duration
	MaxSessions      int // scheduler.Config.MaxSessions
	NoGroupWait      time.Duration
	// FrontendGoneAfter is scheduler.Config's (0: its default).
	FrontendGoneAfter time.Duration
	ResendAfter       time.Duration
	// Pool is the schedulers' --pool: global (default) or local.
	Pool string
	// IndexGroups is the schedulers' IndexGroups (0: MaxIndexedGroups).
	IndexGroups int

	// Frontend, if set, is served too; Conn, Subjects, Logger and Registry
	// are filled in.
	Frontend *frontend.Config

	Logger *slog.Logger
	// Registry receives the metrics of the frontend, the ranks and the first
	// scheduler; other replicas get registries of their own.
	Registry *prometheus.Registry
}

// EngineBackend is a group's model server: how to reach it and, if it
// publishes them, its KV events.
type EngineBackend struct {
	OpenAI   workers.OpenAIConfig
	KVEvents *vllmevents.Config
	// KVEventsSilence is the rank's RankConfig.KVEventsSilence (zero: its
	// default).
	KVEventsSilence time.Duration
}

// Cluster is a running in-process cluster.
type Cluster struct {
	cfg     Config
	NATS    *bus.Server // nil with an external server
	NATSURL string
	// Schedulers are the replicas, with their registries.
	Schedulers          []*scheduler.Scheduler
	SchedulerRegistries []*prometheus.Registry
	Frontend            *frontend.Server // nil without Config.Frontend

	log     *slog.Logger
	profile workers.ModelProfile
	wm      *workers.Metrics
	hm      *bus.HandlerMetrics

	ctx    context.Context
	cancel context.CancelFunc
	// The roles stop in the order a request crosses them backwards, so
	// that what the frontend accepted is answered: the frontend first
	// (ctx), then, once it returned, the schedulers (schedCtx), then the
	// ranks (rankCtx). See stopInOrder.
	schedCtx, rankCtx     context.Context
	stopScheds, stopRanks context.CancelFunc
	feDone                chan struct{} // closed when the frontend's Run returned; nil without one
	wg                    sync.WaitGroup
	errMu                 sync.Mutex
	err                   error

	mu        sync.Mutex
	conns     []*nats.Conn
	ranks     map[rankKey]*rankRun
	schedRuns []*rankRun
	engines   map[string]workers.Engine
}

type rankKey struct {
	group string
	rank  int
}

// rankRun is a running rank or scheduler.
type rankRun struct {
	rank *workers.Rank
	nc   *nats.Conn
	stop context.CancelFunc
	done chan struct{}
}

func (c *Config) defaults() {
	if c.NATSAddr == "" {
		c.NATSAddr = "127.0.0.1:0"
	}
	if c.Groups == 0 {
		c.Groups = 1
	}
	if c.Ranks == 0 {
		c.Ranks = 4
	}
	if c.Model == "" {
		c.Model = "kvbus-sim"
	}
	if c.ModelProfile == "" {
		c.ModelProfile = "llama-3.1-8b"
	}
	if c.KVCapacity == 0 {
		c.KVCapacity = 1 << 30
	}
	if c.Schedulers == 0 {
		c.Schedulers = 1
	}
	if c.Policy == "" {
		c.Policy = scheduler.PolicyKV
	}
	if c.SessionEpsilon == nil {
		eps := 0.25
		c.SessionEpsilon = &eps
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if len(c.Engines) > 0 { // one rank per model server
		// Engines read only their own cache: no LoadSpec may name another
		// group as a source.
		c.Groups, c.Ranks, c.Pool = len(c.Engines), 1, scheduler.PoolLocal
		if c.Frontend != nil {
			fc := *c.Frontend
			fc.Passthrough = true
			c.Frontend = &fc
		}
	}
	if c.Registry == nil {
		c.Registry = prometheus.NewRegistry()
	}
}

// ErrConfig is wrapped when Start refuses a Config.
var ErrConfig = errors.New("cluster: bad configuration")

// Validate checks what the cluster itself decides, before anything
// starts: Groups (--groups) and Ranks (--ranks) are not negative (0: 1
// and 4; ignored with Engines), Schedulers is not negative (0: 1; a
// negative count started none, and every request waited for its
// timeout), ModelProfile (--model-profile) is a known profile ("" for the
// default), and Subjects (--subject-prefix) is valid. The other fields are
// checked by the roles they configure (bus.ServerConfig, workers.RankConfig,
// scheduler.Config, frontend.Config) as Start starts them. Errors wrap
// ErrConfig. Start calls it.
func (c Config) Validate() error {
	if len(c.Engines) == 0 && (c.Groups < 0 || c.Ranks < 0) {
		return fmt.Errorf("%w: --groups (%d) and --ranks (%d) must be at least 1 (0: 1 and 4)", ErrConfig, c.Groups, c.Ranks)
	}
	if c.Schedulers < 0 {
		return fmt.Errorf("%w: Schedulers %d must be at least 1 (0: 1)", ErrConfig, c.Schedulers)
	}
	if c.ModelProfile != "" {
		if _, err := workers.LookupModelProfile(c.ModelProfile); err != nil {
			return fmt.Errorf("%w: --model-profile: %w", ErrConfig, err)
		}
	}
	if err := c.Subjects.Validate(); err != nil {
		return fmt.Errorf("%w: --subject-prefix: %w", ErrConfig, err)
	}
	// Checked by the schedulers too, but only once NATS and every rank
	// had started.
	if c.Policy != "" {
		eps := 0.25
		if c.SessionEpsilon != nil {
			eps = *c.SessionEpsilon
		}
		if _, err := scheduler.NewPolicy(c.Policy, eps); err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
	}
	if c.Pool != "" && c.Pool != scheduler.PoolLocal && c.Pool != scheduler.PoolGlobal {
		return fmt.Errorf("%w: --pool %q must be %s or %s", ErrConfig, c.Pool, scheduler.PoolLocal, scheduler.PoolGlobal)
	}
	return nil
}

// Start starts the cluster; it runs until ctx ends or Stop is called. Use
// WaitReady to wait until every group is ready. It calls cfg.Validate
// first.
func Start(ctx context.Context, cfg Config) (*Cluster, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.defaults()
	profile, err := workers.LookupModelProfile(cfg.ModelProfile)
	if err != nil {
		return nil, err
	}
	c := &Cluster{
		cfg: cfg, log: cfg.Logger, profile: profile,
		wm: workers.NewMetrics(cfg.Registry), hm: bus.NewHandlerMetrics(cfg.Registry),
		ranks: map[rankKey]*rankRun{}, engines: map[string]workers.Engine{},
	}
	c.ctx, c.cancel = context.WithCancel(ctx)
	c.schedCtx, c.stopScheds = context.WithCancel(context.WithoutCancel(c.ctx))
	c.rankCtx, c.stopRanks = context.WithCancel(context.WithoutCancel(c.ctx))
	go c.stopInOrder()
	c.NATSURL = cfg.NATSURL
	if c.NATSURL == "" {
		if c.NATS, err = bus.StartServer(bus.ServerConfig{Addr: cfg.NATSAddr, DataDir: cfg.DataDir, MaxPayload: cfg.MaxPayload, AuthConfig: c.authConfig(), Logger: c.log.With("role", "nats")}); err != nil {
			c.cancel() // ends stopInOrder
			return nil, err
		}
		c.NATSURL = c.NATS.ClientURL()
	}
	if err := c.start(); err != nil {
		c.cancel()
		_ = c.Wait()
		return nil, err
	}
	return c, nil
}

func (c *Cluster) start() error {
	cfg := c.cfg
	var feConn *nats.Conn
	if cfg.Frontend != nil {
		// The frontend's request-log limits must hold even though a
		// scheduler starts first: whoever creates the log sets them.
		var err error
		if feConn, err = c.connect("kvbus-frontend"); err != nil {
			return err
		}
		if err := c.ensureRequestLog(feConn); err != nil {
			return err
		}
	}
	for g := range cfg.Groups {
		group := GroupName(g)
		var engine workers.Engine
		var err error
		if len(cfg.Engines) > 0 {
			oc := cfg.Engines[g].OpenAI
			oc.Logger = c.log.With("group", group)
			engine, err = workers.NewOpenAIEngine(oc)
		} else {
			engine, err = workers.NewSimEngine(cfg.Sim)
		}
		if err != nil {
			return err
		}
		c.engines[group] = engine
		for r := range cfg.Ranks {
			if err := c.startRank(group, r); err != nil {
				return err
			}
		}
	}
	for range cfg.Schedulers {
		if err := c.startScheduler(); err != nil {
			return err
		}
	}
	if cfg.Frontend != nil {
		fc := *cfg.Frontend
		fc.Conn, fc.Subjects, fc.Logger, fc.Registry = feConn, cfg.Subjects, c.log, cfg.Registry
		if len(fc.Models) == 0 {
			fc.Models = []string{cfg.Model}
		}
		if fc.RequestTimeout == 0 {
			fc.RequestTimeout = cfg.RequestTimeout
		}
		fe, err := frontend.New(fc)
		if err != nil {
			return err
		}
		c.Frontend = fe
		done := make(chan struct{})
		c.mu.Lock()
		c.feDone = done
		c.mu.Unlock()
		c.run(c.ctx, "frontend", func(ctx context.Context) error {
			defer close(done)
			return fe.Run(ctx)
		})
	}
	return nil
}

// startScheduler starts the next scheduler replica (Schedulers[i]); the
// first one registers its metrics in Config.Registry.
func (c *Cluster) startScheduler() error {
	cfg := c.cfg
	var requestLog bus.StreamConfig
	if cfg.Frontend != nil {
		requestLog = cfg.Frontend.RequestLog()
	}
	c.mu.Lock()
	i := len(c.schedRuns)
	c.mu.Unlock()
	policy, err := scheduler.NewPolicy(cfg.Policy, *cfg.SessionEpsilon)
	if err != nil {
		return err
	}
	reg := cfg.Registry
	if i > 0 {
		reg = prometheus.NewRegistry()
	}
	nc, err := c.connect(fmt.Sprintf("kvbus-scheduler-%d", i))
	if err != nil {
		return err
	}
	s, err := scheduler.New(scheduler.Config{
		Conn: nc, Subjects: cfg.Subjects, Policy: policy, BlockSize: cfg.BlockSize,
		HeartbeatTimeout: cfg.HeartbeatTimeout, RequestTimeout: cfg.RequestTimeout, SessionTTL: cfg.SessionTTL, MaxSessions: cfg.MaxSessions,
		StreamReplicas: 1, Logger: c.log, Registerer: reg,
		NoGroupWait: cfg.NoGroupWait, ResendAfter: cfg.ResendAfter, RequestLog: requestLog, Pool: cfg.Pool,
		IndexGroups: cfg.IndexGroups, FrontendGoneAfter: cfg.FrontendGoneAfter,
	})
	if err != nil {
		return err
	}
	ctx, stop := context.WithCancel(c.schedCtx)
	sr := &rankRun{nc: nc, stop: stop, done: make(chan struct{})}
	c.mu.Lock()
	c.Schedulers = append(c.Schedulers, s)
	c.SchedulerRegistries = append(c.SchedulerRegistries, reg)
	c.schedRuns = append(c.schedRuns, sr)
	c.mu.Unlock()
	c.run(ctx, fmt.Sprintf("scheduler %d", i), func(ctx context.Context) error {
		defer close(sr.done)
		return s.Run(ctx)
	})
	return nil
}

// StartScheduler starts one more scheduler replica, Schedulers[len-1], as
// an operator starting (or restarting, after KillScheduler) one would: it
// is not the first, so its metrics go to a registry of its own.
func (c *Cluster) StartScheduler() error { return c.startScheduler() }

// ensureRequestLog creates the request log with the frontend's limits.
func (c *Cluster) ensureRequestLog(nc *nats.Conn) error {
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("cluster: jetstream: %w", err)
	}
	rl := c.cfg.Frontend.RequestLog()
	rl.Subjects = c.cfg.Subjects
	ctx, cancel := context.WithTimeout(bus.WithLogger(c.ctx, c.log), 30*time.Second)
	defer cancel()
	_, err = bus.EnsureRequestStream(ctx, js, rl)
	return err
}

func (c *Cluster) connect(name string) (*nats.Conn, error) {
	// Schedulers do not receive their own publications (save plans).
	noEcho := strings.HasPrefix(name, "kvbus-scheduler")
	role, group := roleOf(name)
	nc, err := bus.Connect(c.ctx, bus.Config{URL: c.NATSURL, Name: name, Logger: c.log, NoEcho: noEcho, NKeySeedFile: c.seed(name),
		InboxPrefix: bus.InboxPrefix(role, group)})
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.conns = append(c.conns, nc)
	c.mu.Unlock()
	return nc, nil
}

// authConfig is the embedded server's authorization file ("" without
// AuthDir).
func (c *Cluster) authConfig() string {
	if c.cfg.AuthDir == "" {
		return ""
	}
	return filepath.Join(c.cfg.AuthDir, auth.ConfigFile)
}

// seed is the key a connection of this name uses: its role's, as separate
// processes would; "" without AuthDir.
func (c *Cluster) seed(name string) string {
	if c.cfg.AuthDir == "" {
		return ""
	}
	role, _ := roleOf(name)
	return filepath.Join(c.cfg.AuthDir, role+".nk")
}

// roleOf is the role of a connection of this name (admin for any other
// than the roles' own and "kvbus-observer…"), and a worker's group:
// "kvbus-worker-g0-1" is the worker of group g0, which reads that group's
// inbox (worker.nk allows it).
func roleOf(name string) (role, group string) {
	for _, r := range []string{auth.RoleFrontend, auth.RoleScheduler, auth.RoleWorker, auth.RoleObserver} {
		rest, ok := strings.CutPrefix(name, "kvbus-"+r)
		if !ok {
			continue
		}
		if r == auth.RoleWorker {
			if i := strings.LastIndex(rest, "-"); i > 0 {
				group = rest[1:i]
			}
		}
		return r, group
	}
	return auth.RoleAdmin, ""
}

func (c *Cluster) run(ctx context.Context, name string, f func(context.Context) error) {
	c.wg.Go(func() {
		if err := f(ctx); err != nil && !errors.Is(err, context.Canceled) {
			c.errMu.Lock()
			if c.err == nil {
				c.err = err
				if !strings.HasPrefix(err.Error(), name+":") { // package errors name their role already
					c.err = fmt.Errorf("%s: %w", name, err)
				}
			}
			c.errMu.Unlock()
			c.cancel()
		}
	})
}

func (c *Cluster) startRank(group string, r int) error {
	cfg := c.cfg
	nc, err := c.connect(fmt.Sprintf("kvbus-worker-%s-%d", group, r))
	if err != nil {
		return err
	}
	c.mu.Lock()
	engine := c.engines[group]
	c.mu.Unlock()
	capacity := cfg.KVCapacity
	kvEvents, silence := c.kvEvents(group)
	rank, err := workers.NewRank(workers.RankConfig{
		Conn: nc, Subjects: cfg.Subjects, Group: group, TPRank: r, TPSize: cfg.Ranks, EPRank: r, EPSize: cfg.Ranks,
		Model: cfg.Model, Profile: c.profile, CapacityBytes: capacity, Payload: cfg.Payload, Evict: cfg.Evict,
		Engine: engine, EngineCache: len(cfg.Engines) > 0, KVEvents: kvEvents, KVEventsSilence: silence,
		BlockSize: cfg.BlockSize, HeartbeatInterval: cfg.HeartbeatInterval, ShutdownTimeout: cfg.ShutdownTimeout,
		SaveWait: cfg.SaveWait, DrainHandoff: cfg.DrainHandoff, ReplayBytes: cfg.StreamReplay, StoreDelay: cfg.StoreDelays[r], DropReqMetas: cfg.DropReqMetas[r],
		DelayFirstReqMeta: cfg.DelayFirstReqMeta[r],
		Logger:            c.log, Metrics: c.wm, HandlerMetrics: c.hm,
	})
	if err != nil {
		return err
	}
	ctx, stop := context.WithCancel(c.rankCtx)
	rr := &rankRun{rank: rank, nc: nc, stop: stop, done: make(chan struct{})}
	c.mu.Lock()
	c.ranks[rankKey{group, r}] = rr
	c.mu.Unlock()
	c.run(ctx, fmt.Sprintf("rank %s/%d", group, r), func(ctx context.Context) error {
		defer close(rr.done)
		err := rank.Run(ctx)
		// The rank's process exits: what it published goes out, then its
		// connection closes.
		_ = nc.FlushTimeout(time.Second)
		nc.Close()
		return err
	})
	return nil
}

// GroupName is the name of the cluster's group i: g0, g1, …
func GroupName(i int) string { return fmt.Sprintf("g%d", i) }

// kvEvents is the KV event subscription of a group's model server, if any,
// and how long the rank waits for its first batch before it warns.
func (c *Cluster) kvEvents(group string) (*vllmevents.Config, time.Duration) {
	for i, e := range c.cfg.Engines {
		if group == GroupName(i) && e.KVEvents != nil {
			kc := *e.KVEvents
			return &kc, e.KVEventsSilence
		}
	}
	return nil, 0
}

// WaitReady waits until the cluster is ready as its health checks say:
// every scheduler replica sees every group ready and placeable (its KV
// index synced, or beyond what the index tracks) and is ready itself, and
// the frontend (if any) serves and reports healthy.
func (c *Cluster) WaitReady(ctx context.Context) error {
	if c.Frontend != nil {
		select {
		case <-c.Frontend.Ready():
		case <-c.ctx.Done():
			return c.failure()
		case <-ctx.Done():
			return fmt.Errorf("cluster: frontend not ready: %w", ctx.Err())
		}
	}
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	why := ""
	for {
		ready := true
		for _, s := range c.Schedulers {
			ok, reason := s.Ready()
			placeable := 0
			for _, g := range s.Groups() {
				if s.Index().Placeable(g.Name) {
					placeable++
				}
			}
			if !ok || s.ReadyGroups() != c.cfg.Groups || placeable != c.cfg.Groups {
				ready, why = false, fmt.Sprintf("scheduler %s: %d of %d groups ready, %d placeable (index synced, or beyond what it tracks) (%s)", s.ID(), s.ReadyGroups(), c.cfg.Groups, placeable, reason)
				break
			}
		}
		if ready && c.Frontend != nil {
			if ok, reason := c.Frontend.Healthy(); !ok {
				ready, why = false, "frontend: "+reason
			}
		}
		if ready {
			return nil
		}
		select {
		case <-c.ctx.Done():
			return c.failure()
		case <-ctx.Done():
			return fmt.Errorf("cluster: not ready: %s: %w", why, ctx.Err())
		case <-t.C:
		}
	}
}

func (c *Cluster) failure() error {
	c.errMu.Lock()
	defer c.errMu.Unlock()
	if c.err != nil {
		return c.err
	}
	return errors.New("cluster: stopped")
}

// Groups and Ranks are the cluster's shape as it runs (with engines, one
// group of one rank per engine, whatever Config said).
func (c *Cluster) Groups() int { return c.cfg.Groups }

// Ranks is the ranks per group; see Groups.
func (c *Cluster) Ranks() int { return c.cfg.Ranks }

// Stop ends every role; Wait returns once they are done.
func (c *Cluster) Stop() { c.cancel() }

// stopInOrder, once the cluster stops, lets the frontend finish first: it
// stops taking requests and answers those it accepted, which needs the
// schedulers to dispatch what is still in the request log and the ranks to
// run it. Then the schedulers stop, then the ranks. Stopping all at once
// left requests accepted in the last moments in the log with nobody to
// dispatch them, and their clients waited for --request-timeout.
func (c *Cluster) stopInOrder() {
	<-c.ctx.Done()
	c.mu.Lock()
	feDone := c.feDone
	c.mu.Unlock()
	if feDone != nil {
		<-feDone
	}
	c.stopScheds()
	c.mu.Lock()
	scheds := slices.Clone(c.schedRuns)
	c.mu.Unlock()
	for _, sr := range scheds {
		<-sr.done
	}
	c.stopRanks()
}

// Done is closed when the cluster stops: after Stop, when the context
// given to Start ends, or when a role fails (Wait returns its error).
func (c *Cluster) Done() <-chan struct{} { return c.ctx.Done() }

// Wait waits for every role to end (after Stop or the context), drains the
// connections, stops the embedded server, and returns the first role error.
func (c *Cluster) Wait() error {
	c.wg.Wait()
	c.mu.Lock()
	conns := c.conns
	c.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, nc := range conns {
		bus.Drain(ctx, nc)
	}
	c.mu.Lock()
	srv := c.NATS
	c.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
	}
	c.errMu.Lock()
	defer c.errMu.Unlock()
	return c.err
}

// Connect opens a client connection to the cluster's NATS, closed by Wait.
func (c *Cluster) Connect(name string) (*nats.Conn, error) { return c.connect(name) }
