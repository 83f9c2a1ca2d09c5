package scheduler

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// watchBus pings the server every 250 ms and notes when it answered, so
// that sweep knows a stalled server from silent groups (a stalled server
// keeps the connection open: nothing else says it is away).
func (s *Scheduler) watchBus(ctx context.Context) {
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			pingCtx, cancel := context.WithTimeout(ctx, time.Second)
			if s.cfg.Conn.FlushWithContext(pingCtx) == nil {
				now := time.Now()
				// Before selfHeard: whoever sees this answer sees the silence
				// it ended (maybeAdopted).
				if heard := s.selfHeard.Load(); heard != 0 && now.Sub(time.Unix(0, heard)) > s.cfg.HeartbeatTimeout/2 {
					s.unheardUntil.Store(now.UnixNano())
				}
				s.selfHeard.Store(now.UnixNano())
			}
			cancel()
		}
	}
}

// finish watches the requests this replica dispatched, once it takes no
// more, until they end or ShutdownTimeout passes: their results, and the
// failover of a group that fails meanwhile, are this replica's alone (the
// request log's copy was acknowledged at dispatch). A replica that left at
// once left them unwatched: one whose group then failed waited for its
// deadline.
func (s *Scheduler) finish(ctx context.Context) {
	n := s.trackers.Len()
	if n == 0 {
		return
	}
	s.log.Info("stopping: watching the requests this replica dispatched until they end", "requests", n, "up_to", s.cfg.ShutdownTimeout)
	bound := time.NewTimer(s.cfg.ShutdownTimeout)
	defer bound.Stop()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for s.trackers.Len() > 0 && !s.cfg.Conn.IsClosed() { // a closed connection hears nothing more
		select {
		case <-bound.C:
			s.log.Warn("stopping with requests in flight: their results go unheard, and a failure of their group is not handled (raise --shutdown-timeout)",
				"requests", s.trackers.Len(), "shutdown_timeout", s.cfg.ShutdownTimeout)
			return
		case now := <-tick.C:
			s.sweep(ctx, now)
		}
	}
}

// forgetModelAfter is how long kvbus_scheduler_model_ready_groups keeps a
// model at 0 after its last group was forgotten; maxForgottenModels bounds
// how many it keeps so (heartbeats naming ever new models, forged or from
// a fleet relabelled by the hour, cannot grow it without bound).
const (
	forgetModelAfter   = time.Hour
	maxForgottenModels = 1024
)

// sweep drops trackers past their deadline (plus a grace period for the
// driver's own timeout report) so that none leaks, retries dumps that did
// not arrive, and refreshes the gauges.
func (s *Scheduler) sweep(ctx context.Context, now time.Time) {
	ready := s.groups.ready(now)
	s.m.ready.Set(float64(len(ready)))
	perModel := map[string]int{}
	for _, g := range ready {
		perModel[g.Model]++
	}
	s.announce(now, false)
	s.index.ExpirePlans(now)
	for group, ranks := range s.index.Resyncing() {
		for _, r := range ranks {
			s.requestDump(ctx, group, r)
		}
	}
	s.groups.each(now, func(name, model string, inflight, queued int) {
		if prev, ok := s.groupModels[name]; ok && prev != model { // its ranks now serve another model
			s.deleteGroupSeries(name)
		}
		s.groupModels[name] = model
		if _, ok := perModel[model]; !ok {
			perModel[model] = 0 // known, none ready
		}
		s.m.groupInflight.WithLabelValues(name, model).Set(float64(inflight))
		s.m.groupQueued.WithLabelValues(name, model).Set(float64(queued))
		s.m.groupBlocks.WithLabelValues(name, model).Set(float64(s.index.GroupBlocks(name)))
	})
	for model := range perModel {
		s.modelSeen[model] = now
	}
	for model, seen := range s.modelSeen {
		if _, ok := perModel[model]; ok {
			continue
		}
		// Its groups are all forgotten: it stays at 0 for an hour, so an
		// alert on 0 fires (the series vanished with the last group, and
		// the alert with it).
		if now.Sub(seen) > forgetModelAfter || len(s.modelSeen) > maxForgottenModels {
			delete(s.modelSeen, model)
			s.m.modelReady.DeleteLabelValues(model)
			continue
		}
		perModel[model] = 0
	}
	for model, n := range perModel {
		s.m.modelReady.WithLabelValues(model).Set(float64(n))
	}
	// Cut off from NATS, this replica hears no heartbeat: the groups'
	// silence is its own. It judges no group until it is back, and gives
	// every rank a heartbeat timeout from then (it withdrew every request
	// in flight as group_failed while the workers finished them).
	prevSweep := s.lastSweep
	s.lastSweep = now
	if !s.cfg.Conn.IsConnected() {
		if s.cutSince.IsZero() {
			s.cutSince = prevSweep
		}
		return
	}
	// A server that stalls (stopped, starved, a VM paused) keeps the
	// connection open and delivers nothing, then everything at once: it
	// answers no ping (watchBus). This replica is as cut off as by a
	// disconnect: it judges nothing until the server answers, and then
	// every rank and peer gets a heartbeat timeout from then.
	if heard := s.selfHeard.Load(); heard != 0 && now.Sub(time.Unix(0, heard)) > busQuietAfter {
		if !s.quiet {
			s.cutSince = prevSweep
			s.log.Warn("the NATS server answers no ping (stalled?): judging no worker group or replica until it does",
				"silent_for", now.Sub(time.Unix(0, heard)).Round(time.Millisecond))
		}
		s.quiet = true
		return
	}
	if n := s.cfg.Conn.Stats().Reconnects; n != s.reconnects || s.quiet {
		what := "reconnected to NATS"
		if n == s.reconnects {
			what = "the NATS server answers again"
		}
		s.reconnects, s.quiet = n, false
		// A cut that no sweep saw began after the last one.
		since := s.cutSince
		if since.IsZero() {
			since = prevSweep
		}
		s.cutSince = time.Time{}
		s.groups.reconnected(now, since)
		s.peers.reconnected(now)
		s.trackers.reconnected(now)
		s.frontends.reconnected()
		// Judged above on the ranks' silence during the cut, which says
		// nothing of them: after a cut longer than the heartbeat timeout
		// every group was logged "not ready", and "ready" a sweep later.
		ready = s.groups.ready(now)
		s.m.ready.Set(float64(len(ready)))
		s.log.Info(what+"; worker groups get a heartbeat timeout from now before any is judged failed",
			"heartbeat_timeout", s.cfg.HeartbeatTimeout)
	}
	s.logReadyChanges(ready, now)
	// Connected only, and counting from the last reconnect: after a cut
	// longer than ForgetGroupAfter every group was forgotten, its index
	// wiped, and its requests streaming fine ended group_failed.
	s.forgetGroups(now)
	s.publishEnded()
	// The memories of ended and dispatched ids forget what aged even when
	// no request comes to sweep them (an idle replica kept ~30 MB).
	s.trackers.ended.Expire(now)
	s.dispatched.Expire(now)
	s.adoptDead(ctx, now)
	s.releaseHeld(now)
	s.rescue(now)
	s.resend(now)
	s.watchFrontends(ctx, now)
	entries, full := s.index.Size()
	s.m.indexEntries.Set(float64(entries))
	s.m.indexBlocks.Set(float64(full))
	for _, t := range s.trackers.expired(now.Add(-2 * time.Second)) {
		s.groups.addInflight(t.Group, -1, -t.queued)
		s.m.requests.WithLabelValues(outcomeTimeout.String()).Inc()
		s.log.Warn("request timed out in the scheduler", "req_id", t.ReqID, "session_id", t.SessionID,
			"group", t.Group, "ranks_reported", len(t.Results), "world_size", t.WorldSize)
		s.sendError(t.FrontendID, t.ReqID, t.SessionID, t.Attempt, "timeout", "request timed out waiting for worker ranks")
	}
}

// deleteGroupSeries drops a group's gauges, of whatever model.
func (s *Scheduler) deleteGroupSeries(name string) {
	for _, v := range []*prometheus.GaugeVec{s.m.groupInflight, s.m.groupQueued, s.m.groupBlocks} {
		v.DeletePartialMatch(prometheus.Labels{"group": name})
	}
}

// forgetGroups forgets the groups not heard of for ForgetGroupAfter: in the
// group table (heartbeats) and in the index (heartbeats, KV batches, save
// plans: a group may be known there only), each by its own clock, with
// their gauges and resync state.
func (s *Scheduler) forgetGroups(now time.Time) {
	gone := map[string]bool{}
	for _, name := range s.groups.forget(now, s.cfg.ForgetGroupAfter) {
		gone[name] = true
	}
	for _, name := range s.index.ForgetIdle(now, s.cfg.ForgetGroupAfter, s.groups.reconnectedAt()) {
		gone[name] = true
	}
	if len(gone) == 0 {
		return
	}
	s.resyncMu.Lock()
	for id := range s.resyncs {
		if gone[id.group] {
			delete(s.resyncs, id)
		}
	}
	s.resyncMu.Unlock()
	for name := range gone {
		s.deleteGroupSeries(name)
		delete(s.groupModels, name)
		s.log.Info("forgot a group not heard of", "group", name, "after", s.cfg.ForgetGroupAfter)
	}
}

// logReadyChanges logs each group that became ready since the last sweep,
// and each that stopped being ready, naming the ranks that made it so. A
// rank killed under load showed only "a rank has not answered" for each
// request and "worker group failed, or a rank restarted", naming neither
// the rank nor that its group took no more requests.
func (s *Scheduler) logReadyChanges(ready []GroupState, now time.Time) {
	is := make(map[string]bool, len(ready))
	for _, g := range ready {
		is[g.Name] = true
		if !s.wasReady[g.Name] {
			s.log.Info("worker group ready", "group", g.Name, "world_size", g.WorldSize, "model", g.Model)
		}
	}
	for name := range s.wasReady {
		if is[name] {
			continue
		}
		why, planned := s.groups.notReadyWhy(name, now)
		log := s.log.Warn
		if planned {
			log = s.log.Info
		}
		log("worker group not ready: it takes no new requests", "group", name, "why", why)
	}
	s.wasReady = is
}
