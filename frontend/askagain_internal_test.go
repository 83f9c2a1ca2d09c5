package frontend

import (
	"context"
	"log/slog"
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// TestSilentVerdictsAcrossTwoReconnects: a request silent after a
// reconnect is asked again and kept; a second reconnect before either
// copy answered judges both silent. The verdict on the kept copy is
// ignored and the newest is asked again once, the choice still open
// (before, the verdict on the kept copy spent the last ask and ended the
// request with a 503 while its newest copy was in flight).
func TestSilentVerdictsAcrossTwoReconnects(t *testing.T) {
	nc, js := startJetStream(t)
	subj := messages.Subjects{}
	if _, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{Subjects: subj}); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	s := &Server{js: js, cfg: Config{Conn: nc, Subjects: subj, PublishTimeout: time.Second}, log: log, pending: map[string]route{},
		m: newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })}
	g := &generation{s: s, q: newOutputQueue(), log: log}
	c := &choiceState{busID: "r", buffered: true,
		req: &messages.Request{RequestID: "r", Model: "m", FrontendID: "fe", ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: []uint32{1}}}
	g.choices = []*choiceState{c}
	s.register("r", g.q, 0)
	verdict := func(id string) *messages.Output {
		return &messages.Output{ReqID: id, Attempt: math.MaxInt32, Error: &messages.OutputError{Code: codeOutputLost}}
	}
	// next returns when the outputs are applied and nothing more comes.
	apply := func(outs ...*messages.Output) {
		for _, o := range outs {
			g.q.push(0, o)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		if items, _ := g.next(ctx, time.NewTimer(time.Hour)); len(items) > 0 {
			t.Fatalf("outputs reached the client: %+v", items[0].out)
		}
	}
	apply(verdict("r"))
	if c.busID != "r-again1" || c.hedged != "r" || c.done {
		t.Fatalf("after the first verdict: following %q, kept %q, done %v; want r-again1, r, open", c.busID, c.hedged, c.done)
	}
	apply(verdict("r"), verdict("r-again1"))
	if c.busID != "r-again2" || c.hedged != "r-again1" || c.done {
		t.Fatalf("after the second reconnect: following %q, kept %q, done %v (%v); want r-again2, r-again1, open", c.busID, c.hedged, c.done, c.err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.pending["r"]; ok || len(s.pending) != 2 {
		t.Errorf("listening for %v; want r-again1 and r-again2 only", s.pending)
	}
}
