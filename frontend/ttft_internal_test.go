package frontend

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvbus/kvbus/messages"
)

// TestTTFTOnlyForAFirstToken proves that kvbus_frontend_ttft_seconds and
// vllm:time_to_first_token_seconds observe a request's first output only
// when it is a token: not an error (an engine's 500, group_failed: they
// dragged TTFT down during an outage) and not an engine's whole answer to
// a request that does not stream (its time is the request's e2e latency).
// It failed before: every first output was observed, errors included.
func TestTTFTOnlyForAFirstToken(t *testing.T) {
	tokenOut := &messages.Output{ReqID: "r", Index: 0, Text: "a"}
	final := &messages.Output{ReqID: "r", Index: 1, FinishReason: "stop"}
	errOut := &messages.Output{ReqID: "r", Index: 0, Error: &messages.OutputError{Code: "group_failed", Message: "gone", Status: 503}}
	whole := &messages.Output{ReqID: "r", Index: 0, Text: "a", Raw: []byte(`{"choices":[]}`), FinishReason: "stop"}
	tests := []struct {
		name  string
		whole bool // the engine answers in one output (--engine openai, not streamed)
		outs  []*messages.Output
		want  uint64
	}{
		{"a token", false, []*messages.Output{tokenOut, final}, 1},
		{"an error first", false, []*messages.Output{errOut}, 0},
		{"an engine's whole answer", true, []*messages.Output{whole}, 0},
		{"an engine's stream", false, []*messages.Output{{ReqID: "r", Index: 0, Text: "a", Raw: []byte(`{}`)}, final}, 1},
	}
	count := func(o prometheus.Observer) uint64 {
		var m dto.Metric
		if err := o.(prometheus.Metric).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetHistogram().GetSampleCount()
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			vm := newVLLMMetrics(prometheus.NewRegistry(), "0", []string{"m"})
			m := newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })
			g := &generation{s: &Server{m: m, vm: vm}, q: newOutputQueue(1), endpoint: messages.EndpointChat,
				model: "m", vm: vm.of("m"), choices: []*choiceState{{busID: "r"}}, wholeAnswer: tt.whole}
			for _, o := range tt.outs {
				g.q.push(0, o)
			}
			for c := g.choices[0]; !c.done && len(g.q.items) > 0; {
				if _, err := g.next(t.Context(), nil); err != nil {
					t.Fatal(err)
				}
			}
			if got := count(m.ttft.WithLabelValues(messages.EndpointChat, "m")); got != tt.want {
				t.Errorf("kvbus_frontend_ttft_seconds observed %d times, want %d", got, tt.want)
			}
			if got := count(g.vm.ttft); got != tt.want {
				t.Errorf("vllm:time_to_first_token_seconds observed %d times, want %d", got, tt.want)
			}
		})
	}
}
