package scheduler

import (
	"context"
	"slices"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// Save plans. When a request is dispatched, its group is about to hold its
// prefix; the ranks' KV events say so only after they stored it, which can
// be after the client already sent the next turn. So the dispatching
// replica records the plan in its index at once and tells the other
// replicas (kvbus.sched.plan.<id>): whichever replica places the next turn
// builds its LoadSpec from the blocks saved or being saved, and the ranks
// wait for a save in flight. The same message tells the other replicas
// where the request went, for a takeover after this replica dies.

// dispatchRecord is where another replica sent a request.
type dispatchRecord struct {
	group     string
	attempt   int
	scheduler string
	ended     bool // that replica said it ended: there is nothing to take over
}

// publishPlan records t's plan in the index and announces it: the blocks
// the group will hold that it does not yet (past its local prefix: copies
// read from other groups and blocks it saves), up to what its ranks' stores
// hold. A rank saves no block of a prompt past its store's capacity (it
// could only push out the prefix's start); planned, those blocks counted
// as the group's until the plan expired, and the next turn of a
// conversation longer than the store was told to load them, and missed.
func (s *Scheduler) publishPlan(t *RequestTracker) {
	expires := time.Now().Add(s.cfg.PlanTTL)
	end := len(t.BlockHashes)
	if c := s.groups.capacityBlocks(t.Group); c > 0 {
		end = min(end, c)
	}
	saves := t.BlockHashes[min(t.LocalBlocks, end):end]
	s.index.Plan(t.Group, saves, expires)
	plan := &messages.SavePlan{
		SchedulerID: s.cfg.ID, ReqID: t.ReqID, Group: t.Group, Attempt: t.Attempt,
		BlockHashes: saves, ExpiresUnixMs: expires.UnixMilli(), ExpiresInMs: s.cfg.PlanTTL.Milliseconds(), LogSeq: t.logSeq,
	}
	if t.SessionID != "" {
		// The session's binding as this replica records it (see
		// onRequest): the replica that places the next turn learns it
		// here, before the answer that causes that turn.
		plan.SessionKey, plan.Model, plan.Turn = messages.SessionKey(t.SessionID), t.Model, t.TurnDepth
		if n := len(t.BlockHashes); n > 0 {
			plan.PromptBlocks, plan.LastHash = n, t.BlockHashes[n-1]
		}
	}
	data, err := messages.Marshal(plan)
	if err == nil {
		err = s.cfg.Conn.Publish(s.cfg.Subjects.Plan(s.cfg.ID), data)
	}
	if err != nil {
		s.log.Warn("cannot announce a save plan", "req_id", t.ReqID, "session_id", t.SessionID, "err", err)
	}
}

func (s *Scheduler) onPlan(_ context.Context, m *nats.Msg) error {
	p, err := messages.DecodeSavePlan(m.Data)
	if err != nil {
		return err
	}
	if p.SchedulerID == s.cfg.ID {
		return nil
	}
	now := time.Now()
	if len(p.Ended) > 0 {
		s.peers.ended(p.SchedulerID, p.Ended)
		for _, id := range p.Ended {
			s.dispatched.Update(id, now, func(d *dispatchRecord) {
				if d.scheduler == p.SchedulerID {
					d.ended = true
				}
			})
		}
		if p.Group == "" {
			return nil // nothing else in it
		}
	}
	// A plan lives at most PlanTTL here, whatever it claims: from its
	// receipt, for the time it said it had left (its expiry read on this
	// clock dropped every plan of a replica whose clock ran PlanTTL
	// behind, and kept one of a replica ahead until PlanTTL), or, from a
	// replica of an earlier kvbus, to its expiry on this clock.
	expires := time.UnixMilli(p.ExpiresUnixMs)
	if p.ExpiresInMs > 0 {
		expires = now.Add(time.Duration(p.ExpiresInMs) * time.Millisecond)
	}
	if limit := now.Add(s.cfg.PlanTTL); expires.After(limit) {
		expires = limit
	}
	s.index.Plan(p.Group, p.BlockHashes, expires)
	if p.ReqID != "" && p.SessionKey != "" {
		// Where the session's latest turn runs, before the bucket's watcher
		// says so: the next turn may come first, and placed here without it
		// (the group of the turn before credited, the previous turn's group
		// busy and so no source of its save) it recomputed the previous
		// turn's blocks.
		if b := s.bindings.Load(); b != nil {
			b.heard(p.Model, p.SessionKey, Binding{Group: p.Group, Blocks: p.PromptBlocks, LastHash: p.LastHash, Turn: p.Turn})
		}
	}
	if p.ReqID != "" {
		s.dispatched.Put(p.ReqID, dispatchRecord{group: p.Group, attempt: p.Attempt, scheduler: p.SchedulerID}, now)
		s.peers.dispatched(p.SchedulerID, p.ReqID, p.LogSeq, now)
		// Another replica dispatched a request this one tracks (t): it
		// adopted it while this one was silent (paused, cut off), and the
		// ranks answer it now; watching it on would end it as a timeout.
		// Or this one ended it since, from results that waited for it
		// (held): the adopter counts it. Both are taken under the tracker
		// table's lock (see addResult).
		t, held := s.trackers.handOver(p.ReqID, s.held.take)
		if t != nil {
			s.groups.addInflight(t.Group, -1, -t.queued)
			s.log.Info("request handed over: another scheduler replica took it while this one was not heard", "req_id", t.ReqID,
				"session_id", t.SessionID, "to", p.SchedulerID)
		}
		if held != nil {
			s.m.requests.WithLabelValues("duplicate").Inc()
			s.log.Info("request ended here and adopted by another scheduler replica while this one was not heard: counted there",
				"req_id", held.ReqID, "session_id", held.SessionID, "by", p.SchedulerID)
		}
	}
	return nil
}

// endedPlanIDs bounds the ids of one plan of ended requests.
const endedPlanIDs = 4096

// publishEnded tells the other replicas, and the plan stream (journal.go)
// for those that start later, which requests this one ended since it last
// did, so that none adopts them if it dies.
func (s *Scheduler) publishEnded() {
	for chunk := range slices.Chunk(s.trackers.takeEnded(), endedPlanIDs) {
		data, err := messages.Marshal(&messages.SavePlan{SchedulerID: s.cfg.ID, Ended: chunk})
		if err == nil {
			err = s.cfg.Conn.Publish(s.cfg.Subjects.Plan(s.cfg.ID), data)
		}
		if err != nil {
			s.log.Warn("cannot tell the other replicas which requests ended", "requests", len(chunk), "err", err)
		}
	}
}
