package scheduler_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestRequestAdoptedAndEndedIsNotAdoptedAgain: sched-a dispatched r1 and
// died; sched-b adopted it and ended it. A replica that starts later (a
// restart, a rolling deploy) reads the plan stream: r1 has ended, whoever
// ended it, and is not adopted again. Before, only sched-a's own end
// cleared its dispatch, and every replica started within the request
// timeout sent r1's ReqMeta to its group again and counted it adopted.
func TestRequestAdoptedAndEndedIsNotAdoptedAgain(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{before: func(e *schedEnv) {
		ctx := t.Context()
		// sched-a took it from the log and acknowledged it (dispatched).
		ack := dispatchedElsewhere(t, e, newRequest("r1", "conv-1", testenv.PromptTokens(1, 64)))
		// The plan stream, as sched-a and sched-b wrote it.
		if _, err := bus.EnsurePlanStream(ctx, e.js, e.subj, 1, 2*time.Minute); err != nil {
			t.Fatal(err)
		}
		expires := time.Now().Add(10 * time.Second).UnixMilli()
		for _, p := range []*messages.SavePlan{
			{SchedulerID: "sched-a", ReqID: "r1", Group: "g0", LogSeq: ack.Sequence, ExpiresUnixMs: expires},
			{SchedulerID: "sched-b", ReqID: "r1", Group: "g0", LogSeq: ack.Sequence, ExpiresUnixMs: expires},
			{SchedulerID: "sched-b", Ended: []string{"r1"}},
		} {
			data, err := messages.Marshal(p)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := e.js.Publish(ctx, e.subj.Plan(p.SchedulerID), data); err != nil {
				t.Fatal(err)
			}
		}
	}})
	// It consumes the log, so it read the plan stream (before it does).
	e.publishRequest(newRequest("r2", "conv-2", testenv.PromptTokens(2, 64)))
	e.waitMeta("r2")
	// sched-a and sched-b are judged dead a heartbeat timeout (1 s) after
	// the scheduler started.
	time.Sleep(3 * time.Second)
	if n, adopted := len(e.metas("r1")), e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "adopted"}); n > 0 || adopted > 0 {
		t.Errorf("r1, adopted and ended by sched-b, was adopted again by a replica started later: %d ReqMeta(s) sent to g0, requests_total{adopted} = %v",
			n, adopted)
	}
}

// dispatchedElsewhere puts req in the request log and acknowledges it as
// another replica that dispatched it does; its ack says where it is.
func dispatchedElsewhere(t *testing.T, e *schedEnv, req *messages.Request) *jetstream.PubAck {
	t.Helper()
	ctx := t.Context()
	ack := e.publishRequest(req)
	st, err := e.js.Stream(ctx, ack.Stream)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := bus.EnsureSchedulerConsumer(ctx, st, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for m := range batch.Messages() {
		if err := m.DoubleAck(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return ack
}

func (e *schedEnv) publishMsg(subject string, m messages.Message) {
	e.t.Helper()
	data, err := messages.Marshal(m)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := e.nc.Publish(subject, data); err != nil {
		e.t.Fatal(err)
	}
}

// TestAdoptedRequestStaysOnARankAhead: sched-a dispatched r1 to g0 and
// died; this replica heard its plan and adopts r1. g0's ranks run on a
// host whose clock is two minutes ahead: their started_unix_ms, read
// against the time of the plan on this replica's clock, said they had
// started since, so r1 was placed again as attempt 2 while g0 ran it. No
// rank of g0 restarted since the plan was heard: r1 stays on g0 as
// attempt 1. r2, whose group g1 had a rank restart after its plan was
// heard, is placed again as attempt 2.
func TestAdoptedRequestStaysOnARankAhead(t *testing.T) {
	ahead := time.Now().Add(2 * time.Minute).UnixMilli()
	var acks []*jetstream.PubAck
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0", "g1"}, hbStarted: ahead, noAnswers: true, requestTimeout: 3 * time.Second,
		before: func(e *schedEnv) {
			for _, id := range []string{"r1", "r2"} {
				acks = append(acks, dispatchedElsewhere(t, e, newRequest(id, "conv-"+id, testenv.PromptTokens(1, 64))))
			}
		}})
	// sched-a: heard once, then silent (dead a heartbeat timeout, 1 s, later).
	e.publishMsg(e.subj.Announce(messages.RoleScheduler, "sched-a"), &messages.Announcement{Role: messages.RoleScheduler, ID: "sched-a",
		Ready: true, UnixMs: time.Now().UnixMilli(), StartedUnixMs: time.Now().Add(-time.Minute).UnixMilli()})
	for i, g := range []string{"g0", "g1"} {
		e.publishMsg(e.subj.Plan("sched-a"), &messages.SavePlan{SchedulerID: "sched-a", ReqID: []string{"r1", "r2"}[i],
			Group: g, Attempt: 1, LogSeq: acks[i].Sequence, BlockHashes: messages.BlockHashes{uint64(100 + i)},
			ExpiresUnixMs: time.Now().Add(10 * time.Second).UnixMilli(), ExpiresInMs: 10_000})
	}
	testenv.Eventually(t, waitFor, "sched-a's plans heard", func() bool { return e.s.Index().Plans() == 2 })
	// g1/0 restarts (on its host's clock, a second after the other ranks).
	e.publishMsg(e.subj.Heartbeat("g1", 0), &messages.Heartbeat{Group: "g1", TPRank: 0, WorldSize: worldSize, Model: testModel, StartedUnixMs: ahead + 1000})
	m1, m2 := e.waitMeta("r1").meta, e.waitMeta("r2").meta
	if adopted := e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "adopted"}); adopted != 2 {
		t.Errorf("requests_total{adopted} = %v, want 2", adopted)
	}
	if m1.Group != "g0" || m1.Attempt != 1 {
		t.Errorf("r1, adopted from sched-a, sent to %s as attempt %d; want g0, attempt 1 (no rank of g0 restarted)", m1.Group, m1.Attempt)
	}
	if m2.Attempt != 2 {
		t.Errorf("r2, adopted from sched-a, sent to %s as attempt %d; want attempt 2 (a rank of g1 restarted since)", m2.Group, m2.Attempt)
	}
}

// TestReplayedPlanOfAPeerAheadIsItsOwn: this replica starts while
// sched-a runs r1, and reads sched-a's plan of it from the plan stream.
// sched-a's clock runs two minutes ahead; its process started 5 s before
// it made the plan, on that clock. Read against the plan's time on the
// NATS server's clock, the plan was older than sched-a's start: an
// earlier process's, handed at once to the lowest live replica (sched-a
// itself here; this replica, were its id the lowest, while sched-a ran
// it) and forgotten as sched-a's, so when sched-a died r1 was adopted by
// no one and left to its deadline. The plan's own time (expires_unix_ms −
// expires_in_ms) is on sched-a's clock: r1 is sched-a's, adopted once
// sched-a is no longer heard.
func TestReplayedPlanOfAPeerAheadIsItsOwn(t *testing.T) {
	peerNow := func() int64 { return time.Now().Add(2 * time.Minute).UnixMilli() } // sched-a's clock
	started := peerNow() - 5000
	announce := func(e *schedEnv) {
		e.publishMsg(e.subj.Announce(messages.RoleScheduler, "sched-a"), &messages.Announcement{Role: messages.RoleScheduler, ID: "sched-a",
			Ready: true, UnixMs: peerNow(), StartedUnixMs: started})
	}
	var alive atomic.Bool
	alive.Store(true)
	e := startScheduler(t, schedEnvConfig{noAnswers: true, requestTimeout: 5 * time.Second, before: func(e *schedEnv) {
		ack := dispatchedElsewhere(t, e, newRequest("r1", "conv-1", testenv.PromptTokens(1, 64)))
		if _, err := bus.EnsurePlanStream(t.Context(), e.js, e.subj, 1, 2*time.Minute); err != nil {
			t.Fatal(err)
		}
		data, err := messages.Marshal(&messages.SavePlan{SchedulerID: "sched-a", ReqID: "r1", Group: "g0", Attempt: 1, LogSeq: ack.Sequence,
			ExpiresUnixMs: peerNow() + 10_000, ExpiresInMs: 10_000})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.js.Publish(t.Context(), e.subj.Plan("sched-a"), data); err != nil {
			t.Fatal(err)
		}
		announce(e)
		done := make(chan struct{})
		go func() { // sched-a announces every 200 ms while alive
			defer close(done)
			for alive.Load() {
				announce(e)
				time.Sleep(200 * time.Millisecond)
			}
		}()
		t.Cleanup(func() { alive.Store(false); <-done })
	}})
	testenv.Eventually(t, waitFor, "sched-a's plan read from the plan stream", func() bool {
		return len(e.logs.Lines("read the plan stream", "requests=1")) == 1
	})
	// Two heartbeat timeouts of sched-a alive: r1 is its own.
	time.Sleep(2 * time.Second)
	if n, adopted := len(e.metas("r1")), e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "adopted"}); n > 0 || adopted > 0 {
		t.Fatalf("r1, run by sched-a (alive), was adopted as an earlier process's: %d ReqMeta(s), requests_total{adopted} = %v", n, adopted)
	}
	alive.Store(false) // sched-a dies
	if m := e.waitMeta("r1").meta; m.Group != "g0" || m.Attempt != 1 {
		t.Errorf("r1 adopted after sched-a died: %s, attempt %d; want g0, attempt 1", m.Group, m.Attempt)
	}
}
