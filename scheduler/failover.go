package scheduler

import (
	"time"

	"github.com/kvbus/kvbus/messages"
)

// rescue handles the requests of groups that lost a rank: a request
// whose output has not started is withdrawn from its group and dispatched
// again elsewhere (attempt + 1); one that streamed already ends with an
// error. No request waits for a dead group.
func (s *Scheduler) rescue(now time.Time) {
	groups := s.PlaceableGroups(now)
	alive := s.groups.alive(now) // a draining group finishes its requests
	movable, lost := s.trackers.stranded(func(g string) bool { return alive[g] })
	for _, t := range lost {
		s.groups.addInflight(t.Group, -1, -t.queued)
		s.withdraw(t.ReqID, t.Group, "worker group failed")
		s.m.requests.WithLabelValues("failed").Inc()
		s.log.Warn("worker group failed during generation; the request ends with an error", "req_id", t.ReqID,
			"session_id", t.SessionID, "group", t.Group)
		s.sendError(t.FrontendID, t.ReqID, t.SessionID, t.Attempt, "group_failed", "the worker group failed while generating this answer; retry the request")
	}
	if len(movable) == 0 || len(groups) == 0 {
		return // with no ready group the requests wait, until their deadline
	}
	for _, old := range movable {
		var (
			from, subj string
			data       []byte
			meta       bool
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
			t.Results = map[int]*messages.RankResult{}
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
			subj, data, meta = t.metaSubj, t.metaData, true
		})
		s.withdraw(old.ReqID, from, "worker group not ready: dispatched again elsewhere")
		if !meta {
			continue
		}
		s.m.requests.WithLabelValues("redispatched").Inc()
		s.log.Warn("worker group not ready: request dispatched again", "req_id", old.ReqID, "session_id", old.SessionID,
			"from", from, "to", old.Group, "attempt", old.Attempt)
		s.publishPlan(old)
		if err := s.cfg.Conn.Publish(subj, data); err != nil {
			s.log.Error("cannot dispatch again", "req_id", old.ReqID, "session_id", old.SessionID, "err", err)
		}
	}
}

// withdraw tells one group's ranks to drop a request.
func (s *Scheduler) withdraw(reqID, group, reason string) {
	if data, err := messages.Marshal(&messages.Abort{ReqID: reqID, Group: group, Reason: reason}); err == nil {
		_ = s.cfg.Conn.Publish(s.cfg.Subjects.Abort(), data)
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
			"group", r.group, "attempt", r.attempt)
		if err := s.cfg.Conn.Publish(r.subject, r.data); err != nil {
			s.log.Error("cannot publish ReqMeta again", "req_id", r.reqID, "session_id", r.sessionID, "err", err)
		}
	}
}
