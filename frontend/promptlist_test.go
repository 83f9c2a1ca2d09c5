package frontend_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// promptList is a completion body of n one-word prompts.
func promptList(n int, rest string) string {
	return `{"prompt":[` + strings.TrimSuffix(strings.Repeat(`"a",`, n), ",") + `],"max_tokens":1` + rest + `}`
}

// TestPromptListLimits: each prompt of a list is a request of its own in
// the request log, published one after the other. A list longer than
// frontend.MaxPrompts is refused with a 400 naming the limit (a 4 MiB body
// held a million, each to publish and dispatch); and a list that cannot be
// published within --request-timeout stops there, with a 504, instead of
// publishing on what nobody waits for (20,000 prompts with a 1 s timeout
// took 6 s, all of them in the log).
func TestPromptListLimits(t *testing.T) {
	fe := startFrontend(t, func(c *frontend.Config) { c.RequestTimeout = 30 * time.Millisecond })
	for name, body := range map[string]string{
		"strings":   promptList(frontend.MaxPrompts+1, ""),
		"token ids": `{"prompt":[` + strings.TrimSuffix(strings.Repeat(`[1,2],`, frontend.MaxPrompts+1), ",") + `],"max_tokens":1}`,
	} {
		status, _, b := testenv.Send(t, http.MethodPost, fe.url+"/v1/completions", body, nil)
		if status != http.StatusBadRequest || !strings.Contains(string(b), fmt.Sprintf("at most %d", frontend.MaxPrompts)) {
			t.Errorf("%s: %d prompts: %d %s; want 400 naming the limit", name, frontend.MaxPrompts+1, status, b)
		}
	}
	status, _, b := testenv.Send(t, http.MethodPost, fe.url+"/v1/completions", promptList(frontend.MaxPrompts, ""), nil)
	if status != http.StatusGatewayTimeout || !strings.Contains(string(b), "--request-timeout") {
		t.Errorf("%d prompts past --request-timeout 30ms: %d %s; want 504", frontend.MaxPrompts, status, b)
	}
	st, err := fe.js.Stream(t.Context(), "KVBUS_REQUESTS")
	if err != nil {
		t.Fatal(err)
	}
	if n := st.CachedInfo().State.Msgs; n == 0 || n >= frontend.MaxPrompts {
		t.Errorf("%d of %d prompts in the request log; want the publishing stopped at the deadline, after the first", n, frontend.MaxPrompts)
	}
}

// TestStreamedPromptListRefusedBeforeOutput: a streamed completion of two
// prompts, both refused before any output (no ready group), is answered
// 503 with Retry-After, as one prompt is, so that SDKs retry it. The
// scheduler refuses each prompt on its own: before, the first refusal
// opened a 200 stream, and the second came as an error event in it.
func TestStreamedPromptListRefusedBeforeOutput(t *testing.T) {
	fe := startFrontend(t, func(*frontend.Config) {})
	answering(t, fe, func(req *messages.Request) []*messages.Output {
		if strings.HasSuffix(req.RequestID, "-1") {
			time.Sleep(200 * time.Millisecond) // the second prompt's refusal comes a little later
		}
		return []*messages.Output{{Error: &messages.OutputError{Code: "no_ready_group", Message: "no worker group is ready"}}}
	})
	status, h, body := testenv.Send(t, http.MethodPost, fe.url+"/v1/completions", `{"prompt":["a","b"],"max_tokens":2,"stream":true}`, nil)
	if status != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
		t.Errorf("two prompts, both refused before any output: %d, Retry-After %q, Content-Type %q\n%s\nwant 503 with Retry-After, as for one prompt",
			status, h.Get("Retry-After"), h.Get("Content-Type"), body)
	}
}

// TestStreamedPromptListOneRefused: of two streamed prompts, one refused
// before any output and one answered, the stream begins with the answer
// and carries the refusal as an error event: what was held while no
// choice had answered is sent, not lost.
func TestStreamedPromptListOneRefused(t *testing.T) {
	fe := startFrontend(t, func(*frontend.Config) {})
	answering(t, fe, func(req *messages.Request) []*messages.Output {
		if strings.HasSuffix(req.RequestID, "-0") {
			return []*messages.Output{{Error: &messages.OutputError{Code: "no_ready_group", Message: "no worker group is ready"}}}
		}
		time.Sleep(200 * time.Millisecond)
		return []*messages.Output{{Index: 0, Text: "x", TokenIDs: []uint32{1}}, {Index: 1, Text: "y", TokenIDs: []uint32{2}, FinishReason: "length"}}
	})
	status, _, body := testenv.Send(t, http.MethodPost, fe.url+"/v1/completions", `{"prompt":["a","b"],"max_tokens":2,"stream":true}`, nil)
	if status != http.StatusOK || !strings.Contains(string(body), "no_ready_group") || !strings.Contains(string(body), `"text":"x"`) ||
		!strings.Contains(string(body), `"text":"y"`) || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Errorf("one prompt refused, one answered: %d\n%s\nwant a 200 stream with the refusal's error event and both chunks of the answer", status, body)
	}
}

// TestRelayedStreamErrorCounted: with --engine openai, a stream the engine
// broke off after its first chunk counts under its error's status in
// kvbus_frontend_requests_total, as the sim's streams do: an alert on the
// share of 5xx sees it (it counted as 200).
func TestRelayedStreamErrorCounted(t *testing.T) {
	reg := prometheus.NewRegistry()
	fe := startFrontend(t, func(c *frontend.Config) { c.Passthrough, c.Registry = true, reg })
	answering(t, fe, func(req *messages.Request) []*messages.Output {
		id := `"chatcmpl-` + req.RequestID + `"`
		return []*messages.Output{
			{Index: 0, Text: "a", Raw: []byte(`{"id":` + id + `,"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"a"}}]}`)},
			{Index: 1, Error: &messages.OutputError{Code: "engine_error", Message: "the engine stopped"}},
		}
	})
	status, _, body := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", chatHi+`,"stream":true}`, nil)
	if status != http.StatusOK || !strings.Contains(string(body), "engine_error") {
		t.Fatalf("%d %s; want a 200 stream ending with the engine's error event", status, body)
	}
	ok := testenv.CounterSum(t, reg, "kvbus_frontend_requests_total", map[string]string{"status": "200"})
	failed := testenv.CounterSum(t, reg, "kvbus_frontend_requests_total", map[string]string{"status": "500"})
	if ok != 0 || failed != 1 {
		t.Errorf("a relayed stream that ended with an engine_error event counted as 200 %v times, as 500 %v times; want it under 500", ok, failed)
	}
}
