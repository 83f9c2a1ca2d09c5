package workers

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// Ending a request's work early: its client's or a scheduler's Abort, its
// deadline, and the rank's own shutdown.

// errAborted is the cancel cause of an aborted request.
var errAborted = errors.New("request aborted")

// errAbortedTimeout is the cancel cause of a request its frontend aborted
// because its deadline passed there (Abort.Timeout): an aborted request
// whose RankResult says timeout, as the scheduler counts it.
var errAbortedTimeout = fmt.Errorf("%w: its deadline passed at the frontend", errAborted)

// errSuperseded is the cancel cause of an attempt replaced by a newer one
// of the same request on this group: the newer attempt answers, and the
// older one ends without a word to the frontend.
var errSuperseded = errors.New("superseded by a newer attempt")

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
	case errors.Is(cause, errAbortedTimeout):
		return messages.RankErrTimeout
	case errors.Is(cause, errAborted):
		return messages.RankErrAborted
	case errors.Is(cause, context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return messages.RankErrTimeout
	case errors.Is(cause, errShutdown) || errors.Is(err, ErrEngineUnavailable) || errors.Is(err, ErrEngineDied):
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

// expireInterval is how often expireLoop looks for requests past their
// deadline: how late, at most, a request's work stops after it.
const expireInterval = 50 * time.Millisecond

// expireLoop cancels active requests whose deadline passed, until ctx ends.
// With none active it sleeps until onMeta makes one active (expireWake):
// an idle rank does not wake twenty times a second.
func (r *Rank) expireLoop(ctx context.Context) {
	t := time.NewTicker(expireInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			r.mu.Lock()
			idle := len(r.active) == 0
			for _, rr := range r.active {
				if !rr.deadline.IsZero() && now.After(rr.deadline) {
					rr.cancel(context.DeadlineExceeded)
				}
			}
			r.mu.Unlock()
			if !idle {
				continue
			}
			// A request made active after the check above sent its wake-up
			// (under r.mu) into the channel's buffer.
			t.Stop()
			select {
			case <-ctx.Done():
				return
			case <-r.expireWake:
			}
			t.Reset(expireInterval)
		}
	}
}

// onAbort handles an Abort on kvbus.ctl.abort.<group>: a client's, passed
// on by the scheduler that placed the request (and by every other replica
// that heard where it went), or a scheduler's withdrawal of one group's
// attempts (Abort.group, below Abort.before_attempt).
func (r *Rank) onAbort(_ context.Context, m *nats.Msg) error {
	a, err := messages.DecodeAbort(m.Data)
	if err != nil {
		return err
	}
	if a.Group != "" && a.Group != r.cfg.Group {
		return nil
	}
	timedOut := a.Timeout() // its frontend's deadline passed
	r.mu.Lock()
	rr := r.active[a.ReqID]
	if a.Group == "" {
		// The client's abort may come before the ReqMeta, or before that
		// of an attempt dispatched again while this rank ran (or ran) an
		// earlier one: remember it, and drop every attempt to come.
		now := time.Now()
		if !r.seen.Update(a.ReqID, now, func(s *seenReq) { s.attempt, s.aborted, s.timedOut = math.MaxInt, true, timedOut }) {
			r.seen.Put(a.ReqID, seenReq{attempt: math.MaxInt, aborted: true, timedOut: timedOut}, now)
		}
	}
	if rr != nil && a.BeforeAttempt > 0 && rr.meta.Attempt >= a.BeforeAttempt {
		r.mu.Unlock()
		return nil // the attempt the request goes on at
	}
	if rr != nil && rr.withdrawn {
		rr = nil // a copy (each scheduler replica passes a client's on), or a client's after a withdrawal: done
	}
	if rr != nil {
		rr.withdrawn = true
		r.withdrawnActive++
		if rr.onWithdraw != nil {
			close(rr.onWithdraw)
		}
	}
	r.mu.Unlock()
	if rr != nil {
		r.log.Info("request aborted", "req_id", a.ReqID, "session_id", rr.meta.SessionID, "reason", a.Reason)
		cause := errAborted
		if timedOut {
			cause = errAbortedTimeout
		}
		rr.cancel(cause)
		// Its saves the store thread has not begun will not be made (it
		// skips a request that ended): a later load of those blocks (the
		// client's retry of the prompt) does not wait for the store
		// thread to reach it, behind other requests' saves, only to find
		// them missing. Read after the cancel: see storeLoop.
		r.mu.Lock()
		storing := rr.storing
		r.mu.Unlock()
		if !storing {
			r.settleSaves(rr)
		}
		// Off the driver's prefill queue now, not when the load thread
		// reaches it (behind a slow load, up to --save-wait): the
		// schedulers place by that queue.
		if r.IsDriver() && !rr.prefilled.Load() {
			r.donePrefill(rr)
			r.heartbeatSoon()
		}
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
