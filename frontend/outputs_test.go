package frontend_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// answering stands in for the scheduler and the workers: it answers every
// request in the log with outs(req), on the frontend's output subject.
func answering(t *testing.T, fe *standalone, outs func(*messages.Request) []*messages.Output) {
	t.Helper()
	nc, err := nats.Connect(fe.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	subj := messages.Subjects{Prefix: "kvbus"}
	if _, err := nc.Subscribe(subj.RequestAll(), func(m *nats.Msg) {
		req, err := messages.DecodeRequest(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		for _, o := range outs(req) {
			o.ReqID = req.RequestID
			data, err := messages.Marshal(o)
			if err != nil {
				t.Error(err)
				return
			}
			_ = nc.Publish(subj.Out(req.FrontendID), data)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

const chatHi = `{"messages":[{"role":"user","content":"hi"}],"max_tokens":4`

// TestStreamErrorBeforeOutputHasItsStatus: a streaming request that fails
// before its first output is answered with the error's HTTP status, as a
// non-streaming one is (DESIGN §9), so that SDKs retry a 503 or 429; one
// that fails after it ends its stream with an error event.
func TestStreamErrorBeforeOutputHasItsStatus(t *testing.T) {
	fe := startFrontend(t, func(*frontend.Config) {})
	answering(t, fe, func(*messages.Request) []*messages.Output {
		return []*messages.Output{{Error: &messages.OutputError{Code: "no_ready_group", Message: "no worker group is ready"}}}
	})
	for _, stream := range []string{`}`, `,"stream":true}`} {
		status, h, body := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", chatHi+stream, nil)
		if status != http.StatusServiceUnavailable || h.Get("Retry-After") != "1" || !strings.Contains(string(body), `"no_ready_group"`) {
			t.Errorf("%s: %d, Retry-After %q, %.200s; want 503 with Retry-After 1 and the error's code", stream, status, h.Get("Retry-After"), body)
		}
	}

	slow := startFrontend(t, func(c *frontend.Config) { c.RequestTimeout = 300 * time.Millisecond })
	if status, _, body := testenv.Send(t, http.MethodPost, slow.url+"/v1/chat/completions", chatHi+`,"stream":true}`, nil); status != http.StatusGatewayTimeout {
		t.Errorf("streaming request with no output before its timeout: %d %.200s, want 504", status, body)
	}

	late := startFrontend(t, func(*frontend.Config) {})
	answering(t, late, func(*messages.Request) []*messages.Output {
		return []*messages.Output{{Index: 0, Text: "a"}, {Index: 1, Error: &messages.OutputError{Code: "engine_error", Message: "the engine stopped"}}}
	})
	status, h, body := testenv.Send(t, http.MethodPost, late.url+"/v1/chat/completions", chatHi+`,"stream":true}`, nil)
	if status != http.StatusOK || !strings.HasPrefix(h.Get("Content-Type"), "text/event-stream") ||
		!strings.Contains(string(body), `"content":"a"`) || strings.Count(string(body), `"engine_error"`) != 1 || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Errorf("error after the first output: %d %q, %q; want 200, the text, one error event and [DONE]", status, h.Get("Content-Type"), body)
	}
}

// TestLostOutputEndsTheAnswer: an output index that skips one means
// outputs were lost on the bus; the answer ends with a retriable error
// instead of silently missing text.
func TestLostOutputEndsTheAnswer(t *testing.T) {
	fe := startFrontend(t, func(*frontend.Config) {})
	answering(t, fe, func(*messages.Request) []*messages.Output {
		return []*messages.Output{{Index: 0, Text: "a"}, {Index: 2, Text: "c", FinishReason: "stop", Usage: &messages.Usage{PromptTokens: 3, CompletionTokens: 3}}}
	})
	status, _, body := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", chatHi+`}`, nil)
	if status != http.StatusServiceUnavailable || !strings.Contains(string(body), `"output_lost"`) {
		t.Errorf("non-streaming: %d %.300s; want 503 output_lost", status, body)
	}
	status, _, body = testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", chatHi+`,"stream":true}`, nil)
	if status != http.StatusOK || !strings.Contains(string(body), `"output_lost"`) || strings.Contains(string(body), `"content":"c"`) {
		t.Errorf("streaming: %d %s; want the first text, then an output_lost error event, never the text after the gap", status, body)
	}
}
