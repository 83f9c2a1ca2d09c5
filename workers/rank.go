package workers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/internal/recent"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// ErrConfig is wrapped by configuration errors.
var ErrConfig = errors.New("workers: bad configuration")

// RankConfig configures one rank of a worker group.
type RankConfig struct {
	// Conn is the rank's NATS connection; the caller owns it (Run does not
	// close it).
	Conn     *nats.Conn
	Subjects messages.Subjects
	// Group is the worker group (one engine instance, a DP replica).
	Group string
	// TPRank/TPSize and EPRank/EPSize are the rank's tensor- and
	// expert-parallel coordinates; EP ranks may coincide with TP ranks.
	TPRank, TPSize int
	EPRank, EPSize int
	// Model is the served model name, used in store keys.
	Model string
	// Profile sizes block payloads.
	Profile ModelProfile
	// CapacityBytes is the rank's block store capacity (default 1 GiB).
	CapacityBytes int64
	// Payload is PayloadBytes (default) or PayloadAccounting.
	Payload string
	// Evict is the MemStore's eviction policy: EvictLRU (default) or
	// EvictSession.
	Evict string
	// Engine runs requests on the driver rank (tp_rank 0); required there,
	// ignored elsewhere.
	Engine Engine
	// EngineCache: the driver's engine is a model server with its own KV
	// cache (--engine openai), whose cache is the truth: the rank loads and
	// saves nothing, and the group's blocks are those the engine's KV
	// events (KVEvents) announce. The group is one rank (TPSize 1): the
	// engine does its own tensor parallelism.
	EngineCache bool
	// KVEvents, with EngineCache, subscribes to the engine's KV events
	// (vLLM's ZeroMQ publisher); nil means none, and placement then cannot
	// see the engine's cache. Its Logger and OnGap are the rank's.
	KVEvents *vllmevents.Config
	// BlockSize is the tokens per block used to express capacity in blocks
	// in heartbeats (default 16), and the engine's block size with
	// KVEvents; requests carry their own block_size.
	BlockSize int
	// HeartbeatInterval defaults to 1 s.
	HeartbeatInterval time.Duration
	// IdentityWait is how long Run first listens for another process
	// heartbeating with this rank's identity, and refuses to start if one
	// does (0: 1.5 heartbeat intervals, at most 10 s; negative: not at
	// all). A wait shorter than the other process's heartbeat interval may
	// miss it.
	IdentityWait time.Duration
	// QueueSize bounds the load and store queues (default 1024).
	QueueSize int
	// SaveWait bounds how long a load waits for a block that this rank is
	// still saving for an earlier request (the previous turn of a
	// conversation, placed a moment ago); past it the block counts in
	// failed_blocks and is prefilled (default 2 s).
	SaveWait time.Duration
	// ReceiptAfter: a rank whose result for a ReqMeta is not sent within
	// it sends a receipt, so the scheduler knows it has the ReqMeta
	// (default 100 ms).
	ReceiptAfter time.Duration
	// SeenIDs and SeenAge bound the memory of (req_id, attempt) pairs that
	// drops duplicate ReqMetas (defaults 100,000 and 10 min).
	SeenIDs int
	SeenAge time.Duration
	// ReplayBytes and ReplayAge bound what a driver rank keeps of its
	// requests' outputs, to publish them again when they were lost on the
	// bus (replay.go): a stream's while it runs and ReplayAge after, for a
	// frontend that asks (messages.Resend); every answer's until the
	// driver's server confirmed it, for the driver's own reconnect
	// (defaults 64 MiB and 10 s). A negative ReplayBytes keeps nothing: a
	// stream that lost outputs after its first chunk ends with output_lost,
	// and an answer lost with the driver's connection waits for its
	// deadline.
	ReplayBytes int64
	ReplayAge   time.Duration
	// DrainHandoff is the byte budget per rank of the drain hand-off: a
	// stopping group gives up to this many bytes of its most recently used
	// blocks (whole sessions) to the other groups before it exits, so the
	// conversations it served keep their cache. 0 turns it off.
	DrainHandoff int64
	// StoreDelay is a fault-injection knob: the store thread sleeps this
	// long before each request's save (a slow rank). Zero in production.
	StoreDelay time.Duration
	// DropReqMetas is a fault-injection knob: the rank ignores its first
	// DropReqMetas ReqMetas, as if those core NATS messages were lost.
	DropReqMetas int
	// DelayFirstReqMeta is a fault-injection knob: the rank handles its
	// first ReqMeta this late (a rank whose intake is behind its group's).
	DelayFirstReqMeta time.Duration
	// ShutdownTimeout bounds how long Run lets in-flight requests finish
	// after its context ends (default 10 s).
	ShutdownTimeout time.Duration
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// Metrics and HandlerMetrics; nil means unregistered metrics.
	Metrics        *Metrics
	HandlerMetrics *bus.HandlerMetrics
}

// Validate checks the configuration.
func (c *RankConfig) Validate() error {
	switch {
	case c.Conn == nil:
		return fmt.Errorf("%w: no NATS connection", ErrConfig)
	case messages.ValidateGroup(c.Group) != nil:
		return fmt.Errorf("%w: %v", ErrConfig, messages.ValidateGroup(c.Group))
	case c.TPSize < 1 || c.TPRank < 0 || c.TPRank >= c.TPSize:
		return fmt.Errorf("%w: --tp-rank %d must be in [0, --tp-size %d)", ErrConfig, c.TPRank, c.TPSize)
	case c.EPSize < 1 || c.EPRank < 0 || c.EPRank >= c.EPSize:
		return fmt.Errorf("%w: --ep-rank %d must be in [0, --ep-size %d)", ErrConfig, c.EPRank, c.EPSize)
	case c.Model == "":
		return fmt.Errorf("%w: no --model", ErrConfig)
	case c.Profile.Validate() != nil:
		return fmt.Errorf("%w: %v", ErrConfig, c.Profile.Validate())
	case c.TPRank == 0 && c.Engine == nil:
		return fmt.Errorf("%w: the driver rank (tp_rank 0) needs an engine", ErrConfig)
	case c.CapacityBytes < 0:
		return fmt.Errorf("%w: negative KV capacity", ErrConfig)
	case c.EngineCache && c.TPSize != 1:
		return fmt.Errorf("%w: a group that fronts a model server is --tp-size 1 (the engine does its own tensor parallelism), not %d", ErrConfig, c.TPSize)
	case c.KVEvents != nil && !c.EngineCache:
		return fmt.Errorf("%w: --kv-events needs --engine openai: the sim's ranks publish their own KV events", ErrConfig)
	case c.DrainHandoff < 0:
		return fmt.Errorf("%w: negative --drain-handoff (0 turns it off)", ErrConfig)
	case c.Payload != PayloadBytes && c.Payload != PayloadAccounting:
		return fmt.Errorf("%w: --kv-payload %q must be %s or %s", ErrConfig, c.Payload, PayloadBytes, PayloadAccounting)
	}
	return c.Subjects.Validate()
}

// Rank is one TP/EP rank of a worker group: it receives every ReqMeta of its
// group, loads cached KV blocks (load thread), stores new full blocks (store
// thread), publishes KV events of what it holds, reports a RankResult per
// request and sends heartbeats. The driver rank also runs the engine and
// streams Outputs to the frontend.
type Rank struct {
	cfg     RankConfig
	log     *slog.Logger
	store   BlockStore
	events  *eventLog
	started time.Time
	labels  []string
	series  rankSeries

	loadQ  chan *rankReq
	storeQ chan *rankReq
	pool   PoolClient               // reads of other groups' segments
	peers  peerGroups               // heartbeats the drain hand-off needs
	plans  chan *messages.DrainPlan // the driver's DrainPlan, while draining

	mu     sync.Mutex
	active map[string]*rankReq     // by req_id
	seen   *recent.Memory[seenReq] // recent req_ids, for deduplication
	replay *outputReplay           // the driver's outputs, kept to be sent again (nil: none kept)
	closed bool                    // loadQ is closed
	nextID uint64                  // numbers rankReqs in arrival order
	saving map[string]*rankReq     // store key -> the request saving it

	draining  atomic.Bool  // Run's context ended
	gaveUp    atomic.Bool  // ShutdownTimeout passed with requests running: heartbeats say not ready
	hbPending atomic.Bool  // heartbeatSoon has one scheduled
	hbAsked   atomic.Int64 // unix ns of heartbeatSoon's last call
	lastHB    atomic.Int64 // unix ns when the last heartbeat read the rank's state
	dropped   atomic.Int64 // ReqMetas ignored for DropReqMetas
	delayed   atomic.Bool  // the first ReqMeta was delayed (DelayFirstReqMeta)
	// metaSub is the ReqMeta subscription, and metaHandled counts the
	// messages its handler has finished with: a pool read tells from them
	// whether the ReqMetas that came before it have been handled.
	metaSub     *nats.Subscription
	metaHandled atomic.Int64
	metaBusy    atomic.Int32 // the handler is running
	// queuedTokens: prompt tokens of the driver's requests not yet
	// prefilled, and the cached tokens they will load locally and from
	// other groups first; reported in heartbeats.
	queuedTokens, queuedLoad, queuedRemote atomic.Int64
	prefills                               prefillClock // the driver's engine queue

	drivers sync.WaitGroup // driver goroutines, started by the load loop
	// Pool reads waiting for saves (see onPoolRead), and their slots.
	poolWaits     sync.WaitGroup
	poolWaitSlots chan struct{}
	handoffs      sync.WaitGroup // hand-offs being taken
	handoffSlots  chan struct{}
}

// seenReq is what a rank remembers of a request it took: the attempt, and
// once it reported, its result (answered again to a scheduler replica that
// re-sends the ReqMeta or took the request over).
type seenReq struct {
	attempt int
	result  []byte // the encoded RankResult: bytes the GC does not scan
	// aborted: its client's Abort came before its ReqMeta (they come from
	// different publishers), which is dropped if it comes.
	aborted bool
}

// rankReq is one request's state on a rank.
type rankReq struct {
	meta *messages.ReqMeta
	// id numbers requests in arrival order: a load waits only for saves of
	// requests that arrived before it.
	id uint64
	// resultSubject is where results go; a scheduler replica that takes
	// the request over changes it (guarded by Rank.mu).
	resultSubject string
	// saveKeys are the store keys this request registered as being saved
	// (guarded by Rank.mu); saved is closed when they are settled.
	saveKeys []string
	saved    chan struct{}
	settle   sync.Once
	receipt  *time.Timer
	// prefilled is set once the prompt is prefilled (or the request ended
	// without): its tokens left the driver's prefill queue.
	prefilled atomic.Bool
	ctx       context.Context
	cancel    context.CancelCauseFunc
	deadline  time.Time // zero: none; expireLoop cancels ctx past it
	loaded    int
	remote    int // of loaded, tokens copied from other groups
	loadFail  int
	loadUs    int64
	result    messages.RankResult
	storeDone chan struct{} // closed by the store thread
	// withdrawn: an Abort for this attempt came (a scheduler moved it to
	// another group, or its client left); onWithdraw, made only by a
	// driver that waits for it (see awaitWithdraw), is closed then. Both
	// guarded by Rank.mu.
	withdrawn  bool
	onWithdraw chan struct{}
}

// drainGrace is how long a stopping rank still takes ReqMetas after its
// draining heartbeat: the time for the scheduler to hear it.
const drainGrace = 200 * time.Millisecond

// errAborted is the cancel cause of an aborted request.
var errAborted = errors.New("request aborted")

// errShutdown is the cancel cause of a request still running when its
// rank's ShutdownTimeout passed: the group stops (scaled down, restarted),
// which is no failure of the model. The client hears it as a group that
// failed (group_failed: 503 with Retry-After), and a request whose output
// had not started is left to the scheduler to dispatch again.
var errShutdown = errors.New("worker shutting down: the request outlived its rank's --shutdown-timeout")

// rankErrCode is the RankResult.ErrorCode of a request whose work ended
// with err, its context's cancel cause being cause (either may be nil).
func rankErrCode(cause, err error) string {
	switch {
	case errors.Is(cause, errAborted):
		return messages.RankErrAborted
	case errors.Is(cause, context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return messages.RankErrTimeout
	case errors.Is(cause, errShutdown) || errors.Is(err, ErrEngineUnavailable):
		return "group_failed"
	default:
		return "engine_error"
	}
}

// withdrawWait bounds how long a stopping driver waits, for each request it
// ended before its output started, for the scheduler to withdraw it (an
// Abort: the request goes on at another group) before it ends it at the
// frontend itself (group_failed). The scheduler judges groups every 250 ms,
// from the not-ready heartbeat the rank sends as it gives up.
const withdrawWait = time.Second

// NewRank builds a rank; Run starts it.
func NewRank(cfg RankConfig) (*Rank, error) {
	if cfg.CapacityBytes == 0 {
		cfg.CapacityBytes = 1 << 30
	}
	if cfg.BlockSize <= 0 {
		cfg.BlockSize = 16
	}
	if cfg.HeartbeatInterval <= 0 {
		cfg.HeartbeatInterval = time.Second
	}
	if cfg.IdentityWait == 0 {
		cfg.IdentityWait = min(cfg.HeartbeatInterval*3/2, maxIdentityWait)
	}
	if cfg.QueueSize <= 0 {
		cfg.QueueSize = 1024
	}
	if cfg.SaveWait <= 0 {
		cfg.SaveWait = 2 * time.Second
	}
	if cfg.ReceiptAfter <= 0 {
		cfg.ReceiptAfter = 100 * time.Millisecond
	}
	if cfg.SeenIDs <= 0 {
		cfg.SeenIDs = 100_000
	}
	if cfg.SeenAge <= 0 {
		cfg.SeenAge = 10 * time.Minute
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = 10 * time.Second
	}
	if cfg.ReplayBytes == 0 {
		cfg.ReplayBytes = defaultReplayBytes
	}
	if cfg.ReplayAge <= 0 {
		cfg.ReplayAge = defaultReplayAge
	}
	if cfg.Payload == "" {
		cfg.Payload = PayloadBytes
	}
	if cfg.EngineCache {
		cfg.DrainHandoff = 0 // the engine's cache cannot be handed off
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	if cfg.HandlerMetrics == nil {
		cfg.HandlerMetrics = bus.NewHandlerMetrics(nil)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("group", cfg.Group, "tp_rank", cfg.TPRank, "ep_rank", cfg.EPRank)
	events := newEventLog(cfg.Conn, cfg.Subjects.KV(cfg.Group, cfg.TPRank), cfg.Group, cfg.TPRank, log)
	store, err := NewMemStore(MemStoreConfig{Capacity: cfg.CapacityBytes, Evict: cfg.Evict, OnEvict: events.evicted})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	events.exists = func(keys []string) []bool { return store.BatchIsExist(context.Background(), keys) }
	seen, err := recent.New[seenReq](recent.Config{MaxIDs: cfg.SeenIDs, MaxAge: cfg.SeenAge})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	var replay *outputReplay
	if cfg.TPRank == 0 && cfg.ReplayBytes > 0 {
		replay = newOutputReplay(cfg.ReplayBytes, cfg.ReplayAge)
	}
	return &Rank{
		replay: replay,
		pool:   PoolClient{Conn: cfg.Conn, Subjects: cfg.Subjects},
		cfg:    cfg,
		log:    log,
		store:  store,
		events: events,
		labels: []string{cfg.Group, strconv.Itoa(cfg.TPRank)},
		series: cfg.Metrics.forRank(cfg.Group, strconv.Itoa(cfg.TPRank)),
		loadQ:  make(chan *rankReq, cfg.QueueSize),
		storeQ: make(chan *rankReq, cfg.QueueSize),
		active: map[string]*rankReq{},
		seen:   seen,
		saving: map[string]*rankReq{},
		plans:  make(chan *messages.DrainPlan, 1),

		poolWaitSlots: make(chan struct{}, poolWaitSlots),
		handoffSlots:  make(chan struct{}, handoffSlots),
	}, nil
}

// IsDriver reports whether the rank runs the engine.
func (r *Rank) IsDriver() bool { return r.cfg.TPRank == 0 }

// Run serves until ctx ends, then stops taking requests, lets in-flight ones
// finish within ShutdownTimeout, and returns.
func (r *Rank) Run(ctx context.Context) error {
	r.started = time.Now()
	r.events.started = r.started.UnixMilli() // before anything is published or dumped
	nc, subj := r.cfg.Conn, r.cfg.Subjects
	if err := r.awaitIdentityFree(ctx); err != nil {
		return err
	}
	onMeta := func(ctx context.Context, m *nats.Msg) error {
		r.metaBusy.Add(1)
		defer r.metaBusy.Add(-1)
		defer r.metaHandled.Add(1)
		return r.onMeta(ctx, m)
	}
	metaSub, err := bus.Subscribe(ctx, nc, subj.MetaGroup(r.cfg.Group), bus.Wrap(onMeta, r.log, r.cfg.HandlerMetrics, "worker_reqmeta"))
	if err != nil {
		return fmt.Errorf("workers: subscribe %s: %w", subj.MetaGroup(r.cfg.Group), err)
	}
	r.metaSub = metaSub // before the pool subscription that reads it
	abortSub, err := bus.Subscribe(ctx, nc, subj.Abort(), bus.Wrap(r.onAbort, r.log, r.cfg.HandlerMetrics, "worker_abort"))
	if err != nil {
		_ = metaSub.Unsubscribe()
		return fmt.Errorf("workers: subscribe %s: %w", subj.Abort(), err)
	}
	dumpSub, err := bus.Subscribe(ctx, nc, subj.Dump(r.cfg.Group, r.cfg.TPRank), bus.Wrap(r.events.onDump, r.log, r.cfg.HandlerMetrics, "worker_dump"))
	if err != nil {
		_ = metaSub.Unsubscribe()
		_ = abortSub.Unsubscribe()
		return fmt.Errorf("workers: subscribe %s: %w", subj.Dump(r.cfg.Group, r.cfg.TPRank), err)
	}
	defer func() { _ = dumpSub.Unsubscribe() }()
	// Pool reads are answered until the rank exits, draining or not.
	poolSub, err := bus.Subscribe(context.Background(), nc, subj.Pool(r.cfg.Group, r.cfg.TPRank), bus.Wrap(r.onPoolRead, r.log, r.cfg.HandlerMetrics, "worker_pool_read"))
	if err != nil {
		_ = metaSub.Unsubscribe()
		_ = abortSub.Unsubscribe()
		return fmt.Errorf("workers: subscribe %s: %w", subj.Pool(r.cfg.Group, r.cfg.TPRank), err)
	}
	defer func() { _ = poolSub.Unsubscribe() }()
	// Blocks handed off by draining groups are taken until the rank exits;
	// the drain hand-off's own subscriptions only when it is on.
	type handler struct {
		subject, name string
		fn            bus.Handler[*nats.Msg]
	}
	extra := []handler{{subj.Handoff(r.cfg.Group, r.cfg.TPRank), "worker_handoff", r.onHandoff}}
	if r.cfg.DrainHandoff > 0 {
		extra = append(extra, handler{subj.Drain(r.cfg.Group), "worker_drain_plan", r.onDrainPlan})
	}

	for _, e := range extra {
		sub, err := bus.Subscribe(context.Background(), nc, e.subject, bus.Wrap(e.fn, r.log, r.cfg.HandlerMetrics, e.name))
		if err != nil {
			_ = metaSub.Unsubscribe()
			_ = abortSub.Unsubscribe()
			return fmt.Errorf("workers: subscribe %s: %w", e.subject, err)
		}
		defer func() { _ = sub.Unsubscribe() }()
	}
	// Another role's key, or another group's, is refused these subjects: say
	// so now, naming the key to give, rather than run without ever getting
	// a ReqMeta (the group would never appear).
	check := bus.RoleCheck{Role: "worker", Group: r.cfg.Group,
		Subscribe: []string{subj.MetaGroup(r.cfg.Group), subj.Abort(), subj.Dump(r.cfg.Group, r.cfg.TPRank), subj.Pool(r.cfg.Group, r.cfg.TPRank)}}
	for _, e := range extra {
		check.Subscribe = append(check.Subscribe, e.subject)
	}
	if err := bus.CheckPermissions(ctx, nc, check); err != nil {
		_ = metaSub.Unsubscribe()
		_ = abortSub.Unsubscribe()
		return err
	}
	if r.replay != nil {
		// Answered until the rank exits: a draining group's streams run on.
		sub, err := r.subscribeResend(ctx, nc)
		if err != nil {
			_ = metaSub.Unsubscribe()
			_ = abortSub.Unsubscribe()
			return err
		}
		if sub != nil {
			defer func() { _ = sub.Unsubscribe() }()
		}
	}
	// A (re)started rank holds nothing: say so first, as vLLM does.
	r.events.publish([]messages.KVEvent{{Type: messages.EventAllBlocksCleared}})
	if err := nc.Flush(); err != nil {
		r.log.Warn("flush after subscribe", "err", err)
	}
	r.log.Info("rank started", "model", r.cfg.Model, "tp_size", r.cfg.TPSize, "ep_size", r.cfg.EPSize,
		"capacity_bytes", r.cfg.CapacityBytes, "driver", r.IsDriver())

	var loadLoop, storeLoop, hbLoop, engineLoops sync.WaitGroup
	loadLoop.Go(r.loadLoop)
	storeLoop.Go(r.storeLoop)
	hbCtx, stopHB := context.WithCancel(context.Background())
	hbLoop.Go(func() { r.heartbeatLoop(hbCtx) })
	hbLoop.Go(func() { r.expireLoop(hbCtx) })
	if r.replay != nil {
		hbLoop.Go(func() { r.watchDelivery(hbCtx) })
	}
	// A model server's health and KV events are followed until the rank
	// exits: its requests still finish while it drains.
	if h := r.engineHealth(); h != nil || r.cfg.KVEvents != nil {
		engineLoops.Go(func() { r.runEngine(hbCtx, h) })
	}

	<-ctx.Done()
	// The drain hand-off follows heartbeats from now on (not before: a
	// driver sends one per request, and every driver would get every
	// group's).
	if r.cfg.DrainHandoff > 0 {
		hb := subj.Heartbeat(r.cfg.Group, 0) // is the driver draining too?
		if r.IsDriver() {
			hb = subj.HeartbeatAll() // which groups can take blocks
		}
		sub, err := bus.Subscribe(context.Background(), nc, hb, bus.Wrap(r.peers.onHeartbeat, r.log, r.cfg.HandlerMetrics, "worker_peer_heartbeat"))
		if err != nil {
			r.log.Warn("drain hand-off: cannot follow heartbeats; nothing will be handed off", "err", err)
		} else {
			r.peers.since = time.Now()
			defer func() { _ = sub.Unsubscribe() }()
		}
	}
	// Say so first: the scheduler places nothing new on a draining group.
	r.draining.Store(true)
	r.heartbeat()
	// A ReqMeta placed just before the scheduler heard it is still taken.
	time.Sleep(drainGrace)
	// Stop intake, then let queued and running requests finish: the load
	// loop drains loadQ, the driver goroutines it started end, and only then
	// can nothing push to storeQ any more.
	_ = metaSub.Unsubscribe()
	r.log.Info("rank stopping: finishing in-flight requests", "timeout", r.cfg.ShutdownTimeout)
	timer := time.AfterFunc(r.cfg.ShutdownTimeout, r.giveUp)
	defer timer.Stop()
	r.mu.Lock()
	r.closed = true
	close(r.loadQ)
	r.mu.Unlock()
	loadLoop.Wait()
	r.drivers.Wait()
	close(r.storeQ)
	storeLoop.Wait()
	timer.Stop() // the requests are finished: the hand-off is bounded on its own
	r.handOff()
	stopHB()
	hbLoop.Wait()
	engineLoops.Wait()
	_ = abortSub.Unsubscribe()
	r.poolWaits.Wait() // the saves they wait for have settled
	r.handoffs.Wait()  // taken before this rank drained (it refuses them since)
	// What this rank held leaves with it: no LoadSpec should name it as a
	// source any more (the hand-off's targets announced their copies).
	r.events.publish([]messages.KVEvent{{Type: messages.EventAllBlocksCleared}})
	r.log.Info("rank stopped")
	return nil
}

// onMeta takes a ReqMeta. It runs until the subscription ends, drainGrace
// after the rank began to stop: a request placed before the scheduler
// heard the draining heartbeat still runs.
func (r *Rank) onMeta(_ context.Context, m *nats.Msg) error {
	meta, err := messages.DecodeReqMeta(m.Data)
	if err != nil {
		return fmt.Errorf("dropping ReqMeta on %s: %w", m.Subject, err)
	}
	r.series.reqMetas.Inc()
	if r.cfg.DropReqMetas > 0 && r.dropped.Add(1) <= int64(r.cfg.DropReqMetas) {
		r.log.Warn("fault injection: ReqMeta ignored", "req_id", meta.ReqID, "session_id", meta.SessionID)
		return nil
	}
	if d := r.cfg.DelayFirstReqMeta; d > 0 && r.delayed.CompareAndSwap(false, true) {
		r.log.Warn("fault injection: ReqMeta delayed", "req_id", meta.ReqID, "session_id", meta.SessionID, "delay", d)
		time.Sleep(d)
	}
	if meta.Model != "" && meta.Model != r.cfg.Model {
		// Placed on a group of another model (a scheduler of a kvbus that
		// did not tell models apart, or a hand-made ReqMeta): these weights
		// would answer it as if they were its model's.
		rr := newRankReq(meta)
		rr.result = r.resultOf(meta)
		rr.prefilled.Store(true) // never counted in the prefill queue
		r.fail(rr, "model_mismatch", fmt.Sprintf("group %s serves model %q, not %q: the request was placed on another model's group; "+
			"run schedulers of this kvbus (they place a request only on groups of its model)", r.cfg.Group, r.cfg.Model, meta.Model))
		return nil
	}
	now := time.Now()
	r.mu.Lock()
	// One lookup for a new request: it is remembered at once.
	s, seen := r.seen.GetOrPut(meta.ReqID, seenReq{attempt: meta.Attempt}, now)
	if seen && s.attempt >= meta.Attempt {
		rr := r.active[meta.ReqID]
		if s.attempt > meta.Attempt {
			r.mu.Unlock()
			if s.aborted {
				r.series.aborted.Inc()
				r.log.Info("dropping a ReqMeta its client aborted before it came", "req_id", meta.ReqID, "session_id", meta.SessionID)
				return nil
			}
			r.series.duplicate.Inc()
			r.log.Info("dropping a ReqMeta of an older attempt", "req_id", meta.ReqID, "session_id", meta.SessionID, "attempt", meta.Attempt)
			return nil
		}
		// The same attempt again: the scheduler re-sent it (it did not hear
		// from this rank) or another replica took the request over after
		// the first one died. Answer where it asks now.
		if rr != nil {
			rr.resultSubject = meta.ResultSubject
		}
		r.mu.Unlock()
		r.series.duplicate.Inc()
		switch {
		case rr != nil:
			r.sendReceipt(rr)
			r.log.Info("ReqMeta again: still working on it, receipt sent", "req_id", meta.ReqID, "session_id", meta.SessionID,
				"attempt", meta.Attempt, "result_subject", meta.ResultSubject)
		case s.result != nil:
			r.publishData(meta.ResultSubject, s.result, meta)
			r.log.Info("ReqMeta again: result sent again", "req_id", meta.ReqID, "session_id", meta.SessionID,
				"attempt", meta.Attempt, "result_subject", meta.ResultSubject)
		}
		return nil
	}
	if old, ok := r.active[meta.ReqID]; ok { // a newer attempt replaces an old one
		old.cancel(errors.New("superseded by a newer attempt"))
	}
	if seen { // an older attempt is remembered: this one replaces it
		r.seen.Put(meta.ReqID, seenReq{attempt: meta.Attempt}, now)
	}
	if r.closed { // delivered as intake stopped: the scheduler moves it once the group is gone
		r.mu.Unlock()
		return nil
	}
	rr := newRankReq(meta)
	rr.result = r.resultOf(meta)
	queued := false
	// Set up before the load loop can see it.
	rr.id = r.nextID + 1
	rr.receipt = time.AfterFunc(r.cfg.ReceiptAfter, func() { r.sendReceipt(rr) })
	select {
	case r.loadQ <- rr:
		queued = true
		r.nextID++
		r.active[meta.ReqID] = rr
		r.registerSavesLocked(rr)
		if r.IsDriver() {
			r.queue(meta, 1)
		}
	default:
		rr.receipt.Stop()
	}
	r.mu.Unlock()
	r.series.queue.Inc()
	if !queued {
		rr.prefilled.Store(true) // never counted in the prefill queue
		r.series.overloaded.Inc()
		r.fail(rr, "overloaded", fmt.Sprintf("rank %s/%d: load queue full (%d requests)", r.cfg.Group, r.cfg.TPRank, cap(r.loadQ)))
	}
	return nil
}

// prefillTokens is what a request adds to the driver's prefill queue: its
// prompt tokens not covered by the LoadSpec.
func prefillTokens(meta *messages.ReqMeta) int {
	cached := 0
	if ls := meta.LoadSpec; ls != nil && ls.CanLoad {
		cached = ls.KVPoolCachedTokens
	}
	return max(meta.TokenLen-cached, 0)
}

// loadTokens are the cached tokens a request loads: from the group's own
// segments, and from other groups' (its LoadSpec's remote runs).
func loadTokens(meta *messages.ReqMeta) (local, remote int) {
	ls := meta.LoadSpec
	if ls == nil || !ls.CanLoad || meta.BlockSize < 1 {
		return 0, 0
	}
	n := ls.KVPoolCachedTokens / meta.BlockSize
	for _, run := range ls.Remote {
		remote += max(min(run.FromBlock+run.Blocks, n)-run.FromBlock, 0)
	}
	remote = min(remote, n) * meta.BlockSize
	return ls.KVPoolCachedTokens - remote, remote
}

// queue adds (sign 1) or removes (-1) a request's work to the driver's
// queue counters.
func (r *Rank) queue(meta *messages.ReqMeta, sign int64) {
	local, remote := loadTokens(meta)
	r.queuedTokens.Add(sign * int64(prefillTokens(meta)))
	r.queuedLoad.Add(sign * int64(local))
	r.queuedRemote.Add(sign * int64(remote))
}

// donePrefill takes rr's work off the driver's prefill queue, once.
func (r *Rank) donePrefill(rr *rankReq) {
	if r.IsDriver() && rr.prefilled.CompareAndSwap(false, true) {
		r.queue(rr.meta, -1)
	}
}

// newRankReq starts a request's context. Its deadline is not a timer of its
// own (two contexts, a timer and a child map per request per rank were an
// eighth of the bytes a request allocates): expireLoop cancels requests past
// their deadline with the cause context.DeadlineExceeded, and one already
// past it starts cancelled.
func newRankReq(meta *messages.ReqMeta) *rankReq {
	ctx, cancel := context.WithCancelCause(context.Background())
	rr := &rankReq{
		meta:          meta,
		resultSubject: meta.ResultSubject,
		saved:         make(chan struct{}),
		ctx:           ctx,
		cancel:        cancel,
		storeDone:     make(chan struct{}),
	}
	if meta.DeadlineUnixMs > 0 {
		rr.deadline = time.UnixMilli(meta.DeadlineUnixMs)
		if !time.Now().Before(rr.deadline) {
			cancel(context.DeadlineExceeded)
		}
	}
	return rr
}

// expireInterval is how often expireLoop looks for requests past their
// deadline: how late, at most, a request's work stops after it.
const expireInterval = 50 * time.Millisecond

// expireLoop cancels active requests whose deadline passed, until ctx ends.
func (r *Rank) expireLoop(ctx context.Context) {
	t := time.NewTicker(expireInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			r.mu.Lock()
			for _, rr := range r.active {
				if !rr.deadline.IsZero() && now.After(rr.deadline) {
					rr.cancel(context.DeadlineExceeded)
				}
			}
			r.mu.Unlock()
		}
	}
}

func (r *Rank) onAbort(_ context.Context, m *nats.Msg) error {
	a, err := messages.DecodeAbort(m.Data)
	if err != nil {
		return err
	}
	if a.Group != "" && a.Group != r.cfg.Group {
		return nil
	}
	r.mu.Lock()
	rr := r.active[a.ReqID]
	if rr == nil && a.Group == "" {
		// The client's abort may come before the ReqMeta: remember it (a
		// request this rank already saw is left as it is).
		r.seen.GetOrPut(a.ReqID, seenReq{attempt: math.MaxInt, aborted: true}, time.Now())
	}
	if rr != nil && a.BeforeAttempt > 0 && rr.meta.Attempt >= a.BeforeAttempt {
		r.mu.Unlock()
		return nil // the attempt the request goes on at
	}
	if rr != nil && !rr.withdrawn {
		rr.withdrawn = true
		if rr.onWithdraw != nil {
			close(rr.onWithdraw)
		}
	}
	r.mu.Unlock()
	if rr != nil {
		r.log.Info("request aborted", "req_id", a.ReqID, "session_id", rr.meta.SessionID, "reason", a.Reason)
		rr.cancel(errAborted)
	}
	return nil
}

// giveUp ends the requests still running once ShutdownTimeout has passed.
// A planned stop must not look like a failure of the model: the rank first
// says in a heartbeat that it is not ready, which the schedulers handle as a
// group that lost a rank (their failover: a request whose output has not
// started is withdrawn and dispatched again on another group, one that
// streamed ends with group_failed), then cancels the requests with
// errShutdown; the driver ends those whose output started with
// group_failed (503, Retry-After), and waits for the others' withdrawal
// (see awaitWithdraw).
func (r *Rank) giveUp() {
	r.mu.Lock()
	n := len(r.active)
	r.mu.Unlock()
	if n == 0 {
		return
	}
	r.log.Warn("rank stopping: requests still running past --shutdown-timeout end here; those whose output has not started are left to the scheduler to dispatch again",
		"requests", n, "timeout", r.cfg.ShutdownTimeout)
	r.gaveUp.Store(true)
	r.heartbeat() // before the cancels: the scheduler hears it as soon as it can
	r.cancelAll(errShutdown)
}

// awaitWithdraw waits, up to withdrawWait, until rr is withdrawn (an Abort
// for its attempt came: the scheduler dispatched it again elsewhere, or its
// client left), and reports whether it was.
func (r *Rank) awaitWithdraw(rr *rankReq) bool {
	r.mu.Lock()
	if rr.withdrawn {
		r.mu.Unlock()
		return true
	}
	if rr.onWithdraw == nil {
		rr.onWithdraw = make(chan struct{})
	}
	ch := rr.onWithdraw
	r.mu.Unlock()
	t := time.NewTimer(withdrawWait)
	defer t.Stop()
	select {
	case <-ch:
		return true
	case <-t.C:
		return false
	}
}

func (r *Rank) cancelAll(cause error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rr := range r.active {
		rr.cancel(cause)
	}
}
