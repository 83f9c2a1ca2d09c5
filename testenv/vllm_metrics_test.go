package testenv_test

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvbus/kvbus/testenv"
)

// TestVLLMMetricNames: the frontend's /metrics exports vLLM's metrics under
// vLLM's names and labels, with the values the clients saw: prompt and
// generation tokens, prefix-cache queries and hits, successes by finish
// reason, one TTFT and one e2e observation per request, and no request
// left waiting or running.
func TestVLLMMetricNames(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	turns, err := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 5,
		Headers: map[string]string{"X-Session-ID": "vllm-names"}}.Run(t.Context(), 3)
	if err != nil {
		t.Fatal(err)
	}
	prompt, cached, generated := 0, 0, 0
	reasons := map[string]float64{}
	for _, turn := range turns {
		prompt, cached, generated = prompt+turn.PromptTokens, cached+turn.CachedTokens, generated+turn.CompletionTokens
		reasons[turn.FinishReason]++
	}
	resp, err := client.Get(c.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	value := func(name string, want map[string]string) float64 {
		mf := families[name]
		if mf == nil {
			t.Fatalf("no %s in /metrics", name)
		}
		sum := 0.0
	series:
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			// engine is vLLM's engine index, stable across restarts (the
			// frontend's random id began new series at each).
			if labels["model_name"] != c.Model || labels["engine"] != "0" {
				t.Errorf("%s has labels %v, want model_name and engine 0", name, labels)
			}
			for k, v := range want {
				if labels[k] != v {
					continue series
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			case m.Histogram != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
		return sum
	}
	checks := []struct {
		name string
		want map[string]string
		val  float64
	}{
		{"vllm:prompt_tokens_total", nil, float64(prompt)},
		{"vllm:prefix_cache_queries_total", nil, float64(prompt)},
		{"vllm:prefix_cache_hits_total", nil, float64(cached)},
		{"vllm:generation_tokens_total", nil, float64(generated)},
		{"vllm:request_success_total", nil, 3},
		{"vllm:request_success_total", map[string]string{"finished_reason": "length"}, reasons["length"]},
		{"vllm:request_success_total", map[string]string{"finished_reason": "stop"}, reasons["stop"]},
		{"vllm:time_to_first_token_seconds", nil, 3},
		{"vllm:e2e_request_latency_seconds", nil, 3},
		{"vllm:num_requests_running", nil, 0},
		{"vllm:num_requests_waiting", nil, 0},
	}
	for _, ck := range checks {
		if got := value(ck.name, ck.want); got != ck.val {
			t.Errorf("%s%v = %v, want %v", ck.name, ck.want, got, ck.val)
		}
	}
	if cached == 0 {
		t.Error("the conversation found nothing cached")
	}
}

// TestSchedulerReadyGauge: kvbus_scheduler_ready says what the scheduler's
// /healthz says, so an alert can ask whether any scheduler is ready (it
// could only ask whether one had a ready group, which a scheduler that
// stopped consuming the request log still has).
func TestSchedulerReadyGauge(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	gauge := func() float64 { return testenv.GaugeSum(t, c.Registry, "kvbus_scheduler_ready", nil) }
	testenv.Eventually(t, 10*time.Second, "the scheduler ready", func() bool { ok, _ := c.Scheduler.Ready(); return ok })
	if g := gauge(); g != 1 {
		t.Errorf("kvbus_scheduler_ready = %v with the scheduler ready, want 1", g)
	}
	c.KillRank(t, "g0", 1) // its only group incomplete: not ready
	testenv.Eventually(t, 10*time.Second, "the scheduler not ready", func() bool { ok, _ := c.Scheduler.Ready(); return !ok })
	if g := gauge(); g != 0 {
		t.Errorf("kvbus_scheduler_ready = %v with the scheduler not ready, want 0", g)
	}
}
