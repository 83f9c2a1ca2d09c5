package frontend

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvbus/kvbus/messages"
)

// TestVLLMMetricsPerPrompt proves a completion's prompt list counts in the
// vLLM metrics as vLLM counts it, one engine request per prompt: each
// prompt's success under its own finish reason, and its own TTFT and e2e
// latency. A list of two prompts, one stopped and one cut by length,
// counted one success, as stop, one TTFT and one latency: a vLLM
// dashboard's request rate undercounted prompt lists.
func TestVLLMMetricsPerPrompt(t *testing.T) {
	for _, streamed := range []bool{false, true} {
		reg := prometheus.NewRegistry()
		vm := newVLLMMetrics(reg, vllmEngineIndex, []string{"m"})
		m := newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })
		g := &generation{s: &Server{m: m, vm: vm}, q: newOutputQueue(2), endpoint: messages.EndpointCompletions, log: slog.New(slog.DiscardHandler),
			model: "m", vm: vm.of("m"), choices: []*choiceState{{busID: "r-0"}, {busID: "r-1", buffered: !streamed}}, start: time.Now()}
		g.choices[0].buffered = !streamed
		for i, finish := range []string{"stop", "length"} {
			g.q.push(i, &messages.Output{ReqID: g.choices[i].busID, Index: 0, Text: "a"})
			g.q.push(i, &messages.Output{ReqID: g.choices[i].busID, Index: 1, FinishReason: finish,
				Usage: &messages.Usage{PromptTokens: 10, CompletionTokens: 2}})
		}
		deadline := time.Now().Add(5 * time.Second)
		if streamed {
			g.stream(httptest.NewRecorder(), t.Context(), deadline, false, false)
		} else {
			g.respond(httptest.NewRecorder(), t.Context(), deadline)
		}
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		success := map[string]float64{}
		samples := map[string]uint64{}
		for _, f := range families {
			for _, mt := range f.GetMetric() {
				switch f.GetName() {
				case "vllm:request_success_total":
					success[label(mt, "finished_reason")] = mt.GetCounter().GetValue()
				case "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds":
					samples[f.GetName()] = mt.GetHistogram().GetSampleCount()
				}
			}
		}
		if success["stop"] != 1 || success["length"] != 1 {
			t.Errorf("streamed %v: vllm:request_success_total by finished_reason %v, want stop 1, length 1", streamed, success)
		}
		if samples["vllm:time_to_first_token_seconds"] != 2 || samples["vllm:e2e_request_latency_seconds"] != 2 {
			t.Errorf("streamed %v: samples %v, want 2 TTFTs and 2 e2e latencies (one per prompt)", streamed, samples)
		}
	}
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// TestVLLMMetricsStreamWithAFailedPrompt: a streamed prompt list whose
// second prompt failed after the stream began counts its first prompt's
// success, as vLLM counts each engine request that finished; the failed one
// counts in no success series. Before, one failed prompt took every
// prompt's success out of the metrics.
func TestVLLMMetricsStreamWithAFailedPrompt(t *testing.T) {
	reg := prometheus.NewRegistry()
	vm := newVLLMMetrics(reg, vllmEngineIndex, []string{"m"})
	m := newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })
	g := &generation{s: &Server{m: m, vm: vm}, q: newOutputQueue(2), endpoint: messages.EndpointCompletions, log: slog.New(slog.DiscardHandler),
		model: "m", vm: vm.of("m"), choices: []*choiceState{{busID: "r-0"}, {busID: "r-1"}}, start: time.Now()}
	g.q.push(0, &messages.Output{ReqID: "r-0", Index: 0, Text: "a"})
	g.q.push(0, &messages.Output{ReqID: "r-0", Index: 1, FinishReason: "stop", Usage: &messages.Usage{PromptTokens: 10, CompletionTokens: 2}})
	g.q.push(1, &messages.Output{ReqID: "r-1", Index: 0, Text: "b"})
	g.q.push(1, &messages.Output{ReqID: "r-1", Index: 1, Error: &messages.OutputError{Code: "engine_error", Message: "generation stopped"}})
	g.stream(httptest.NewRecorder(), t.Context(), time.Now().Add(5*time.Second), false, false)
	success := successByReason(t, reg)
	if success["stop"] != 1 || success["length"]+success["abort"] != 0 {
		t.Errorf("vllm:request_success_total by finished_reason %v, want the finished prompt's stop 1 and nothing for the failed one", success)
	}
}

// TestVLLMMetricsCountClientAborts: a client that leaves before its answer
// is finished counts, in vllm:request_success_total, each prompt it left
// unfinished under finished_reason="abort", as vLLM counts an engine
// request its client aborted; a prompt already finished keeps its own
// reason. Before, the abort series stayed at zero whatever clients did,
// and a vLLM dashboard's abort rate showed none.
func TestVLLMMetricsCountClientAborts(t *testing.T) {
	nc, _ := startJetStream(t)
	reg := prometheus.NewRegistry()
	vm := newVLLMMetrics(reg, vllmEngineIndex, []string{"m"})
	m := newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })
	s := &Server{m: m, vm: vm, cfg: Config{Conn: nc, Subjects: messages.Subjects{}}}
	g := &generation{s: s, q: newOutputQueue(2), endpoint: messages.EndpointCompletions, log: slog.New(slog.DiscardHandler),
		model: "m", vm: vm.of("m"), choices: []*choiceState{{busID: "r-0"}, {busID: "r-1"}}, start: time.Now()}
	g.q.push(0, &messages.Output{ReqID: "r-0", Index: 0, Text: "a"})
	g.q.push(0, &messages.Output{ReqID: "r-0", Index: 1, FinishReason: "stop", Usage: &messages.Usage{PromptTokens: 10, CompletionTokens: 2}})
	g.q.push(1, &messages.Output{ReqID: "r-1", Index: 0, Text: "b"})
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		time.Sleep(200 * time.Millisecond) // the outputs are streamed: the client leaves
		cancel()
	}()
	if status := g.stream(httptest.NewRecorder(), ctx, time.Now().Add(5*time.Second), false, false); status != 499 {
		t.Fatalf("status %d, want 499 (the client left)", status)
	}
	success := successByReason(t, reg)
	if success["stop"] != 1 || success["abort"] != 1 {
		t.Errorf("vllm:request_success_total by finished_reason %v, want the finished prompt's stop 1 and the one left unfinished abort 1", success)
	}
}

// successByReason is vllm:request_success_total in reg by finished_reason.
func successByReason(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	success := map[string]float64{}
	for _, f := range families {
		if f.GetName() == "vllm:request_success_total" {
			for _, mt := range f.GetMetric() {
				success[label(mt, "finished_reason")] += mt.GetCounter().GetValue()
			}
		}
	}
	return success
}

// counterSums returns each counter family's sum over its series.
func counterSums(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sums := map[string]float64{}
	for _, f := range families {
		for _, mt := range f.GetMetric() {
			if c := mt.GetCounter(); c != nil {
				sums[f.GetName()] += c.GetValue()
			}
		}
	}
	return sums
}

// TestVLLMMetricsCountUnfinishedPrompts: a request that ended unfinished
// after its first token (its client left, or it failed) counts its prompt
// in vllm:prompt_tokens_total and the tokens it generated in
// vllm:generation_tokens_total, as vLLM's engine counts a prompt once its
// prefill yields a token. Before, only finished requests counted: a review
// run of 37 finished, 2 aborted and 1 failed requests observed 40 TTFTs
// but counted 3,550 of the 4,300 prompt tokens processed.
func TestVLLMMetricsCountUnfinishedPrompts(t *testing.T) {
	nc, _ := startJetStream(t)
	for _, failed := range []bool{false, true} {
		reg := prometheus.NewRegistry()
		vm := newVLLMMetrics(reg, vllmEngineIndex, []string{"m"})
		m := newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })
		s := &Server{m: m, vm: vm, cfg: Config{Conn: nc, Subjects: messages.Subjects{}}}
		g := &generation{s: s, q: newOutputQueue(1), endpoint: messages.EndpointCompletions, log: slog.New(slog.DiscardHandler),
			model: "m", vm: vm.of("m"), choices: []*choiceState{{busID: "r-0", promptTokens: 350}}, start: time.Now()}
		g.q.push(0, &messages.Output{ReqID: "r-0", Index: 0, Text: "a b", TokenIDs: messages.TokenIDs{1, 2}})
		g.q.push(0, &messages.Output{ReqID: "r-0", Index: 1, Text: " c", TokenIDs: messages.TokenIDs{3}})
		ctx, cancel := context.WithCancel(t.Context())
		if failed {
			g.q.push(0, &messages.Output{ReqID: "r-0", Index: 2, Error: &messages.OutputError{Code: "group_failed", Message: "the worker group failed"}})
		} else {
			go func() {
				time.Sleep(200 * time.Millisecond) // the outputs are streamed: the client leaves
				cancel()
			}()
		}
		g.stream(httptest.NewRecorder(), ctx, time.Now().Add(5*time.Second), false, false)
		cancel()
		got := counterSums(t, reg)
		if got["vllm:prompt_tokens_total"] != 350 || got["vllm:generation_tokens_total"] != 3 {
			t.Errorf("failed %v: vllm:prompt_tokens_total %v, vllm:generation_tokens_total %v; want 350 (the prompt, prefilled) and 3 (the tokens streamed)",
				failed, got["vllm:prompt_tokens_total"], got["vllm:generation_tokens_total"])
		}
	}
}

// TestRequestsHelpNamesClientClosed: kvbus_frontend_requests_total counts a
// request whose client went away as status 499, which no client is sent:
// its help says so. A review's 2 aborted clients showed up as a 499 series
// on /metrics and the "HTTP requests by status" panel that neither the
// help nor the README explained.
func TestRequestsHelpNamesClientClosed(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := newMetrics(reg, func() float64 { return 0 })
	m.requests.WithLabelValues(messages.EndpointCompletions, "499", "m").Inc()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "kvbus_frontend_requests_total" {
			if help := f.GetHelp(); !strings.Contains(help, "499") || !strings.Contains(help, "went away") {
				t.Errorf("help %q does not say what status 499 counts (a client that went away)", help)
			}
			return
		}
	}
	t.Fatal("kvbus_frontend_requests_total not gathered")
}

// TestVLLMMetricsCountPromptsThatTimedOutOrFailedUnstreamed: a prompt
// prefilled and answered in part counts its prompt and the tokens generated
// however the request then ends. Only a client that left and a stream that
// failed counted them: a request whose --request-timeout passed (504), or
// one not streamed whose group failed (503 group_failed), counted neither,
// though its TTFT was observed (a review's two 504s after 2 s of streaming:
// vllm:time_to_first_token_seconds_count 2, vllm:prompt_tokens_total 0).
func TestVLLMMetricsCountPromptsThatTimedOutOrFailedUnstreamed(t *testing.T) {
	nc, _ := startJetStream(t)
	for _, stream := range []bool{false, true} {
		for _, timeout := range []bool{false, true} {
			reg := prometheus.NewRegistry()
			vm := newVLLMMetrics(reg, vllmEngineIndex, []string{"m"})
			m := newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })
			s := &Server{m: m, vm: vm, cfg: Config{Conn: nc, Subjects: messages.Subjects{}}}
			g := &generation{s: s, q: newOutputQueue(1), endpoint: messages.EndpointCompletions, log: slog.New(slog.DiscardHandler),
				model: "m", vm: vm.of("m"), choices: []*choiceState{{busID: "r-0", promptTokens: 350, buffered: !stream}}, start: time.Now()}
			g.q.push(0, &messages.Output{ReqID: "r-0", Index: 0, Text: "a b", TokenIDs: messages.TokenIDs{1, 2}})
			g.q.push(0, &messages.Output{ReqID: "r-0", Index: 1, Text: " c", TokenIDs: messages.TokenIDs{3}})
			if !timeout {
				g.q.push(0, &messages.Output{ReqID: "r-0", Index: 2, Error: &messages.OutputError{Code: "group_failed", Message: "the worker group failed"}})
			}
			deadline := time.Now().Add(300 * time.Millisecond)
			var status int
			if stream {
				status = g.stream(httptest.NewRecorder(), t.Context(), deadline, false, false)
			} else {
				status = g.respond(httptest.NewRecorder(), t.Context(), deadline)
			}
			got := counterSums(t, reg)
			if got["vllm:prompt_tokens_total"] != 350 || got["vllm:generation_tokens_total"] != 3 {
				t.Errorf("stream %v, timeout %v (status %d): vllm:prompt_tokens_total %v, vllm:generation_tokens_total %v; want 350 (the prompt, prefilled) and 3 (the tokens generated)",
					stream, timeout, status, got["vllm:prompt_tokens_total"], got["vllm:generation_tokens_total"])
			}
		}
	}
}
