package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/messages"
)

// noGroupRetry is how soon a request that found no ready group is tried
// again.
const noGroupRetry = 100 * time.Millisecond

// onRequest dispatches one request from the log. It acks after the ReqMeta
// is published. With no ready group it asks for redelivery for up to
// NoGroupWait, then answers with a fast no_ready_group error (503).
//
// A request redelivered after the replica that dispatched it died (before
// its ack) goes to the group and attempt that replica chose, as its
// SavePlan said: the ranks answer this replica instead, so the request ends
// once, with its answer.
func (s *Scheduler) onRequest(ctx context.Context, m jetstream.Msg) error {
	start := time.Now()
	req, err := messages.DecodeRequest(m.Data())
	if err != nil {
		_ = m.Term()
		return fmt.Errorf("request on %s: %w", m.Subject(), err)
	}
	if s.trackers.seen(req.RequestID) { // a redelivery of a request already dispatched (or adopted), or one its client aborted
		if !s.countAbortedInLog(req.RequestID) {
			s.m.requests.WithLabelValues("duplicate").Inc()
		}
		return m.Ack()
	}
	deadline, skew := s.requestDeadline(req, start, true)
	sessionID := requestSession(req)
	// Bound only when a line is written: With formats its attributes
	// at once, and the usual dispatch writes none at info level.
	log := func() *slog.Logger { return s.log.With("req_id", req.RequestID, "session_id", sessionID) }
	if skew.Abs() >= clockSkewWarning {
		if ok, held, _ := s.skewSaid.Allow(skew); ok {
			log().Warn("a frontend's clock and this host's disagree: its requests' deadlines are read from the time they had left, "+
				"moved by what they waited in the request log (run NTP on every host)",
				"frontend_id", req.FrontendID, "frontend_ahead_by", skew.Round(time.Millisecond), "more_since_last_warning", held)
		}
	}
	if start.After(deadline) {
		s.m.requests.WithLabelValues("expired").Inc()
		if ok, held, _ := s.expiredSaid.Allow(req.RequestID); ok {
			log().Warn("request expired before dispatch", "deadline", deadline, "more_since_last_warning", held)
		}
		s.sendError(req.FrontendID, req.RequestID, sessionID, 0, "timeout", "request deadline passed before it could be dispatched")
		return m.Ack()
	}
	md, mdErr := m.Metadata()
	s.awaitCausal()
	// The waits below are the request's own: its retries, not its time in
	// the log, so that a backlog is not refused at once for a group that
	// missed one heartbeat while it queued.
	logged, deliveries := start, uint64(1)
	if mdErr == nil {
		logged, deliveries = md.Timestamp, md.NumDelivered
	}
	retried := time.Duration(deliveries-1) * noGroupRetry
	all := s.groups.ready(start)
	ready := forModel(all, req.Model) // a request of model a never goes to model b's ranks
	groups := s.index.placeable(ready)
	if len(groups) == 0 && len(ready) > 0 {
		// Groups are ready but the index of none is synced: a scheduler
		// that just started, its ranks' dumps on the way. Placed now, the
		// next turn of every waiting conversation would miss its blocks;
		// it waits for the dumps, up to UnsyncedWait (a resync in
		// progress everywhere must not stop placement).
		if retried < s.cfg.UnsyncedWait {
			return m.NakWithDelay(noGroupRetry)
		}
		groups = ready
	}
	if len(groups) > 0 && retried < s.cfg.UnsyncedWait && start.Sub(s.started) < s.cfg.HeartbeatTimeout &&
		(s.groups.forming(start) || len(groups) < len(ready)) {
		// A replica that just started hears a group's driver at once (a
		// heartbeat at every prefill), its other ranks up to a heartbeat
		// interval later, and each rank's dump after it heard the rank:
		// placed now, a conversation whose prefix a group heard in part,
		// or not synced yet, holds would go elsewhere and load nothing.
		return m.NakWithDelay(noGroupRetry)
	}
	if len(groups) > 0 && retried < s.cfg.UnsyncedWait && s.groups.rejoining(start, groups) {
		// Just back from a cut (a NATS restart): a group's rank not heard
		// since may not be back yet, and would miss this ReqMeta and the
		// saves it asks for (see rejoining). A rank's first heartbeat
		// after its reconnect (buffered while cut off, or its next) says
		// it is back.
		return m.NakWithDelay(noGroupRetry)
	}
	if len(groups) == 0 {
		if retried < s.cfg.NoGroupWait {
			return m.NakWithDelay(noGroupRetry)
		}
		s.m.requests.WithLabelValues("no_ready_group").Inc()
		msg := fmt.Sprintf("no worker group is ready (waited %s); retry shortly, and check that the workers run", s.cfg.NoGroupWait)
		if len(all) > 0 {
			// Groups are ready, but for other models: say so, or the
			// operator looks for workers that are down.
			msg = fmt.Sprintf("no worker group of model %q is ready (waited %s; the ready groups serve %s); retry shortly, and check that workers with --model %s run",
				req.Model, s.cfg.NoGroupWait, strings.Join(quoted(servedModels(all)), ", "), req.Model)
		}
		log().Warn("no ready worker group: request refused", "model", req.Model, "ready_groups_other_models", len(all),
			"waited", start.Sub(logged).Round(time.Millisecond), "deliveries", deliveries)
		s.sendError(req.FrontendID, req.RequestID, sessionID, 0, "no_ready_group", msg)
		return m.Ack()
	}

	t := s.newTracker(req, start, deadline)
	if mdErr == nil {
		t.logSeq = md.Sequence.Stream
	}
	bindings := s.bindings.Load()
	binding, bound := bindings.GetModel(req.Model, sessionID)
	legacy := bound && binding.Model == "" && req.Model != ""
	if legacy && binding.Blocks > 0 && !binding.extendedBy(t.BlockHashes) {
		// A binding of an older kvbus names no model: it is this model's
		// previous turn only if this prompt extends it (each model hashes
		// from its own seed); else another model's conversation.
		bound, legacy = false, false
	}
	redelivered := mdErr == nil && md.NumDelivered > 1
	if bound {
		t.TurnDepth = binding.turnOf(t.BlockHashes, redelivered || req.AgainOf != "")
	}
	if redelivered {
		// A redelivery: another replica may have dispatched it before it
		// died. Without its SavePlan, a higher attempt makes sure a second
		// run is never mixed into the first one's answer.
		t.Attempt = int(md.NumDelivered - 1)
	}
	var group string
	prev, dispatched := s.dispatched.Get(req.RequestID, start)
	if dispatched && prev.ended {
		// A copy this replica held while it was paused or cut off, past
		// its ack wait: another replica dispatched the redelivery and has
		// ended it. Taken over, it ran (or was answered from the ranks'
		// memory) and counted a second time.
		s.m.requests.WithLabelValues("duplicate").Inc()
		log().Info("request already dispatched and ended by another scheduler replica: dropped", "from", prev.scheduler)
		return m.Ack()
	}
	if dispatched && (s.takeOver(t, prev, ready) || s.keepOnAlive(t, prev, start)) {
		group = t.Group
		log().Info("request taken over from another scheduler replica", "group", group, "attempt", t.Attempt, "from", prev.scheduler)
	} else if group, err = s.place(t, groups, binding, bound); err != nil {
		return m.NakWithDelay(200 * time.Millisecond)
	} else if dispatched {
		// Its group is gone: should any of it still run the old attempt,
		// it drops it, and the answer is generated once.
		s.withdraw(req.RequestID, prev.group, t.Attempt, "placed again by another scheduler replica: its group is gone")
	}
	if err := s.buildMeta(t); err != nil {
		_ = m.Term()
		return err
	}
	// Once added, the tracker is shared (a failover may move it): what
	// this dispatch publishes and counts is read before. The plan goes out
	// first: another replica hears of it before anything this request
	// causes (see awaitCausal).
	queued, subj, data := t.queued, t.metaSubj, t.metaData
	if s.countAbortedInLog(req.RequestID) {
		// Its client gave up while it was placed: no save plan is
		// announced for blocks nothing will save.
		return m.Ack()
	}
	s.publishPlan(t)
	if !s.trackers.add(t) {
		s.countAbortedInLog(req.RequestID)
		return m.Ack()
	}
	s.groups.addInflight(group, 1, queued)
	// The ranks' decoders take at most MaxMessageBytes, whatever a NATS
	// server's max_payload lets through.
	limit := min(s.cfg.Conn.MaxPayload(), messages.MaxMessageBytes)
	err = nats.ErrMaxPayload
	if int64(len(data)) <= limit {
		err = s.cfg.Conn.Publish(subj, data)
	}
	if err != nil {
		s.trackers.drop(t.ReqID)
		s.groups.addInflight(group, -1, -queued)
		if errors.Is(err, nats.ErrMaxPayload) { // no retry can pass
			s.m.requests.WithLabelValues("too_large").Inc()
			s.sendError(req.FrontendID, req.RequestID, sessionID, t.Attempt, "request_too_large",
				fmt.Sprintf("the request's ReqMeta is %d bytes, above the %d a message on the bus may take (the NATS server's max_payload, %d, and at most %d); send a shorter prompt",
					len(data), limit, s.cfg.Conn.MaxPayload(), messages.MaxMessageBytes))
			_ = m.Term()
			return fmt.Errorf("publish ReqMeta %s: %w", t.ReqID, err)
		}
		_ = m.NakWithDelay(100 * time.Millisecond)
		return fmt.Errorf("publish ReqMeta %s: %w", t.ReqID, err)
	}
	if sessionID != "" {
		b := Binding{Group: group, Blocks: len(t.BlockHashes), Turn: t.TurnDepth, continuesLegacy: legacy}
		if b.Blocks > 0 {
			b.LastHash = t.BlockHashes[b.Blocks-1]
		}
		bindings.RecordModel(req.Model, sessionID, b)
	}
	s.m.routing.Observe(time.Since(start).Seconds())
	s.m.requests.WithLabelValues("dispatched").Inc()
	if s.log.Enabled(ctx, slog.LevelDebug) {
		log().Debug("dispatched", "group", group, "prompt_tokens", t.TokenLen, "blocks", len(t.BlockHashes),
			"load_blocks", t.LoadBlocks, "turn_depth", t.TurnDepth)
	}
	return m.Ack()
}

// countAbortedInLog counts, once, the outcome of the Abort that ended a
// request before it was dispatched (its client gave up while it waited in
// the log, or while it was placed), as one aborted after dispatch is; it
// reports whether there was one.
func (s *Scheduler) countAbortedInLog(id string) bool {
	o, aborted := s.trackers.abortedInLog(id)
	if aborted {
		s.m.requests.WithLabelValues(o.String()).Inc()
	}
	return aborted
}

// requestDeadline is when req's client stops waiting, on this host's
// clock: its own deadline, or the request timeout from its arrival. With
// the time it had left (timeout_ms) its frontend's clock is taken into
// account (see frontendClocks); received is when this replica got it
// (learn) or now (a request another replica received). skew is how far
// ahead of this host's clock its frontend's clock is, as learnt.
func (s *Scheduler) requestDeadline(req *messages.Request, received time.Time, learn bool) (time.Time, time.Duration) {
	if req.DeadlineUnixMs > 0 {
		return s.clocks.deadline(req, received, learn)
	}
	return time.UnixMilli(req.ArrivalUnixMs).Add(s.cfg.RequestTimeout), 0
}

// requestSession is req's session id: vllm_xargs.session_id, else the one
// the frontend resolved.
func requestSession(req *messages.Request) string {
	if id := req.SamplingParams.SessionFromExtraArgs(); id != "" {
		return id
	}
	return req.SessionID
}

// newTracker makes the tracker of req, taken from the log at start, due by
// deadline (requestDeadline), its prompt hashed into blocks; TurnDepth is 1
// (the caller sets it from the session's binding).
func (s *Scheduler) newTracker(req *messages.Request, start, deadline time.Time) *RequestTracker {
	t := &RequestTracker{
		ReqID: req.RequestID, SessionID: requestSession(req), Model: req.Model, FrontendID: req.FrontendID,
		TokenLen: len(req.PromptTokenIDs), TokenIDs: req.PromptTokenIDs, Request: req,
		Received: start, Deadline: deadline, Results: map[int]*messages.RankResult{}, TurnDepth: 1,
	}
	t.BlockHashes = HashBlocks(make([]uint64, 0, t.TokenLen/s.cfg.BlockSize), PromptSeed(req.Model, req.LoRAName, req.CacheSalt), req.PromptTokenIDs, s.cfg.BlockSize)
	return t
}

// takeOver sets t to the group and attempt another replica dispatched it
// to, if that group is still among groups (ready) — else t is placed anew.
func (s *Scheduler) takeOver(t *RequestTracker, prev dispatchRecord, groups []GroupState) bool {
	for _, g := range groups {
		if g.Name == prev.group {
			s.index.Match(t.BlockHashes, groups)
			t.Group, t.Attempt, t.WorldSize = g.Name, prev.attempt, g.WorldSize
			for _, m := range groups {
				if m.Name == g.Name {
					s.setLoad(t, m.IndexBlocks, false)
				}
			}
			t.foreignLoad = true
			return true
		}
	}
	t.Attempt = prev.attempt + 1 // its group is gone: a new attempt elsewhere
	return false
}

// keepOnAlive leaves t on the group prev named, with its attempt, when that
// group is still alive though not ready (draining: it finishes its
// requests): its ranks run it already, and a second run elsewhere would
// generate the answer twice, or end one already streaming with
// group_failed.
func (s *Scheduler) keepOnAlive(t *RequestTracker, prev dispatchRecord, now time.Time) bool {
	if !s.groups.alive(now)[prev.group] {
		return false
	}
	t.Group, t.Attempt, t.WorldSize = prev.group, prev.attempt, s.groups.worldSize(prev.group)
	s.setLoad(t, 0, false)
	t.foreignLoad = true
	return true
}

// place chooses a group among groups for t and sets its Group, WorldSize,
// LoadBlocks, PrefillBlocks and queued.
func (s *Scheduler) place(t *RequestTracker, groups []GroupState, binding Binding, bound bool) (string, error) {
	s.index.Match(t.BlockHashes, groups)
	// With the global pool, what each group can read: a rank reads the same
	// tp_rank of another group, so only groups of its own world size (a
	// rank of a 4-rank group holds a quarter of a block's heads, one of a
	// 2-rank group half: the copy fails verification and is recomputed).
	type poolView struct {
		sources, savers []string
		prefix          int
	}
	// The previous turn's blocks, if this prompt extends it and its group
	// has not lost its cache since, within PlanTTL of the turn: its answer
	// came, so its ranks' save of them is imminent whatever else the group
	// has queued, and another group may plan to read them (the read waits
	// for the save).
	prevTurn := bound && binding.extendedBy(t.BlockHashes) && !s.index.LostCacheSince(binding.Group, binding.UpdatedUnixMs)
	fresh := prevTurn && time.Since(time.UnixMilli(binding.UpdatedUnixMs)) < s.cfg.PlanTTL
	var views map[int]*poolView
	if s.cfg.Pool == PoolGlobal {
		sources, saving := s.groups.sources(time.Now()), savers(groups)
		if fresh && !slices.Contains(saving, binding.Group) {
			saving = append(saving, binding.Group)
		}
		views = map[int]*poolView{}
		for _, g := range groups {
			if views[g.WorldSize] != nil {
				continue
			}
			v := &poolView{sources: s.groups.ofWorldSize(sources, g.WorldSize), savers: s.groups.ofWorldSize(saving, g.WorldSize)}
			v.prefix = s.index.PoolPrefix(t.BlockHashes, v.sources, v.savers)
			views[g.WorldSize] = v
		}
	}
	for i := range groups {
		g := &groups[i]
		pool := 0
		if v := views[g.WorldSize]; v != nil {
			pool = v.prefix
		}
		g.CachedBlocks = g.IndexBlocks
		if bound && g.Name == binding.Group {
			g.Bound = true
			// The previous turn's blocks (prevTurn: the group has not
			// lost its cache since, a restarted engine), while the ranks'
			// KV events may not have told the index yet (fresh), or its
			// index is not synced: later the index knows, evictions
			// included, and a group credited with blocks it evicted got
			// the turn behind its queue to prefill it all.
			if prevTurn && (fresh || !s.index.Synced(g.Name)) {
				g.CachedBlocks = max(g.CachedBlocks, binding.Blocks)
			}
		}
		// The pool's blocks past what the group has (or is credited with).
		g.RemoteBlocks = max(pool-g.CachedBlocks, 0)
	}
	group, err := s.cfg.Policy.Place(t, groups)
	if err != nil {
		return "", err
	}
	t.Group = group
	for _, g := range groups {
		if g.Name == group {
			t.WorldSize = g.WorldSize
			if v := views[g.WorldSize]; v != nil {
				t.sources, t.savers = v.sources, v.savers
			}
			s.setLoad(t, g.IndexBlocks, s.cfg.Pool == PoolGlobal)
		}
	}
	return group, nil
}

// setLoad sets t's LoadSpec on its group, which holds (or is saving) local
// leading blocks: never the whole prompt — at least one token is computed
// (vLLM's rule) — and, with the global pool, the runs past them that other
// groups hold.
func (s *Scheduler) setLoad(t *RequestTracker, local int, global bool) {
	limit := max(t.TokenLen-1, 0) / s.cfg.BlockSize
	t.foreignLoad = false
	t.LocalBlocks = min(local, limit)
	t.Remote, t.LoadBlocks = nil, t.LocalBlocks
	if global {
		t.Remote, t.LoadBlocks = s.index.RemoteRuns(t.BlockHashes, t.Group, t.LocalBlocks, limit, t.sources, t.savers)
	}
	t.PrefillBlocks = len(t.BlockHashes) - t.LoadBlocks
	t.queued = t.PrefillBlocks + loadWork(t.LocalBlocks, t.LoadBlocks-t.LocalBlocks, s.cfg.LocalLoadCost, s.cfg.RemoteLoadCost)
}

// savers are the groups with no prefill queued: what they are saving is
// saved within a moment, so other groups may plan to read it.
func savers(groups []GroupState) []string {
	out := make([]string, 0, len(groups))
	for _, g := range groups {
		if g.QueuedBlocks == 0 {
			out = append(out, g.Name)
		}
	}
	return out
}

// buildMeta encodes the tracker's ReqMeta for its group's session-keyed
// subject and marks it dispatched now; the caller publishes it (and the
// sweep again, for ranks that do not answer).
func (s *Scheduler) buildMeta(t *RequestTracker) error {
	req := t.Request
	meta := &messages.ReqMeta{
		ReqID: t.ReqID, SessionID: t.SessionID, Model: t.Model, Group: t.Group,
		TokenLen: t.TokenLen, TokenIDs: t.TokenIDs, BlockSize: s.cfg.BlockSize, BlockHashes: t.BlockHashes,
		LoadSpec: &messages.LoadSpec{KVPoolCachedTokens: t.LoadBlocks * s.cfg.BlockSize, CanLoad: t.LoadBlocks > 0, Remote: t.Remote},
		CanSave:  true, SaveFromBlock: t.LoadBlocks, IsLastChunk: true, NumPromptTokens: t.TokenLen,
		SamplingParams: req.SamplingParams, FrontendID: t.FrontendID,
		ResultSubject: s.cfg.Subjects.Done(s.cfg.ID), Attempt: t.Attempt,
		// The time left beside the deadline: a rank counts it from the
		// ReqMeta's receipt, whatever its clock says.
		DeadlineUnixMs: t.Deadline.UnixMilli(), TimeoutMs: messages.TimeLeftMs(t.Deadline, time.Now()),
		Endpoint: req.Endpoint, Stream: req.Stream, Body: req.Body, KVTransferParams: req.KVTransferParams,
		CacheSalt: req.CacheSalt,
	}
	data, err := messages.Marshal(meta)
	if err != nil {
		return err
	}
	t.metaSubj, t.metaData = s.cfg.Subjects.Meta(t.Group, t.SessionID), data
	t.Dispatched, t.Heard, t.Resends = time.Now(), nil, 0
	return nil
}

// quoted returns each of names in Go quotes, for messages.
func quoted(names []string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = strconv.Quote(n)
	}
	return out
}
