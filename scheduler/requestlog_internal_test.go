package scheduler

import (
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
	m := newMetrics(reg, func() float64 { return 0 }, func() float64 { return 0 }, func() float64 { return 0 }, func() float64 { return 0 })
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
	l.check(t.Context())
	if got := gaugeValue(t, reg, "kvbus_scheduler_request_log_pending_messages"); got != n {
		t.Errorf("request_log_pending_messages = %v, want %d (published, none taken)", got, n)
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
