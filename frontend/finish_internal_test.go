package frontend

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestRequestSuccessByVLLMsFinishReasons proves vllm:request_success_total
// counts under vLLM's own finished_reason values (stop, length, abort,
// error, repetition): an engine's answer that called a tool (OpenAI's
// finish_reason "tool_calls", which vLLM's engine counts as "stop") counts
// as stop. It made a finished_reason="tool_calls" series before, which
// vLLM never exports, and a vLLM dashboard's stop rate missed it.
func TestRequestSuccessByVLLMsFinishReasons(t *testing.T) {
	reg := prometheus.NewRegistry()
	vm := newVLLMMetrics(reg, vllmEngineIndex, []string{"m"})
	ms := vm.of("m")
	for _, finish := range []string{"stop", "tool_calls", "function_call", "length", ""} {
		ms.finished(10, 2, 0, finish, 0.5)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "vllm:request_success_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "finished_reason" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	want := map[string]float64{"stop": 4, "length": 1, "abort": 0}
	if len(got) != len(want) || got["stop"] != want["stop"] || got["length"] != want["length"] || got["abort"] != 0 {
		t.Errorf("vllm:request_success_total by finished_reason %v, want %v", got, want)
	}
}
