package frontend

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/messages"
)

// TestAttemptsNeverMix: the chunks of a request moved to another group
// (attempt 1) never mix with the abandoned attempt's (attempt 0).
func TestAttemptsNeverMix(t *testing.T) {
	chunk := func(attempt, index int, text string) *messages.Output {
		return &messages.Output{ReqID: "r", Attempt: attempt, Index: index, Text: text}
	}
	final := func(attempt, index int) *messages.Output {
		return &messages.Output{ReqID: "r", Attempt: attempt, Index: index, FinishReason: "stop"}
	}
	fail := func(attempt int) *messages.Output {
		return &messages.Output{ReqID: "r", Attempt: attempt, Error: &messages.OutputError{Code: "timeout", Message: "late"}}
	}
	tests := []struct {
		name     string
		buffered bool // not streamed: nothing reaches the client before the end
		outs     []*messages.Output
		wantText string
		wantErr  string // error code that ends the answer
	}{
		{"one attempt", false, []*messages.Output{chunk(0, 0, "a"), chunk(0, 1, "b"), final(0, 2)}, "ab", ""},
		{"moved before output: the new attempt from index 0, the old one's late chunks dropped", false,
			[]*messages.Output{chunk(1, 0, "x"), chunk(0, 0, "a"), chunk(1, 1, "y"), chunk(0, 1, "b"), final(1, 2)}, "xy", ""},
		{"an old attempt's final chunk does not end the new one", false,
			[]*messages.Output{chunk(1, 0, "x"), final(0, 1), chunk(1, 1, "y"), final(1, 2)}, "xy", ""},
		{"a new attempt after output began ends the answer with an error, nothing spliced", false,
			[]*messages.Output{chunk(0, 0, "a"), chunk(1, 0, "x"), chunk(0, 1, "b")}, "a", "group_failed"},
		{"an error of a newer attempt ends the answer", false,
			[]*messages.Output{chunk(0, 0, "a"), fail(1)}, "a", "timeout"},
		{"duplicates of the same attempt are dropped", false,
			[]*messages.Output{chunk(0, 0, "a"), chunk(0, 0, "a"), chunk(0, 1, "b"), final(0, 2)}, "ab", ""},
		{"not streamed: a new attempt after output began replaces it whole (the client had none of it)", true,
			[]*messages.Output{chunk(0, 0, "a"), chunk(0, 1, "b"), chunk(1, 0, "x"), chunk(0, 2, "c"), chunk(1, 1, "y"), final(1, 2)}, "xy", ""},
		{"not streamed: an error of a newer attempt still ends the answer", true,
			[]*messages.Output{chunk(0, 0, "a"), fail(1)}, "a", "timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			vm := newVLLMMetrics(prometheus.NewRegistry(), "fe-test", []string{"m"})
			g := &generation{s: &Server{m: newMetrics(prometheus.NewRegistry(), func() float64 { return 0 }), vm: vm}, q: newOutputQueue(1),
				vm: vm.of("m"), choices: []*choiceState{{busID: "r", buffered: tt.buffered}}}
			for _, o := range tt.outs {
				g.q.push(0, o)
			}
			c := g.choices[0]
			for !c.done && len(g.q.items) > 0 {
				if _, err := g.next(t.Context(), nil); err != nil {
					t.Fatal(err)
				}
			}
			if got := c.text.String(); got != tt.wantText {
				t.Errorf("text %q, want %q", got, tt.wantText)
			}
			switch {
			case tt.wantErr == "" && c.err != nil:
				t.Errorf("error %+v, want none", c.err)
			case tt.wantErr != "" && (c.err == nil || c.err.Code != tt.wantErr):
				t.Errorf("error %+v, want code %s", c.err, tt.wantErr)
			case tt.wantErr == "" && c.finish != "stop":
				t.Errorf("finish %q, want stop", c.finish)
			}
		})
	}
}
