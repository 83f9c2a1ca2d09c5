package frontend

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
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
	g := &generation{s: s, q: newOutputQueue(1), log: log}
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

// TestProbesAfterReconnectsSpendNoResendAsk: a stream under way that hears
// nothing after each of four NATS reconnects asks its driver each time,
// and the driver has nothing missing; those probes spend none of the
// stream's maxResends, and an output index skipped after them is still
// asked for. Before, the fourth reconnect found the asks spent and ended a
// healthy stream with output_lost.
func TestProbesAfterReconnectsSpendNoResendAsk(t *testing.T) {
	nc, _ := startJetStream(t)
	subj := messages.Subjects{}
	asked := make(chan *messages.Resend, 16)
	sub, err := nc.Subscribe(subj.Resend(), func(m *nats.Msg) {
		rs, err := messages.DecodeResend(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		asked <- rs
		data, _ := messages.Marshal(&messages.ResendReply{})
		_ = m.Respond(data)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	g, c := streamUnderWay(nc, subj)
	apply := func(o *messages.Output) {
		g.q.add(choiceOutput{out: o})
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		if items, _ := g.next(ctx, time.NewTimer(time.Hour)); len(items) > 0 {
			t.Fatalf("reached the client: %+v (error %v)", items[0].out, items[0].out.Error)
		}
	}
	for n := range maxResends + 1 {
		apply(&messages.Output{ReqID: "r", Attempt: math.MaxInt32, Error: &messages.OutputError{Code: codeOutputLost}})
		select {
		case rs := <-asked:
			if rs.FromIndex != 3 {
				t.Fatalf("probe %d asked from index %d; want 3", n+1, rs.FromIndex)
			}
		default:
			t.Fatalf("reconnect %d: the driver was not asked", n+1)
		}
		if c.resending || c.done {
			t.Fatalf("after probe %d: resending %v, done %v; want the stream going on", n+1, c.resending, c.done)
		}
	}
	// A real loss after the probes: index 5 where 3 was due.
	apply(&messages.Output{ReqID: "r", Attempt: 1, Index: 5, Text: "late"})
	select {
	case rs := <-asked:
		if rs.FromIndex != 3 {
			t.Errorf("the gap asked from index %d; want 3", rs.FromIndex)
		}
	default:
		t.Error("an index skipped after the probes was not asked for")
	}
}

// streamUnderWay is a streamed request "r" of one choice on a frontend
// without HTTP: its outputs up to index 2 reached the client.
func streamUnderWay(nc *nats.Conn, subj messages.Subjects) (*generation, *choiceState) {
	log := slog.New(slog.DiscardHandler)
	s := &Server{cfg: Config{Conn: nc, Subjects: subj}, log: log, pending: map[string]route{},
		m: newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })}
	g := &generation{s: s, q: newOutputQueue(1), log: log, firstByte: time.Now()}
	c := &choiceState{busID: "r", attempt: 1, started: true, nextIndex: 3, ttftSeen: true}
	g.choices = []*choiceState{c}
	s.register("r", g.q, 0)
	return g, c
}

// TestProbeAnsweredLateSpendsNoResendAsk: a probe after a reconnect whose
// driver answers "nothing missing" only after the stream's next output
// came spends none of the stream's maxResends either: after more such
// probes than maxResends, an output index skipped is still asked for.
// Before, a late answer was dropped uncounted, and the fourth loss ended
// a healthy stream with output_lost.
func TestProbeAnsweredLateSpendsNoResendAsk(t *testing.T) {
	nc, _ := startJetStream(t)
	subj := messages.Subjects{}
	asked := make(chan *nats.Msg, 16)
	sub, err := nc.Subscribe(subj.Resend(), func(m *nats.Msg) { asked <- m })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	g, c := streamUnderWay(nc, subj)
	// apply queues o and returns what reached the client.
	apply := func(o *messages.Output) []choiceOutput {
		g.q.add(choiceOutput{out: o})
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		items, _ := g.next(ctx, time.NewTimer(time.Hour))
		return items
	}
	nextAsk := func(what string) *nats.Msg {
		select {
		case m := <-asked:
			return m
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the driver was not asked", what)
			return nil
		}
	}
	for n := range maxResends + 1 {
		if items := apply(&messages.Output{ReqID: "r", Attempt: math.MaxInt32, Error: &messages.OutputError{Code: codeOutputLost}}); len(items) > 0 {
			t.Fatalf("reconnect %d: the verdict reached the client: %+v", n+1, items[0].out)
		}
		probe := nextAsk(fmt.Sprintf("reconnect %d", n+1))
		// The stream's next output comes before the driver's answer.
		if items := apply(&messages.Output{ReqID: "r", Attempt: 1, Index: c.nextIndex, Text: "on"}); len(items) != 1 || items[0].out.Error != nil {
			t.Fatalf("reconnect %d: the next output did not reach the client (%d items)", n+1, len(items))
		}
		data, _ := messages.Marshal(&messages.ResendReply{})
		if err := probe.Respond(data); err != nil {
			t.Fatal(err)
		}
		// The late answer is taken, and ends nothing.
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		if items, _ := g.next(ctx, time.NewTimer(time.Hour)); len(items) > 0 {
			t.Fatalf("reconnect %d: the late answer reached the client: %+v", n+1, items[0].out)
		}
		cancel()
	}
	if c.done || c.resending {
		t.Fatalf("after the probes: done %v, resending %v; want the stream going on", c.done, c.resending)
	}
	// A real loss after the probes: two indexes skipped.
	want := c.nextIndex
	if items := apply(&messages.Output{ReqID: "r", Attempt: 1, Index: want + 2, Text: "late"}); len(items) > 0 {
		t.Fatalf("the output past a gap reached the client: %+v", items[0].out)
	}
	if rs, err := messages.DecodeResend(nextAsk("the gap").Data); err != nil || rs.FromIndex != want {
		t.Errorf("the gap asked %+v (err %v); want from index %d", rs, err, want)
	}
}

// TestAskAgainAbortsACopyItGaveUp: a client that leaves while its request
// is published again (its answer lost on the bus) has the copy aborted:
// the log may have taken it, its acknowledgement not yet heard. Before,
// the copy was forgotten without an Abort, and a rank generated its whole
// answer for nobody.
func TestAskAgainAbortsACopyItGaveUp(t *testing.T) {
	nc, js := startJetStream(t)
	subj := messages.Subjects{}
	log := slog.New(slog.DiscardHandler)
	s := &Server{js: js, cfg: Config{Conn: nc, Subjects: subj, PublishTimeout: 5 * time.Second}, log: log, pending: map[string]route{},
		m: newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })}
	g := &generation{s: s, q: newOutputQueue(1), log: log}
	c := &choiceState{busID: "r", buffered: true,
		req: &messages.Request{RequestID: "r", Model: "m", FrontendID: "fe", ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: []uint32{1}}}
	g.choices = []*choiceState{c}
	s.register("r", g.q, 0)
	aborts := make(chan *nats.Msg, 4)
	asub, err := nc.ChanSubscribe(subj.Abort(), aborts)
	if err != nil {
		t.Fatal(err)
	}
	defer asub.Unsubscribe()
	// The log takes the copy; the client leaves before its acknowledgement.
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	lsub, err := nc.Subscribe(subj.Request("m"), func(*nats.Msg) { cancel() })
	if err != nil {
		t.Fatal(err)
	}
	defer lsub.Unsubscribe()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if g.askAgain(ctx, 0, "an output index skipped", false) {
		t.Fatal("asked again, though the client left before the log acknowledged it")
	}
	deadline := time.After(5 * time.Second)
	for {
		select {
		case m := <-aborts:
			if a, err := messages.DecodeAbort(m.Data); err == nil && a.ReqID == "r-again1" {
				return
			}
		case <-deadline:
			t.Fatal("no Abort for the copy r-again1, which the log may hold")
		}
	}
}

// TestAskedAgainAnswerIDKeepsAClientIDThatJSONEscapes: with --engine
// openai, a whole answer lost on the bus is asked again under a new bus id,
// which the engine names its answer after ("chatcmpl-a\"b-<nuid>-again1",
// escaped in its JSON); the client still gets chatcmpl-<its id>. Before,
// the frontend renamed the engine id it looks for with the bus ids
// unescaped, found no quote to rename in the escaped id, and the client got
// the bus id chatcmpl-a\"b-<nuid>-again1.
func TestAskedAgainAnswerIDKeepsAClientIDThatJSONEscapes(t *testing.T) {
	nc, js := startJetStream(t)
	subj := messages.Subjects{}
	if _, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{Subjects: subj}); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	s := &Server{js: js, cfg: Config{Conn: nc, Subjects: subj, PublishTimeout: time.Second, Passthrough: true}, log: log,
		pending: map[string]route{}, m: newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })}
	const clientID, busID = `a"b\c`, `a"b\c-N1`
	g := &generation{s: s, q: newOutputQueue(1), log: log, wholeAnswer: true, firstByte: time.Now(),
		engineID: jsonString("chatcmpl-" + busID), clientID: jsonString("chatcmpl-" + clientID)}
	c := &choiceState{busID: busID, buffered: true,
		req: &messages.Request{RequestID: busID, Model: "m", FrontendID: "fe", ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: []uint32{1}}}
	g.choices = []*choiceState{c}
	s.register(busID, g.q, 0)
	next := func(o *messages.Output) []choiceOutput {
		g.q.push(0, o)
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		items, _ := g.next(ctx, time.NewTimer(time.Hour))
		return items
	}
	// Nothing heard after a reconnect, and no driver holds it: asked again.
	if items := next(&messages.Output{ReqID: busID, Attempt: math.MaxInt32, Error: &messages.OutputError{Code: codeOutputLost}}); len(items) > 0 {
		t.Fatalf("outputs reached the client: %+v", items[0].out)
	}
	again := busID + "-again1"
	if c.busID != again {
		t.Fatalf("following %q; want %q", c.busID, again)
	}
	engineID, _ := json.Marshal("chatcmpl-" + again)
	raw := `{"id":` + string(engineID) + `,"object":"chat.completion","choices":[]}`
	items := next(&messages.Output{ReqID: again, Attempt: 1, Raw: []byte(raw), FinishReason: "stop"})
	if len(items) != 1 {
		t.Fatalf("%d outputs reached the client; want the answer", len(items))
	}
	want, _ := json.Marshal("chatcmpl-" + clientID)
	if got := string(items[0].out.Raw); !strings.Contains(got, `"id":`+string(want)+`,`) {
		t.Errorf("the client got %s; want the id %s", got, want)
	}
}

// TestKeptCopyOfAWholeAnswerUnderWayIsFollowedFromWhereItWas: a request
// that does not stream hears its first output (the driver sends its first
// token at once and holds the rest for the last output), then nothing for
// 3 s after a NATS reconnect, and no driver answers for it: it is asked
// again and kept. When the kept request's last output (index 1, the rest
// of the answer) comes first, the client gets the whole answer from it.
// Before, asking again had reset where the choice's outputs had got to, so
// index 1 of the kept request looked like a gap: its whole answer was
// thrown away, its copy aborted and the request published a third time.
func TestKeptCopyOfAWholeAnswerUnderWayIsFollowedFromWhereItWas(t *testing.T) {
	nc, js := startJetStream(t)
	subj := messages.Subjects{}
	if _, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{Subjects: subj}); err != nil {
		t.Fatal(err)
	}
	published := make(chan string, 8)
	sub, err := nc.Subscribe(subj.RequestAll(), func(m *nats.Msg) {
		if req, err := messages.DecodeRequest(m.Data); err == nil {
			published <- req.RequestID
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	log := slog.New(slog.DiscardHandler)
	s := &Server{js: js, cfg: Config{Conn: nc, Subjects: subj, PublishTimeout: time.Second}, log: log, pending: map[string]route{},
		m: newMetrics(prometheus.NewRegistry(), func() float64 { return 0 })}
	vm := newVLLMMetrics(prometheus.NewRegistry(), vllmEngineIndex, []string{"m"})
	g := &generation{s: s, q: newOutputQueue(1), log: log, endpoint: messages.EndpointChat, model: "m", vm: vm.of("m"), start: time.Now()}
	c := &choiceState{busID: "r", buffered: true,
		req: &messages.Request{RequestID: "r", Model: "m", FrontendID: "fe", ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: []uint32{1}}}
	g.choices = []*choiceState{c}
	s.register("r", g.q, 0)
	next := func(outs ...*messages.Output) []choiceOutput {
		for _, o := range outs {
			g.q.push(0, o)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		items, _ := g.next(ctx, time.NewTimer(time.Hour))
		return items
	}
	if items := next(&messages.Output{ReqID: "r", Attempt: 1, Index: 0, Text: " first", TokenIDs: messages.TokenIDs{1}}); len(items) != 1 {
		t.Fatalf("the first output: %d items taken", len(items))
	}
	// Nothing heard after a reconnect; no driver answers the probe.
	next(&messages.Output{ReqID: "r", Attempt: math.MaxInt32, Error: &messages.OutputError{Code: codeOutputLost}})
	if c.busID != "r-again1" || c.hedged != "r" {
		t.Fatalf("after the verdict: following %q, kept %q; want r-again1 and r kept", c.busID, c.hedged)
	}
	// The kept request's last output: the rest of the answer.
	next(&messages.Output{ReqID: "r", Attempt: 1, Index: 1, Text: " second third", TokenIDs: messages.TokenIDs{2, 3},
		FinishReason: "length", Usage: &messages.Usage{PromptTokens: 1, CompletionTokens: 3}})
	if !c.done || c.err != nil || c.busID != "r" || c.text.String() != " first second third" || c.generated != 3 {
		t.Errorf("after the kept request's last output: done %v (err %v), following %q, text %q, %d tokens; want its whole answer %q, 3 tokens",
			c.done, c.err, c.busID, c.text.String(), c.generated, " first second third")
	}
	var ids []string
	for len(published) > 0 {
		ids = append(ids, <-published)
	}
	if len(ids) != 1 {
		t.Errorf("requests published: %v; want only the copy r-again1", ids)
	}
}
