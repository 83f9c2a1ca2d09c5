package frontend_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/internal/validatetest"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/testenv/fakeengine"
)

// startFakeEngine starts a fake vLLM server (no KV events) closed at
// cleanup.
func startFakeEngine(t *testing.T, cfg fakeengine.Config) *fakeengine.Engine {
	t.Helper()
	e, err := fakeengine.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

func newEngineTokenizer(t *testing.T, cfg frontend.EngineTokenizerConfig) *frontend.EngineTokenizer {
	t.Helper()
	tok, err := frontend.NewEngineTokenizer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// closedURL returns the URL of a server that is no longer there: its
// connections are refused.
func closedURL() string {
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close()
	return srv.URL
}

// received returns the requests an engine got on path.
func received(e *fakeengine.Engine, path string) []fakeengine.Received {
	var out []fakeengine.Received
	for _, r := range e.Requests() {
		if r.Path == path {
			out = append(out, r)
		}
	}
	return out
}

// prefilled sends body to the engine's path and returns the prompt tokens
// the engine prefilled for it.
func prefilled(t *testing.T, e *fakeengine.Engine, path, body string) []uint32 {
	t.Helper()
	status, _, raw := testenv.Send(t, http.MethodPost, e.URL()+path, body, nil)
	if status != http.StatusOK {
		t.Fatalf("engine answered %d: %s", status, raw)
	}
	got := received(e, path)
	return got[len(got)-1].PromptTokens
}

// TestEngineTokenizerMatchesEngine proves the EngineTokenizer's tokens are
// the engine's own: a conversation's are fakeengine.ChatTemplate with the
// generation prompt and without added special tokens, a completion
// prompt's are fakeengine.Tokenize with the special tokens (TokenBOS
// first), and both are exactly what the engine prefills for the same
// request, so kvbus's block hashes match the engine's cache. It also
// proves what /tokenize receives: the configured model (not the
// client's), the fields of vLLM's TokenizeChatRequest and no others, and
// the API key.
func TestEngineTokenizerMatchesEngine(t *testing.T) {
	t.Parallel()
	fe := startFakeEngine(t, fakeengine.Config{ModelName: "served/model"})
	tok := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: []string{fe.URL()}, Model: "served/model", APIKey: "sk-tok"})

	turns := []frontend.ChatTurn{
		{Role: "system", Content: "You are terse."}, {Role: "user", Content: "Hello, world!"},
		{Role: "assistant", Content: "Hi."}, {Role: "user", Content: "What is 2+2? Answer in 3 words."},
	}
	msgs := make([]fakeengine.Message, len(turns))
	for i, m := range turns {
		msgs[i] = fakeengine.Message{Role: m.Role, Content: m.Content}
	}
	want := fakeengine.ChatTemplate(msgs, true, false, false)
	got, err := tok.ApplyChatTemplate(turns)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) || got[0] != fakeengine.TokenBOS || got[len(got)-1] != fakeengine.TokenAssistant {
		t.Errorf("ApplyChatTemplate = %v, want %v (TokenBOS ... TokenAssistant)", got, want)
	}

	// A client's chat body: its model, sampling fields and tools, content
	// parts. Only the rendering fields go to /tokenize.
	const messagesJSON = `[{"role":"system","content":"You are terse."},` +
		`{"role":"user","content":[{"type":"text","text":"Hello,"},{"type":"image_url","image_url":{"url":"http://x/y.png"}},{"type":"text","text":"world!"}]}]`
	const tools = `[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]`
	body := `{"model":"client-alias","messages":` + messagesJSON + `,"tools":` + tools + `,"max_tokens":5,"temperature":0,"stream":true}`
	got, err = tok.TokenizeChat(t.Context(), []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	partsMsgs := []fakeengine.Message{{Role: "system", Content: "You are terse."}, {Role: "user", Content: "Hello,\nworld!"}}
	if want := fakeengine.ChatTemplate(partsMsgs, true, false, false); !slices.Equal(got, want) {
		t.Errorf("TokenizeChat = %v, want %v", got, want)
	}
	engineBody := `{"model":"served/model","messages":` + messagesJSON + `,"tools":` + tools + `,"max_tokens":5}`
	if pre := prefilled(t, fe, "/v1/chat/completions", engineBody); !slices.Equal(got, pre) {
		t.Errorf("TokenizeChat = %v, but the engine prefilled %v", got, pre)
	}
	reqs := received(fe, "/tokenize")
	last := reqs[len(reqs)-1]
	var keys []string
	for k := range last.Body {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	if want := []string{"add_generation_prompt", "messages", "model", "tools"}; !slices.Equal(keys, want) {
		t.Errorf("/tokenize got fields %v, want %v", keys, want)
	}
	if last.Model != "served/model" || last.Body["add_generation_prompt"] != true {
		t.Errorf("/tokenize got model %q, add_generation_prompt %v; want served/model, true", last.Model, last.Body["add_generation_prompt"])
	}
	for _, r := range reqs {
		if r.Header.Get("Authorization") != "Bearer sk-tok" {
			t.Errorf("/tokenize got Authorization %q", r.Header.Get("Authorization"))
		}
	}

	// The template arguments the client gives are the engine's to apply.
	got, err = tok.TokenizeChat(t.Context(), []byte(`{"messages":[{"role":"user","content":"Say"},{"role":"assistant","content":"Well,"}],`+
		`"add_generation_prompt":false,"continue_final_message":true}`))
	if err != nil {
		t.Fatal(err)
	}
	cont := []fakeengine.Message{{Role: "user", Content: "Say"}, {Role: "assistant", Content: "Well,"}}
	if want := fakeengine.ChatTemplate(cont, false, true, false); !slices.Equal(got, want) {
		t.Errorf("TokenizeChat (continue_final_message) = %v, want %v", got, want)
	}

	const text = "The quick brown fox, 42 times: über-fast!"
	got, err = tok.Encode(text)
	if err != nil {
		t.Fatal(err)
	}
	if want := fakeengine.Tokenize(text, true); !slices.Equal(got, want) || got[0] != fakeengine.TokenBOS {
		t.Errorf("Encode = %v, want %v (TokenBOS first)", got, want)
	}
	if pre := prefilled(t, fe, "/v1/completions", `{"prompt":"`+text+`","max_tokens":2}`); !slices.Equal(got, pre) {
		t.Errorf("Encode = %v, but the engine prefilled %v", got, pre)
	}
}

// TestEngineTokenizerFailover proves that an engine that cannot tokenize
// (refusing connections, answering 503, 404 as an engine without
// /tokenize or without the model, or 401) does not stop tokenization: the
// next engine answers, and then is asked first.
func TestEngineTokenizerFailover(t *testing.T) {
	t.Parallel()
	status := func(code int) func(t *testing.T, hits *atomic.Int32) string {
		return func(t *testing.T, hits *atomic.Int32) string {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				hits.Add(1)
				w.WriteHeader(code)
				_, _ = w.Write([]byte(`{"error":{"message":"not here","code":` + strconv.Itoa(code) + `}}`))
			}))
			t.Cleanup(srv.Close)
			return srv.URL
		}
	}
	tests := []struct {
		name     string
		first    func(t *testing.T, hits *atomic.Int32) string // the failing engine's URL
		wantHits int32                                         // requests the failing engine counts
	}{
		{"connection refused", func(*testing.T, *atomic.Int32) string { return closedURL() }, 0},
		{"503", status(http.StatusServiceUnavailable), 1},
		{"500", status(http.StatusInternalServerError), 1},
		{"404 no /tokenize", status(http.StatusNotFound), 1},
		{"401", status(http.StatusUnauthorized), 1},
		{"404 model not served", func(t *testing.T, _ *atomic.Int32) string {
			return startFakeEngine(t, fakeengine.Config{ModelName: "another/model"}).URL()
		}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var hits atomic.Int32
			bad := tt.first(t, &hits)
			fe := startFakeEngine(t, fakeengine.Config{ModelName: "served/model"})
			tok := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: []string{bad, fe.URL()}, Model: "served/model"})
			for i, text := range []string{"first call", "second call"} {
				got, err := tok.Encode(text)
				if err != nil {
					t.Fatalf("call %d: %v", i+1, err)
				}
				if want := fakeengine.Tokenize(text, true); !slices.Equal(got, want) {
					t.Errorf("call %d: Encode = %v, want %v", i+1, got, want)
				}
			}
			if n := len(received(fe, "/tokenize")); n != 2 {
				t.Errorf("the working engine got %d /tokenize requests, want 2", n)
			}
			if n := hits.Load(); n != tt.wantHits {
				t.Errorf("the failing engine counted %d requests, want %d: after the failover the engine that answered is asked first", n, tt.wantHits)
			}
		})
	}
}

// TestEngineTokenizerAllDown proves that when no engine can tokenize the
// error wraps ErrTokenizerUnavailable (the request gets a 503) and names
// every engine tried.
func TestEngineTokenizerAllDown(t *testing.T) {
	t.Parallel()
	urls := []string{closedURL(), closedURL()}
	tok := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: urls})
	_, errEncode := tok.Encode("hello")
	_, errChat := tok.TokenizeChat(t.Context(), []byte(`{"messages":[{"role":"user","content":"hi"}]}`))
	_, errTemplate := tok.ApplyChatTemplate([]frontend.ChatTurn{{Role: "user", Content: "hi"}})
	for name, err := range map[string]error{"Encode": errEncode, "TokenizeChat": errChat, "ApplyChatTemplate": errTemplate} {
		if !errors.Is(err, frontend.ErrTokenizerUnavailable) {
			t.Errorf("%s: %v, want ErrTokenizerUnavailable", name, err)
			continue
		}
		for _, u := range urls {
			if !strings.Contains(err.Error(), u) {
				t.Errorf("%s: %q does not name %s", name, err, u)
			}
		}
	}
}

// TestEngineTokenizerRejects proves that an engine refusing the request
// itself (a 400) is a *TokenizeError with the engine's status and message
// (the client gets a 400), not an unavailable tokenizer, and is not asked
// of the next engine; and that a body that is not a JSON object is refused
// without asking any.
func TestEngineTokenizerRejects(t *testing.T) {
	t.Parallel()
	fe1 := startFakeEngine(t, fakeengine.Config{})
	fe2 := startFakeEngine(t, fakeengine.Config{})
	tok := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: []string{fe1.URL(), fe2.URL()}})
	_, err := tok.TokenizeChat(t.Context(), []byte(`{"messages":[{"role":"user","content":"hi"}],`+
		`"add_generation_prompt":true,"continue_final_message":true}`))
	var te *frontend.TokenizeError
	if !errors.As(err, &te) || te.Status != http.StatusBadRequest ||
		te.Message != "Cannot set both `continue_final_message` and `add_generation_prompt` to True." {
		t.Fatalf("TokenizeChat: %#v, want *TokenizeError{400, the engine's message}", err)
	}
	if errors.Is(err, frontend.ErrTokenizerUnavailable) {
		t.Errorf("%v wraps ErrTokenizerUnavailable: the client's error would be a 503", err)
	}
	if n1, n2 := len(received(fe1, "/tokenize")), len(received(fe2, "/tokenize")); n1 != 1 || n2 != 0 {
		t.Errorf("engines got %d and %d /tokenize requests, want 1 and 0", n1, n2)
	}

	for _, body := range []string{`[]`, `"hi"`, `{"messages":`, ``} {
		_, err := tok.TokenizeChat(t.Context(), []byte(body))
		if !errors.As(err, &te) || te.Status != http.StatusBadRequest {
			t.Errorf("TokenizeChat(%q): %v, want a 400 *TokenizeError", body, err)
		}
	}
	if n := len(received(fe1, "/tokenize")) + len(received(fe2, "/tokenize")); n != 1 {
		t.Errorf("bodies that are not objects reached the engines (%d /tokenize requests in all, want 1)", n)
	}
}

// TestNewEngineTokenizerValidates proves a missing or malformed
// --tokenizer-url is a configuration error naming the flag.
func TestNewEngineTokenizerValidates(t *testing.T) {
	t.Parallel()
	for _, urls := range [][]string{nil, {"localhost:8000"}, {"ftp://h:1"}, {"http://"}, {"http://ok:1", "http://[::1"}} {
		_, err := frontend.NewEngineTokenizer(frontend.EngineTokenizerConfig{URLs: urls})
		if !errors.Is(err, frontend.ErrConfig) || !strings.Contains(err.Error(), "--tokenizer-url") {
			t.Errorf("URLs %q: %v, want ErrConfig naming --tokenizer-url", urls, err)
		}
	}
}

// TestEngineTokenizerConfigValidate: a config with URLs and a zero
// (default) or positive Timeout passes; no URL, a URL that is not
// http(s)://HOST[:PORT], or a negative Timeout is refused wrapping
// ErrConfig and naming the flag, and NewEngineTokenizer refuses it too.
func TestEngineTokenizerConfigValidate(t *testing.T) {
	t.Parallel()
	ok := []string{"http://127.0.0.1:19000"}
	for _, tc := range []struct {
		name string
		cfg  frontend.EngineTokenizerConfig
		want string // "" for valid
	}{
		{"default timeout", frontend.EngineTokenizerConfig{URLs: ok}, ""},
		{"every field", frontend.EngineTokenizerConfig{URLs: []string{"https://e1:8000/", "http://e2"}, Model: "m", APIKey: "k", Timeout: time.Second}, ""},
		{"zero", frontend.EngineTokenizerConfig{}, "--tokenizer-url"},
		{"no scheme", frontend.EngineTokenizerConfig{URLs: []string{"localhost:8000"}}, "--tokenizer-url"},
		{"ftp", frontend.EngineTokenizerConfig{URLs: []string{"ftp://h:1"}}, "--tokenizer-url"},
		{"no host", frontend.EngineTokenizerConfig{URLs: []string{"http://"}}, "--tokenizer-url"},
		{"second unparsable", frontend.EngineTokenizerConfig{URLs: []string{"http://ok:1", "http://[::1"}}, "--tokenizer-url"},
		{"negative timeout", frontend.EngineTokenizerConfig{URLs: ok, Timeout: -time.Second}, "--tokenizer-timeout"},
	} {
		err := tc.cfg.Validate()
		if !validatetest.Refused(t, tc.name, err, frontend.ErrConfig, tc.want) {
			continue
		}
		_, nerr := frontend.NewEngineTokenizer(tc.cfg)
		validatetest.SameError(t, tc.name, "NewEngineTokenizer", nerr, err)
	}
}

// TestEngineTokenizerHungEngine proves that an engine that accepts
// /tokenize but never answers (a stopped process) costs one attempt of
// Timeout, not the request: the next engine answers within the same call,
// and an engine that timed out is asked after the others for a while, so
// requests do not each wait for it again. It failed before: one timeout
// covered every engine, so the hung first engine ate it and the call
// failed with ErrTokenizerUnavailable though the next engine was healthy.
func TestEngineTokenizerHungEngine(t *testing.T) {
	t.Parallel()
	var hungHits atomic.Int32
	release := make(chan struct{})
	hung := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hungHits.Add(1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(hung.Close)
	t.Cleanup(func() { close(release) })
	// Engines A and B answer /tokenize, or 503 when told to.
	toggled := func(fe *fakeengine.Engine, down *atomic.Bool) string {
		u, err := url.Parse(fe.URL())
		if err != nil {
			t.Fatal(err)
		}
		proxy := httputil.NewSingleHostReverseProxy(u)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if down.Load() {
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			proxy.ServeHTTP(w, r)
		}))
		t.Cleanup(srv.Close)
		return srv.URL
	}
	var downA, downB atomic.Bool
	a := toggled(startFakeEngine(t, fakeengine.Config{}), &downA)
	b := toggled(startFakeEngine(t, fakeengine.Config{}), &downB)
	const timeout = 300 * time.Millisecond
	tok := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: []string{hung.URL, a, b}, Timeout: timeout})
	encode := func(step string) time.Duration {
		t.Helper()
		start := time.Now()
		got, err := tok.Encode(step)
		took := time.Since(start)
		if err != nil {
			t.Fatalf("%s: %v after %s", step, err, took)
		}
		if want := fakeengine.Tokenize(step, true); !slices.Equal(got, want) {
			t.Fatalf("%s: Encode = %v, want %v", step, got, want)
		}
		return took
	}
	if took := encode("the hung engine first"); took < timeout {
		t.Errorf("the first call took %s, less than the attempt timeout %s: was the hung engine asked?", took, timeout)
	}
	downA.Store(true)
	encode("engine A fails") // asked A (it answered last), then B
	downB.Store(true)
	downA.Store(false)
	// From B, round the list, the hung engine would come next: it timed
	// out a moment ago, so A is asked first.
	if took := encode("engine B fails"); took >= timeout {
		t.Errorf("the call took %s: it waited for the engine that timed out a moment ago", took)
	}
	if n := hungHits.Load(); n != 1 {
		t.Errorf("the hung engine got %d /tokenize requests, want 1", n)
	}
}

// passthroughCompletions starts a fake engine and a passthrough frontend
// that tokenizes with it, whose bus requests come on got, each answered
// with a completion "ok".
func passthroughCompletions(t *testing.T) (engine *fakeengine.Engine, fe *standalone, got chan *messages.Request) {
	t.Helper()
	engine = startFakeEngine(t, fakeengine.Config{ModelName: "kvbus-sim"})
	tok := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: []string{engine.URL()}})
	fe = startFrontend(t, func(c *frontend.Config) { c.Passthrough, c.Tokenizer = true, tok })
	got = make(chan *messages.Request, 4)
	answering(t, fe, func(req *messages.Request) []*messages.Output {
		got <- req
		return []*messages.Output{{Index: 0, Text: "ok", FinishReason: "stop",
			Raw: []byte(`{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}`)}}
	})
	return engine, fe, got
}

// TestEngineTokenizerCompletionSpecialTokens proves a completion's prompt
// is tokenized with the body's add_special_tokens, as the engine's
// /v1/completions tokenizes it: with false (a prompt the client rendered
// with its own template and BOS) the bus request's tokens are the engine's
// own, without a BOS, so kvbus's block hashes match the engine's cache;
// without the field they start with the BOS, as before. It failed before:
// /tokenize was always asked with add_special_tokens true, and every such
// prompt was one BOS longer than the engine's, no block of it matching.
func TestEngineTokenizerCompletionSpecialTokens(t *testing.T) {
	engine, fe, got := passthroughCompletions(t)
	for _, extra := range []string{`,"add_special_tokens":false`, ``, `,"add_special_tokens":true`} {
		body := `{"model":"kvbus-sim","prompt":"a prompt the client rendered itself","max_tokens":4` + extra + `}`
		status, _, resp := testenv.Send(t, http.MethodPost, fe.url+"/v1/completions", body, nil)
		if status != http.StatusOK {
			t.Fatalf("%s: %d %s", body, status, resp)
		}
		req := <-got
		if want := prefilled(t, engine, "/v1/completions", body); !slices.Equal(req.PromptTokenIDs, want) {
			t.Errorf("%s: bus prompt tokens %v; the engine prefills %v", body, req.PromptTokenIDs, want)
		}
	}
}

// TestEngineTokenizerPromptListAsksOnce proves a completion's prompt list
// sent to an engine (passthrough, which answers the whole list and is
// placed by its first prompt) costs one /tokenize call, for the prompt the
// bus request carries. It failed before: every prompt of the list was
// tokenized, one round trip to the engine after the other, before the
// request was sent, and the tokens of all but the first were thrown away:
// a list of 64 prompts waited for 64 calls.
func TestEngineTokenizerPromptListAsksOnce(t *testing.T) {
	engine, fe, got := passthroughCompletions(t)
	prompts := make([]string, 64)
	for i := range prompts {
		prompts[i] = strconv.Quote("prompt number " + strconv.Itoa(i))
	}
	body := `{"model":"kvbus-sim","max_tokens":4,"prompt":[` + strings.Join(prompts, ",") + `]}`
	status, _, resp := testenv.Send(t, http.MethodPost, fe.url+"/v1/completions", body, nil)
	if status != http.StatusOK {
		t.Fatalf("%d %s", status, resp)
	}
	req := <-got
	if want := fakeengine.Tokenize("prompt number 0", true); !slices.Equal(req.PromptTokenIDs, want) {
		t.Errorf("bus prompt tokens %v; want the first prompt's %v", req.PromptTokenIDs, want)
	}
	if n := len(received(engine, "/tokenize")); n != 1 {
		t.Errorf("the engine was asked /tokenize %d times for a list of %d prompts; want 1", n, len(prompts))
	}
}

// TestLoRAAdapterNameAboveTheBusLimitIsA400: an adapter the engines list
// whose name is longer than a Request's lora_name may be (a scheduler
// refuses such a Request and the client waited for its deadline) is a 400
// naming the limit, and nothing goes on the bus. It was published.
func TestLoRAAdapterNameAboveTheBusLimitIsA400(t *testing.T) {
	long := strings.Repeat("a", messages.MaxLoRANameBytes+1)
	engine := startFakeEngine(t, fakeengine.Config{ModelName: "kvbus-sim", LoRAModules: []string{"short", long}})
	tok := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: []string{engine.URL()}})
	fe := startFrontend(t, func(c *frontend.Config) { c.Passthrough, c.Tokenizer = true, tok })
	got := make(chan *messages.Request, 4)
	answering(t, fe, func(req *messages.Request) []*messages.Output {
		got <- req
		return []*messages.Output{{Index: 0, Text: "ok", FinishReason: "stop",
			Raw: []byte(`{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}`)}}
	})
	send := func(model string) (int, []byte) {
		status, _, resp := testenv.Send(t, http.MethodPost, fe.url+"/v1/completions", `{"model":"`+model+`","prompt":"hi","max_tokens":1}`, nil)
		return status, resp
	}
	if status, resp := send("short"); status != http.StatusOK {
		t.Fatalf("adapter short: %d %s", status, resp)
	}
	if req := <-got; req.LoRAName != "short" {
		t.Fatalf("lora_name %q; want short", req.LoRAName)
	}
	status, resp := send(long)
	if status != http.StatusBadRequest || !strings.Contains(string(resp), `"param":"model"`) || !strings.Contains(string(resp), strconv.Itoa(messages.MaxLoRANameBytes)) {
		t.Fatalf("adapter of %d bytes: %d %.300s; want a 400 naming the limit", len(long), status, resp)
	}
	select {
	case req := <-got:
		t.Fatalf("a request with a lora_name of %d bytes went on the bus", len(req.LoRAName))
	case <-time.After(100 * time.Millisecond):
	}
}
