package workers

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/internal/logevery"
	"github.com/kvbus/kvbus/internal/recent"
	"github.com/kvbus/kvbus/messages"
)

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
	saving map[string]*rankReq     // store key -> the earliest request saving it
	// savingAfter: store key -> the later requests saving it too, in
	// arrival order (a regenerated turn, a newer attempt, the same prompt
	// twice): one takes over when the one before settles.
	savingAfter map[string][]*rankReq
	// withdrawnActive counts the requests of active that were withdrawn
	// (see rankReq.withdrawn) and have not left it yet: they wait for the
	// load thread or are stopping, and are no longer the group's work.
	withdrawnActive int

	serving   atomic.Bool  // Run subscribed to its ReqMetas and has not returned
	draining  atomic.Bool  // Run's context ended
	handedOff atomic.Bool  // the drain hand-off is over (heartbeats say handed_off)
	gaveUp    atomic.Bool  // ShutdownTimeout passed with requests running: heartbeats say not ready
	hbPending atomic.Bool  // heartbeatSoon has one scheduled
	hbAsked   atomic.Int64 // unix ns of heartbeatSoon's last call
	lastHB    atomic.Int64 // unix ns when the last heartbeat read the rank's state
	dropped   atomic.Int64 // ReqMetas ignored for DropReqMetas
	// resendByGroup: the driver reads its group's Resends (its heartbeats
	// say so).
	resendByGroup atomic.Bool
	delayed       atomic.Bool // the first ReqMeta was delayed (DelayFirstReqMeta)
	// skewSaid holds back repeats of the warning that a ReqMeta's
	// deadline, on this host's clock, disagrees with its time left.
	skewSaid logevery.Limiter[time.Duration]
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
	// engineHeard: a batch of the engine's KV events was handled since the
	// rank started; blockAnswered: unix ns of the engine's first answer
	// (0: none yet) to a prompt it stored a new block of (see
	// watchEngineSilence).
	engineHeard   atomic.Bool
	blockAnswered atomic.Int64

	drivers sync.WaitGroup // driver goroutines, started by the load loop
	// Pool reads waiting for saves (see onPoolRead), and their slots.
	poolWaits *offloader
	// loadReading is the pool read the load thread waits on (nil: none).
	loadReading atomic.Pointer[loadReading]
	// expireWake wakes expireLoop from its sleep with no request active.
	expireWake chan struct{}
	handoffs   *offloader // hand-offs being taken
}

// seenReq is what a rank remembers of a request it took: the attempt, and
// once it reported, its result (answered again to a scheduler replica that
// re-sends the ReqMeta or took the request over).
type seenReq struct {
	attempt int
	result  []byte // the encoded RankResult: bytes the GC does not scan
	// aborted: its client's Abort came (before its ReqMeta, maybe: they
	// come from different publishers); any ReqMeta of it is dropped.
	// timedOut: that Abort was its frontend's, for its deadline.
	aborted, timedOut bool
}

// rankReq is one request's state on a rank.
type rankReq struct {
	meta *messages.ReqMeta
	// id numbers requests in arrival order: a load waits only for saves of
	// requests that arrived before it, and the store orders the blocks it
	// touches by it (recency).
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
	// storing: the store thread took it (guarded by Rank.mu); an abort
	// before then settles its saves at once (see onAbort).
	storing bool
}

// drainGrace is how long a stopping rank still takes ReqMetas after its
// draining heartbeat: the time for the scheduler to hear it.
const drainGrace = 200 * time.Millisecond

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
	series := cfg.Metrics.forRank(cfg.Group, strconv.Itoa(cfg.TPRank))
	series.capBytes.Set(float64(cfg.CapacityBytes))
	store, err := NewMemStore(MemStoreConfig{Capacity: cfg.CapacityBytes, Evict: cfg.Evict, OnEvict: events.evicted,
		EvictIdle: func(idle time.Duration) { series.evictIdle.Observe(idle.Seconds()) }})
	if err != nil {
		return nil, err // wraps ErrConfig
	}
	events.exists = func(keys []string) []bool { return store.BatchIsExist(context.Background(), keys) }
	seen, err := recent.New[seenReq](recent.Config{MaxIDs: cfg.SeenIDs, MaxAge: cfg.SeenAge})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
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
		series: series,
		loadQ:  make(chan *rankReq, cfg.QueueSize),
		storeQ: make(chan *rankReq, cfg.QueueSize),
		active: map[string]*rankReq{},
		seen:   seen,
		saving: map[string]*rankReq{}, savingAfter: map[string][]*rankReq{},
		plans: make(chan *messages.DrainPlan, 1),

		poolWaits:  newOffloader(poolWaitSlots),
		expireWake: make(chan struct{}, 1),
		handoffs:   newOffloader(handoffSlots),
		skewSaid:   logevery.Limiter[time.Duration]{Every: time.Minute},
	}, nil
}

// IsDriver reports whether the rank runs the engine.
func (r *Rank) IsDriver() bool { return r.cfg.TPRank == 0 }

// Ready reports whether the rank takes requests, as its heartbeats tell the
// schedulers, and if not why: Run has subscribed to its ReqMetas (after
// the identity wait and the permission check) and is not draining, and on
// the driver the engine is healthy. It is safe for concurrent use.
func (r *Rank) Ready() (bool, string) {
	switch {
	case !r.serving.Load():
		return false, "starting: the rank does not take requests yet"
	case r.draining.Load():
		return false, "draining: the rank takes no new requests"
	case r.gaveUp.Load():
		return false, "stopping: requests outlived --shutdown-timeout"
	}
	if h := r.engineHealth(); h != nil {
		if ok, why := h.Healthy(); !ok {
			return false, "engine not healthy: " + why
		}
	}
	return true, ""
}

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
	// The ReqMeta and Abort subscriptions end as the rank drains (below);
	// the others are answered until it exits, draining or not: pool reads,
	// dumps, blocks handed off by draining groups, the drain hand-off's
	// plans when it is on, and (on the driver) asks to send outputs again.
	type handler struct {
		subject, name string
		fn            bus.Handler[*nats.Msg]
	}
	intake := []handler{
		{subj.MetaGroup(r.cfg.Group), "worker_reqmeta", onMeta},
		{subj.AbortGroup(r.cfg.Group), "worker_abort", r.onAbort},
	}
	serving := []handler{
		{subj.Dump(r.cfg.Group, r.cfg.TPRank), "worker_dump", r.events.onDump},
		{subj.Pool(r.cfg.Group, r.cfg.TPRank), "worker_pool_read", r.onPoolRead},
		{subj.Handoff(r.cfg.Group, r.cfg.TPRank), "worker_handoff", r.onHandoff},
	}
	if r.cfg.DrainHandoff > 0 {
		serving = append(serving, handler{subj.Drain(r.cfg.Group), "worker_drain_plan", r.onDrainPlan})
	}
	var subs []*nats.Subscription // all of them, until Run returns
	defer func() {
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
	}()
	// Refused alone, a subject of Newer (listed last) says the server's
	// nats-auth.conf predates it: the group's aborts were on kvbus.ctl.abort
	// before 2026-12-07, the drain plan on kvbus.pool.<g>.drain before
	// 2026-12-06.
	check := bus.RoleCheck{Role: "worker", Group: r.cfg.Group, Newer: []string{subj.AbortGroup(r.cfg.Group)}}
	if r.cfg.DrainHandoff > 0 {
		check.Newer = append(check.Newer, subj.Drain(r.cfg.Group))
	}
	for _, h := range append(intake, serving...) {
		sub, err := bus.Subscribe(bus.WithLogger(context.Background(), r.log), nc, h.subject, bus.Wrap(h.fn, r.log, r.cfg.HandlerMetrics, h.name))
		if err != nil {
			return fmt.Errorf("workers: subscribe %s: %w", h.subject, err)
		}
		if len(subs) == 0 {
			r.metaSub = sub // before the pool subscription that reads it
		}
		subs = append(subs, sub)
		if !slices.Contains(check.Newer, h.subject) {
			check.Subscribe = append(check.Subscribe, h.subject)
		}
	}
	check.Subscribe = append(check.Subscribe, check.Newer...)
	metaSub, abortSub := subs[0], subs[1]
	// Another role's key, or another group's, is refused these subjects: say
	// so now, naming the key to give, rather than run without ever getting
	// a ReqMeta (the group would never appear).
	if err := bus.CheckPermissions(ctx, nc, check); err != nil {
		return err
	}
	if r.replay != nil {
		sub, err := r.subscribeResend(ctx, nc)
		if err != nil {
			return err
		}
		if sub != nil {
			subs = append(subs, sub)
		}
	}
	// A (re)started rank holds nothing: say so first, as vLLM does.
	r.events.publish([]messages.KVEvent{{Type: messages.EventAllBlocksCleared}})
	if err := nc.Flush(); err != nil {
		r.log.Warn("flush after subscribe", "err", err)
	}
	r.log.Info("rank started", "model", r.cfg.Model, "tp_size", r.cfg.TPSize, "ep_size", r.cfg.EPSize,
		"capacity_bytes", r.cfg.CapacityBytes, "driver", r.IsDriver())
	r.serving.Store(true)
	defer r.serving.Store(false)

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
		// Is the driver draining too, and are the group's other ranks done
		// with their hand-offs?
		hb := subj.HeartbeatGroup(r.cfg.Group)
		if r.IsDriver() {
			hb = subj.HeartbeatAll() // which groups can take blocks
		}
		r.peers.ownPrefix = strings.TrimSuffix(subj.HeartbeatGroup(r.cfg.Group), "*")
		sub, err := bus.Subscribe(bus.WithLogger(context.Background(), r.log), nc, hb, bus.Wrap(r.peers.onHeartbeat, r.log, r.cfg.HandlerMetrics, "worker_peer_heartbeat"))
		if err != nil {
			r.log.Warn("drain hand-off: cannot follow heartbeats; nothing will be handed off", "err", err)
		} else {
			r.peers.since = time.Now()
			subs = append(subs, sub)
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
	if r.cfg.DrainHandoff > 0 {
		until := r.handOff()
		// The group's other ranks wait for this rank's word that its
		// hand-off is over before they exit (awaitGroupHandOff).
		r.handedOff.Store(true)
		r.heartbeat()
		r.awaitGroupHandOff(until)
	}
	stopHB()
	hbLoop.Wait()
	engineLoops.Wait()
	_ = abortSub.Unsubscribe()
	r.poolWaits.close() // the saves they wait for have settled
	r.handoffs.close()  // taken before this rank drained (it refuses them since)
	// What this rank held leaves with it: no LoadSpec should name it as a
	// source any more (the hand-off's targets announced their copies).
	r.events.publish([]messages.KVEvent{{Type: messages.EventAllBlocksCleared}})
	r.log.Info("rank stopped")
	return nil
}
