package scheduler

import (
	"fmt"
	"strings"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// rescue handles the requests of groups that lost a rank, or whose rank
// restarted (a new process, within the heartbeat timeout, as a supervisor
// restarts a crashed one) before it finished them: a request whose output
// has not started is withdrawn from its group and dispatched again (attempt
// + 1, on any ready group of its model, the restarted one included), or,
// with none, waits for one up to NoGroupWait (waitForAGroup); one that
// streamed already ends with an error. No request waits for a rank that
// forgot it.
func (s *Scheduler) rescue(now time.Time) {
	ready := s.groups.ready(now)
	alive := s.groups.alive(now) // a draining group finishes its requests
	sizes := make(map[string]int, len(alive))
	for name := range alive {
		sizes[name] = s.groups.worldSize(name)
	}
	restarts := s.groups.restarts()
	gone := func(t *RequestTracker) bool {
		if !alive[t.Group] || sizes[t.Group] != t.WorldSize {
			return true // gone, or formed again of other ranks: none has it
		}
		for r, rs := range restarts[t.Group] {
			switch {
			case !rs.at.After(t.Dispatched), t.Results[r] != nil:
				// Sent after the restart was heard (the new process has it,
				// or a resend follows), or the rank is done with it.
			case t.Heard[r] == rs.started:
				// The new process answered it: it got the ReqMeta after it
				// subscribed, before its first heartbeat was heard.
			case now.Sub(rs.at) < restartGrace:
				// The new process may have it: its receipt comes within the
				// rank's --receipt-after.
			default:
				return true // the old process took it with it
			}
		}
		return false
	}
	movable, lost := s.trackers.stranded(func(t *RequestTracker) bool {
		if gone(t) {
			return true
		}
		t.strandedAt = time.Time{} // its group is back
		return false
	}, func(model string) bool { return len(forModel(ready, model)) > 0 })
	for _, t := range lost {
		s.groups.addInflight(t.Group, -1, -t.queued)
		if driver := t.Results[0]; driver != nil {
			// The driver answered: its client has the whole answer (or the
			// driver's error); only other ranks' results, their saves, went
			// with the rank. It ends as its ranks reported, not failed, and
			// the ranks still saving it go on.
			outcome := outcomeCompleted
			for _, res := range t.Results {
				outcome = max(outcome, resultOutcome(res))
			}
			s.m.requests.WithLabelValues(outcome.String()).Inc()
			s.log.Info("request done; a rank of its group failed or restarted before it reported", "req_id", t.ReqID,
				"session_id", t.SessionID, "group", t.Group, "outcome", outcome.String(), "ranks_reported", len(t.Results), "world_size", t.WorldSize)
			continue
		}
		s.withdraw(t.ReqID, t.Group, 0, "worker group failed")
		s.m.requests.WithLabelValues("failed").Inc()
		s.log.Warn("worker group failed, or a rank restarted, during generation; the request ends with an error", "req_id", t.ReqID,
			"session_id", t.SessionID, "group", t.Group)
		s.sendError(t.FrontendID, t.ReqID, t.SessionID, t.Attempt, "group_failed", "the worker group failed while generating this answer; retry the request")
	}
	if len(movable) == 0 {
		return
	}
	// The placeable groups of each model: a request moves only to a group
	// of its own model (with none, it waits as a new request does, up to
	// NoGroupWait).
	byModel := map[string][]GroupState{}
	for _, old := range movable {
		groups, ok := byModel[old.Model]
		if !ok {
			groups = s.placeableOf(forModel(ready, old.Model))
			byModel[old.Model] = groups
		}
		if len(groups) == 0 {
			s.waitForAGroup(old, ready, now)
			continue
		}
		var (
			from, subj string
			data       []byte
			meta       bool
			before     int // the attempt it goes on at; 0: withdrawn whole
		)
		s.trackers.update(old.ReqID, func(t *RequestTracker) {
			from = t.Group
			s.groups.addInflight(t.Group, -1, -t.queued)
			cands := append([]GroupState(nil), groups...)
			if _, err := s.place(t, cands, Binding{}, false); err != nil {
				t.Group = ""
				return
			}
			t.Attempt++
			t.Results, t.Prefilled = map[int]*messages.RankResult{}, false
			if err := s.buildMeta(t); err != nil {
				t.Group = ""
				return
			}
			s.groups.addInflight(t.Group, 1, t.queued)
			// The next request of the batch sees this one's work.
			for i := range groups {
				if groups[i].Name == t.Group {
					groups[i].Inflight++
					groups[i].QueuedBlocks += t.queued
				}
			}
			subj, data, meta, before = t.metaSubj, t.metaData, true, t.Attempt
		})
		s.withdraw(old.ReqID, from, before, "worker group lost the request: dispatched again")
		if !meta {
			continue
		}
		s.m.requests.WithLabelValues("redispatched").Inc()
		s.log.Warn("worker group lost the request (not ready, or a rank restarted): dispatched again", "req_id", old.ReqID, "session_id", old.SessionID,
			"from", from, "to", old.Group, "attempt", old.Attempt)
		s.publishPlan(old)
		if err := s.cfg.Conn.Publish(subj, data); err != nil {
			s.log.Error("cannot dispatch again", "req_id", old.ReqID, "session_id", old.SessionID, "err", err)
		}
	}
}

// waitForAGroup keeps a stranded request that no ready group of its model
// can take waiting for one, NoGroupWait from when it was first found so,
// as a new request waits at intake; then it ends with no_ready_group (503),
// withdrawn from its group. It waited for its deadline (a minute by
// default) while each new request of its model got its 503 within
// NoGroupWait.
func (s *Scheduler) waitForAGroup(old *RequestTracker, all []GroupState, now time.Time) {
	var refused *RequestTracker
	s.trackers.update(old.ReqID, func(t *RequestTracker) {
		if t.strandedAt.IsZero() {
			t.strandedAt = now
		}
		if now.Sub(t.strandedAt) >= s.cfg.NoGroupWait {
			refused = t
			s.trackers.endLocked(t)
		}
	})
	if refused == nil {
		return
	}
	t := refused
	s.groups.addInflight(t.Group, -1, -t.queued)
	s.withdraw(t.ReqID, t.Group, 0, "no ready worker group of its model")
	s.m.requests.WithLabelValues("no_ready_group").Inc()
	msg := fmt.Sprintf("no worker group of model %q is ready (its group %s was lost before it started this request; waited %s); retry shortly, and check that workers with --model %s run",
		t.Model, t.Group, s.cfg.NoGroupWait, t.Model)
	if len(all) > 0 {
		msg = fmt.Sprintf("no worker group of model %q is ready (its group %s was lost before it started this request; waited %s; the ready groups serve %s); retry shortly, and check that workers with --model %s run",
			t.Model, t.Group, s.cfg.NoGroupWait, strings.Join(quoted(servedModels(all)), ", "), t.Model)
	}
	s.log.Warn("worker group lost the request and no ready group of its model took it: request refused", "req_id", t.ReqID,
		"session_id", t.SessionID, "group", t.Group, "model", t.Model, "waited", s.cfg.NoGroupWait)
	s.sendError(t.FrontendID, t.ReqID, t.SessionID, t.Attempt, "no_ready_group", msg)
}

// restartGrace is how long after hearing a rank restart a request it had
// not answered from its new process still waits for that process's receipt
// (a rank sends one --receipt-after, 100 ms, after a ReqMeta arrives).
const restartGrace = time.Second

// withdraw tells one group's ranks to drop a request: its attempts below
// before, or all of them (0).
func (s *Scheduler) withdraw(reqID, group string, before int, reason string) {
	if data, err := messages.Marshal(&messages.Abort{ReqID: reqID, Group: group, BeforeAttempt: before, Reason: reason}); err == nil {
		s.sendAbort(group, reqID, data)
	}
}

// resend publishes again the ReqMetas that a rank of their group has not
// answered (no receipt, no result) within ResendAfter: one lost core NATS
// message must not leave a request waiting for its deadline. Ranks that
// have the request already answer the copy with a receipt or their result.
func (s *Scheduler) resend(now time.Time) {
	for _, r := range s.trackers.silent(now, s.cfg.ResendAfter) {
		s.m.resends.Inc()
		s.log.Warn("a rank has not answered: ReqMeta published again", "req_id", r.reqID, "session_id", r.sessionID,
			"group", r.group, "attempt", r.attempt, "silent_tp_ranks", r.silent)
		if err := s.cfg.Conn.Publish(r.subject, r.data); err != nil {
			s.log.Error("cannot publish ReqMeta again", "req_id", r.reqID, "session_id", r.sessionID, "err", err)
		}
	}
}
