package bus

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/messages"
)

// HandlerMetrics count and time message handlers, by handler name and
// outcome (ok, malformed, error).
type HandlerMetrics struct {
	handled  *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

// NewHandlerMetrics registers the handler metrics with reg (nil: not
// registered). Roles of one process may share a registry: a second call
// reuses the series already registered.
func NewHandlerMetrics(reg prometheus.Registerer) *HandlerMetrics {
	m := &HandlerMetrics{
		handled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_bus_messages_total",
			Help: "Bus messages handled, by handler and outcome (ok, malformed, error).",
		}, []string{"handler", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvbus_bus_handler_seconds",
			Help:    "Time spent in a bus message handler.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 12),
		}, []string{"handler"}),
	}
	if reg != nil {
		m.handled = register(reg, m.handled)
		m.duration = register(reg, m.duration)
	}
	return m
}

// register registers c, or returns the equal collector already registered.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		panic(err) // a programming error: two different metrics with one name
	}
	return c
}

// Metrics counts and times every handler call under name. A handler error
// wrapping messages.ErrMalformed, messages.ErrInvalid or messages.ErrTooLarge
// counts as malformed.
func Metrics[M any](m *HandlerMetrics, name string) Middleware[M] {
	// The series are looked up once: a label lookup hashes and locks, and
	// this runs for every message.
	duration := m.duration.WithLabelValues(name)
	ok, malformed, failed := m.handled.WithLabelValues(name, "ok"), m.handled.WithLabelValues(name, "malformed"), m.handled.WithLabelValues(name, "error")
	return func(next Handler[M]) Handler[M] {
		return func(ctx context.Context, msg M) error {
			start := time.Now()
			err := next(ctx, msg)
			duration.Observe(time.Since(start).Seconds())
			switch {
			case err == nil:
				ok.Inc()
			case errors.Is(err, messages.ErrMalformed), errors.Is(err, messages.ErrInvalid), errors.Is(err, messages.ErrTooLarge):
				malformed.Inc()
			default:
				failed.Inc()
			}
			return err
		}
	}
}
