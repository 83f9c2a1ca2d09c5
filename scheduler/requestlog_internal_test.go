package scheduler

import (
	"context"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// TestRequestLogGauges: the gauges an operator watches for a log filling
// up (503 request_log_full) say what the log holds: requests no scheduler
// took, its bytes and its limit.
func TestRequestLogGauges(t *testing.T) {
	nc := embeddedConn(t)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	const limit = 64 << 20
	reg := prometheus.NewRegistry()
	zero := func() float64 { return 0 }
	m := newMetrics(reg, metricFuncs{trackers: zero, rejected: zero, refused: zero, plans: zero, ready: zero, sessions: zero, unbound: zero})
	consuming := &atomic.Bool{}
	l := &requestLog{js: js, cfg: bus.StreamConfig{MaxBytes: limit}, ackWait: time.Second, m: m, consuming: consuming,
		log: slog.New(slog.NewTextHandler(io.Discard, nil)), onMsg: func(jetstream.Msg) {}}
	if err := l.ensure(t.Context()); err != nil {
		t.Fatal(err)
	}
	const n, size = 7, 1000
	for i := range n {
		if _, err := js.Publish(t.Context(), messages.Subjects{}.Request("m"), make([]byte, size)); err != nil {
			t.Fatal(i, err)
		}
	}
	consuming.Store(true) // as after consume, without taking any
	// The server counts a consumer's pending messages in its own time (its
	// stream signals consumers from a goroutine of their own, after the
	// publish is acknowledged): a loaded host answered 0 for the 7 just
	// published (CI's fail). The scheduler checks every logCheckEvery; the
	// test checks until the count is in, for as long.
	var pending float64
	for deadline := time.Now().Add(logCheckEvery); ; time.Sleep(20 * time.Millisecond) {
		l.check(t.Context())
		if pending = gaugeValue(t, reg, "kvbus_scheduler_request_log_pending_messages"); pending == n || time.Now().After(deadline) {
			break
		}
	}
	if pending != n {
		t.Errorf("request_log_pending_messages = %v, want %d (published, none taken)", pending, n)
	}
	if got := gaugeValue(t, reg, "kvbus_scheduler_request_log_bytes"); got < n*size {
		t.Errorf("request_log_bytes = %v, want at least the %d bytes published", got, n*size)
	}
	if got := gaugeValue(t, reg, "kvbus_scheduler_request_log_limit_bytes"); got != limit {
		t.Errorf("request_log_limit_bytes = %v, want %d", got, limit)
	}
}

// gaugeValue reads the gauge name from g.
func gaugeValue(t *testing.T, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no gauge %s", name)
	return 0
}

// TestRequestLogMadeAgainByAnotherReplica: the log and its consumer vanish
// (a NATS server restarted without its store); replica a notices first and
// makes them again, with the session bucket. Replica b's consumer then
// exists again under its name, so it used to see nothing wrong: it kept
// watching the lost bucket and never saw a's bindings (a flaky
// TestLostRequestLogIsMadeAgain). b notices the log is another by its
// creation time, consumes it anew and watches the new bucket.
func TestRequestLogMadeAgainByAnotherReplica(t *testing.T) {
	nc := embeddedConn(t)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	replica := func() (*requestLog, *atomic.Int32) {
		remade := &atomic.Int32{}
		l := &requestLog{js: js, cfg: bus.StreamConfig{}, ackWait: time.Second, consuming: &atomic.Bool{},
			log: slog.New(slog.NewTextHandler(io.Discard, nil)), onMsg: func(m jetstream.Msg) { _ = m.Ack() },
			remade: func(context.Context) { remade.Add(1) }}
		if err := l.ensure(t.Context()); err != nil {
			t.Fatal(err)
		}
		if err := l.consume(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.stop(true) })
		return l, remade
	}
	a, aRemade := replica()
	b, bRemade := replica()
	time.Sleep(10 * time.Millisecond) // distinct creation times
	if err := js.DeleteStream(t.Context(), messages.RequestStream); err != nil {
		t.Fatal(err)
	}
	a.check(t.Context())
	if aRemade.Load() != 1 || !a.consuming.Load() {
		t.Fatalf("replica a: remade %d times, consuming %v; want it to make the log again and consume", aRemade.Load(), a.consuming.Load())
	}
	b.check(t.Context())
	if bRemade.Load() != 1 || !b.consuming.Load() {
		t.Errorf("replica b, after a made the log again: remade %d times, consuming %v; want it to take the new log (and bucket)", bRemade.Load(), b.consuming.Load())
	}
	b.check(t.Context())
	if bRemade.Load() != 1 {
		t.Errorf("replica b took the log again on its next check (%d); want once", bRemade.Load())
	}
}
