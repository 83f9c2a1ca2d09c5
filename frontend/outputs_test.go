package frontend_test

import (
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/internal/logbuf"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/testenv/fakeengine"
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
	// The error says which ask went unanswered: no scheduler named the
	// request's group, or the driver of the group one named.
	if want := "no scheduler named the group running it"; !strings.Contains(string(body), want) {
		t.Errorf("streaming: %s; want it to say %q", body, want)
	}
	nc, err := nats.Connect(fe.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if _, err := nc.Subscribe(messages.Subjects{}.Resend(), func(m *nats.Msg) {
		data, _ := messages.Marshal(&messages.ResendReply{Group: "g7"})
		_ = m.Respond(data)
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	_, _, body = testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", chatHi+`,"stream":true}`, nil)
	if want := "the driver of group g7 did not answer"; !strings.Contains(string(body), want) {
		t.Errorf("streaming, a scheduler naming g7: %s; want it to say %q", body, want)
	}
}

// TestEngineAnswerIDIsTheClients proves that with engines behind the
// frontend (passthrough) a client's X-Request-Id my-req-1 gets the answer
// id chatcmpl-my-req-1, streamed or not, as vLLM answers it, while the bus
// request (and so the engine, which names its answer after it) keeps the
// unique my-req-1-<nuid>. It failed before: the client got the engine's
// chatcmpl-my-req-1-<nuid>, where the README promised chatcmpl-<id>.
func TestEngineAnswerIDIsTheClients(t *testing.T) {
	fe := startFrontend(t, func(c *frontend.Config) { c.Passthrough = true })
	busIDs := make(chan string, 4)
	answering(t, fe, func(req *messages.Request) []*messages.Output {
		busIDs <- req.RequestID
		id := `"chatcmpl-` + req.RequestID + `"`
		if !req.Stream {
			return []*messages.Output{{Index: 0, Text: "a", FinishReason: "stop",
				Raw: []byte(`{"id":` + id + `,"object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"a"},"finish_reason":"stop"}]}`)}}
		}
		return []*messages.Output{
			{Index: 0, Text: "a", Raw: []byte(`{"id":` + id + `,"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"a"}}]}`)},
			{Index: 1, FinishReason: "stop", Raw: []byte(`{"id":` + id + `,"object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`)},
		}
	})
	for _, stream := range []string{`}`, `,"stream":true}`} {
		status, h, body := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", chatHi+stream, map[string]string{"X-Request-Id": "my-req-1"})
		busID := <-busIDs
		if status != http.StatusOK || h.Get("X-Request-Id") != "my-req-1" {
			t.Fatalf("%s: %d, X-Request-Id %q: %s", stream, status, h.Get("X-Request-Id"), body)
		}
		if !strings.HasPrefix(busID, "my-req-1-") {
			t.Errorf("%s: bus request id %q, want my-req-1-<nuid> (unique)", stream, busID)
		}
		if n := strings.Count(string(body), `"id":"chatcmpl-my-req-1"`); n == 0 || strings.Contains(string(body), busID) {
			t.Errorf("%s: answer %s; want the id chatcmpl-my-req-1 and not the bus id %s", stream, body, busID)
		}
	}
	// Without a client id the engine's id is the client's: unchanged.
	status, h, body := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", chatHi+`}`, nil)
	<-busIDs
	if want := `"id":"chatcmpl-` + h.Get("X-Request-Id") + `"`; status != http.StatusOK || !strings.Contains(string(body), want) {
		t.Errorf("without X-Request-Id: %d %s; want %s", status, body, want)
	}
}

// TestEngineModeServesTheEnginesModelsAndLimits proves that with engines
// behind the frontend (passthrough, --tokenizer engine) the engine's limits
// and names apply, not kvbus's own: a prompt longer than kvbus's
// --max-model-len reaches the engine (whose max_model_len is larger, and
// which answers a prompt too long itself), a model the engine serves under
// another name than --model is served (on the bus under kvbus's model, whose
// hash seed indexes the engine's cache; the body keeps the client's name),
// GET /v1/models lists the engine's models with their max_model_len, and a
// model nobody serves is a 404 naming all. It failed before: the long
// prompt got kvbus's 400, the engine's model name a 404, and /v1/models
// listed only --model with kvbus's 8192.
func TestEngineModeServesTheEnginesModelsAndLimits(t *testing.T) {
	engine := startFakeEngine(t, fakeengine.Config{ModelName: "org/served-model", MaxModelLen: 32768})
	tok := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: []string{engine.URL()}})
	fe := startFrontend(t, func(c *frontend.Config) { c.Passthrough, c.Tokenizer, c.MaxModelLen = true, tok, 8192 })
	got := make(chan *messages.Request, 4)
	answering(t, fe, func(req *messages.Request) []*messages.Output {
		got <- req
		return []*messages.Output{{Index: 0, Text: "ok", FinishReason: "stop",
			Raw: []byte(`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}`)}}
	})
	long := strings.Repeat("word ", 10000)
	for _, model := range []string{"kvbus-sim", "org/served-model"} {
		body := `{"model":"` + model + `","messages":[{"role":"user","content":"` + long + `"}]}`
		status, _, resp := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", body, nil)
		if status != http.StatusOK {
			t.Fatalf("model %s, a 10k-token prompt: %d %.300s; want it sent to the engine", model, status, resp)
		}
		req := <-got
		if req.Model != "kvbus-sim" || len(req.PromptTokenIDs) <= 10000 || !strings.Contains(string(req.Body), `"model":"`+model+`"`) {
			t.Errorf("model %s: bus request of model %q with %d prompt tokens; want kvbus-sim, over 10000 tokens, the client's body",
				model, req.Model, len(req.PromptTokenIDs))
		}
	}
	status, _, resp := testenv.Send(t, http.MethodGet, fe.url+"/v1/models", "", nil)
	if status != http.StatusOK || !strings.Contains(string(resp), `"id":"org/served-model"`) || !strings.Contains(string(resp), `"max_model_len":32768`) ||
		!strings.Contains(string(resp), `"id":"kvbus-sim"`) {
		t.Errorf("/v1/models: %d %s; want the engine's model with its max_model_len, and kvbus-sim", status, resp)
	}
	status, _, resp = testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", `{"model":"nobody/serves","messages":[{"role":"user","content":"hi"}]}`, nil)
	if status != http.StatusNotFound || !strings.Contains(string(resp), "kvbus-sim, org/served-model") {
		t.Errorf("unknown model: %d %s; want a 404 naming the served models", status, resp)
	}
}

// TestOutputsSentAgainAndLostAgainAreAskedOnceMore: a stream skips an
// index; its driver answers the frontend's Resend but the outputs it sent
// again are lost on the bus too (here: not published at all). The frontend
// asks once more resendWait after the answer, and the stream ends whole;
// before, it waited for its deadline.
func TestOutputsSentAgainAndLostAgainAreAskedOnceMore(t *testing.T) {
	fe := startFrontend(t, func(c *frontend.Config) { c.RequestTimeout = 20 * time.Second })
	outs := []*messages.Output{{Index: 0, Text: "a"}, {Index: 1, Text: "b"}, {Index: 2, Text: "c"}, {Index: 3, FinishReason: "length"}}
	subj := messages.Subjects{Prefix: "kvbus"}
	nc, err := nats.Connect(fe.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	publish := func(frontendID, id string, outs ...*messages.Output) {
		for _, o := range outs {
			o.ReqID = id
			data, err := messages.Marshal(o)
			if err == nil {
				err = nc.Publish(subj.Out(frontendID), data)
			}
			if err != nil {
				t.Error(err)
			}
		}
	}
	var frontendID atomic.Value // the subscriptions' callbacks run on goroutines of their own
	if _, err := nc.Subscribe(subj.RequestAll(), func(m *nats.Msg) {
		req, err := messages.DecodeRequest(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		frontendID.Store(req.FrontendID)
		publish(req.FrontendID, req.RequestID, outs[0], outs[2]) // index 1 lost
	}); err != nil {
		t.Fatal(err)
	}
	var asks atomic.Int32
	if _, err := nc.Subscribe(subj.Resend(), func(m *nats.Msg) {
		rs, err := messages.DecodeResend(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		if asks.Add(1) > 1 { // the first time, what it sends again is lost
			publish(frontendID.Load().(string), rs.ReqID, outs[rs.FromIndex:]...)
		}
		data, _ := messages.Marshal(&messages.ResendReply{Resent: len(outs) - rs.FromIndex, Done: true})
		_ = m.Respond(data)
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	status, _, body := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", chatHi+`,"stream":true}`, nil)
	took := time.Since(start)
	text := ""
	for _, c := range []string{"a", "b", "c"} {
		if strings.Contains(string(body), `"content":"`+c+`"`) {
			text += c
		}
	}
	if status != http.StatusOK || text != "abc" || strings.Contains(string(body), `"error"`) || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Fatalf("%d after %s: %s; want the whole stream abc", status, took, body)
	}
	if n := asks.Load(); n != 2 {
		t.Errorf("the driver was asked %d times; want 2 (the outputs it sent the first time were lost)", n)
	}
}

// TestRequestCarriesItsTimeLeft: a published request carries, beside its
// deadline on this host's clock, the time it had left when it was
// published, from which a scheduler on another host learns this clock.
func TestRequestCarriesItsTimeLeft(t *testing.T) {
	fe := startFrontend(t, func(c *frontend.Config) { c.RequestTimeout = 20 * time.Second })
	got := make(chan *messages.Request, 1)
	answering(t, fe, func(req *messages.Request) []*messages.Output {
		got <- req
		return []*messages.Output{{Index: 0, Text: "a", FinishReason: "stop"}}
	})
	start := time.Now()
	if status, _, body := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", chatHi+`}`, nil); status != http.StatusOK {
		t.Fatalf("%d %.200s", status, body)
	}
	took := time.Since(start)
	req := <-got
	if total := req.DeadlineUnixMs - req.ArrivalUnixMs; total != 20_000 {
		t.Errorf("deadline %d ms after arrival, want 20000", total)
	}
	if req.TimeoutMs > 20_000 || req.TimeoutMs < (20*time.Second-took).Milliseconds() {
		t.Errorf("timeout_ms %d, want at most 20000 and at least %d (the request took %v)", req.TimeoutMs, (20*time.Second - took).Milliseconds(), took)
	}
}

// TestEngineModelListFailureIsLogged: when the engines' GET /v1/models
// fails (here a 401: engines started with vLLM's --api-key, the frontend
// given no key), the frontend warns once, naming the engine's answer, and
// again only after a list was read in between. Before, the failure was
// dropped without a word: /v1/models showed --model alone and the engines'
// adapters were 404s, and nothing said why.
func TestEngineModelListFailureIsLogged(t *testing.T) {
	engine := startFakeEngine(t, fakeengine.Config{ModelName: "kvbus-sim", APIKey: "sk-engine", LoRAModules: []string{"ad1"}})
	tok := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: []string{engine.URL()}})
	logs := &logbuf.Buffer{}
	fe := startFrontend(t, func(c *frontend.Config) {
		c.Passthrough, c.Tokenizer, c.Logger = true, tok, slog.New(slog.NewJSONHandler(logs, nil))
	})
	for range 2 {
		if status, _, body := testenv.Send(t, http.MethodGet, fe.url+"/v1/models", "", nil); status != http.StatusOK {
			t.Fatalf("/v1/models: %d %s", status, body)
		}
	}
	// A request for the adapter asks the engines again (a model not in the
	// list), and fails alike: still one line.
	_, _, _ = testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", `{"model":"ad1","messages":[{"role":"user","content":"hi"}]}`, nil)
	got := logs.Lines("the engines' model list")
	if len(got) != 1 || !strings.Contains(got[0], "401") || !strings.Contains(got[0], engine.URL()) {
		t.Errorf("log lines about the engines' model list: %q; want one warning naming the engine and its 401", got)
	}
}
