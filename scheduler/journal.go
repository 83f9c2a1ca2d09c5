package scheduler

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// The plan stream. A replica acknowledges a request in the log once it has
// dispatched it, and the others learn where it went from its save plans,
// which are core NATS: a replica that starts after another died never
// heard them. With one replica (the default), or all of them gone at once,
// a scheduler that died while its requests generated left them to their
// deadline if their group then failed too (a host that ran both): the
// restarted scheduler knew nothing of them. So the plans, and the lists of
// ended requests that follow them, are also kept in a stream (KVBUS_PLANS,
// in memory, for the request timeout). A replica reads it once when it
// starts, before it consumes the log: what each replica dispatched and
// did not end goes into the peer table as if heard live, and the replicas
// named there are judged by their silence. One that is not heard within
// the heartbeat timeout of this start is dead, and its requests are
// adopted as a peer's are (adopt.go); so are those of this replica's own
// earlier process.

// planStreamBatch is how many plans one pull asks for.
const planStreamBatch = 1024

// readPlanStream makes sure the plan stream exists and reads what it holds
// of the last request timeout into the peer table and the dispatch records.
// Without it (a key of an older kvbus auth init, a server that refuses)
// the replica runs on, only unable to adopt the requests of a replica that
// died before it started; it says so.
func (s *Scheduler) readPlanStream(ctx context.Context, js jetstream.JetStream) {
	st, err := bus.EnsurePlanStream(ctx, js, s.cfg.Subjects, s.cfg.StreamReplicas, s.cfg.RequestTimeout+time.Minute)
	if err != nil {
		hint := "check that JetStream runs"
		if errors.Is(err, bus.ErrPermission) {
			hint = "run kvbus auth init on the key directory again (it adds the permission to the scheduler key) and reload NATS (make reload-nats, or SIGHUP)"
		}
		s.log.Warn("no plan stream: if this replica dies with no other running, the requests it dispatched are not adopted by the next one; "+hint,
			"stream", s.cfg.Subjects.PlanStream(), "err", err)
		return
	}
	s.peers.replay()
	pending, read, err := s.pendingDispatches(ctx, st)
	s.peers.replayed(pending)
	if err != nil {
		s.log.Warn("cannot read the plan stream: requests a replica that died before this one started had dispatched may not be adopted",
			"stream", s.cfg.Subjects.PlanStream(), "plans_read", read, "err", err)
	}
	replicas, n := 0, 0
	for _, ds := range pending {
		replicas, n = replicas+min(len(ds), 1), n+len(ds)
	}
	if n > 0 {
		s.log.Info("read the plan stream: requests dispatched by replicas and not ended, adopted if their replica is not heard",
			"replicas", replicas, "requests", n, "plans_read", read)
	}
}

// pendingDispatches reads the plans of the last request timeout, up to the
// last one the stream held when it began, and returns by replica id the
// requests each dispatched and had not ended. Each dispatch also goes into
// the dispatch records, so that a request redelivered from the log goes to
// the group and attempt its plan named.
func (s *Scheduler) pendingDispatches(ctx context.Context, st jetstream.Stream) (map[string]map[string]peerDispatch, int, error) {
	info, err := st.Info(ctx)
	if err != nil || info.State.Msgs == 0 {
		return nil, 0, err
	}
	last := info.State.LastSeq
	start := time.Now().Add(-s.cfg.RequestTimeout)
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverByStartTimePolicy, OptStartTime: &start})
	if err != nil {
		return nil, 0, err
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(planStreamBatch))
	if err != nil {
		return nil, 0, err
	}
	defer it.Stop()
	byReplica := map[string]map[string]peerDispatch{}
	read := 0
	now := time.Now()
	for ctx.Err() == nil {
		// A plan past the start time is delivered at once; a second of
		// nothing means none is left (the stream trimmed meanwhile).
		m, err := it.Next(jetstream.NextMaxWait(time.Second))
		if errors.Is(err, nats.ErrTimeout) {
			break
		}
		if err != nil {
			return byReplica, read, err
		}
		md, err := m.Metadata()
		if err != nil {
			continue
		}
		if p, err := messages.DecodeSavePlan(m.Data()); err == nil { // else dropped, as a live replica would
			read++
			ds := byReplica[p.SchedulerID]
			if ds == nil {
				ds = map[string]peerDispatch{}
				byReplica[p.SchedulerID] = ds
			}
			for _, r := range p.Ended {
				// A request ends once, whoever ended it: one a replica
				// adopted is ended by the adopter, not by its first one.
				for _, other := range byReplica {
					delete(other, r)
				}
			}
			if p.ReqID != "" && p.LogSeq != 0 {
				d := peerDispatch{reqID: p.ReqID, seq: p.LogSeq, at: md.Timestamp, replayed: true}
				if p.ExpiresInMs > 0 { // the plan's expiry and time left: its making on the peer's clock
					d.peerMs = p.ExpiresUnixMs - p.ExpiresInMs
				}
				ds[p.ReqID] = d
				s.dispatched.Put(p.ReqID, dispatchRecord{group: p.Group, attempt: p.Attempt, scheduler: p.SchedulerID}, now)
			}
		}
		if md.Sequence.Stream >= last {
			break
		}
	}
	return byReplica, read, ctx.Err()
}

// watchPlanStream makes the plan stream again, every logCheckEvery, when
// the NATS server lost it: it is kept in memory, which a server's restart
// loses even with its store on disk, and until a replica started again
// nothing journaled the plans: a lone replica that then died left its
// requests to their deadline. It runs until ctx ends.
func (s *Scheduler) watchPlanStream(ctx context.Context, js jetstream.JetStream) {
	check := time.NewTicker(logCheckEvery)
	defer check.Stop()
	name := s.cfg.Subjects.PlanStream()
	for {
		select {
		case <-ctx.Done():
			return
		case <-check.C:
		}
		cctx, cancel := context.WithTimeout(ctx, logCheckEvery)
		_, err := js.Stream(cctx, name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			if _, err = bus.EnsurePlanStream(cctx, js, s.cfg.Subjects, s.cfg.StreamReplicas, s.cfg.RequestTimeout+time.Minute); err == nil {
				s.log.Warn("the plan stream was gone from the NATS server (it is kept in memory: a restart of the server loses it); made again",
					"stream", name)
			}
		}
		cancel()
	}
}
