package workers

import (
	"bytes"
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// report publishes the rank's RankResult and forgets the request.
func (r *Rank) report(rr *rankReq) {
	res := &rr.result
	res.LoadedTokens, res.LoadUs, res.RemoteTokens = rr.loaded, rr.loadUs, min(rr.remote, rr.loaded)
	res.FailedBlocks += rr.loadFail
	// A request that ended with its context (deadline, abort, shutdown)
	// says so, unless it failed otherwise first; a skipped save is no
	// error of the answer, and gives way.
	if cause := context.Cause(rr.ctx); cause != nil && (res.Error == "" || res.ErrorCode == messages.RankErrStoreSkipped) {
		res.Error, res.ErrorCode = cause.Error(), rankErrCode(cause, nil)
	}
	if rr.receipt != nil {
		rr.receipt.Stop()
	}
	r.settleSaves(rr)
	r.donePrefill(rr)
	data, err := messages.Marshal(res)
	if err != nil {
		r.log.Error("encode result", "req_id", rr.meta.ReqID, "session_id", rr.meta.SessionID, "err", err)
	}
	r.mu.Lock()
	subject := rr.resultSubject
	// A request refused at intake (overloaded) was never active: its
	// result is remembered too, for a replica that asks again.
	if active := r.active[rr.meta.ReqID]; active == rr || active == nil {
		if active == rr && rr.withdrawn {
			r.withdrawnActive--
		}
		delete(r.active, rr.meta.ReqID)
		r.seen.Update(rr.meta.ReqID, time.Now(), func(s *seenReq) {
			if s.attempt == rr.meta.Attempt {
				// Kept for minutes (duplicates are answered from it): the
				// bytes only, not the room Marshal's upper bound left
				// (383 bytes allocated for a 177-byte result).
				s.result = bytes.Clone(data)
			}
		})
	}
	r.mu.Unlock()
	r.publishData(subject, data, rr.meta)
	if r.IsDriver() {
		r.heartbeatSoon() // the group's load changed: every replica hears it soon
	}
	rr.cancel(nil)
	r.series.queue.Dec()
}

// sendReceipt tells the scheduler that the rank has rr's ReqMeta and is
// working on it.
func (r *Rank) sendReceipt(rr *rankReq) {
	r.mu.Lock()
	subject, active := rr.resultSubject, r.active[rr.meta.ReqID] == rr
	r.mu.Unlock()
	if !active {
		return
	}
	receipt := r.resultOf(rr.meta)
	receipt.Received = true
	r.publish(subject, &receipt, rr.meta)
}

// resultOf is an empty RankResult of meta's attempt from this rank's
// process: what every result, receipt and prefill report it sends says of
// itself.
func (r *Rank) resultOf(meta *messages.ReqMeta) messages.RankResult {
	return messages.RankResult{ReqID: meta.ReqID, Group: r.cfg.Group, TPRank: r.cfg.TPRank, EPRank: r.cfg.EPRank,
		Attempt: meta.Attempt, StartedUnixMs: r.started.UnixMilli()}
}

// fail ends a request that could not run, telling the scheduler and, on the
// driver, the frontend.
func (r *Rank) fail(rr *rankReq, code, msg string) {
	r.log.Warn("request failed on rank", "req_id", rr.meta.ReqID, "session_id", rr.meta.SessionID, "code", code, "err", msg)
	rr.result.Error, rr.result.ErrorCode = msg, code
	if r.IsDriver() {
		r.publish(r.cfg.Subjects.Out(rr.meta.FrontendID), &messages.Output{
			ReqID: rr.meta.ReqID, Attempt: rr.meta.Attempt, Error: &messages.OutputError{Code: code, Message: msg},
		}, rr.meta)
	}
	close(rr.storeDone)
	r.report(rr)
}

func (r *Rank) publish(subject string, m messages.Message, meta *messages.ReqMeta) {
	data, err := messages.Marshal(m)
	if err != nil {
		r.log.Error("encode failed", "subject", subject, "req_id", meta.ReqID, "session_id", meta.SessionID, "err", err)
		return
	}
	r.publishData(subject, data, meta)
}

// publishData publishes an encoded message (nil: nothing, its encoding
// failed and was logged).
func (r *Rank) publishData(subject string, data []byte, meta *messages.ReqMeta) {
	if data == nil {
		return
	}
	if err := r.cfg.Conn.Publish(subject, data); err != nil {
		r.log.Error("publish failed", "subject", subject, "req_id", meta.ReqID, "session_id", meta.SessionID, "err", err)
	}
}

func (r *Rank) heartbeatLoop(ctx context.Context) {
	t := time.NewTicker(r.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		r.heartbeat()
		// The memory of finished requests forgets what aged even when no
		// request comes to sweep it (an idle worker kept its busy
		// minutes' results: 190 MB for 4 ranks in a soak run).
		r.seen.Expire(time.Now())
		if r.replay != nil {
			r.replay.expire(time.Now())
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// loadHeartbeatDelay bounds how long a finished request may still count in
// the load other scheduler replicas see. The replica that placed it counts
// it out at once, from its RankResult; and the heartbeat that matters to
// the client's next turn, the end of the prefill, goes out before the first
// token (see drive).
const loadHeartbeatDelay = 5 * time.Millisecond

// heartbeatSoon sends a heartbeat within loadHeartbeatDelay, unless one goes
// out before: under load, one per prefill already carries the change, and a
// request's end costs no message of its own.
func (r *Rank) heartbeatSoon() {
	r.hbAsked.Store(time.Now().UnixNano()) // before the flag: a pending timer sees it
	if r.hbPending.CompareAndSwap(false, true) {
		time.AfterFunc(loadHeartbeatDelay, r.askedHeartbeat)
	}
}

// askedHeartbeat sends the heartbeat heartbeatSoon asked for, unless one
// that read the rank's state after the last ask went out meanwhile.
func (r *Rank) askedHeartbeat() {
	r.hbPending.Store(false)
	if r.lastHB.Load() < r.hbAsked.Load() {
		r.heartbeat()
	}
}

func (r *Rank) heartbeat() {
	r.lastHB.Store(time.Now().UnixNano()) // before the state is read: it is at least this new
	used, capacity := r.heldBlocks()
	r.mu.Lock()
	// A withdrawn request (its client left, or a scheduler moved it) is
	// out of every scheduler's count of the group's load from the Abort
	// on, though it waits here for the load thread (behind a slow load,
	// up to --save-wait): the heartbeat the Abort causes must not count
	// it in again.
	depth, inflight := len(r.active), len(r.active)-r.withdrawnActive
	r.mu.Unlock()
	hb := &messages.Heartbeat{
		Group: r.cfg.Group, TPRank: r.cfg.TPRank, EPRank: r.cfg.EPRank, WorldSize: r.cfg.TPSize,
		Model: r.cfg.Model, CapacityBlocks: capacity, UsedBlocks: used,
		QueueDepth: depth, StartedUnixMs: r.started.UnixMilli(), Draining: r.draining.Load(),
		HandedOff: r.handedOff.Load(),
	}
	if !r.cfg.EngineCache {
		hb.UsedBytes, _, _ = r.store.Usage()
	}
	if h := r.engineHealth(); h != nil {
		ok, why := h.Healthy()
		hb.NotReady, hb.NotReadyReason = !ok, why
	}
	if r.gaveUp.Load() {
		// The rank ends the requests it still has (see giveUp): the
		// schedulers' failover moves those that have not started.
		hb.NotReady, hb.NotReadyReason = true, "stopping: requests outlived --shutdown-timeout"
	}
	if r.IsDriver() {
		hb.InflightRequests, hb.QueuedPrefillTokens = inflight, max(r.queuedTokens.Load(), 0)
		hb.QueuedLoadTokens, hb.QueuedRemoteLoadTokens = max(r.queuedLoad.Load(), 0), max(r.queuedRemote.Load(), 0)
		elapsed, tokens := r.prefills.head(time.Now())
		hb.PrefillingUs, hb.PrefillingTokens = elapsed.Microseconds(), tokens
		hb.ResendByGroup = r.resendByGroup.Load()
	}
	data, err := messages.Marshal(hb)
	if err == nil {
		err = r.cfg.Conn.Publish(r.cfg.Subjects.Heartbeat(r.cfg.Group, r.cfg.TPRank), data)
	}
	if err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		r.log.Warn("heartbeat publish failed", "err", err)
	}
}
