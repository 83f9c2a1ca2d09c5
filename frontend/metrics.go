package frontend

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	ttft     *prometheus.HistogramVec
	// askedAgain counts requests published again because their answer
	// was lost on the bus.
	askedAgain prometheus.Counter
	// resends counts asks to the drivers for outputs lost on the bus, or
	// whether one holds a request silent after a reconnect.
	resends prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, inflight func() float64) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_frontend_requests_total", Help: "HTTP generate requests by endpoint, status and served model (\"\" when refused before the model is known, or for a model not served). A stream that ended with an error event counts under that error's status (its headers said 200); a request whose client went away before its answer ended counts as 499 (nginx's client closed request), answered to no one; an answer its client had not read by the request's deadline (cut off at the write deadline) counts as 504.",
		}, []string{"endpoint", "status", "model"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvbus_frontend_request_seconds", Help: "End-to-end latency of generate requests, by endpoint and served model.",
			Buckets: prometheus.ExponentialBuckets(1e-4, 2, 20),
		}, []string{"endpoint", "model"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvbus_frontend_ttft_seconds", Help: "Time to the first output chunk, by endpoint and served model.",
			Buckets: prometheus.ExponentialBuckets(1e-4, 2, 20),
		}, []string{"endpoint", "model"}),
		askedAgain: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbus_frontend_asked_again_total", Help: "Requests published again because their answer was lost on the bus (a NATS server stopped) before any of it reached the client.",
		}),
		resends: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbus_frontend_resends_total", Help: "Asks to the driver ranks to send again the outputs of a request that were lost on the bus (a NATS server stopped), or whether one holds a request that heard nothing after a NATS reconnect.",
		}),
	}
	reg.MustRegister(m.requests, m.latency, m.ttft, m.askedAgain, m.resends, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvbus_frontend_inflight_requests", Help: "Bus requests waiting for output.",
	}, inflight))
	return m
}
