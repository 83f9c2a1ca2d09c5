package frontend

import (
	"github.com/prometheus/client_golang/prometheus"
)

// vllmMetrics exports what the frontend measures under vLLM's own metric
// names and labels, so that a dashboard built for vLLM works on kvbus.
// Names, types, buckets and labels follow vllm/v1/metrics/loggers.py
// (PrometheusStatLogger: labelnames ["model_name", "engine"], plus
// "finished_reason" on vllm:request_success; prometheus_client appends
// _total to counters). The engine label is vLLM's engine index, "0" for
// one engine (vllmEngineIndex): requests are counted where clients meet
// kvbus, and Prometheus' instance label tells frontends apart. It was the
// frontend's random id, so every restart began new series. vllm:num_requests_waiting counts this
// frontend's requests with no output yet, vllm:num_requests_running those
// streaming.
type vllmMetrics struct {
	engine             string
	ttft, e2e          *prometheus.HistogramVec
	prompt, generation *prometheus.CounterVec
	queries, hits      *prometheus.CounterVec
	success            *prometheus.CounterVec
	running, waiting   *prometheus.GaugeVec
	// models holds each served model's series, looked up once: a request
	// touches a dozen of them. Read-only after newVLLMMetrics.
	models map[string]*modelSeries
}

// modelSeries are one model's series of the vLLM metrics.
type modelSeries struct {
	ttft, e2e                         prometheus.Observer
	prompt, generation, queries, hits prometheus.Counter
	running, waiting                  prometheus.Gauge
	stop, length, abort               prometheus.Counter // vllm:request_success by the usual finish reasons
	success                           *prometheus.CounterVec
	model, engine                     string
}

// vllmEngineIndex is the engine label of a frontend's vLLM metrics.
const vllmEngineIndex = "0"

func newVLLMMetrics(reg prometheus.Registerer, engine string, models []string) *vllmMetrics {
	labels := []string{"model_name", "engine"}
	m := &vllmMetrics{
		engine: engine,
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "vllm:time_to_first_token_seconds",
			Help:    "Histogram of time to first token in seconds.",
			Buckets: []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0},
		}, labels),
		e2e: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "vllm:e2e_request_latency_seconds",
			Help:    "Histogram of e2e request latency in seconds.",
			Buckets: []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0},
		}, labels),
		prompt:     prometheus.NewCounterVec(prometheus.CounterOpts{Name: "vllm:prompt_tokens_total", Help: "Number of prefill tokens processed."}, labels),
		generation: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "vllm:generation_tokens_total", Help: "Number of generation tokens processed."}, labels),
		queries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "vllm:prefix_cache_queries_total",
			Help: "Prefix cache queries, in terms of number of queried tokens."}, labels),
		hits: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "vllm:prefix_cache_hits_total",
			Help: "Prefix cache hits, in terms of number of cached tokens."}, labels),
		success: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "vllm:request_success_total",
			Help: "Count of successfully processed requests."}, append(labels, "finished_reason")),
		running: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "vllm:num_requests_running",
			Help: "Number of requests in model execution batches."}, labels),
		waiting: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "vllm:num_requests_waiting",
			Help: "Number of requests waiting to be processed."}, labels),
	}
	reg.MustRegister(m.ttft, m.e2e, m.prompt, m.generation, m.queries, m.hits, m.success, m.running, m.waiting)
	m.models = make(map[string]*modelSeries, len(models))
	for _, model := range models {
		m.models[model] = m.series(model)
	}
	return m
}

// of returns model's series: those of a served model, made at start, or
// looked up now.
func (m *vllmMetrics) of(model string) *modelSeries {
	if ms := m.models[model]; ms != nil {
		return ms
	}
	return m.series(model)
}

func (m *vllmMetrics) series(model string) *modelSeries {
	e := m.engine
	return &modelSeries{
		ttft: m.ttft.WithLabelValues(model, e), e2e: m.e2e.WithLabelValues(model, e),
		prompt: m.prompt.WithLabelValues(model, e), generation: m.generation.WithLabelValues(model, e),
		queries: m.queries.WithLabelValues(model, e), hits: m.hits.WithLabelValues(model, e),
		running: m.running.WithLabelValues(model, e), waiting: m.waiting.WithLabelValues(model, e),
		stop: m.success.WithLabelValues(model, e, "stop"), length: m.success.WithLabelValues(model, e, "length"),
		abort:   m.success.WithLabelValues(model, e, "abort"), // at zero from the start, as vLLM makes one per finish reason
		success: m.success, model: model, engine: e,
	}
}

// finished records a request that completed.
func (ms *modelSeries) finished(prompt, completion, cached int, finish string, e2eSeconds float64) {
	ms.prompt.Add(float64(prompt))
	ms.generation.Add(float64(completion))
	ms.queries.Add(float64(prompt))
	ms.hits.Add(float64(cached))
	// vLLM's engine finishes a request by stop, length, abort, error or
	// repetition (FINISH_REASON_STRINGS); its OpenAI server's "tool_calls"
	// (or "function_call") is a stop there.
	switch finish {
	case "length":
		ms.length.Inc()
	case "abort":
		ms.abort.Inc()
	case "error", "repetition":
		ms.success.WithLabelValues(ms.model, ms.engine, finish).Inc()
	default:
		ms.stop.Inc()
	}
	ms.e2e.Observe(e2eSeconds)
}

// aborted records an engine request its client left before it finished,
// as vLLM's engine finishes one its client aborted: under
// finished_reason="abort".
func (ms *modelSeries) aborted() { ms.abort.Inc() }

// unfinished records the work done for an engine request that ended
// unfinished after its first token: vLLM counts a request's prompt in
// vllm:prompt_tokens_total when its prefill yields that token, and each
// token generated as it is, whether or not the request then finishes.
func (ms *modelSeries) unfinished(prompt, generated int) {
	ms.prompt.Add(float64(prompt))
	ms.generation.Add(float64(generated))
}
