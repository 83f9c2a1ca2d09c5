package scheduler

import (
	"context"
	"sync"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// adoptDead starts adopting the requests of the replicas that died (see
// peers.go), when this replica is the one to adopt them. A replica that
// does not consume the request log adopts nothing: it is stopping, or its
// log is being made again.
func (s *Scheduler) adoptDead(ctx context.Context, now time.Time) {
	if !s.consuming.Load() {
		return // the peers are judged once it consumes again
	}
	for id, ds := range s.peers.dead(s.cfg.ID, now, s.cfg.HeartbeatTimeout) {
		s.adoptions.Go(func() { s.adopt(ctx, id, ds) })
	}
}

// adopt takes over the requests a dead replica dispatched: each is read
// from the request log and its group is sent the same ReqMeta (same group,
// same attempt) with this replica's result subject. Ranks still working on
// it send their receipt and results here from then on, ranks that finished
// it send their result again, so this replica's tracker ends as if it had
// dispatched it; a group that is gone is handled by the next rescue (the
// request moves to another group, or ends with group_failed once its
// output had begun). Requests that ended, are past their deadline or are
// already tracked here (redelivered from the log) are left alone.
func (s *Scheduler) adopt(ctx context.Context, from string, ds []peerDispatch) {
	s.log.Warn("a scheduler replica is no longer heard (or was restarted): adopting the requests it dispatched that have not ended",
		"replica", from, "requests", len(ds), "heartbeat_timeout", s.cfg.HeartbeatTimeout)
	adopted, ended, unreadable := 0, 0, 0
	for _, d := range ds {
		if ctx.Err() != nil {
			break
		}
		if s.trackers.seen(d.reqID) {
			ended++
			continue
		}
		getCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		raw, err := s.reqLog.get(getCtx, d.seq)
		cancel()
		if err != nil {
			unreadable++
			s.log.Warn("cannot adopt a request: reading it from the request log failed (its history may be trimmed, or this key may not read the log: kvbus auth init again and restart NATS)",
				"req_id", d.reqID, "replica", from, "seq", d.seq, "err", err)
			continue
		}
		req, err := messages.DecodeRequest(raw.Data)
		if err != nil || req.RequestID != d.reqID {
			unreadable++
			s.log.Warn("cannot adopt a request: the request log holds another message at its sequence", "req_id", d.reqID, "replica", from, "seq", d.seq)
			continue
		}
		if s.adoptOne(req, d, from) {
			adopted++
		} else {
			ended++
		}
	}
	s.log.Warn("adopted the requests of a scheduler replica that is no longer heard", "replica", from,
		"adopted", adopted, "ended_or_known", ended, "unreadable", unreadable)
}

// adoptOne tracks and re-sends one adopted request, dispatched as d said;
// false when it is past its deadline or already tracked.
func (s *Scheduler) adoptOne(req *messages.Request, d peerDispatch, from string) bool {
	now := time.Now()
	deadline, _ := s.requestDeadline(req, now, false)
	t := s.newTracker(req, time.UnixMilli(req.ArrivalUnixMs), deadline) // its times count from its arrival
	t.logSeq = d.seq
	prev, known := s.dispatched.Get(req.RequestID, now)
	if !known || now.After(t.Deadline) {
		return false
	}
	// Its binding was recorded at its dispatch: its turn is that binding's
	// when it is this request's own prefix.
	if b, ok := s.bindings.Load().GetModel(t.Model, t.SessionID); ok {
		t.TurnDepth = b.turnOf(t.BlockHashes, true)
	}
	ready := forModel(s.groups.ready(now), t.Model)
	switch {
	case s.groups.startedSince(prev.group, d) && s.placeAnew(t, prev, ready):
		// A rank of its group restarted since: the new process does not
		// have it, and the same attempt run again there would be spliced
		// into what the old one had sent.
	case s.takeOver(t, prev, ready):
	default:
		// Draining, or gone: its ranks still finish it, or rescue moves it.
		t.Group, t.Attempt, t.WorldSize = prev.group, prev.attempt, s.groups.worldSize(prev.group)
		s.setLoad(t, 0, false)
		t.foreignLoad = true
	}
	if err := s.buildMeta(t); err != nil {
		s.log.Error("cannot adopt a request", "req_id", t.ReqID, "session_id", t.SessionID, "err", err)
		return false
	}
	subj, data, queued := t.metaSubj, t.metaData, t.queued
	s.publishPlan(t)
	if !s.trackers.add(t) {
		return false
	}
	s.groups.addInflight(t.Group, 1, queued)
	s.m.requests.WithLabelValues("adopted").Inc()
	s.log.Debug("request adopted from a scheduler replica that is no longer heard", "req_id", t.ReqID, "session_id", t.SessionID,
		"replica", from, "group", t.Group, "attempt", t.Attempt)
	if err := s.cfg.Conn.Publish(subj, data); err != nil {
		s.log.Warn("cannot send an adopted request's ReqMeta (resent within a second)", "req_id", t.ReqID, "session_id", t.SessionID, "err", err)
	}
	return true
}

// placeAnew places t as a new attempt after prev among groups' placeable
// ones; false when there is none.
func (s *Scheduler) placeAnew(t *RequestTracker, prev dispatchRecord, groups []GroupState) bool {
	groups = s.placeableOf(groups)
	if len(groups) == 0 {
		return false
	}
	t.Attempt = prev.attempt + 1
	_, err := s.place(t, groups, Binding{}, false)
	return err == nil
}

// A replica that was not heard for the heartbeat timeout (paused, its
// server stalled) finds its requests adopted when it is back, and the
// results its ranks sent meanwhile waiting for it. It handled those before
// the adopter's save plan, and counted each request completed; the
// adopter, which the ranks answered again from memory, counted it too
// (11 of 11 adopted requests twice after a review's SIGSTOP). The adopter
// holds the request when it ends: it counts it. This replica holds back
// the count of a request it ends that was in flight while it was not heard
// (maybeAdopted): a save plan of another replica naming it makes this copy
// a duplicate; with none within heldGrace it is counted as it ended.

// maybeAdopted reports whether t was in flight while this replica went
// unheard for longer than half the heartbeat timeout, or still is (the
// server answered no ping since): another replica may have adopted it. A
// peer judges this one dead past the heartbeat timeout, which its last
// announcement (one a second) may have begun up to a second before.
func (s *Scheduler) maybeAdopted(t *RequestTracker, now time.Time) bool {
	heard := s.selfHeard.Load()
	if heard == 0 {
		return false
	}
	return now.Sub(time.Unix(0, heard)) > s.cfg.HeartbeatTimeout/2 || t.Received.UnixNano() < s.unheardUntil.Load()
}

// heldGrace is how long, in heartbeat timeouts, a held count waits for
// the adopter's save plan: the adopter judges this replica dead at most a
// heartbeat timeout after the silence began, and its plans reach this
// replica once the server delivers what waited.
const heldGrace = 2

// releaseHeld counts the held requests that no other replica claimed
// within heldGrace heartbeat timeouts.
func (s *Scheduler) releaseHeld(now time.Time) {
	for _, h := range s.held.due(now.Add(-heldGrace * s.cfg.HeartbeatTimeout)) {
		s.countDone(h.t, h.at)
	}
}

// heldEnds are the ended requests whose count waits (see maybeAdopted). It
// is safe for concurrent use.
type heldEnds struct {
	mu sync.Mutex
	m  map[string]heldEnd
}

type heldEnd struct {
	t  *RequestTracker
	at time.Time // when it ended
}

func (h *heldEnds) hold(t *RequestTracker, now time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.m == nil {
		h.m = map[string]heldEnd{}
	}
	h.m[t.ReqID] = heldEnd{t, now}
}

// take removes and returns a held request, nil if there is none.
func (h *heldEnds) take(id string) *RequestTracker {
	h.mu.Lock()
	defer h.mu.Unlock()
	e, ok := h.m[id]
	if !ok {
		return nil
	}
	delete(h.m, id)
	return e.t
}

// due removes and returns the requests held since before.
func (h *heldEnds) due(before time.Time) []heldEnd {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []heldEnd
	for id, e := range h.m {
		if e.at.Before(before) {
			out = append(out, e)
			delete(h.m, id)
		}
	}
	return out
}
