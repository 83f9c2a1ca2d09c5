package frontend

import (
	"bytes"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/messages"
)

// relayParts relays a whole (not streamed) answer that comes in parts, as
// a driver sends one too large for a message on the bus (splitAnswer).
func relayParts(t *testing.T, parts ...[]byte) *httptest.ResponseRecorder {
	t.Helper()
	vm := newVLLMMetrics(prometheus.NewRegistry(), "fe-test", []string{"m"})
	g := &generation{s: &Server{m: newMetrics(prometheus.NewRegistry(), func() float64 { return 0 }), vm: vm},
		q: newOutputQueue(1), log: slog.New(slog.DiscardHandler), vm: vm.of("m"), start: time.Now(), wholeAnswer: true,
		choices: []*choiceState{{busID: "r", buffered: true}}}
	for i, p := range parts {
		o := &messages.Output{ReqID: "r", Index: i, Raw: p}
		if i == len(parts)-1 {
			o.FinishReason = "stop"
		}
		g.q.push(0, o)
	}
	w := httptest.NewRecorder()
	g.relay(w, t.Context(), time.Now().Add(time.Minute), false)
	return w
}

// TestRelayPutsPartsTogether: the parts of a whole answer reach the client
// as one body.
func TestRelayPutsPartsTogether(t *testing.T) {
	w := relayParts(t, []byte(`{"id":"x",`), []byte(`"choices":[]}`))
	if w.Code != http.StatusOK || w.Body.String() != `{"id":"x","choices":[]}` {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
}

// TestRelayBoundsTheWholeAnswer: parts that add up to more than a worker
// ever sends (it reads at most maxWholeAnswer bytes of the engine's answer)
// end the request with an engine_error; the frontend put them together
// without a bound before, and relayed 8 MiB and one byte.
func TestRelayBoundsTheWholeAnswer(t *testing.T) {
	half := bytes.Repeat([]byte("a"), maxWholeAnswer/2)
	if w := relayParts(t, half, half); w.Code != http.StatusOK || w.Body.Len() != maxWholeAnswer {
		t.Fatalf("an answer of exactly %d bytes: %d, %d bytes", maxWholeAnswer, w.Code, w.Body.Len())
	}
	w := relayParts(t, half, half, []byte("a"))
	if w.Code != http.StatusInternalServerError || w.Body.Len() > 1<<10 || !bytes.Contains(w.Body.Bytes(), []byte(`"engine_error"`)) {
		t.Fatalf("an answer of %d bytes: %d, %d bytes: %.200s", maxWholeAnswer+1, w.Code, w.Body.Len(), w.Body)
	}
}
