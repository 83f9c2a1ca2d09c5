package scheduler_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
)

// TestRequestAdoptedAndEndedIsNotAdoptedAgain: sched-a dispatched r1 and
// died; sched-b adopted it and ended it. A replica that starts later (a
// restart, a rolling deploy) reads the plan stream: r1 has ended, whoever
// ended it, and is not adopted again. Before, only sched-a's own end
// cleared its dispatch, and every replica started within the request
// timeout sent r1's ReqMeta to its group again and counted it adopted.
func TestRequestAdoptedAndEndedIsNotAdoptedAgain(t *testing.T) {
	srv := testenv.StartNATS(t)
	nc := testenv.Connect(t, srv)
	ctx := t.Context()
	var subj messages.Subjects
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{Subjects: subj})
	if err != nil {
		t.Fatal(err)
	}
	req := newRequest("r1", "conv-1", testenv.PromptTokens(1, 64))
	data, err := messages.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	ack, err := js.Publish(ctx, subj.Request(testModel), data, jetstream.WithMsgID(req.RequestID))
	if err != nil {
		t.Fatal(err)
	}
	// sched-a took it from the log and acknowledged it (dispatched).
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
	if _, err := bus.EnsurePlanStream(ctx, js, subj, 1, 2*time.Minute); err != nil {
		t.Fatal(err)
	}
	plan := func(from string, p *messages.SavePlan) {
		d, err := messages.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := js.Publish(ctx, subj.Plan(from), d); err != nil {
			t.Fatal(err)
		}
	}
	plan("sched-a", &messages.SavePlan{SchedulerID: "sched-a", ReqID: "r1", Group: "g0", Attempt: 0, LogSeq: ack.Sequence,
		ExpiresUnixMs: time.Now().Add(10 * time.Second).UnixMilli()})
	plan("sched-b", &messages.SavePlan{SchedulerID: "sched-b", ReqID: "r1", Group: "g0", Attempt: 0, LogSeq: ack.Sequence,
		ExpiresUnixMs: time.Now().Add(10 * time.Second).UnixMilli()})
	plan("sched-b", &messages.SavePlan{SchedulerID: "sched-b", Ended: []string{"r1"}})

	// The ranks of g0: heartbeats, and a count of the ReqMetas of r1.
	var metas atomic.Int32
	if _, err := nc.Subscribe(subj.MetaGroup("g0"), func(m *nats.Msg) {
		if meta, err := messages.DecodeReqMeta(m.Data); err == nil && meta.ReqID == "r1" {
			metas.Add(1)
		}
	}); err != nil {
		t.Fatal(err)
	}
	hbCtx, stopHB := context.WithCancel(context.Background())
	hbDone := make(chan struct{})
	go func() {
		defer close(hbDone)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			for r := range worldSize {
				d, _ := messages.Marshal(&messages.Heartbeat{Group: "g0", TPRank: r, EPRank: r, WorldSize: worldSize, Model: testModel, StartedUnixMs: 1})
				if err := nc.Publish(subj.Heartbeat("g0", r), d); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
					t.Errorf("heartbeat: %v", err)
				}
			}
			select {
			case <-hbCtx.Done():
				return
			case <-tick.C:
			}
		}
	}()

	reg := prometheus.NewRegistry()
	s, err := scheduler.New(scheduler.Config{Conn: testenv.Connect(t, srv), Subjects: subj, ID: "sched-c",
		Policy: &scheduler.SessionPolicy{Epsilon: 0.25}, HeartbeatTimeout: time.Second, UnsyncedWait: -1, ShutdownTimeout: time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- s.Run(runCtx) }()
	t.Cleanup(func() {
		cancel()
		stopHB()
		<-hbDone
		if err := <-runErr; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	// sched-a and sched-b are judged dead 1 s after sched-c starts.
	time.Sleep(3 * time.Second)
	adopted := testenv.CounterSum(t, reg, "kvbus_scheduler_requests_total", map[string]string{"outcome": "adopted"})
	if n := metas.Load(); n > 0 || adopted > 0 {
		t.Errorf("r1, adopted and ended by sched-b, was adopted again by a replica started later: %d ReqMeta(s) sent to g0, requests_total{adopted} = %v",
			n, adopted)
	}
}
