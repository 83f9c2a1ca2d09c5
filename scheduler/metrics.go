package scheduler

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	routing  prometheus.Histogram
	requests *prometheus.CounterVec
	trackers prometheus.GaugeFunc
	ready    prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer, trackers func() float64) *metrics {
	m := &metrics{
		routing: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvbus_scheduler_routing_seconds",
			Help:    "Time from a Request received to its ReqMeta published (decode, hashing, placement, encode).",
			Buckets: prometheus.ExponentialBuckets(5e-6, 2, 16),
		}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_scheduler_requests_total",
			Help: "Requests by outcome (dispatched, completed, failed, timeout, aborted, duplicate, expired).",
		}, []string{"outcome"}),
		trackers: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_trackers",
			Help: "Live RequestTrackers.",
		}, trackers),
		ready: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_ready_groups",
			Help: "Worker groups whose ranks all sent a recent heartbeat.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.routing, m.requests, m.trackers, m.ready)
	}
	return m
}
