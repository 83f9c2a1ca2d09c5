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
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

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
	// DumpTimeout bounds a rank's answer to a dump request (default 2 s).
	DumpTimeout time.Duration
	Logger      *slog.Logger
	// Registerer receives the scheduler's metrics; nil: unregistered.
	Registerer prometheus.Registerer
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	switch {
	case c.Conn == nil:
		return fmt.Errorf("%w: no NATS connection", ErrConfig)
	case c.Policy == nil:
		return fmt.Errorf("%w: no placement policy", ErrConfig)
	case c.BlockSize < 1:
		return fmt.Errorf("%w: --block-size must be >= 1", ErrConfig)
	}
	if err := messages.ValidateToken("scheduler id", c.ID); err != nil {
		return fmt.Errorf("%w: %v", ErrConfig, err)
	}
	return c.Subjects.Validate()
}

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

	dumpMu  sync.Mutex
	dumping map[rankID]time.Time // dump requests in flight
	dumps   sync.WaitGroup
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
	if cfg.RequestTimeout <= 0 {
		cfg.RequestTimeout = 60 * time.Second
	}
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = 30 * time.Minute
	}
	if cfg.DumpTimeout <= 0 {
		cfg.DumpTimeout = 2 * time.Second
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	s := &Scheduler{
		cfg:      cfg,
		log:      log.With("scheduler_id", cfg.ID),
		groups:   newGroupTable(cfg.HeartbeatTimeout),
		trackers: newTrackerTable(),
		index:    NewKVIndex(),
		hm:       bus.NewHandlerMetrics(cfg.Registerer),
		dumping:  map[rankID]time.Time{},
	}
	s.m = newMetrics(cfg.Registerer, func() float64 { return float64(s.trackers.Len()) })
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
	nc, subj := s.cfg.Conn, s.cfg.Subjects
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("scheduler: jetstream: %w", err)
	}
	setupCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := bus.EnsureRequestStream(setupCtx, js, bus.StreamConfig{Subjects: subj, Replicas: s.cfg.StreamReplicas})
	if err != nil {
		return err
	}
	cons, err := bus.EnsureSchedulerConsumer(setupCtx, st, s.cfg.AckWait, s.cfg.StreamReplicas)
	if err != nil {
		return err
	}
	bindings, err := OpenSessionBindings(setupCtx, js, s.cfg.SessionTTL, s.cfg.StreamReplicas, s.log)
	if err != nil {
		return err
	}
	s.bindings.Store(bindings)
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
	}()

	var subs []*nats.Subscription
	defer func() {
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
	}()
	for _, h := range []struct {
		subject, name string
		fn            bus.Handler[*nats.Msg]
	}{
		{subj.HeartbeatAll(), "scheduler_heartbeat", s.onHeartbeat},
		{subj.KVAll(), "scheduler_kv_events", s.onKVEvents},
		{subj.Done(s.cfg.ID), "scheduler_done", s.onDone},
		{subj.Abort(), "scheduler_abort", s.onAbort},
	} {
		sub, err := bus.Subscribe(ctx, nc, h.subject, bus.Wrap(h.fn, s.log, s.hm, h.name))
		if err != nil {
			return fmt.Errorf("scheduler: subscribe %s: %w", h.subject, err)
		}
		subs = append(subs, sub)
	}
	if err := nc.Flush(); err != nil {
		s.log.Warn("flush after subscribe", "err", err)
	}

	onRequest := bus.Wrap(s.onRequest, s.log, s.hm, "scheduler_request")
	cc, err := cons.Consume(func(m jetstream.Msg) { _ = onRequest(ctx, m) },
		jetstream.PullMaxMessages(512),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if !errors.Is(err, jetstream.ErrNoHeartbeat) {
				s.log.Warn("request consumer", "err", err)
			}
		}))
	if err != nil {
		return fmt.Errorf("scheduler: consume %s: %w", messages.RequestStream, err)
	}
	s.log.Info("scheduler started", "block_size", s.cfg.BlockSize, "policy", fmt.Sprintf("%T", s.cfg.Policy))

	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			if !nc.IsConnected() {
				cc.Stop() // NATS is gone: nothing to drain
			} else {
				cc.Drain()
			}
			select {
			case <-cc.Closed():
			case <-time.After(5 * time.Second):
				cc.Stop()
			}
			s.log.Info("scheduler stopped", "trackers_left", s.trackers.Len())
			return nil
		case now := <-tick.C:
			s.sweep(ctx, now)
		}
	}
}

func (s *Scheduler) onHeartbeat(ctx context.Context, m *nats.Msg) error {
	hb, err := messages.DecodeHeartbeat(m.Data)
	if err != nil {
		return err
	}
	s.groups.observe(hb, time.Now())
	if s.index.ObserveRank(hb.Group, hb.TPRank, hb.WorldSize, hb.StartedUnixMs) {
		s.log.Info("rank (re)started: asking it for a dump", "group", hb.Group, "tp_rank", hb.TPRank)
		s.requestDump(ctx, hb.Group, hb.TPRank)
	}
	return nil
}

func (s *Scheduler) onKVEvents(ctx context.Context, m *nats.Msg) error {
	b, err := messages.DecodeKVEventBatch(m.Data)
	if err != nil {
		return err
	}
	if s.index.Apply(b) {
		s.log.Warn("gap in KV events: asking the rank for a dump", "group", b.Group, "tp_rank", b.Rank, "seq", b.Seq)
		s.requestDump(ctx, b.Group, b.Rank)
	}
	return nil
}

// requestDump asks a rank for everything it holds, in the background, unless
// a request to it is already in flight.
func (s *Scheduler) requestDump(ctx context.Context, group string, rank int) {
	id := rankID{group, rank}
	s.dumpMu.Lock()
	if _, busy := s.dumping[id]; busy || ctx.Err() != nil {
		s.dumpMu.Unlock()
		return
	}
	s.dumping[id] = time.Now()
	s.dumpMu.Unlock()
	s.m.resyncs.Inc()
	s.dumps.Go(func() {
		defer func() {
			s.dumpMu.Lock()
			delete(s.dumping, id)
			s.dumpMu.Unlock()
		}()
		rctx, cancel := context.WithTimeout(ctx, s.cfg.DumpTimeout)
		msg, err := s.cfg.Conn.RequestWithContext(rctx, s.cfg.Subjects.Dump(group, rank), nil)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			s.log.Warn("dump request failed; will retry", "group", group, "tp_rank", rank, "err", err)
			return
		}
		dump, err := messages.DecodeKVEventBatch(msg.Data)
		if err != nil {
			s.log.Warn("malformed dump; will retry", "group", group, "tp_rank", rank, "err", err)
			return
		}
		again := s.index.ApplyDump(group, rank, dump)
		s.log.Info("rank resynced from its dump", "group", group, "tp_rank", rank, "seq", dump.Seq, "gap_again", again)
		if again {
			s.dumpMu.Lock()
			delete(s.dumping, id)
			s.dumpMu.Unlock()
			s.requestDump(ctx, group, rank)
		}
	})
}

func (s *Scheduler) onAbort(_ context.Context, m *nats.Msg) error {
	a, err := messages.DecodeAbort(m.Data)
	if err != nil {
		return err
	}
	if a.Group != "" {
		return nil // a scheduler withdrawing a request from one group
	}
	if t := s.trackers.remove(a.ReqID); t != nil {
		s.groups.addInflight(t.Group, -1, -t.queued)
		s.m.requests.WithLabelValues("aborted").Inc()
		s.log.Info("request aborted", "req_id", t.ReqID, "session_id", t.SessionID, "group", t.Group, "reason", a.Reason)
	}
	return nil
}

func (s *Scheduler) onDone(_ context.Context, m *nats.Msg) error {
	r, err := messages.DecodeRankResult(m.Data)
	if err != nil {
		return err
	}
	if r.Prefilled {
		if group, blocks := s.trackers.prefilled(r); blocks > 0 {
			s.groups.addInflight(group, 0, -blocks)
		}
		return nil
	}
	t, known := s.trackers.addResult(r)
	if !known {
		s.log.Debug("result for an unknown request or attempt", "req_id", r.ReqID, "group", r.Group, "tp_rank", r.TPRank)
		return nil
	}
	if t == nil {
		return nil
	}
	s.groups.addInflight(t.Group, -1, -t.queued)
	outcome, failed := "completed", 0
	for _, res := range t.Results {
		failed += res.FailedBlocks
		if res.Error != "" {
			outcome = "failed"
		}
	}
	s.m.requests.WithLabelValues(outcome).Inc()
	driver := t.Results[0]
	depth := turnDepthLabel(t.TurnDepth)
	s.m.predicted.Add(float64(t.LoadBlocks * s.cfg.BlockSize))
	s.m.actual.Add(float64(driver.LoadedTokens))
	s.m.promptTokens.WithLabelValues(depth).Add(float64(t.TokenLen))
	s.m.cachedTokens.WithLabelValues(depth).Add(float64(driver.LoadedTokens))
	s.log.Info("request done", "req_id", t.ReqID, "session_id", t.SessionID, "group", t.Group,
		"outcome", outcome, "prompt_tokens", t.TokenLen, "predicted_tokens", t.LoadBlocks*s.cfg.BlockSize, "loaded_tokens", driver.LoadedTokens,
		"completion_tokens", driver.CompletionTokens, "failed_blocks", failed, "error", driver.Error,
		"ms", time.Since(t.Received).Milliseconds())
	return nil
}

// onRequest dispatches one request from the log. It acks after the ReqMeta
// is published; with no ready group it asks for redelivery until the
// request's deadline, then answers with an error.
func (s *Scheduler) onRequest(_ context.Context, m jetstream.Msg) error {
	start := time.Now()
	req, err := messages.DecodeRequest(m.Data())
	if err != nil {
		_ = m.Term()
		return fmt.Errorf("request on %s: %w", m.Subject(), err)
	}
	if s.trackers.seen(req.RequestID) { // a redelivery of a request already dispatched
		s.m.requests.WithLabelValues("duplicate").Inc()
		return m.Ack()
	}
	deadline := time.UnixMilli(req.ArrivalUnixMs).Add(s.cfg.RequestTimeout)
	if req.DeadlineUnixMs > 0 {
		deadline = time.UnixMilli(req.DeadlineUnixMs)
	}
	sessionID := req.SamplingParams.SessionFromExtraArgs()
	if sessionID == "" {
		sessionID = req.SessionID
	}
	log := s.log.With("req_id", req.RequestID, "session_id", sessionID)
	if start.After(deadline) {
		s.m.requests.WithLabelValues("expired").Inc()
		log.Warn("request expired before dispatch", "deadline", deadline)
		s.sendError(req.FrontendID, req.RequestID, sessionID, "timeout", "request deadline passed before it could be dispatched")
		return m.Ack()
	}
	groups := s.groups.ready(start)
	s.m.ready.Set(float64(len(groups)))
	if len(groups) == 0 {
		if md, err := m.Metadata(); err == nil && md.NumDelivered == 1 {
			log.Warn("no ready worker group; will retry until the deadline", "deadline", deadline)
		}
		return m.NakWithDelay(200 * time.Millisecond)
	}

	t := &RequestTracker{
		ReqID: req.RequestID, SessionID: sessionID, Model: req.Model, FrontendID: req.FrontendID,
		TokenLen: len(req.PromptTokenIDs), TokenIDs: req.PromptTokenIDs, Request: req,
		Received: start, Deadline: deadline, Results: map[int]*messages.RankResult{}, TurnDepth: 1,
	}
	t.BlockHashes = HashBlocks(make([]uint64, 0, t.TokenLen/s.cfg.BlockSize), HashSeed(req.Model), req.PromptTokenIDs, s.cfg.BlockSize)
	bindings := s.bindings.Load()
	binding, bound := bindings.Get(sessionID)
	if bound {
		t.TurnDepth = binding.Turn + 1
	}
	group, err := s.place(t, groups, binding, bound)
	if err != nil {
		return m.NakWithDelay(200 * time.Millisecond)
	}
	if !s.trackers.add(t) {
		return m.Ack()
	}
	s.groups.addInflight(group, 1, t.PrefillBlocks)
	if err := s.publishMeta(t); err != nil {
		s.trackers.drop(t.ReqID)
		s.groups.addInflight(group, -1, -t.queued)
		_ = m.NakWithDelay(100 * time.Millisecond)
		return err
	}
	if sessionID != "" {
		b := Binding{Group: group, Blocks: len(t.BlockHashes), Turn: t.TurnDepth}
		if b.Blocks > 0 {
			b.LastHash = t.BlockHashes[b.Blocks-1]
		}
		bindings.Record(sessionID, b)
	}
	s.m.routing.Observe(time.Since(start).Seconds())
	s.m.requests.WithLabelValues("dispatched").Inc()
	log.Debug("dispatched", "group", group, "prompt_tokens", t.TokenLen, "blocks", len(t.BlockHashes),
		"load_blocks", t.LoadBlocks, "turn_depth", t.TurnDepth)
	return m.Ack()
}

// place chooses a group among the ready ones for t and sets its Group,
// WorldSize, LoadBlocks, PrefillBlocks and queued.
func (s *Scheduler) place(t *RequestTracker, groups []GroupState, binding Binding, bound bool) (string, error) {
	s.index.Match(t.BlockHashes, groups)
	for i := range groups {
		g := &groups[i]
		g.CachedBlocks = g.IndexBlocks
		if bound && g.Name == binding.Group {
			g.Bound = true
			// The previous turn's blocks, if this prompt extends it.
			if n := binding.Blocks; n > 0 && n <= len(t.BlockHashes) && t.BlockHashes[n-1] == binding.LastHash {
				g.CachedBlocks = max(g.CachedBlocks, n)
			}
		}
	}
	group, err := s.cfg.Policy.Place(t, groups)
	if err != nil {
		return "", err
	}
	for _, g := range groups {
		if g.Name == group {
			t.WorldSize = g.WorldSize
			// Load what every rank holds, but never the whole prompt: at least
			// one token is computed (vLLM's rule).
			t.LoadBlocks = min(g.IndexBlocks, max(t.TokenLen-1, 0)/s.cfg.BlockSize)
		}
	}
	t.Group = group
	t.PrefillBlocks = len(t.BlockHashes) - t.LoadBlocks
	t.queued = t.PrefillBlocks
	return group, nil
}

// rescue handles the requests of groups that lost a rank: a request
// whose output has not started is withdrawn from its group and dispatched
// again elsewhere (attempt + 1); one that streamed already ends with an
// error. No request waits for a dead group.
func (s *Scheduler) rescue(now time.Time) {
	groups := s.groups.ready(now)
	alive := s.groups.alive(now) // a draining group finishes its requests
	movable, lost := s.trackers.stranded(func(g string) bool { return alive[g] })
	for _, t := range lost {
		s.groups.addInflight(t.Group, -1, -t.queued)
		s.withdraw(t.ReqID, t.Group, "worker group failed")
		s.m.requests.WithLabelValues("failed").Inc()
		s.log.Warn("worker group failed during generation; the request ends with an error", "req_id", t.ReqID,
			"session_id", t.SessionID, "group", t.Group)
		s.sendError(t.FrontendID, t.ReqID, t.SessionID, "group_failed", "the worker group failed while generating this answer; retry the request")
	}
	if len(movable) == 0 || len(groups) == 0 {
		return // with no ready group the requests wait, until their deadline
	}
	for _, old := range movable {
		var from string
		var meta bool
		s.trackers.update(old.ReqID, func(t *RequestTracker) {
			from = t.Group
			s.groups.addInflight(t.Group, -1, -t.queued)
			cands := append([]GroupState(nil), groups...)
			if _, err := s.place(t, cands, Binding{}, false); err != nil {
				t.Group = ""
				return
			}
			t.Attempt++
			t.Results = map[int]*messages.RankResult{}
			s.groups.addInflight(t.Group, 1, t.queued)
			meta = true
		})
		s.withdraw(old.ReqID, from, "worker group not ready: dispatched again elsewhere")
		if !meta {
			continue
		}
		s.m.requests.WithLabelValues("redispatched").Inc()
		s.log.Warn("worker group not ready: request dispatched again", "req_id", old.ReqID, "session_id", old.SessionID,
			"from", from, "to", old.Group, "attempt", old.Attempt)
		if err := s.publishMeta(old); err != nil {
			s.log.Error("cannot dispatch again", "req_id", old.ReqID, "err", err)
		}
	}
}

// withdraw tells one group's ranks to drop a request.
func (s *Scheduler) withdraw(reqID, group, reason string) {
	if data, err := messages.Marshal(&messages.Abort{ReqID: reqID, Group: group, Reason: reason}); err == nil {
		_ = s.cfg.Conn.Publish(s.cfg.Subjects.Abort(), data)
	}
}

// publishMeta builds the tracker's ReqMeta and publishes it once on the
// group's session-keyed subject.
func (s *Scheduler) publishMeta(t *RequestTracker) error {
	req := t.Request
	meta := &messages.ReqMeta{
		ReqID: t.ReqID, SessionID: t.SessionID, Model: t.Model, Group: t.Group,
		TokenLen: t.TokenLen, TokenIDs: t.TokenIDs, BlockSize: s.cfg.BlockSize, BlockHashes: t.BlockHashes,
		LoadSpec: &messages.LoadSpec{KVPoolCachedTokens: t.LoadBlocks * s.cfg.BlockSize, CanLoad: t.LoadBlocks > 0},
		CanSave:  true, SaveFromBlock: t.LoadBlocks, IsLastChunk: true, NumPromptTokens: t.TokenLen,
		SamplingParams: req.SamplingParams, FrontendID: t.FrontendID,
		ResultSubject: s.cfg.Subjects.Done(s.cfg.ID), Attempt: t.Attempt,
		DeadlineUnixMs: t.Deadline.UnixMilli(),
	}
	data, err := messages.Marshal(meta)
	if err != nil {
		return err
	}
	if err := s.cfg.Conn.Publish(s.cfg.Subjects.Meta(t.Group, t.SessionID), data); err != nil {
		return fmt.Errorf("publish ReqMeta %s: %w", t.ReqID, err)
	}
	return nil
}

// sendError ends a request at its frontend with an error chunk.
func (s *Scheduler) sendError(frontendID, reqID, sessionID, code, msg string) {
	data, err := messages.Marshal(&messages.Output{ReqID: reqID, Index: 0, Error: &messages.OutputError{Code: code, Message: msg}})
	if err == nil {
		err = s.cfg.Conn.Publish(s.cfg.Subjects.Out(frontendID), data)
	}
	if err != nil {
		s.log.Error("cannot send error to frontend", "req_id", reqID, "session_id", sessionID, "err", err)
	}
}

// sweep drops trackers past their deadline (plus a grace period for the
// driver's own timeout report) so that none leaks, retries dumps that did
// not arrive, and refreshes the gauges.
func (s *Scheduler) sweep(ctx context.Context, now time.Time) {
	s.m.ready.Set(float64(len(s.groups.ready(now))))
	for group, ranks := range s.index.Resyncing() {
		for _, r := range ranks {
			s.requestDump(ctx, group, r)
		}
	}
	s.groups.each(func(name string, inflight, queued int) {
		s.m.groupInflight.WithLabelValues(name).Set(float64(inflight))
		s.m.groupQueued.WithLabelValues(name).Set(float64(queued))
		s.m.groupBlocks.WithLabelValues(name).Set(float64(s.index.GroupBlocks(name)))
	})
	s.rescue(now)
	s.trackers.forget(now)
	entries, full := s.index.Size()
	s.m.indexEntries.Set(float64(entries))
	s.m.indexBlocks.Set(float64(full))
	for _, t := range s.trackers.expired(now.Add(-2 * time.Second)) {
		s.groups.addInflight(t.Group, -1, -t.queued)
		s.m.requests.WithLabelValues("timeout").Inc()
		s.log.Warn("request timed out in the scheduler", "req_id", t.ReqID, "session_id", t.SessionID,
			"group", t.Group, "ranks_reported", len(t.Results), "world_size", t.WorldSize)
		s.sendError(t.FrontendID, t.ReqID, t.SessionID, "timeout", "request timed out waiting for worker ranks")
	}
}

// turnDepthLabel buckets a turn depth as 1, 2, 3 or 4+.
func turnDepthLabel(d int) string {
	if d >= 4 {
		return "4+"
	}
	return strconv.Itoa(max(d, 1))
}
