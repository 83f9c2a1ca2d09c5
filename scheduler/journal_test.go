package scheduler_test

import (
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
		ack := e.publishRequest(newRequest("r1", "conv-1", testenv.PromptTokens(1, 64)))
		// sched-a took it from the log and acknowledged it (dispatched).
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
