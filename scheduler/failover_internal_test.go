package scheduler

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/internal/logbuf"
	"github.com/kvbus/kvbus/messages"
)

// TestRescueGroupFormedAgainWithAnotherWorldSize: a group's processes are
// replaced by new ones of another world size (restarted with another
// --tp-size). The old processes took the request with them, as in a
// restart at the same size, and it is dispatched again. Before, the table
// forgot the old ranks on the change of world size without recording a
// restart, and the request waited for its deadline.
func TestRescueGroupFormedAgainWithAnotherWorldSize(t *testing.T) {
	s, _ := newBareScheduler(t)
	holding(s, "g0")
	t0 := time.Now()
	heard(s, "g0", t0, 0) // one rank, its process started at 1
	tr := promptTracker("r1", 4)
	if _, err := s.place(tr, s.PlaceableGroups(t0), Binding{}, false); err != nil {
		t.Fatal(err)
	}
	if err := s.buildMeta(tr); err != nil {
		t.Fatal(err)
	}
	s.trackers.add(tr)
	// The group comes back as two new processes (started at 2).
	for i := 1; i <= 4; i++ {
		now := t0.Add(time.Duration(i) * restartGrace / 2)
		for r := range 2 {
			s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: r, WorldSize: 2, StartedUnixMs: 2}, now)
		}
		s.rescue(now)
	}
	var attempt, worldSize int
	s.trackers.update("r1", func(t *RequestTracker) { attempt, worldSize = t.Attempt, t.WorldSize })
	if attempt != 1 || worldSize != 2 {
		t.Errorf("after the group was formed again of new processes (world size 1 -> 2) the request is attempt %d for %d ranks; want attempt 1, dispatched again to the 2 new ranks",
			attempt, worldSize)
	}
}

// redelivered is a request delivered a second time from the log: the
// replica that took it first died before acknowledging it.
type redelivered struct{ ackMsg }

func (m *redelivered) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{NumDelivered: 2, Timestamp: time.Now(), Sequence: jetstream.SequencePair{Stream: 7}}, nil
}

// TestRedeliveredRequestOfADrainingGroup: a request redelivered from the
// log, that a dead replica dispatched to g0, stays on g0 with its attempt
// while g0 drains (its ranks still finish what they have); before, it was
// placed again on g1 as attempt 1 and nobody told g0, so the answer was
// generated twice (and one already streaming ended with group_failed). A
// request whose group is gone is placed again, and the group told to drop
// the old attempt should any of it still run.
func TestRedeliveredRequestOfADrainingGroup(t *testing.T) {
	for _, tc := range []struct {
		name                    string
		draining                bool // else gone: never heard
		wantGroup               string
		wantAttempt             int
		wantWithdrawnFromFormer bool
	}{
		{"draining", true, "g0", 0, false},
		{"gone", false, "g1", 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, nc := newBareScheduler(t)
			b, _ := openTestBindings(t)
			s.bindings.Store(b)
			now := time.Now()
			holding(s, "g0")
			holding(s, "g1")
			if tc.draining {
				s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: 0, WorldSize: 1, StartedUnixMs: 1, Draining: true}, now)
			}
			heard(s, "g1", now, 0)
			s.dispatched.Put("r1", dispatchRecord{group: "g0", attempt: 0, scheduler: "dead"}, now)
			metas := subscribeMetas(t, nc)
			aborts := make(chan *nats.Msg, 8)
			asub, err := nc.ChanSubscribe(s.cfg.Subjects.AbortGroup("*"), aborts)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = asub.Unsubscribe() }()
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			if err := s.onRequest(context.Background(), redeliveredR1(t)); err != nil {
				t.Fatal(err)
			}
			var meta *messages.ReqMeta
			select {
			case mm := <-metas:
				if meta, err = messages.DecodeReqMeta(mm.Data); err != nil {
					t.Fatal(err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("no ReqMeta")
			}
			if meta.Group != tc.wantGroup || meta.Attempt != tc.wantAttempt {
				t.Errorf("dispatched to %s as attempt %d; want %s, attempt %d", meta.Group, meta.Attempt, tc.wantGroup, tc.wantAttempt)
			}
			withdrawn := false
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
		wait:
			for deadline := time.After(300 * time.Millisecond); ; {
				select {
				case am := <-aborts:
					if a, err := messages.DecodeAbort(am.Data); err == nil && a.ReqID == "r1" && a.Group == "g0" && a.BeforeAttempt == 1 {
						withdrawn = true
					}
				case <-deadline:
					break wait
				}
			}
			if withdrawn != tc.wantWithdrawnFromFormer {
				t.Errorf("g0 told to drop attempt 0: %v, want %v", withdrawn, tc.wantWithdrawnFromFormer)
			}
		})
	}
}

// TestRedeliveredRequestEndedByItsPeerIsNotTakenOver: replica s0, paused
// for 15 s under load, held requests it had pulled from the log; past the
// ack wait they were redelivered to s1, which dispatched and ended them.
// s0 woke up and took each over from s1's save plan: the ranks answered it
// again from memory and it counted dispatched and completed a second time
// (14 requests in a review). A request its peer said it ended is dropped.
func TestRedeliveredRequestEndedByItsPeerIsNotTakenOver(t *testing.T) {
	s, nc := newBareScheduler(t)
	b, _ := openTestBindings(t)
	s.bindings.Store(b)
	now := time.Now()
	holding(s, "g0")
	heard(s, "g0", now, 0)
	plan := func(p *messages.SavePlan) {
		t.Helper()
		data, err := messages.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.onPlan(context.Background(), &nats.Msg{Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	plan(&messages.SavePlan{SchedulerID: "s1", ReqID: "r1", Group: "g0", Attempt: 1, ExpiresUnixMs: now.Add(time.Second).UnixMilli()})
	plan(&messages.SavePlan{SchedulerID: "s1", Ended: []string{"r1"}})
	metas := subscribeMetas(t, nc)
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	m := redeliveredR1(t)
	if err := s.onRequest(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if !m.acked {
		t.Error("the copy was not acknowledged")
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	select {
	case mm := <-metas:
		meta, _ := messages.DecodeReqMeta(mm.Data)
		t.Errorf("dispatched again (group %s, attempt %d) though s1 ended it", meta.Group, meta.Attempt)
	case <-time.After(300 * time.Millisecond):
	}
	if s.trackers.has("r1") {
		t.Error("r1 is tracked again")
	}
}

// TestCacheCountersOverCompletedRequests: the cache's counters (prompt,
// predicted and loaded tokens) are over completed requests, as their help
// says: a failed request adds nothing to them (it may have loaded nothing,
// and took the hit ratio down), only to requests_total{outcome="failed"}.
func TestCacheCountersOverCompletedRequests(t *testing.T) {
	nc := embeddedConn(t)
	s, err := New(Config{Conn: nc, ID: "s0", Policy: KVPolicy{}, HeartbeatTimeout: time.Second, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	holding(s, "g0")
	heard(s, "g0", now, 0)
	for _, r := range []*messages.RankResult{
		{ReqID: "failed", Group: "g0", Error: "engine unavailable"},
		{ReqID: "completed", Group: "g0", LoadedTokens: 32},
	} {
		tr := promptTracker(r.ReqID, 4)
		if _, err := s.place(tr, s.PlaceableGroups(now), Binding{}, false); err != nil {
			t.Fatal(err)
		}
		if err := s.buildMeta(tr); err != nil {
			t.Fatal(err)
		}
		s.trackers.add(tr)
		data, err := messages.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.onDone(context.Background(), &nats.Msg{Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	if failed, completed := counterValue(t, s.m.requests.WithLabelValues("failed")), counterValue(t, s.m.requests.WithLabelValues("completed")); failed != 1 || completed != 1 {
		t.Fatalf("requests{failed} = %v, {completed} = %v; want 1 each", failed, completed)
	}
	if prompt, cached := counterValue(t, s.m.promptTokens.WithLabelValues("m", "1")), counterValue(t, s.m.cachedTokens.WithLabelValues("m", "1")); prompt != 65 || cached != 32 {
		t.Errorf("prompt_tokens_total = %v, cached_tokens_total = %v; want 65 and 32, the completed request's only", prompt, cached)
	}
}

// TestLongCutForgetsNoHealthyGroup: a replica cut off from NATS for longer
// than ForgetGroupAfter heard no heartbeat meanwhile: the groups' silence
// was its own. At the reconnect it keeps them, and the request streaming
// on g0 goes on. Before, its sweep forgot every group during the cut, and
// at the reconnect the request was taken for lost: ended with group_failed
// and withdrawn from g0, whose ranks were fine all along.
func TestLongCutForgetsNoHealthyGroup(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	holding(s, "g0")
	holding(s, "g1")
	cut := s.cfg.ForgetGroupAfter + time.Second
	heard(s, "g0", now.Add(-cut), 0) // last heard just before the cut
	heard(s, "g1", now, 0)
	tr := promptTracker("inflight", 4)
	tr.Group, tr.WorldSize, tr.Deadline = "g0", 1, now.Add(time.Minute)
	s.trackers.add(tr)
	s.trackers.prefilled(&messages.RankResult{ReqID: "inflight", Group: "g0", TPRank: 0, Prefilled: true})
	// The connection reconnected since the last sweep.
	s.reconnects = s.cfg.Conn.Stats().Reconnects + 1
	s.sweep(t.Context(), now)
	if !s.trackers.has("inflight") {
		t.Fatalf("the request streaming on g0 was ended (group_failed) at the reconnect after a %s cut: the replica forgot g0 during its own silence", cut)
	}
	if s.groups.worldSize("g0") == 0 {
		t.Errorf("g0 forgotten at the reconnect after a %s cut", cut)
	}
	// Still silent a ForgetGroupAfter after the reconnect: forgotten.
	s.sweep(t.Context(), now.Add(s.cfg.ForgetGroupAfter+time.Second))
	if s.groups.worldSize("g0") != 0 {
		t.Errorf("g0, silent for ForgetGroupAfter since the reconnect, is not forgotten")
	}
}

// subscribeMetas collects the ReqMetas published on nc's server until the
// test ends.
func subscribeMetas(t *testing.T, nc *nats.Conn) chan *nats.Msg {
	t.Helper()
	metas := make(chan *nats.Msg, 8)
	sub, err := nc.ChanSubscribe(messages.DefaultPrefix+".meta.>", metas)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	return metas
}

// redeliveredR1 is request r1 (40 tokens) as the request log delivers it
// again.
func redeliveredR1(t *testing.T) *redelivered {
	t.Helper()
	data, err := messages.Marshal(&messages.Request{RequestID: "r1", FrontendID: "fe", Model: "m",
		ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: make([]uint32, 40)})
	if err != nil {
		t.Fatal(err)
	}
	return &redelivered{ackMsg{data: data}}
}

// TestWithdrawFromNoGroupPublishesNothing: rescue withdraws a movable
// request from the group it was on (from), read inside trackers.update;
// when the tracker ended between stranded and update (its client's Abort,
// its last result) from is "", and the withdrawal went to
// kvbus.ctl.abort. — no subject: with keys the server refuses it and the
// scheduler logs "nats permissions violation: this role's key may not use
// the subject (see `kvbus auth show`)", an operator sent to a key that is
// fine. (Before aborts went to one group, it was an Abort without a group
// on kvbus.ctl.abort.) A request on no group has nothing to withdraw.
func TestWithdrawFromNoGroupPublishesNothing(t *testing.T) {
	s, nc := newBareScheduler(t)
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	before := nc.Stats().OutMsgs
	s.withdraw("r1", "", 0, "worker group lost the request: dispatched again")
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if n := nc.Stats().OutMsgs - before; n != 0 {
		t.Errorf("a withdrawal from no group published %d message(s), want none", n)
	}
}

// TestStrandedRequestWithNoGroupOfItsModel: a request not started yet on a
// group that fails, when no other ready group serves its model (one group
// per model, another model's groups ready, or none at all), waits for one
// as a new request does, --no-group-wait, and then ends with
// no_ready_group, its group's in-flight count given back. Before, it waited
// for its deadline (60 s by default, then a timeout) while every new
// request of the model got its 503 within --no-group-wait.
func TestStrandedRequestWithNoGroupOfItsModel(t *testing.T) {
	for _, other := range []bool{true, false} {
		s, nc := newBareScheduler(t)
		s.cfg.NoGroupWait = time.Second
		outs := make(chan *messages.Output, 4)
		sub, err := nc.Subscribe(s.cfg.Subjects.Out("fe"), func(m *nats.Msg) {
			if o, err := messages.DecodeOutput(m.Data); err == nil {
				outs <- o
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		holding(s, "g0")
		s.groups.observe(&messages.Heartbeat{Group: "g0", WorldSize: 1, StartedUnixMs: 1, Model: "m"}, t0)
		tr := promptTracker("r1", 4)
		tr.Group, tr.WorldSize, tr.queued = "g0", 1, 4
		s.trackers.add(tr)
		s.groups.addInflight("g0", 1, 4)
		for i := 1; i <= 8; i++ { // g0 silent from t0; another model's group beats on
			now := t0.Add(time.Duration(i) * 500 * time.Millisecond)
			if other {
				holding(s, "b0")
				s.groups.observe(&messages.Heartbeat{Group: "b0", WorldSize: 1, StartedUnixMs: 1, Model: "b"}, now)
			}
			s.rescue(now)
			if i == 3 && !s.trackers.has("r1") { // g0 lost at 1 s: within --no-group-wait
				t.Fatalf("other model's group ready %v: the request ended 0.5 s after its group was lost; want it to wait --no-group-wait (1s)", other)
			}
		}
		if s.trackers.has("r1") {
			t.Errorf("other model's group ready %v: the request still waits 3 s after its group (the model's only one) was lost; want it ended after --no-group-wait (1s)", other)
		}
		select {
		case o := <-outs:
			if o.Error == nil || o.Error.Code != "no_ready_group" || !strings.Contains(o.Error.Message, `"m"`) {
				t.Errorf("other model's group ready %v: frontend got %+v, want a no_ready_group error naming the model", other, o.Error)
			}
		case <-time.After(2 * time.Second):
			t.Errorf("other model's group ready %v: no error sent to the frontend", other)
		}
		s.groups.each(t0.Add(4*time.Second), func(name, _ string, inflight, queued int) {
			if name == "g0" && (inflight != 0 || queued != 0) {
				t.Errorf("other model's group ready %v: g0 still counts %d requests, %d blocks in flight", other, inflight, queued)
			}
		})
		_ = sub.Unsubscribe()
	}
}

// TestTakenOverRequestCountsNoPredictionItDidNotMake: a request another
// replica dispatched to g0 before it died is taken over (same group and
// attempt): g0's ranks run that replica's LoadSpec, which this replica
// never saw. It made a prediction of its own from its index, which by then
// held the request's own blocks (saved by the run it took over), and
// counted it: a review's kill -9 of one of two schedulers under 8 fresh
// 120-token prompts added 448 predicted cached tokens (112 for each of the
// 4 adopted) to kvbus_scheduler_predicted_cached_tokens_total, where the
// ranks had been told to load nothing and loaded nothing. The cache's
// prompt and cached tokens still count it (the hit ratio); predicted,
// actual and the pool's counters compare only the LoadSpecs this replica
// made.
func TestTakenOverRequestCountsNoPredictionItDidNotMake(t *testing.T) {
	nc := embeddedConn(t)
	var logs logbuf.Buffer
	s, err := New(Config{Conn: nc, ID: "s0", Policy: KVPolicy{}, HeartbeatTimeout: time.Second, Registerer: prometheus.NewRegistry(),
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := openTestBindings(t)
	s.bindings.Store(b)
	now := time.Now()
	// r1's 40 tokens: its two full blocks, which g0 saved while it ran r1.
	own := HashBlocks(nil, HashSeed("m"), make([]uint32, 40), 16)
	holding(s, "g0", own...)
	heard(s, "g0", now, 0)
	s.dispatched.Put("r1", dispatchRecord{group: "g0", attempt: 0, scheduler: "dead"}, now)
	if err := s.onRequest(context.Background(), redeliveredR1(t)); err != nil {
		t.Fatal(err)
	}
	if !s.trackers.has("r1") {
		t.Fatal("r1 not taken over")
	}
	// g0's only rank ran the dead replica's LoadSpec: nothing to load.
	data, err := messages.Marshal(&messages.RankResult{ReqID: "r1", Group: "g0", TPRank: 0, Attempt: 0, LoadedTokens: 0})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.onDone(context.Background(), &nats.Msg{Data: data}); err != nil {
		t.Fatal(err)
	}
	checkOutcomes(t, s, map[string]float64{"completed": 1})
	if got := counterValue(t, s.m.predicted); got != 0 {
		t.Errorf("predicted_cached_tokens_total = %v; want 0: the LoadSpec g0 ran was the dead replica's", got)
	}
	if got := counterValue(t, s.m.actual); got != 0 {
		t.Errorf("actual_cached_tokens_total = %v; want 0", got)
	}
	for _, kind := range []string{"predicted", "actual"} {
		if got := counterValue(t, s.m.poolTokens.WithLabelValues(kind, "local")); got != 0 {
			t.Errorf("pool_cached_tokens_total{kind=%q,source=\"local\"} = %v; want 0", kind, got)
		}
	}
	if got := counterValue(t, s.m.promptTokens.WithLabelValues("m", "1")); got != 40 {
		t.Errorf("prompt_tokens_total = %v; want 40 (a completed request's prompt counts in the hit ratio)", got)
	}
	// Its request done line does not claim a prediction either.
	done := logs.Lines(`msg="request done"`)
	for _, line := range done {
		if !strings.Contains(line, "predicted_tokens=unknown") {
			t.Errorf("the request done line names a prediction this replica did not make: %s", line)
		}
	}
	if len(done) != 1 {
		t.Errorf("%d request done lines, want 1", len(done))
	}
}

// TestModelWithNoGroupLeftStaysAtZero: kvbus_scheduler_model_ready_groups
// keeps a model at 0 for forgetModelAfter once its last group is
// forgotten, and then drops it. Before, the series went with the group,
// ForgetGroupAfter (30 s) after its last heartbeat, and an alert on
// `== 0` stopped firing while the model still had no group.
func TestModelWithNoGroupLeftStaysAtZero(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: 0, WorldSize: 1, StartedUnixMs: 1, Model: "m"}, now)
	reg := prometheus.NewRegistry()
	reg.MustRegister(s.m.modelReady)
	ready := func() (float64, bool) { // model m's gauge, and whether it is a series
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		if len(mfs) == 0 {
			return 0, false
		}
		return gaugeValue(t, reg, "kvbus_scheduler_model_ready_groups"), true
	}
	s.sweep(t.Context(), now)
	if n, ok := ready(); !ok || n != 1 {
		t.Fatalf("model m with its group ready: gauge %v (present %v), want 1", n, ok)
	}
	forgotten := now.Add(s.cfg.ForgetGroupAfter + time.Second)
	s.sweep(t.Context(), forgotten)
	if s.groups.worldSize("g0") != 0 {
		t.Fatal("g0 silent for ForgetGroupAfter is not forgotten: the test forgets nothing")
	}
	if n, ok := ready(); !ok || n != 0 {
		t.Errorf("model m whose only group was forgotten: gauge %v (present %v), want 0", n, ok)
	}
	s.sweep(t.Context(), forgotten.Add(forgetModelAfter-time.Second))
	if n, ok := ready(); !ok || n != 0 {
		t.Errorf("model m just under %s after its group was forgotten: gauge %v (present %v), want 0", forgetModelAfter, n, ok)
	}
	s.sweep(t.Context(), forgotten.Add(forgetModelAfter+time.Second))
	if _, ok := ready(); ok {
		t.Errorf("model m %s after its group was forgotten is still a series", forgetModelAfter)
	}
}
