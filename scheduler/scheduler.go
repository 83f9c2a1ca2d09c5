// Package scheduler consumes requests from the JetStream request log, keeps a
// RequestTracker per request, hashes prompts into KV blocks, places each
// request on a ready worker group and publishes its ReqMeta once on the
// group's session-keyed subject, then collects every rank's RankResult.
package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/internal/logevery"
	"github.com/kvbus/kvbus/internal/recent"
	"github.com/kvbus/kvbus/messages"
)

// KV pool modes (--pool).
const (
	PoolLocal  = "local"
	PoolGlobal = "global"
)

// busQuietAfter is how long the server may leave this replica's pings
// (watchBus, every 250 ms) unanswered before it is taken for stalled.
const busQuietAfter = 1500 * time.Millisecond

// ErrConfig is wrapped by configuration errors.
var ErrConfig = errors.New("scheduler: bad configuration")

// Config configures a scheduler replica.
type Config struct {
	// Conn is the scheduler's NATS connection, owned by the caller.
	Conn     *nats.Conn
	Subjects messages.Subjects
	// ID names the replica in subjects (kvbus.done.<id>); default a random
	// "sched-…".
	ID string
	// Policy places requests; required.
	Policy Policy
	// BlockSize is the tokens per KV block (default 16).
	BlockSize int
	// HeartbeatTimeout: a group is ready when all its ranks sent a heartbeat
	// within it (default 3 s).
	HeartbeatTimeout time.Duration
	// ForgetGroupAfter: a group none of whose ranks was heard of for this
	// long is dropped, from the index too (its id is freed for another
	// group), and comes back as a new group if it returns (default 10 ×
	// HeartbeatTimeout).
	ForgetGroupAfter time.Duration
	// RequestTimeout applies to requests without a deadline (default 60 s).
	RequestTimeout time.Duration
	// AckWait is how long JetStream waits for this replica's ack before
	// redelivering a request to another replica (default bus.DefaultAckWait),
	// applied when this replica creates the consumer.
	AckWait time.Duration
	// StreamReplicas is the JetStream replication of the request log and
	// the session bucket (default 1).
	StreamReplicas int
	// SessionTTL is how long a session binding lives after its last turn
	// (default 30 min).
	SessionTTL time.Duration
	// MaxSessions bounds the sessions bound at once (see
	// SessionBindingsConfig.MaxSessions; 0: DefaultMaxSessions).
	MaxSessions int
	// ShutdownTimeout bounds how long a stopping replica watches the
	// requests it dispatched until they end (default 20 s).
	ShutdownTimeout time.Duration
	// DumpTimeout bounds a rank's answer to a dump request, all its chunks
	// (default 5 s).
	DumpTimeout time.Duration
	// FrontendGoneAfter is how long every probe of a frontend with
	// requests in flight here must find nobody listening on its output
	// subject before its requests are aborted on their groups (default
	// DefaultFrontendGoneAfter; see frontends.go).
	FrontendGoneAfter time.Duration
	// NoGroupWait is how long a request waits for a ready worker group
	// before it gets a fast no_ready_group error (503 with Retry-After)
	// instead of waiting out its deadline (default 2 s).
	NoGroupWait time.Duration
	// UnsyncedWait is how long a request waits, when groups are ready but
	// the KV index of none is synced yet (a scheduler that just started,
	// its ranks' dumps on the way), before it is placed on them anyway
	// (default 2 s; negative: no wait). Placed before the dumps, the next
	// turn of a waiting conversation misses the blocks its group holds.
	UnsyncedWait time.Duration
	// ResendAfter: a ReqMeta is published again (at most 3 times) when a
	// rank of its group has not answered it within this bound — no
	// receipt, no result — as when one core NATS message was lost
	// (default 1 s).
	ResendAfter time.Duration
	// PlanTTL bounds how long a dispatched request's blocks count as its
	// group's before the ranks' KV events confirm them (default 10 s: ranks
	// confirm within milliseconds; a slow rank's loads wait at most
	// --save-wait).
	PlanTTL time.Duration
	// EndedIDs and EndedAge bound the memory of ended request ids that
	// drops redeliveries (defaults 200,000 and 10 min).
	EndedIDs int
	EndedAge time.Duration
	// Pool is PoolGlobal (default): the ranks' stores are one pool and a
	// LoadSpec may read runs of the prefix from other groups; or
	// PoolLocal: a group loads only what its own ranks hold. With PoolGlobal the kv policy costs loads in prefill time:
	// LocalLoadCost and RemoteLoadCost per block, as fractions of a block's
	// prefill (defaults 5/60 and 15/60, the sim engine's per-token costs).
	Pool                          string
	LocalLoadCost, RemoteLoadCost float64
	// IndexGroups caps the groups the KV index tracks at once (0: the
	// maximum, MaxIndexedGroups); groups beyond it are placed as if they
	// held nothing. Tests lower it to reach that case with a few groups.
	IndexGroups int
	// RequestLog holds the request log's limits, applied when this replica
	// creates it (Subjects and Replicas come from above); the replica
	// trims the log's dispatched history to RequestLog.HistoryBound(), or,
	// when HistoryBytes is zero, to half the log's own cap.
	RequestLog bus.StreamConfig
	Logger     *slog.Logger
	// Registerer receives the scheduler's metrics; nil: unregistered.
	Registerer prometheus.Registerer
}

// Validate checks the configuration's settings; New also needs Conn. It
// needs no connection, so a command line calls it before connecting (an
// empty ID passes: New picks one).
func (c *Config) Validate() error {
	switch {
	case c.Policy == nil:
		return fmt.Errorf("%w: no placement policy", ErrConfig)
	case c.BlockSize < 1:
		return fmt.Errorf("%w: --block-size must be >= 1", ErrConfig)
	case c.IndexGroups < 0 || c.IndexGroups > MaxIndexedGroups:
		return fmt.Errorf("%w: IndexGroups %d, want 0 to %d", ErrConfig, c.IndexGroups, MaxIndexedGroups)
	case c.MaxSessions < 0:
		return fmt.Errorf("%w: --max-sessions must be positive", ErrConfig)
	}
	if c.ID != "" {
		if err := messages.ValidateToken("scheduler id", c.ID); err != nil {
			return fmt.Errorf("%w: --id: %v", ErrConfig, err)
		}
	}
	if err := c.RequestLog.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return c.Subjects.Validate()
}

// DefaultShutdownTimeout is Config.ShutdownTimeout's default.
const DefaultShutdownTimeout = 20 * time.Second

// DefaultFrontendGoneAfter is Config.FrontendGoneAfter's default: longer
// than a frontend's reconnect to another NATS server (nats.go waits 2 s
// between attempts), far shorter than the answers a dead frontend left
// running.
const DefaultFrontendGoneAfter = 10 * time.Second

// Scheduler is one scheduler replica. Several replicas share the request
// log's durable consumer; each request is dispatched by one of them.
type Scheduler struct {
	cfg      Config
	log      *slog.Logger
	groups   *groupTable
	trackers *trackerTable
	index    *KVIndex
	bindings atomic.Pointer[SessionBindings] // set by Run
	m        *metrics
	hm       *bus.HandlerMetrics

	resyncMu  sync.Mutex
	resyncs   map[rankID]*resyncState
	dumps     sync.WaitGroup
	dumpSlots chan struct{} // a token per dump in flight (maxDumpsInFlight)

	// dispatched remembers where other replicas sent requests (from their
	// SavePlans): a redelivered request goes to the same group and attempt.
	dispatched *recent.Memory[dispatchRecord]
	// peers follows the other replicas, to adopt a dead one's requests
	// (peers.go); reqLog, set by Run, is where they are read.
	peers      *peerTable
	reqLog     *requestLog
	adoptions  sync.WaitGroup
	started    time.Time    // announced, so that a restart under the same id is told apart
	consuming  atomic.Bool  // the request consumer runs
	reconnects uint64       // the connection's reconnects, as sweep last saw them
	causal     []*causalSub // set by Run before it consumes
	announced  announcement
	// groupModels is the model of each group's gauges, and modelSeen when
	// each model of kvbus_scheduler_model_ready_groups last had a known
	// group (sweep's own).
	groupModels map[string]string
	modelSeen   map[string]time.Time

	// selfHeard is when the server last answered this replica's ping
	// (watchBus; unix ns, 0: not yet): the bus delivers. quiet is sweep's:
	// the server answered nothing for busQuietAfter.
	selfHeard atomic.Int64
	quiet     bool
	// cutSince is the time of the sweep before the one that last saw this
	// replica cut off (sweep's own; zero: connected at the last sweep):
	// the cut began after it, at most a sweep interval (250 ms) after.
	cutSince  time.Time
	lastSweep time.Time
	// wasReady are the groups ready at the last sweep that judged them
	// (sweep's own), so that a group's change is logged once.
	wasReady map[string]bool
	// unheardUntil is when the server last answered again after this
	// replica went unheard for more than half the heartbeat timeout
	// (watchBus; unix ns): the others may have adopted the requests it
	// had; held are those it ended since, whose count waits (adopt.go).
	unheardUntil atomic.Int64
	held         heldEnds
	// clocks learns the frontends' clocks from their requests, and
	// skewSaid holds back repeats of the warning that one is off.
	clocks   *frontendClocks
	skewSaid logevery.Limiter[time.Duration]
	// expiredSaid holds back repeats of "request expired before dispatch"
	// (by request id): a backlog that outlived its deadlines in the log (a
	// long outage of every scheduler) expires one request at a time.
	expiredSaid logevery.Limiter[string]
	// frontends follows the frontends with requests in flight here, and
	// probe is the Output a probe of one carries (frontends.go).
	frontends *frontendWatch
	probe     []byte
}

type rankID struct {
	group string
	rank  int
}

// New builds a scheduler; Run starts it.
func New(cfg Config) (*Scheduler, error) {
	if cfg.ID == "" {
		cfg.ID = "sched-" + nuid.Next()
	}
	if cfg.BlockSize == 0 {
		cfg.BlockSize = 16
	}
	if cfg.HeartbeatTimeout <= 0 {
		cfg.HeartbeatTimeout = 3 * time.Second
	}
	if cfg.ForgetGroupAfter <= 0 {
		cfg.ForgetGroupAfter = 10 * cfg.HeartbeatTimeout
	}
	if cfg.RequestTimeout <= 0 {
		cfg.RequestTimeout = 60 * time.Second
	}
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = 30 * time.Minute
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = DefaultShutdownTimeout
	}
	if cfg.DumpTimeout <= 0 {
		cfg.DumpTimeout = 5 * time.Second
	}
	if cfg.FrontendGoneAfter <= 0 {
		cfg.FrontendGoneAfter = DefaultFrontendGoneAfter
	}
	if cfg.UnsyncedWait == 0 {
		cfg.UnsyncedWait = 2 * time.Second
	}
	if cfg.NoGroupWait <= 0 {
		cfg.NoGroupWait = 2 * time.Second
	}
	if cfg.ResendAfter <= 0 {
		cfg.ResendAfter = time.Second
	}
	if cfg.PlanTTL <= 0 {
		cfg.PlanTTL = 10 * time.Second
	}
	if cfg.Pool == "" {
		cfg.Pool = PoolGlobal
	}
	if cfg.Pool != PoolLocal && cfg.Pool != PoolGlobal {
		return nil, fmt.Errorf("%w: --pool %q must be %s or %s", ErrConfig, cfg.Pool, PoolLocal, PoolGlobal)
	}
	if cfg.LocalLoadCost <= 0 {
		cfg.LocalLoadCost = 5.0 / 60
	}
	if cfg.RemoteLoadCost <= 0 {
		cfg.RemoteLoadCost = 15.0 / 60
	}
	if kv, ok := cfg.Policy.(KVPolicy); ok && kv == (KVPolicy{}) {
		// Local reads cost time in either pool mode; with --pool local no
		// block is remote.
		cfg.Policy = KVPolicy{LocalLoad: cfg.LocalLoadCost, RemoteLoad: cfg.RemoteLoadCost}
	}
	if cfg.EndedIDs <= 0 {
		cfg.EndedIDs = 200_000
	}
	if cfg.EndedAge <= 0 {
		cfg.EndedAge = 10 * time.Minute
	}
	if cfg.IndexGroups == 0 {
		cfg.IndexGroups = MaxIndexedGroups
	}
	if cfg.Conn == nil {
		return nil, fmt.Errorf("%w: no NATS connection", ErrConfig)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	ended := recent.Config{MaxIDs: cfg.EndedIDs, MaxAge: cfg.EndedAge}
	trackers, err := newTrackerTable(ended)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	dispatched, err := recent.New[dispatchRecord](ended)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	s := &Scheduler{
		cfg:        cfg,
		log:        log.With("scheduler_id", cfg.ID),
		groups:     newGroupTable(cfg.HeartbeatTimeout, cfg.BlockSize, cfg.LocalLoadCost, cfg.RemoteLoadCost),
		trackers:   trackers,
		index:      newKVIndex(cfg.IndexGroups),
		hm:         bus.NewHandlerMetrics(cfg.Registerer),
		resyncs:    map[rankID]*resyncState{},
		dumpSlots:  make(chan struct{}, maxDumpsInFlight),
		dispatched: dispatched,
		peers:      newPeerTable(cfg.RequestTimeout, time.Now()),
		started:    time.Now(),
		clocks:     newFrontendClocks(),
		skewSaid:   logevery.Limiter[time.Duration]{Every: time.Minute},

		groupModels: map[string]string{},
		modelSeen:   map[string]time.Time{},
	}
	s.frontends = newFrontendWatch()
	if s.probe, err = messages.Marshal(&messages.Output{V: messages.Version, ReqID: messages.FrontendProbeReqID}); err != nil {
		return nil, fmt.Errorf("scheduler: %w", err)
	}
	s.expiredSaid = logevery.Limiter[string]{Every: 10 * time.Second, Held: func(last string, held int, over time.Duration) {
		s.log.Warn("requests expired before dispatch", "count", held, "over", over.Round(time.Millisecond), "last_req_id", last)
	}}
	s.m = newMetrics(cfg.Registerer, metricFuncs{
		trackers: func() float64 { return float64(s.trackers.Len()) },
		rejected: func() float64 { return float64(s.index.Rejected()) },
		refused:  func() float64 { return float64(s.index.Refused()) },
		plans:    func() float64 { return float64(s.index.Plans()) },
		ready: func() float64 {
			if ok, _ := s.Ready(); ok {
				return 1
			}
			return 0
		},
		sessions: func() float64 {
			if b := s.bindings.Load(); b != nil {
				return float64(b.Sessions())
			}
			return 0
		},
		unbound: func() float64 {
			if b := s.bindings.Load(); b != nil {
				return float64(b.Unbound())
			}
			return 0
		},
	})
	s.m.heartbeatTimeout.Set(cfg.HeartbeatTimeout.Seconds())
	return s, nil
}

// ID returns the replica's id.
func (s *Scheduler) ID() string { return s.cfg.ID }

// ReadyGroups returns the number of worker groups ready now.
func (s *Scheduler) ReadyGroups() int { return len(s.groups.ready(time.Now())) }

// Index returns the scheduler's KV index.
func (s *Scheduler) Index() *KVIndex { return s.index }

// Bindings returns the session bindings; nil before Run.
func (s *Scheduler) Bindings() *SessionBindings { return s.bindings.Load() }

// Trackers returns the number of live request trackers.
func (s *Scheduler) Trackers() int { return s.trackers.Len() }

// Run serves until ctx ends.
func (s *Scheduler) Run(ctx context.Context) error {
	ctx = bus.WithLogger(ctx, s.log)
	nc, subj := s.cfg.Conn, s.cfg.Subjects
	type handler struct {
		subject, name string
		fn            bus.Handler[*nats.Msg]
		// causal: the state this feeds (load, plans) must be current
		// when a request is placed; see awaitCausal. KV events are not:
		// the plans already cover what a just-answered turn stored.
		causal bool
	}
	handlers := []handler{
		{subj.HeartbeatAll(), "scheduler_heartbeat", s.onHeartbeat, true},
		{subj.KVAll(), "scheduler_kv_events", s.onKVEvents, false},
		{subj.Done(s.cfg.ID), "scheduler_done", s.onDone, false},
		{subj.Abort(), "scheduler_abort", s.onAbort, false},
		{subj.PlanAll(), "scheduler_plan", s.onPlan, true},
	}
	// Another role's key is refused these subjects: say so now, naming the
	// key to give, rather than wait 30 s for JetStream or run deaf.
	check := bus.RoleCheck{Role: messages.RoleScheduler}
	for _, h := range handlers {
		check.Subscribe = append(check.Subscribe, h.subject)
	}
	if err := bus.CheckPermissions(ctx, nc, check); err != nil {
		return err
	}
	// The other replicas' announcements are not checked, so that a key
	// from an older kvbus auth init (without them) still runs, only
	// without adopting a dead replica's requests (the server's refusal is
	// logged).
	handlers = append(handlers, handler{subj.AnnounceRole(messages.RoleScheduler), "scheduler_peers", s.onPeer, false})
	// Nor the frontends' Resends: under an earlier key they go unanswered
	// (a stream that lost outputs on the bus ends with output_lost).
	handlers = append(handlers, handler{subj.Resend(), "scheduler_resend", s.onResend, false})
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("scheduler: jetstream: %w", err)
	}
	setupCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	rl := s.cfg.RequestLog
	rl.Subjects, rl.Replicas = subj, s.cfg.StreamReplicas
	onRequest := bus.Wrap(s.onRequest, s.log, s.hm, "scheduler_request")
	reqLog := &requestLog{js: js, cfg: rl, ackWait: s.cfg.AckWait, log: s.log, consuming: &s.consuming, m: s.m,
		onMsg: func(m jetstream.Msg) { _ = onRequest(ctx, m) }}
	s.reqLog = reqLog
	if err := reqLog.ensure(setupCtx); err != nil {
		return err
	}
	names, err := bus.ResolveNames(setupCtx, js, s.cfg.Subjects)
	if err != nil {
		return fmt.Errorf("scheduler: %w", err)
	}
	bindings, err := OpenSessionBindings(setupCtx, js, SessionBindingsConfig{Bucket: names.SessionBucket, TTL: s.cfg.SessionTTL,
		Replicas: s.cfg.StreamReplicas, MaxSessions: s.cfg.MaxSessions, Logger: s.log})
	if err != nil {
		return err
	}
	s.bindings.Store(bindings)
	reqLog.remade = bindings.remake
	bindCtx, stopBindings := context.WithCancel(context.Background())
	var bindingsDone sync.WaitGroup
	bindingsDone.Go(func() {
		if err := bindings.Run(bindCtx); err != nil {
			s.log.Error("session bindings stopped", "err", err)
		}
	})
	defer func() {
		stopBindings()
		bindingsDone.Wait()
		s.dumps.Wait()
		s.adoptions.Wait()
	}()

	// The handlers outlive ctx: a stopping replica still hears the results
	// of the requests it dispatched (finish).
	handlerCtx, stopHandlers := context.WithCancel(context.WithoutCancel(ctx))
	defer stopHandlers()
	var subs []*nats.Subscription
	defer func() {
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
	}()
	for _, h := range handlers {
		fn := bus.Wrap(h.fn, s.log, s.hm, h.name)
		var cs *causalSub
		if h.causal {
			cs = newCausalSub()
			inner := fn
			fn = func(ctx context.Context, m *nats.Msg) error {
				defer cs.done()
				return inner(ctx, m)
			}
		}
		sub, err := bus.Subscribe(handlerCtx, nc, h.subject, fn)
		if err != nil {
			return fmt.Errorf("scheduler: subscribe %s: %w", h.subject, err)
		}
		if cs != nil {
			cs.sub = sub
			s.causal = append(s.causal, cs)
		}
		subs = append(subs, sub)
	}
	if err := nc.Flush(); err != nil {
		s.log.Warn("flush after subscribe", "err", err)
	}

	// Before the first request: a dead replica's dispatches, and this
	// replica's earlier process's, from the plan stream.
	s.readPlanStream(setupCtx, js)
	if err := reqLog.consume(); err != nil {
		return fmt.Errorf("scheduler: consume the request log: %w", err)
	}
	s.log.Info("scheduler started", "block_size", s.cfg.BlockSize, "policy", policyName(s.cfg.Policy))
	s.announce(time.Now(), true)

	var watcher sync.WaitGroup
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer func() { stopWatch(); watcher.Wait() }()
	watcher.Go(func() { reqLog.watch(watchCtx) })
	watcher.Go(func() { s.watchPlanStream(watchCtx, js) })

	// Until Run returns: finish's sweeps judge by it too.
	busCtx, stopBus := context.WithCancel(context.WithoutCancel(ctx))
	var busWatch sync.WaitGroup
	busWatch.Go(func() { s.watchBus(busCtx) })
	defer func() { stopBus(); busWatch.Wait() }()
	defer s.frontends.running.Wait() // each within probeWait

	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			stopWatch()
			watcher.Wait()
			s.consuming.Store(false)
			s.announce(time.Now(), true) // not ready: frontends stop counting on this replica
			reqLog.stop(nc.IsConnected())
			s.finish(handlerCtx)
			if s.trackers.Len() == 0 {
				s.announceStopped() // nothing for another replica to adopt
			}
			s.log.Info("scheduler stopped", "trackers_left", s.trackers.Len())
			return nil
		case now := <-tick.C:
			s.sweep(ctx, now)
		}
	}
}
