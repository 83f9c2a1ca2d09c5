package workers

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

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
		rr, _ := newRankReq(meta)
		rr.result = r.resultOf(meta)
		rr.prefilled.Store(true) // never counted in the prefill queue
		r.series.queue.Inc()     // report counts it out
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
				// The scheduler asking may not have heard the Abort (lost
				// across a NATS restart, and this ReqMeta is its resend):
				// without an answer it held the request, and its group's
				// load, until the deadline. It gets the result this rank
				// sent for this attempt, or word that it was aborted.
				if sent, err := messages.DecodeRankResult(s.result); s.result != nil && err == nil && sent.Attempt == meta.Attempt {
					r.publishData(meta.ResultSubject, s.result, meta)
				} else {
					res := r.resultOf(meta)
					res.Error, res.ErrorCode = "aborted by its client before this rank ran it", messages.RankErrAborted
					if s.timedOut {
						res.Error, res.ErrorCode = "its deadline passed at its frontend before this rank ran it", messages.RankErrTimeout
					}
					r.publish(meta.ResultSubject, &res, meta)
				}
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
		old.cancel(errSuperseded)
	}
	if seen { // an older attempt is remembered: this one replaces it
		r.seen.Put(meta.ReqID, seenReq{attempt: meta.Attempt}, now)
	}
	if r.closed { // delivered as intake stopped: the scheduler moves it once the group is gone
		r.mu.Unlock()
		return nil
	}
	rr, skew := newRankReq(meta)
	r.saySkew(rr, skew)
	rr.result = r.resultOf(meta)
	queued := false
	// Set up before the load loop can see it.
	rr.id = r.nextID + 1
	rr.receipt = time.AfterFunc(r.cfg.ReceiptAfter, func() { r.sendReceipt(rr) })
	select {
	case r.loadQ <- rr:
		queued = true
		r.nextID++
		if old := r.active[meta.ReqID]; old != nil && old.withdrawn {
			r.withdrawnActive--
		}
		r.active[meta.ReqID] = rr
		if len(r.active) == 1 {
			select { // expireLoop may sleep: there was none active
			case r.expireWake <- struct{}{}:
			default:
			}
		}
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
// past it starts cancelled. The deadline is the time the scheduler said the
// request had left, counted from now (messages.LocalDeadline): read as a
// time on this host's clock, a scheduler's deadline ended every request at
// once on a host whose clock ran a minute ahead of the scheduler's, and
// never ended one on a host whose clock ran behind. skew is how far the
// scheduler's deadline, on this host's clock, lies after that one.
func newRankReq(meta *messages.ReqMeta) (rr *rankReq, skew time.Duration) {
	ctx, cancel := context.WithCancelCause(context.Background())
	rr = &rankReq{
		meta:          meta,
		resultSubject: meta.ResultSubject,
		saved:         make(chan struct{}),
		ctx:           ctx,
		cancel:        cancel,
		storeDone:     make(chan struct{}),
	}
	now := time.Now()
	rr.deadline, skew = messages.LocalDeadline(meta.DeadlineUnixMs, meta.TimeoutMs, now)
	if !rr.deadline.IsZero() && !now.Before(rr.deadline) {
		cancel(context.DeadlineExceeded)
	}
	return rr, skew
}

// skewWarning is how far a ReqMeta's deadline, read on this host's clock,
// may lie from the time left the scheduler sent with it before the rank
// says the two hosts' clocks disagree: well above a ReqMeta's transit, and
// above the up to 3 s a resent ReqMeta's time left is stale by (the
// scheduler resends the bytes it built, ResendAfter apart, at most 3 times).
const skewWarning = 5 * time.Second

// saySkew warns, at most once a minute, that rr's scheduler's clock and
// this host's disagree (by skew, from newRankReq): the request is unharmed (its deadline is its time
// left), but an operator should fix the clocks (logs, kvbus top's TTFT and
// the engine restart check compare them).
func (r *Rank) saySkew(rr *rankReq, skew time.Duration) {
	if skew.Abs() < skewWarning {
		return
	}
	ok, held, _ := r.skewSaid.Allow(skew)
	if !ok {
		return
	}
	r.log.Warn("the scheduler's clock and this host's disagree: its deadline for the request, on this clock, is off from the time it said the request had left; "+
		"the rank counts the time left (run NTP on every host; a deadline that looks earlier can also be a ReqMeta that waited that long to be read, this process or its NATS server stalled)", "req_id", rr.meta.ReqID, "session_id", rr.meta.SessionID,
		"scheduler_ahead_by", skew.Round(time.Millisecond), "timeout_ms", rr.meta.TimeoutMs, "more_since_last_warning", held)
}

// recency is where the store orders the blocks rr touches: its place in the
// rank's intake order, the same for the request on every rank of the group
// (see Recency).
func (rr *rankReq) recency() Recency { return Recency(rr.id) }
