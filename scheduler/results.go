package scheduler

import (
	"context"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/messages"
)

func (s *Scheduler) onDone(_ context.Context, m *nats.Msg) error {
	r, err := messages.DecodeRankResult(m.Data)
	if err != nil {
		return err
	}
	if r.Prefilled {
		// The group's queue is not changed here: the driver sent a
		// heartbeat at the prefill, whose count no longer holds it. Taking
		// it off here too took it off twice whenever that heartbeat was
		// handled first. What the prefill took teaches how fast the group
		// works off its queue.
		if group, work := s.trackers.prefilled(r); work > 0 && r.PrefillUs > 0 {
			s.groups.observePrefill(group, work, r.PrefillUs)
		}
	}
	now := time.Now()
	t, held, known := s.trackers.addResult(r, func(t *RequestTracker) bool {
		if !s.maybeAdopted(t, now) {
			return false
		}
		// Its results waited for this replica, which was not heard:
		// counted once it is known whether another replica adopted it.
		// Held as it ends, under the tracker table's lock: an adopter's
		// save plan handled meanwhile (onPlan) found it neither tracked
		// nor held, and it was counted here as well as by the adopter.
		s.held.hold(t, now)
		return true
	})
	if !known {
		s.log.Debug("result for an unknown request or attempt", "req_id", r.ReqID, "group", r.Group, "tp_rank", r.TPRank)
		return nil
	}
	if t == nil {
		return nil
	}
	s.groups.addInflight(t.Group, -1, -t.queued)
	if held {
		return nil
	}
	s.countDone(t, now)
	return nil
}

// countDone counts and logs a request every rank of whose attempt
// answered, at end.
func (s *Scheduler) countDone(t *RequestTracker, end time.Time) {
	// The request's outcome is the gravest of its ranks' (a failure on one
	// rank is the request's, whatever the others say).
	outcome, failed, errRank, errText := outcomeCompleted, 0, 0, ""
	for rank, res := range t.Results {
		failed += res.FailedBlocks
		if o := resultOutcome(res); o > outcome {
			outcome, errRank, errText = o, rank, res.Error
		}
	}
	s.m.requests.WithLabelValues(outcome.String()).Inc()
	driver := t.Results[0]
	// What the group loaded is the prefix every rank loaded: a block one
	// rank missed (it restarted empty after the LoadSpec was made, or
	// evicted the block meanwhile) is prefilled by the whole group, as a
	// tensor-parallel engine needs every rank's shard of it. The driver's
	// own count (the client's cached_tokens) says more then.
	loaded, remote := groupLoaded(t.Results)
	if outcome == outcomeCompleted {
		// The cache's counters are over completed requests: a failed or
		// aborted one may have loaded nothing, or not all it was told to.
		depth := turnDepthLabel(t.TurnDepth)
		if !t.foreignLoad {
			// Predicted against loaded, for the LoadSpecs this replica
			// made: one taken over from another replica ran that one's.
			s.m.predicted.Add(float64(t.LoadBlocks * s.cfg.BlockSize))
			s.m.actual.Add(float64(loaded))
			bs := s.cfg.BlockSize
			s.m.poolTokens.WithLabelValues("predicted", "local").Add(float64(t.LocalBlocks * bs))
			s.m.poolTokens.WithLabelValues("predicted", "remote").Add(float64((t.LoadBlocks - t.LocalBlocks) * bs))
			s.m.poolTokens.WithLabelValues("actual", "local").Add(float64(loaded - remote))
			s.m.poolTokens.WithLabelValues("actual", "remote").Add(float64(remote))
		}
		s.m.promptTokens.WithLabelValues(t.Model, depth).Add(float64(t.TokenLen))
		s.m.cachedTokens.WithLabelValues(t.Model, depth).Add(float64(loaded))
	}
	var predicted any = t.LoadBlocks * s.cfg.BlockSize
	if t.foreignLoad {
		predicted = "unknown" // the LoadSpec its ranks ran was another replica's
	}
	logsink.Info(s.log, "request done", "req_id", t.ReqID, "session_id", t.SessionID, "group", t.Group,
		"outcome", outcome.String(), "prompt_tokens", t.TokenLen, "predicted_tokens", predicted, "loaded_tokens", loaded,
		"driver_loaded_tokens", driver.LoadedTokens, "completion_tokens", driver.CompletionTokens, "failed_blocks", failed,
		"error", errText, "error_rank", errRank, "ms", end.Sub(t.Received).Milliseconds())
}

// groupLoaded returns the cached tokens every rank of a request loaded, and
// how many of them were read from other groups: the least of the ranks'.
func groupLoaded(results map[int]*messages.RankResult) (loaded, remote int) {
	first := true
	for _, res := range results {
		if first || res.LoadedTokens < loaded {
			loaded = res.LoadedTokens
		}
		if first || res.RemoteTokens < remote {
			remote = res.RemoteTokens
		}
		first = false
	}
	return loaded, min(remote, loaded)
}

// resultOutcome is what one rank's result makes of its request: completed
// (a skipped save is no error of the answer), aborted (its client went
// away), timeout (its deadline passed) or failed.
func resultOutcome(res *messages.RankResult) requestOutcome {
	switch {
	case res.Error == "" || res.ErrorCode == messages.RankErrStoreSkipped:
		return outcomeCompleted
	case res.ErrorCode == messages.RankErrAborted:
		return outcomeAborted
	case res.ErrorCode == messages.RankErrTimeout:
		return outcomeTimeout
	default:
		return outcomeFailed
	}
}

// requestOutcome is how a request that every rank answered ended, from the
// least grave to the gravest.
type requestOutcome int

const (
	outcomeCompleted requestOutcome = iota
	outcomeAborted
	outcomeTimeout
	outcomeFailed
	outcomeWithdrawn
)

// String is the outcome's label of kvbus_scheduler_requests_total.
func (o requestOutcome) String() string {
	return [...]string{"completed", "aborted", "timeout", "failed", "withdrawn"}[o]
}

func (s *Scheduler) onAbort(_ context.Context, m *nats.Msg) error {
	a, err := messages.DecodeAbort(m.Data)
	if err != nil {
		return err
	}
	if a.Group != "" {
		return nil // a scheduler withdrawing a request from one group
	}
	outcome := outcomeWithdrawn // a copy the frontend gave up, or a publish that failed
	switch {
	case a.Timeout(): // its deadline passed at the frontend
		outcome = outcomeTimeout
	case a.ByClient():
		outcome = outcomeAborted
	}
	t := s.trackers.abort(a.ReqID, outcome)
	if t != nil {
		s.groups.addInflight(t.Group, -1, -t.queued)
		s.m.requests.WithLabelValues(outcome.String()).Inc()
		s.log.Info("request aborted", "req_id", t.ReqID, "session_id", t.SessionID, "group", t.Group, "reason", a.Reason)
		s.sendAbort(t.Group, a.ReqID, m.Data)
	}
	if d, ok := s.dispatched.Get(a.ReqID, time.Now()); ok && !d.ended && (t == nil || d.group != t.Group) {
		// Another replica's request: that replica relays it too, unless it
		// died, and then nobody else would until an adoption (which the
		// abort now prevents). Or one this replica adopted or took over
		// onto another group than that replica's (a rank of its group
		// restarted, or the group is gone): the ranks of the first group
		// that still run its earlier attempt stop too, as they did when
		// every rank read every client's Abort. A second copy changes
		// nothing on a rank.
		s.sendAbort(d.group, a.ReqID, m.Data)
	}
	return nil
}

// sendAbort sends an encoded Abort to the ranks of one group, and to no
// other: a client's, passed on to the group running the request, or this
// replica's withdrawal. Frontends publish Aborts for the schedulers only
// (kvbus.ctl.abort): when every rank of every group read them, each cost
// every rank ~4 µs of CPU (242-289 µs with 16 groups of 4 in one process),
// which grew with the cluster. A request on no group (rescue's, whose
// tracker ended before it was moved) has nothing to abort: the subject
// would be kvbus.ctl.abort., which the keys refuse.
func (s *Scheduler) sendAbort(group, reqID string, data []byte) {
	if group == "" {
		return
	}
	if err := s.cfg.Conn.Publish(s.cfg.Subjects.AbortGroup(group), data); err != nil {
		s.log.Warn("cannot send an abort to its group", "req_id", reqID, "group", group, "err", err)
	}
}

// onResend tells a frontend that lost outputs of a request on the bus which
// group's driver to ask for them again (ResendReply.Group): for a request
// of this replica, live or ended lately, or another replica's, from its save
// plan (that replica may have died; a frontend takes the first answer, and
// a second costs it nothing). Frontends ask the schedulers, not every
// driver: with every group's driver reading kvbus.ctl.resend, a frontend
// back from a NATS restart had each of its requests that heard nothing
// read by every group. A request this replica does not know, or has not
// placed yet, gets no answer from it; nor does one whose group's driver
// predates kvbus.ctl.resend.<group> (it reads kvbus.ctl.resend and answers
// itself).
func (s *Scheduler) onResend(_ context.Context, m *nats.Msg) error {
	rs, err := messages.DecodeResend(m.Data)
	if err != nil {
		return err
	}
	group := s.trackers.route(rs.ReqID)
	if group == "" {
		d, _ := s.dispatched.Get(rs.ReqID, time.Now())
		group = d.group
	}
	if group == "" || m.Reply == "" || !s.groups.resendByGroup(group) {
		return nil
	}
	data, err := messages.Marshal(&messages.ResendReply{Group: group,
		// What a frontend before 2026-12-07, which knows no Group, says.
		Error: "its driver is asked on " + s.cfg.Subjects.ResendGroup(group) + " since 2026-12-07, which this frontend predates (upgrade it)"})
	if err != nil {
		return err
	}
	return m.Respond(data)
}

// sendError ends a request at its frontend with an error chunk.
func (s *Scheduler) sendError(frontendID, reqID, sessionID string, attempt int, code, msg string) {
	data, err := messages.Marshal(&messages.Output{ReqID: reqID, Attempt: attempt, Error: &messages.OutputError{Code: code, Message: msg}})
	if err == nil {
		err = s.cfg.Conn.Publish(s.cfg.Subjects.Out(frontendID), data)
	}
	if err != nil {
		s.log.Error("cannot send error to frontend", "req_id", reqID, "session_id", sessionID, "err", err)
	}
}

// turnDepthLabel buckets a turn depth as 1, 2, 3 or 4+.
func turnDepthLabel(d int) string {
	if d >= 4 {
		return "4+"
	}
	return strconv.Itoa(max(d, 1))
}
