package workers

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/kvbus/kvbus/messages"
)

// --- clientBody and traceBody -------------------------------------------

// decodeFields decodes a JSON object into its fields, failing the test if
// it is not one.
func decodeFields(t testing.TB, b []byte) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil || m == nil {
		t.Fatalf("not a JSON object (%v): %s", err, b)
	}
	return m
}

// sameValue is the form a JSON value takes once json.Marshal has relayed it
// as a json.RawMessage: compacted, with <, > and & (and U+2028, U+2029)
// escaped inside strings. The value is the same JSON value, with the same
// number literals and the same key order.
func sameValue(raw []byte) []byte {
	var c, h bytes.Buffer
	if err := json.Compact(&c, raw); err != nil {
		return nil
	}
	json.HTMLEscape(&h, c.Bytes())
	return h.Bytes()
}

// checkOthers asserts that every field of in but those named in changed
// is in out with the same JSON value, byte for byte once compacted: no
// number is re-encoded, no key of a nested object reordered.
func checkOthers(t testing.TB, in, out []byte, changed ...string) {
	t.Helper()
	fin, fout := decodeFields(t, in), decodeFields(t, out)
	for k, v := range fin {
		if slices.Contains(changed, k) {
			continue
		}
		got, ok := fout[k]
		if !ok {
			t.Errorf("field %q was dropped (in: %s)", k, v)
			continue
		}
		if want := sameValue(v); !bytes.Equal(got, want) {
			t.Errorf("field %q = %s, want %s", k, got, want)
		}
	}
	for k := range fout {
		if _, ok := fin[k]; !ok && !slices.Contains(changed, k) {
			t.Errorf("field %q was added: %s", k, fout[k])
		}
	}
}

// clientBodyBase carries fields kvbus must not touch: big integers and
// number literals a float64 round trip would change, a nested object whose
// keys are not sorted, HTML characters, tools and a vllm_xargs with keys of
// its own beside a client session id.
const clientBodyBase = `{"model":"client-model",
	"messages":[{"role":"user","content":"a<b & c \u00e9"},{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/y.png"}}]}],
	"seed":18446744073709551615, "temperature":0.50, "weird":{"z":1,"a":[1e400,2.50,-0.0]},
	"logit_bias":{"50256":-100}, "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],
	"tool_choice":"auto", "n":2,
	"vllm_xargs":{"session_id":"from-client","priority":3,"x":{"y":null}}%s}`

// TestClientBody proves what clientBody sends the engine: the resolved
// session id in vllm_xargs.session_id (replacing the client's, keeping its
// other keys, dropping an empty vllm_xargs), the --engine-model override,
// stream_options.include_usage=true on streams while wantUsage keeps what
// the client asked (vLLM's semantics), and every other field unchanged.
func TestClientBody(t *testing.T) {
	t.Parallel()
	base := func(extra string) string { return fmt.Sprintf(clientBodyBase, extra) }
	tests := []struct {
		name      string
		body      string
		session   string
		model     string
		busModel  string            // kvbus's model, the request's on the bus
		wantModel string            // "" when the model field is unchanged
		wantXargs map[string]string // nil: no vllm_xargs field; values are JSON
		stream    bool
		wantUsage bool
		wantOpts  map[string]string // stream_options sent (values are JSON), nil when none
	}{
		{name: "session replaces the client's, other xargs kept",
			body: base(""), session: "s-1",
			wantXargs: map[string]string{"session_id": `"s-1"`, "priority": "3", "x": `{"y":null}`}},
		{name: "no session removes the client's session_id, other xargs kept",
			body:      base(""),
			wantXargs: map[string]string{"priority": "3", "x": `{"y":null}`}},
		{name: "no session and only a session_id: vllm_xargs dropped",
			body: `{"prompt":"p","vllm_xargs":{"session_id":"c"}}`},
		{name: "no session, empty vllm_xargs dropped",
			body: `{"prompt":"p","vllm_xargs":{}}`},
		{name: "null vllm_xargs, no session: dropped",
			body: `{"prompt":"p","vllm_xargs":null}`},
		{name: "null vllm_xargs with a session",
			body: `{"prompt":"p","vllm_xargs":null}`, session: "s",
			wantXargs: map[string]string{"session_id": `"s"`}},
		{name: "no vllm_xargs with a session: added",
			body: `{"prompt":"p"}`, session: "s \"quoted\" é",
			wantXargs: map[string]string{"session_id": `"s \"quoted\" é"`}},
		{name: "model override",
			body: base(""), session: "s", model: "served/model", wantModel: `"served/model"`,
			wantXargs: map[string]string{"session_id": `"s"`, "priority": "3", "x": `{"y":null}`}},
		{name: "model override without a client model",
			body: `{"prompt":"p"}`, model: "served", wantModel: `"served"`},
		{name: "model override of kvbus's model",
			body: `{"prompt":"p","model":"kvbus-model"}`, model: "served", busModel: "kvbus-model", wantModel: `"served"`},
		{name: "no model override of a model the engine lists (a LoRA adapter)",
			body: `{"prompt":"p","model":"sql-lora"}`, model: "served", busModel: "kvbus-model"},
		{name: "stream false: no stream_options added",
			body: `{"prompt":"p","stream":false}`},
		{name: "stream without stream_options: usage asked of the engine, not wanted by the client",
			body: `{"prompt":"p","stream":true}`, stream: true, wantUsage: false,
			wantOpts: map[string]string{"include_usage": "true"}},
		{name: "stream_options null is no stream_options",
			body: `{"prompt":"p","stream":true,"stream_options":null}`, stream: true, wantUsage: false,
			wantOpts: map[string]string{"include_usage": "true"}},
		{name: "stream_options {}: vLLM's include_usage default is true",
			body: `{"prompt":"p","stream":true,"stream_options":{}}`, stream: true, wantUsage: true,
			wantOpts: map[string]string{"include_usage": "true"}},
		{name: "include_usage true",
			body: `{"prompt":"p","stream":true,"stream_options":{"include_usage":true}}`, stream: true, wantUsage: true,
			wantOpts: map[string]string{"include_usage": "true"}},
		{name: "include_usage false: not wanted, still asked of the engine, other options kept",
			body:   `{"prompt":"p","stream":true,"stream_options":{"include_usage":false,"other":1}}`,
			stream: true, wantUsage: false,
			wantOpts: map[string]string{"include_usage": "true", "other": "1"}},
		{name: "continuous_usage_stats without include_usage: dropped, or usage would ride on every chunk",
			body:   `{"prompt":"p","stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":true}}`,
			stream: true, wantUsage: false,
			wantOpts: map[string]string{"include_usage": "true"}},
		{name: "continuous_usage_stats with include_usage: kept",
			body:   `{"prompt":"p","stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`,
			stream: true, wantUsage: true,
			wantOpts: map[string]string{"include_usage": "true", "continuous_usage_stats": "true"}},
		{name: "include_usage null: vLLM reads None as false",
			body: `{"prompt":"p","stream":true,"stream_options":{"include_usage":null}}`, stream: true, wantUsage: false,
			wantOpts: map[string]string{"include_usage": "true"}},
		{name: "streamed chat with everything",
			body: base(`,"stream":true,"stream_options":{"include_usage":true}`), session: "s", model: "m2", wantModel: `"m2"`,
			stream: true, wantUsage: true,
			wantXargs: map[string]string{"session_id": `"s"`, "priority": "3", "x": `{"y":null}`},
			wantOpts:  map[string]string{"include_usage": "true"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			out, stream, wantUsage, err := clientBody(EngineRequest{SessionID: tt.session, Model: tt.busModel, Body: []byte(tt.body)}, tt.model)
			if err != nil {
				t.Fatalf("clientBody: %v", err)
			}
			if stream != tt.stream || wantUsage != tt.wantUsage {
				t.Errorf("stream, wantUsage = %v, %v; want %v, %v", stream, wantUsage, tt.stream, tt.wantUsage)
			}
			f := decodeFields(t, out)
			changed := []string{"vllm_xargs", "stream_options"}
			if tt.wantModel != "" {
				changed = append(changed, "model")
				if got := string(f["model"]); got != tt.wantModel {
					t.Errorf("model = %s, want %s", got, tt.wantModel)
				}
			}
			checkOthers(t, []byte(tt.body), out, changed...)
			checkObject(t, "vllm_xargs", f, tt.wantXargs)
			if tt.wantOpts != nil || tt.stream {
				checkObject(t, "stream_options", f, tt.wantOpts)
			} else if got, want := f["stream_options"], decodeFields(t, []byte(tt.body))["stream_options"]; !bytes.Equal(got, sameValue(want)) {
				t.Errorf("stream_options = %s, want it untouched (%s)", got, want)
			}
		})
	}
}

// checkObject asserts that field k of f is the object want (values as
// JSON), or absent when want is nil.
func checkObject(t *testing.T, k string, f map[string]json.RawMessage, want map[string]string) {
	t.Helper()
	raw, ok := f[k]
	if want == nil {
		if ok {
			t.Errorf("%s = %s, want no such field", k, raw)
		}
		return
	}
	if !ok {
		t.Fatalf("no %s field, want %v", k, want)
	}
	got := map[string]string{}
	for kk, v := range decodeFields(t, raw) {
		got[kk] = string(v)
	}
	if !equalMaps(got, want) {
		t.Errorf("%s = %v, want %v", k, got, want)
	}
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// TestClientBodyErrors proves that a body kvbus cannot edit safely is an
// error, not a request sent with a guess.
func TestClientBodyErrors(t *testing.T) {
	t.Parallel()
	for _, body := range []string{
		``, `null`, `[]`, `[{"prompt":"p"}]`, `"a string"`, `7`, `true`, `{"prompt":`, `{"prompt":"p"} x`,
		`{"prompt":"p","vllm_xargs":"session_id=a"}`,
		`{"prompt":"p","vllm_xargs":[{"session_id":"a"}]}`,
		`{"prompt":"p","stream":true,"stream_options":[]}`,
		`{"prompt":"p","stream":true,"stream_options":"include_usage"}`,
	} {
		out, _, _, err := clientBody(EngineRequest{SessionID: "s", Body: []byte(body)}, "m")
		if err == nil {
			t.Errorf("clientBody(%s) = %s, want an error", body, out)
			continue
		}
		// The JSON error is wrapped (it was only formatted with %v), and
		// a body that is JSON but no object says so without a nil error.
		var syntax *json.SyntaxError
		var typ *json.UnmarshalTypeError
		if body != `null` && !errors.As(err, &syntax) && !errors.As(err, &typ) {
			t.Errorf("clientBody(%s) = %v, which does not wrap the JSON error", body, err)
		}
		if strings.Contains(err.Error(), "%!") || strings.Contains(err.Error(), "<nil>") {
			t.Errorf("clientBody(%s) = %q", body, err)
		}
	}
}

// TestTraceBody proves the /v1/completions body of a replayed trace (token
// ids, no client body): the prompt's ids, max_tokens (at least 1), the
// sampling fields (top_p 0 meaning 1), the session id replacing one in the
// extra args, kv_transfer_params, and a stream with usage.
func TestTraceBody(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		req   EngineRequest
		model string
		want  string // the body, as JSON
	}{
		{
			name: "every field",
			req: EngineRequest{
				PromptTokens: []uint32{1, 200000, 4294967295}, Model: "client-model", SessionID: "s-1",
				Params: messages.SamplingParams{MaxTokens: 7, MinTokens: 2, Temperature: 0.3, TopP: 0.9, Seed: seed(-5),
					Stop: []string{"\n", "END"}, IgnoreEOS: true, ExtraArgs: messages.Args{"session_id": "old", "priority": 2}},
				KVTransferParams: messages.Args{"do_remote_prefill": true, "remote_block_ids": []any{1, 2}},
			},
			want: `{"prompt":[1,200000,4294967295],"max_tokens":7,"min_tokens":2,"temperature":0.3,"top_p":0.9,"seed":-5,
				"stop":["\n","END"],"ignore_eos":true,"model":"client-model","stream":true,"stream_options":{"include_usage":true},
				"vllm_xargs":{"session_id":"s-1","priority":2},"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2]}}`,
		},
		{
			name:  "model override, no session drops the old one, defaults",
			req:   EngineRequest{PromptTokens: []uint32{5}, Model: "client-model", Params: messages.SamplingParams{ExtraArgs: messages.Args{"session_id": "old"}}},
			model: "served",
			want:  `{"prompt":[5],"max_tokens":1,"temperature":0,"top_p":1,"model":"served","stream":true,"stream_options":{"include_usage":true}}`,
		},
		{
			name: "no model at all, session without extra args",
			req:  EngineRequest{PromptTokens: []uint32{5, 6}, SessionID: "s", Params: messages.SamplingParams{MaxTokens: 3, Temperature: 1, TopP: 1}},
			want: `{"prompt":[5,6],"max_tokens":3,"temperature":1,"top_p":1,"stream":true,"stream_options":{"include_usage":true},
				"vllm_xargs":{"session_id":"s"}}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := traceBody(tt.req, tt.model)
			if err != nil {
				t.Fatal(err)
			}
			if g, w := jsonValue(t, got), jsonValue(t, []byte(tt.want)); !equalJSON(g, w) {
				t.Errorf("traceBody =\n%s\nwant\n%s", got, tt.want)
			}
		})
	}
	// A trace's body goes to /v1/completions, streamed, also when the
	// request came through the chat endpoint: there are only token ids,
	// which vLLM's chat endpoint does not take.
	for _, endpoint := range []string{messages.EndpointChat, messages.EndpointCompletions, ""} {
		call, err := newEngineCall(EngineRequest{PromptTokens: []uint32{1}, Endpoint: endpoint}, "")
		if err != nil {
			t.Fatal(err)
		}
		if call.path != "/v1/completions" || !call.stream {
			t.Errorf("trace call of endpoint %q: path %s, stream %v; want /v1/completions, streamed", endpoint, call.path, call.stream)
		}
	}
}

func jsonValue(t *testing.T, b []byte) any {
	t.Helper()
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		t.Fatalf("not JSON (%v): %s", err, b)
	}
	return v
}

func equalJSON(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y)
}

// --- Generate against model servers on loopback ---------------------------

// stubRequest is a POST a stubEngine received.
type stubRequest struct {
	Path   string
	Header http.Header
	Body   []byte
}

// stubEngine is a model server on loopback whose POST answers are the
// test's: GET /health answers health (200 until set), every POST goes to
// the handler with its 1-based number. It records what it receives.
type stubEngine struct {
	URL    string
	health atomic.Int32

	mu         sync.Mutex
	posts      []stubRequest
	healthHdrs []http.Header
}

func newStubEngine(t *testing.T, h func(w http.ResponseWriter, r *http.Request, n int)) *stubEngine {
	t.Helper()
	s := &stubEngine{}
	s.health.Store(http.StatusOK)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		if r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/health") {
			s.healthHdrs = append(s.healthHdrs, r.Header.Clone())
			s.mu.Unlock()
			w.WriteHeader(int(s.health.Load()))
			return
		}
		s.posts = append(s.posts, stubRequest{Path: r.URL.Path, Header: r.Header.Clone(), Body: body})
		n := len(s.posts)
		s.mu.Unlock()
		h(w, r, n)
	}))
	t.Cleanup(srv.Close)
	s.URL = srv.URL
	return s
}

func (s *stubEngine) requests() []stubRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.posts)
}

// newOpenAI returns an engine adapter for cfg whose idle connections close
// at cleanup. It is unhealthy, as before its first health check.
func newOpenAI(t *testing.T, cfg OpenAIConfig) *OpenAIEngine {
	t.Helper()
	e, err := NewOpenAIEngine(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.client.CloseIdleConnections)
	return e
}

// healthyOpenAI is newOpenAI after a passing health check.
func healthyOpenAI(t *testing.T, cfg OpenAIConfig) *OpenAIEngine {
	t.Helper()
	e := newOpenAI(t, cfg)
	e.setHealth(true, "")
	return e
}

// watchHealth runs e.WatchHealth until the test ends and returns the
// health seen by each call of changed.
func watchHealth(t *testing.T, e *OpenAIEngine) <-chan bool {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	seen := make(chan bool, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.WatchHealth(ctx, func() {
			ok, _ := e.Healthy()
			select {
			case seen <- ok:
			case <-ctx.Done():
			}
		})
	}()
	t.Cleanup(func() { cancel(); <-done })
	return seen
}

// awaitHealth reads calls of changed until one saw health ok.
func awaitHealth(t *testing.T, seen <-chan bool, ok bool) {
	t.Helper()
	var got []bool
	timeout := time.After(20 * time.Second)
	for {
		select {
		case h := <-seen:
			got = append(got, h)
			if h == ok {
				return
			}
		case <-timeout:
			t.Fatalf("changed never saw healthy=%v (saw %v)", ok, got)
		}
	}
}

// sse writes lines of an event stream, each followed by "\n", and flushes.
func sse(w http.ResponseWriter, lines ...string) {
	for _, l := range lines {
		_, _ = io.WriteString(w, l+"\n")
	}
	w.(http.Flusher).Flush()
}

// The chunks of streamAnswer, and its usage chunk.
const (
	streamChunk0     = `{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`
	streamChunk1     = `{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hel"},"logprobs":null,"finish_reason":null}]}`
	streamChunk2     = `{"id":"c", "object":"chat.completion.chunk", "choices":[{"index":0,"delta":{"content":"lo \u003c"},"finish_reason":"stop","stop_reason":null}]}`
	streamUsageChunk = `{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,"total_tokens":8,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}`
)

// streamChunks returns the chunks of streamAnswer but its usage chunk.
func streamChunks() []string { return []string{streamChunk0, streamChunk1, streamChunk2} }

// streamAnswer writes streamChunks and streamUsageChunk in the ways SSE
// allows: comments, event and id fields, "data:" without a space, CRLF
// line ends, trailing blanks.
func streamAnswer(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream")
	sse(w, ": ping", "", "data: "+streamChunk0, "")
	sse(w, "data:"+streamChunk1+"\r", "\r")
	sse(w, "event: message", "id: 3", "data: "+streamChunk2+"  ", "")
	sse(w, "data: "+streamUsageChunk, "", "data: [DONE]", "")
}

// TestOpenAIGenerateAnswer proves a non-streamed answer reaches emit as
// the engine wrote it, byte for byte, with the text of choice 0, and that
// the engine's usage (cached tokens included) and finish reason are
// returned; and what the engine receives: the path under the base URL's
// prefix, X-Request-Id, X-Session-ID, the API key and the session in the
// body.
func TestOpenAIGenerateAnswer(t *testing.T) {
	t.Parallel()
	const chatAnswer = `{"id":"chatcmpl-1", "object":"chat.completion","choices":[` +
		`{"index":1,"message":{"role":"assistant","content":"other"},"finish_reason":"length"},` +
		`{"index":0,"message":{"role":"assistant","content":"Paris \u00e9 <b>"},"logprobs":null,"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":40,"completion_tokens":9,"total_tokens":49,"prompt_tokens_details":{"cached_tokens":32}},` +
		`"kv_transfer_params":{"remote_block_ids":[1,2]}}` + "\n"
	const completionAnswer = `{"choices":[{"index":0,"text":" world","finish_reason":"length"}],` +
		`"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":null}}`
	tests := []struct {
		name, endpoint, path, answer string
		session, apiKey              string
		wantText, wantFinish         string
		wantUsage                    messages.Usage
	}{
		{"chat with session and key", messages.EndpointChat, "/prefix/v1/chat/completions", chatAnswer, "s-1", "sk-test",
			"Paris é <b>", "stop", messages.Usage{PromptTokens: 40, CompletionTokens: 9, CachedTokens: 32}},
		{"completion, no session, no key", messages.EndpointCompletions, "/prefix/v1/completions", completionAnswer, "", "",
			" world", "length", messages.Usage{PromptTokens: 3, CompletionTokens: 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {
				w.Header().Set("Content-Type", "application/json")
				_, _ = io.WriteString(w, tt.answer)
			})
			e := healthyOpenAI(t, OpenAIConfig{URL: stub.URL + "/prefix/", APIKey: tt.apiKey})
			body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"vllm_xargs":{"session_id":"client"}}`
			r := generate(t.Context(), e, EngineRequest{ReqID: "req-1", SessionID: tt.session, Endpoint: tt.endpoint, Body: []byte(body)})
			if r.err != nil {
				t.Fatal(r.err)
			}
			if len(r.chunks) != 1 || string(r.chunks[0].Raw) != tt.answer || r.chunks[0].Text != tt.wantText {
				t.Fatalf("chunks = %+v, want one with Raw = the answer and Text %q", r.chunks, tt.wantText)
			}
			if r.prefilled != 1 || !r.prefilledBeforeChunk {
				t.Errorf("prefilled called %d times (before the chunk: %v), want once before it", r.prefilled, r.prefilledBeforeChunk)
			}
			if r.res.Usage == nil || *r.res.Usage != tt.wantUsage || r.res.FinishReason != tt.wantFinish ||
				r.res.CompletionTokens != tt.wantUsage.CompletionTokens {
				t.Errorf("result = %+v (usage %+v), want usage %+v, finish %q", r.res, r.res.Usage, tt.wantUsage, tt.wantFinish)
			}
			reqs := stub.requests()
			if len(reqs) != 1 {
				t.Fatalf("engine got %d requests, want 1", len(reqs))
			}
			got := reqs[0]
			if got.Path != tt.path {
				t.Errorf("path %s, want %s", got.Path, tt.path)
			}
			wantHdr := map[string]string{"X-Request-Id": "req-1", "Content-Type": "application/json", "Accept": "",
				"X-Session-ID": tt.session, "Authorization": ""}
			if tt.apiKey != "" {
				wantHdr["Authorization"] = "Bearer " + tt.apiKey
			}
			for k, v := range wantHdr {
				if g := got.Header.Get(k); g != v {
					t.Errorf("header %s = %q, want %q", k, g, v)
				}
			}
			if _, ok := got.Header["X-Session-Id"]; ok && tt.session == "" {
				t.Error("X-Session-ID sent without a session")
			}
			var sent struct {
				VLLMXargs map[string]any `json:"vllm_xargs"`
			}
			if err := json.Unmarshal(got.Body, &sent); err != nil {
				t.Fatal(err)
			}
			if tt.session == "" && sent.VLLMXargs != nil || tt.session != "" && sent.VLLMXargs["session_id"] != tt.session {
				t.Errorf("engine got vllm_xargs %v, want session_id %q", sent.VLLMXargs, tt.session)
			}
		})
	}
}

// TestOpenAIGenerateWholeAnswerPrefilledWhenSent: a request that does not
// stream is prefilled, for the group's queue, once it is sent to the engine,
// not when the engine's whole answer arrives. A model server answers such a
// request only at its end and says nothing of its prefill, which takes a
// small part of that time; counted as queued prefill until the answer, every
// in-flight prompt made its group look busy for its whole generation, and
// the kv policy moved sessions off the engine holding their cache (on the
// real binaries, 3 of 8 next turns beside three non-streamed requests
// recomputed their 592 cached tokens on the other engine; 0 of 8 beside the
// same requests streamed). Once per request, retries included.
func TestOpenAIGenerateWholeAnswerPrefilledWhenSent(t *testing.T) {
	t.Parallel()
	const answer = `{"choices":[{"index":0,"text":" world","finish_reason":"length"}],` +
		`"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}`
	const generation = 600 * time.Millisecond
	stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {
		if n == 1 { // the first attempt's connection breaks: sent again
			if hj, ok := w.(http.Hijacker); ok {
				if c, _, err := hj.Hijack(); err == nil {
					_ = c.Close()
					return
				}
			}
		}
		time.Sleep(generation)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, answer)
	})
	e := healthyOpenAI(t, OpenAIConfig{URL: stub.URL})
	start := time.Now()
	var prefilledAt []time.Duration
	var chunkAt time.Duration
	_, err := e.Generate(t.Context(), EngineRequest{ReqID: "whole", Endpoint: messages.EndpointCompletions,
		Body: []byte(`{"model":"m","prompt":"hello"}`)},
		func() { prefilledAt = append(prefilledAt, time.Since(start)) },
		func(Chunk) error { chunkAt = time.Since(start); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if n := len(stub.requests()); n != 2 {
		t.Fatalf("the engine got %d requests, want 2 (the first connection broke)", n)
	}
	if len(prefilledAt) != 1 || prefilledAt[0] >= generation/2 || chunkAt < generation {
		t.Errorf("prefilled at %v, the answer at %v; want it once, when the request reached the engine (well before the %v the answer took)",
			prefilledAt, chunkAt, generation)
	}
}

// TestOpenAIGenerateStream proves a stream's chunks reach emit as the
// engine wrote them, one Chunk per data line, whatever the SSE framing;
// the usage chunk kvbus asks for reaches the client only if the client
// asked for it (vLLM's rules), while its usage is always returned; and a
// trace request (no client body) gets text only.
func TestOpenAIGenerateStream(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		body       string // "" for a trace request
		wantChunks []string
	}{
		{"no stream_options: usage chunk dropped", `{"messages":[],"stream":true}`, streamChunks()},
		{"include_usage true: usage chunk relayed", `{"messages":[],"stream":true,"stream_options":{"include_usage":true}}`,
			append(streamChunks(), streamUsageChunk)},
		{"stream_options {}: usage chunk relayed", `{"messages":[],"stream":true,"stream_options":{}}`,
			append(streamChunks(), streamUsageChunk)},
		{"include_usage false: usage chunk dropped", `{"messages":[],"stream":true,"stream_options":{"include_usage":false}}`, streamChunks()},
		{"trace request: text only", "", []string{"", "", ""}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) { streamAnswer(w) })
			e := healthyOpenAI(t, OpenAIConfig{URL: stub.URL})
			req := EngineRequest{ReqID: "r", SessionID: "s", Endpoint: messages.EndpointChat, Body: []byte(tt.body),
				PromptTokens: []uint32{7, 8, 9}, Params: messages.SamplingParams{MaxTokens: 4}}
			r := generate(t.Context(), e, req)
			if r.err != nil {
				t.Fatal(r.err)
			}
			var raws []string
			for _, c := range r.chunks {
				raws = append(raws, string(c.Raw))
			}
			if !slices.Equal(raws, tt.wantChunks) {
				t.Errorf("chunks relayed:\n%s\nwant\n%s", strings.Join(raws, "\n"), strings.Join(tt.wantChunks, "\n"))
			}
			if r.text != "Hello <" {
				t.Errorf("text %q, want %q", r.text, "Hello <")
			}
			if r.prefilled != 1 || !r.prefilledBeforeChunk {
				t.Errorf("prefilled called %d times (before the first chunk: %v), want once before it", r.prefilled, r.prefilledBeforeChunk)
			}
			want := messages.Usage{PromptTokens: 5, CompletionTokens: 3, CachedTokens: 4}
			if r.res.Usage == nil || *r.res.Usage != want || r.res.FinishReason != FinishStop || r.res.CompletionTokens != 3 {
				t.Errorf("result %+v (usage %+v), want usage %+v, finish stop", r.res, r.res.Usage, want)
			}
			got := stub.requests()[0]
			if got.Header.Get("Accept") != "text/event-stream" {
				t.Errorf("Accept = %q, want text/event-stream", got.Header.Get("Accept"))
			}
			var sent struct {
				Stream        bool            `json:"stream"`
				StreamOptions map[string]bool `json:"stream_options"`
				Prompt        []uint32        `json:"prompt"`
			}
			if err := json.Unmarshal(got.Body, &sent); err != nil {
				t.Fatal(err)
			}
			if !sent.Stream || !sent.StreamOptions["include_usage"] {
				t.Errorf("engine got stream %v, stream_options %v; want a stream with include_usage", sent.Stream, sent.StreamOptions)
			}
			if tt.body == "" && (got.Path != "/v1/completions" || !slices.Equal(sent.Prompt, req.PromptTokens)) {
				t.Errorf("trace request went to %s with prompt %v, want /v1/completions with %v", got.Path, sent.Prompt, req.PromptTokens)
			}
		})
	}
}

// TestOpenAIGenerateErrors proves how an engine's failures end a request
// that reached it: a 4xx is an *EngineError with the engine's status and
// body (the client's fault, not retried, the engine stays healthy); an
// error chunk in a started stream is an *EngineError with that chunk; a
// stream cut before [DONE] after output is an error that is not
// ErrEngineUnavailable (output was sent: no retry); and an error of emit
// ends the generation with that error.
func TestOpenAIGenerateErrors(t *testing.T) {
	t.Parallel()
	const badRequest = `{"error":{"message":"This model's maximum context length is 4096 tokens.","type":"BadRequestError","param":"input_tokens","code":400}}`
	const errChunk = `{"error":{"message":"EngineCore died","type":"InternalServerError","code":500}}`
	errEmit := errors.New("the client went away")
	tests := []struct {
		name       string
		handler    func(w http.ResponseWriter)
		emitErr    error
		wantStatus int    // of the *EngineError; 0 if none
		wantBody   string // of the *EngineError
		wantIs     error  // errors.Is(err, wantIs) when no *EngineError
		wantChunks int
	}{
		{name: "400", handler: func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, badRequest)
		}, wantStatus: 400, wantBody: badRequest},
		{name: "404 unknown model", handler: func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusNotFound)
			_, _ = io.WriteString(w, `{"error":{"message":"The model `+"`x`"+` does not exist.","type":"NotFoundError","code":404}}`)
		}, wantStatus: 404, wantBody: `{"error":{"message":"The model ` + "`x`" + ` does not exist.","type":"NotFoundError","code":404}}`},
		{name: "error chunk mid-stream", handler: func(w http.ResponseWriter) {
			sse(w, "data: "+streamChunk0, "", "data: "+streamChunk1, "")
			sse(w, "data: "+errChunk, "", "data: [DONE]", "")
		}, wantStatus: 500, wantBody: errChunk, wantChunks: 2},
		{name: "stream cut after output", handler: func(w http.ResponseWriter) {
			sse(w, "data: "+streamChunk0, "", "data: "+streamChunk1, "")
		}, wantIs: io.ErrUnexpectedEOF, wantChunks: 2},
		{name: "emit fails", handler: func(w http.ResponseWriter) { streamAnswer(w) }, emitErr: errEmit, wantIs: errEmit, wantChunks: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) { tt.handler(w) })
			e := healthyOpenAI(t, OpenAIConfig{URL: stub.URL})
			var chunks int
			_, err := e.Generate(t.Context(), EngineRequest{ReqID: "r", Endpoint: messages.EndpointChat, Body: []byte(`{"stream":true}`)},
				nil, func(Chunk) error { chunks++; return tt.emitErr })
			if err == nil {
				t.Fatal("no error")
			}
			if errors.Is(err, ErrEngineUnavailable) {
				t.Errorf("error %v is ErrEngineUnavailable: the request would be retried", err)
			}
			var ee *EngineError
			if tt.wantStatus != 0 {
				if !errors.As(err, &ee) || ee.Status != tt.wantStatus || string(ee.Body) != tt.wantBody {
					t.Fatalf("error %#v, want *EngineError{%d, %s}", err, tt.wantStatus, tt.wantBody)
				}
				var msg struct {
					Error struct{ Message string } `json:"error"`
				}
				_ = json.Unmarshal(ee.Body, &msg)
				if want := fmt.Sprintf("engine answered %d: %s", tt.wantStatus, msg.Error.Message); ee.Error() != want {
					t.Errorf("Error() = %q, want %q", ee.Error(), want)
				}
			} else if !errors.Is(err, tt.wantIs) || errors.As(err, &ee) {
				t.Errorf("error %v, want one wrapping %v", err, tt.wantIs)
			}
			if chunks != tt.wantChunks {
				t.Errorf("%d chunks emitted, want %d", chunks, tt.wantChunks)
			}
			if n := len(stub.requests()); n != 1 {
				t.Errorf("engine got %d requests, want 1 (no retry)", n)
			}
			if ok, why := e.Healthy(); !ok {
				t.Errorf("engine marked unhealthy (%s) by a request's own failure", why)
			}
		})
	}
}

// TestOpenAIGenerateRetriesWhenUnavailable proves that a request the
// engine could not take (a 5xx, a dropped connection, a stream that ends
// before any output) is sent again, the same, and the client gets only
// the second answer. When /health fails too the engine is down: it is
// marked unhealthy and the request waits for the next poll that passes;
// when /health passes, the engine's health does not move (a 5xx then is
// the request's own, relayed: TestOpenAIGenerate5xxOfAHealthyEngine).
func TestOpenAIGenerateRetriesWhenUnavailable(t *testing.T) {
	t.Parallel()
	const answer = `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`
	tests := []struct {
		name       string
		first      func(w http.ResponseWriter, r *http.Request)
		engineDown bool // /health fails from the first answer until the test sees the engine unhealthy
	}{
		{"503, engine down", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, `{"error":{"message":"overloaded","code":503}}`)
		}, true},
		{"500 dead engine core, engine down", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = io.WriteString(w, `{"error":{"message":"EngineCore encountered an issue.","type":"InternalServerError","code":500}}`)
		}, true},
		{"500 error event before any output, engine down", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			sse(w, `data: {"error":{"message":"EngineCore encountered an issue.","type":"InternalServerError","code":500}}`, "", "data: [DONE]", "")
		}, true},
		{"connection dropped, engine down", func(w http.ResponseWriter, r *http.Request) {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				_ = conn.Close()
			}
		}, true},
		{"connection dropped, /health passes", func(w http.ResponseWriter, r *http.Request) {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				_ = conn.Close()
			}
		}, false},
		{"stream ended before output, /health passes", func(w http.ResponseWriter, r *http.Request) {
			sse(w, ": ping", "")
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var stub *stubEngine
			stub = newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {
				if n == 1 {
					if tt.engineDown {
						stub.health.Store(http.StatusServiceUnavailable)
					}
					tt.first(w, r)
					return
				}
				sse(w, "data: "+answer, "", "data: [DONE]", "")
			})
			logs, log := newLogLines()
			e := newOpenAI(t, OpenAIConfig{URL: stub.URL, HealthInterval: 50 * time.Millisecond, UnavailableWait: time.Minute, Logger: log})
			seen := watchHealth(t, e)
			awaitHealth(t, seen, true)
			body := `{"prompt":"p","stream":true}`
			done := make(chan genRun, 1)
			go func() {
				done <- generate(t.Context(), e, EngineRequest{ReqID: "r", Endpoint: messages.EndpointCompletions, Body: []byte(body)})
			}()
			if tt.engineDown {
				// The request asked /health (and logged what it found) before
				// the engine recovers.
				deadline := time.Now().Add(20 * time.Second)
				for len(logs.Lines("engine did not take the request", "POST /v1/completions", "health=\"GET /health answered 503\"")) == 0 {
					if time.Now().After(deadline) {
						t.Fatal("the request never logged its failure with the engine's /health")
					}
					time.Sleep(5 * time.Millisecond)
				}
				if ok, _ := e.Healthy(); ok {
					t.Error("the engine is healthy while its /health fails")
				}
				awaitHealth(t, seen, false)
				stub.health.Store(http.StatusOK)
			}
			r := <-done
			if r.err != nil {
				t.Fatal(r.err)
			}
			if len(r.chunks) != 1 || string(r.chunks[0].Raw) != answer || r.prefilled != 1 {
				t.Errorf("chunks %+v (prefilled %d times), want only the second attempt's answer", r.chunks, r.prefilled)
			}
			reqs := stub.requests()
			if len(reqs) != 2 || !bytes.Equal(reqs[0].Body, reqs[1].Body) || reqs[0].Header.Get("X-Request-Id") != reqs[1].Header.Get("X-Request-Id") {
				t.Fatalf("engine got %d requests, want the same one twice", len(reqs))
			}
			if ok, why := e.Healthy(); !ok {
				t.Errorf("engine unhealthy after the retry: %s", why)
			}
			if !tt.engineDown {
				select {
				case h := <-seen:
					t.Errorf("health changed to %v while /health passed", h)
				default:
				}
			}
		})
	}
}

// TestOpenAIGenerateWaitsForUnreachableEngine proves that an engine that
// refuses connections, while it was thought healthy, is marked unhealthy
// by the request, which then waits for it (instead of failing at once: the
// scheduler moves it to another group) until its context ends, and
// returns the context's error. The wait is bounded by UnavailableWait
// (TestOpenAIGenerateGivesUpOnADeadEngine), an hour here.
func TestOpenAIGenerateWaitsForUnreachableEngine(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close() // nothing listens there now
	e := healthyOpenAI(t, OpenAIConfig{URL: url, UnavailableWait: time.Hour})
	e.mu.Lock()
	healthy := e.changed
	e.mu.Unlock()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	emitted := make(chan Chunk, 1)
	go func() {
		_, err := e.Generate(ctx, EngineRequest{ReqID: "r", Endpoint: messages.EndpointChat, Body: []byte(`{"messages":[]}`)},
			nil, func(c Chunk) error { emitted <- c; return nil })
		done <- err
	}()
	select {
	case <-healthy:
	case err := <-done:
		t.Fatalf("Generate returned %v before the engine was marked unhealthy", err)
	case <-time.After(20 * time.Second):
		t.Fatal("the refused connection never marked the engine unhealthy")
	}
	ok, why := e.Healthy()
	if ok || !strings.Contains(why, "/v1/chat/completions") {
		t.Errorf("Healthy() = %v, %q; want false, naming the failed POST", ok, why)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Generate = %v, want context.Canceled: it must wait for the engine, not fail", err)
	}
	if ok, _ := e.Healthy(); ok {
		t.Error("engine healthy after the refused request")
	}
	if len(emitted) != 0 {
		t.Error("a chunk was emitted")
	}
}

// slotWaiter matches, in a goroutine dump, a goroutine parked in a select
// of Generate itself: its wait for a concurrency slot (its other waits are
// in functions of their own; runtime frames are not shown).
var slotWaiter = regexp.MustCompile(`(?m)^goroutine \d+ \[select[^\]]*\]:\n[^\n]*workers\.\(\*OpenAIEngine\)\.Generate\(`)

// slotWaiters counts the goroutines waiting for a slot of an OpenAIEngine.
func slotWaiters() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return len(slotWaiter.FindAll(buf[:n], -1))
		}
		buf = make([]byte, 2*len(buf))
	}
}

// TestOpenAIMaxConcurrency proves that MaxConcurrency 1 holds a second
// request back, before it reaches the engine, while the first is in
// flight, and sends it when the first ends.
func TestOpenAIMaxConcurrency(t *testing.T) {
	t.Parallel()
	arrived := make(chan int, 2)
	release := make(chan struct{})
	var releaseOnce sync.Once
	stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {
		arrived <- n
		sse(w, "data: "+streamChunk1, "")
		if n == 1 {
			<-release // the first request is held mid-stream
		}
		sse(w, "data: [DONE]", "")
	})
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) }) // before the stub closes
	e := healthyOpenAI(t, OpenAIConfig{URL: stub.URL, MaxConcurrency: 1})
	run := func(id string, done chan<- error) {
		_, err := e.Generate(t.Context(), EngineRequest{ReqID: id, Endpoint: messages.EndpointChat, Body: []byte(`{"stream":true}`)},
			nil, func(Chunk) error { return nil })
		done <- err
	}
	done1, done2 := make(chan error, 1), make(chan error, 1)
	go run("first", done1)
	if n := <-arrived; n != 1 {
		t.Fatalf("request %d arrived first", n)
	}
	before := slotWaiters()
	go run("second", done2)
	// Wait until the second request is parked waiting for the slot.
	deadline := time.Now().Add(20 * time.Second)
	for slotWaiters() <= before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("the second request never waited for a slot:\n%s", buf[:runtime.Stack(buf, true)])
		}
		select {
		case n := <-arrived:
			t.Fatalf("request %d reached the engine while the first was in flight", n)
		case err := <-done2:
			t.Fatalf("the second request ended (%v) while the first was in flight", err)
		case <-time.After(time.Millisecond):
		}
	}
	if got := stub.requests(); len(got) != 1 {
		t.Fatalf("engine got %d requests while the first was held, want 1", len(got))
	}
	releaseOnce.Do(func() { close(release) })
	if err := <-done1; err != nil {
		t.Fatal(err)
	}
	if n := <-arrived; n != 2 {
		t.Fatalf("request %d arrived second", n)
	}
	if err := <-done2; err != nil {
		t.Fatal(err)
	}
	reqs := stub.requests()
	if len(reqs) != 2 || reqs[0].Header.Get("X-Request-Id") != "first" || reqs[1].Header.Get("X-Request-Id") != "second" {
		t.Errorf("engine got %d requests, want first then second", len(reqs))
	}
}

// TestOpenAIWatchHealth proves that WatchHealth keeps the engine
// unhealthy while GET /health answers 503, makes it healthy when it
// answers 200 and unhealthy again, with the status as reason, when it
// answers 503, calling changed after each change; that /health carries
// the API key; and that it returns when its context ends (cleanup waits
// for it).
func TestOpenAIWatchHealth(t *testing.T) {
	t.Parallel()
	stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {})
	stub.health.Store(http.StatusServiceUnavailable)
	// A poll times out after the interval: long enough for a loaded machine.
	e := newOpenAI(t, OpenAIConfig{URL: stub.URL, APIKey: "sk-h", HealthInterval: 50 * time.Millisecond})
	if ok, why := e.Healthy(); ok || why == "" {
		t.Fatalf("new engine: Healthy() = %v, %q; want false until checked", ok, why)
	}
	seen := watchHealth(t, e)
	// why is updated on every poll: wait for a poll's 503 (no change).
	waitReason := func(want string) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for {
			ok, why := e.Healthy()
			if !ok && strings.Contains(why, want) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("Healthy() = %v, %q; want false naming %s", ok, why, want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitReason("answered 503")
	stub.health.Store(http.StatusOK)
	awaitHealth(t, seen, true)
	if ok, why := e.Healthy(); !ok || why != "" {
		t.Errorf("after 200: Healthy() = %v, %q", ok, why)
	}
	stub.health.Store(http.StatusServiceUnavailable)
	awaitHealth(t, seen, false)
	waitReason("answered 503")
	stub.health.Store(http.StatusOK)
	awaitHealth(t, seen, true)
	stub.mu.Lock()
	defer stub.mu.Unlock()
	for _, h := range stub.healthHdrs {
		if h.Get("Authorization") != "Bearer sk-h" {
			t.Fatalf("/health sent Authorization %q", h.Get("Authorization"))
		}
	}
}

// TestOpenAIConfigValidate proves each bad configuration is refused with
// an error wrapping ErrConfig that names the flag to fix.
func TestOpenAIConfigValidate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		cfg  OpenAIConfig
		want string // in the error; "" when valid
	}{
		{"valid", OpenAIConfig{URL: "http://127.0.0.1:8000"}, ""},
		{"valid https with a path prefix", OpenAIConfig{URL: "https://engine.example/vllm/", MaxConcurrency: 4, Timeout: time.Minute}, ""},
		{"no URL", OpenAIConfig{}, "--engine openai needs --engine-url"},
		{"unparsable URL", OpenAIConfig{URL: "http://[::1"}, "--engine-url"},
		{"no scheme", OpenAIConfig{URL: "127.0.0.1:8000"}, "--engine-url"},
		{"other scheme", OpenAIConfig{URL: "grpc://h:1"}, "must start with http:// or https://"},
		{"no host", OpenAIConfig{URL: "http:///v1"}, `--engine-url "http:///v1" has no host`},
		{"query", OpenAIConfig{URL: "http://h:1/?x=1"}, `--engine-url "http://h:1/?x=1" must be a base URL`},
		{"fragment", OpenAIConfig{URL: "http://h:1/#v1"}, "must be a base URL, without query or fragment"},
		{"negative concurrency", OpenAIConfig{URL: "http://h:1", MaxConcurrency: -1}, "engine concurrency and timeouts must be >= 0"},
		{"negative connect timeout", OpenAIConfig{URL: "http://h:1", ConnectTimeout: -time.Second}, "must be >= 0"},
		{"negative timeout", OpenAIConfig{URL: "http://h:1", Timeout: -1}, "must be >= 0"},
		{"negative health interval", OpenAIConfig{URL: "http://h:1", HealthInterval: -1}, "must be >= 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := tt.cfg.Validate()
			_, nerr := NewOpenAIEngine(tt.cfg)
			if tt.want == "" {
				if err != nil || nerr != nil {
					t.Errorf("Validate() = %v, NewOpenAIEngine: %v; want no error", err, nerr)
				}
				return
			}
			if err == nil || !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Validate() = %v, want ErrConfig containing %q", err, tt.want)
			}
			if nerr == nil || nerr.Error() != fmt.Sprint(err) {
				t.Errorf("NewOpenAIEngine: %v, want Validate's error", nerr)
			}
		})
	}
}

// --- fuzzing ------------------------------------------------------------

// FuzzEngineStream feeds arbitrary bytes to readStream as an engine's SSE
// body. Whatever they are it must not panic, and: prefilled is called once,
// before the first chunk, iff output started; a client request's chunks
// are valid JSON taken from a data line of the input, never the usage-only
// chunk the client did not ask for; a trace request's chunks carry no Raw;
// an ErrEngineUnavailable error (which Generate retries) never follows
// output; and success means a [DONE] line was read.
func FuzzEngineStream(f *testing.F) {
	var full bytes.Buffer
	for _, c := range streamChunks() {
		full.WriteString("data: " + c + "\n\n")
	}
	full.WriteString("data: " + streamUsageChunk + "\n\ndata: [DONE]\n\n")
	for _, s := range []string{
		full.String(),
		"data: [DONE]\n",
		": ping\n\nevent: x\r\ndata:" + streamChunk1 + "\r\n\r\ndata:[DONE]\r\n",
		"data: " + streamChunk0 + "\n\n",
		`data: {"error":{"message":"x"}}` + "\n\n",
		`data: {"error":null,"choices":[{"index":3,"finish_reason":""}]}` + "\ndata: [DONE]",
		"data: null\ndata: 5\n",
		`data: {"choices":[],"usage":{"prompt_tokens":-1,"prompt_tokens_details":null}}` + "\ndata: [DONE]\n",
		`data: {"choices":[{"index":0,"delta":null,"message":{"content":null}}]}` + "\ndata: [DONE]\n",
		"", "\n\n\n", "data:", "data: {", "data: [DONE", "data: [DONE]x\n", "data:\t[DONE]\r\n",
	} {
		f.Add([]byte(s), false, true)
		f.Add([]byte(s), true, false)
	}
	f.Fuzz(func(t *testing.T, body []byte, wantUsage, client bool) {
		e := &OpenAIEngine{} // readStream uses no state of the engine
		c := &engineCall{wantUsage: wantUsage}
		if client {
			c.req.Body = []byte(`{"stream":true}`)
		}
		prefilled := 0
		var chunks []Chunk
		res, err := e.readStream(context.Background(), c, bytes.NewReader(body), func() { prefilled++ }, func(ch Chunk) error {
			if prefilled != 1 {
				t.Fatalf("chunk emitted with prefilled called %d times", prefilled)
			}
			chunks = append(chunks, ch)
			return nil
		})
		if prefilled > 1 || (prefilled == 1) != c.started {
			t.Fatalf("prefilled called %d times, started %v", prefilled, c.started)
		}
		if errors.Is(err, ErrEngineUnavailable) && c.started {
			t.Fatalf("ErrEngineUnavailable after output: Generate would send the request again: %v", err)
		}
		for _, ch := range chunks {
			if !client {
				if ch.Raw != nil {
					t.Fatalf("trace chunk with Raw %q", ch.Raw)
				}
				continue
			}
			if !json.Valid(ch.Raw) || !bytes.Contains(body, ch.Raw) {
				t.Fatalf("chunk Raw %q is not JSON from the input", ch.Raw)
			}
			var a engineAnswer
			if json.Unmarshal(ch.Raw, &a) == nil && len(a.Choices) == 0 && a.Usage != nil && !wantUsage {
				t.Fatalf("usage-only chunk %s relayed to a client that did not ask", ch.Raw)
			}
		}
		if err == nil && !doneLine.Match(body) {
			t.Fatalf("success (%+v) without a [DONE] line", res)
		}
	})
}

// doneLine matches a data line of [DONE], as readStream reads one.
var doneLine = regexp.MustCompile(`(?m)^data:[\t\v\f\r \x85\p{Z}]*\[DONE\]`)

// FuzzClientBody feeds arbitrary bodies, session ids and model names to
// clientBody. It must not panic; when it succeeds, its output is a JSON
// object whose vllm_xargs.session_id is the session (absent without one),
// whose model is the override when one is given, whose stream asks for
// usage, and whose every other field is the client's value.
func FuzzClientBody(f *testing.F) {
	for _, s := range []string{
		fmt.Sprintf(clientBodyBase, ""),
		fmt.Sprintf(clientBodyBase, `,"stream":true,"stream_options":{"include_usage":false}`),
		`{}`, `{"vllm_xargs":null}`, `{"vllm_xargs":{}}`, `{"vllm_xargs":{"session_id":1,"session_id":"x"}}`,
		`{"stream":true}`, `{"stream":"true","stream_options":7}`, `{"stream":true,"stream_options":{"include_usage":"no"}}`,
		`{"model":1,"model":"two"}`, `{"a":"<>&\u2028 \u003c"}`, `{"n":1e999}`, `null`, `[]`, ``, `{"vllm_xargs":[]}`,
	} {
		f.Add([]byte(s), "sess-1", "")
		f.Add([]byte(s), "", "served")
	}
	f.Fuzz(func(t *testing.T, body []byte, session, model string) {
		if !utf8.ValidString(session) || !utf8.ValidString(model) {
			return // the frontend and the flags accept only UTF-8 ids and names
		}
		out, stream, _, err := clientBody(EngineRequest{SessionID: session, Body: body}, model)
		if err != nil {
			return
		}
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(out, &fields); err != nil || fields == nil {
			t.Fatalf("output is not a JSON object (%v): %s", err, out)
		}
		var xargs map[string]json.RawMessage
		if raw, ok := fields["vllm_xargs"]; ok {
			if err := json.Unmarshal(raw, &xargs); err != nil || len(xargs) == 0 {
				t.Fatalf("vllm_xargs %s is not a non-empty object", raw)
			}
		}
		if sid, ok := xargs[messages.ExtraArgSessionID]; session == "" && ok {
			t.Fatalf("vllm_xargs.session_id = %s without a session", sid)
		} else if session != "" {
			var got string
			if err := json.Unmarshal(sid, &got); err != nil || got != session {
				t.Fatalf("vllm_xargs.session_id = %s, want %q", sid, session)
			}
		}
		if model != "" {
			var got string
			if err := json.Unmarshal(fields["model"], &got); err != nil || got != model {
				t.Fatalf("model = %s, want %q", fields["model"], model)
			}
		}
		in := map[string]json.RawMessage{}
		_ = json.Unmarshal(body, &in)
		if inStream := string(bytes.TrimSpace(in["stream"])) == "true"; stream != inStream {
			t.Fatalf("stream = %v for a body whose stream is %s", stream, in["stream"])
		}
		if stream {
			var opts struct {
				IncludeUsage *bool `json:"include_usage"`
			}
			if err := json.Unmarshal(fields["stream_options"], &opts); err != nil || opts.IncludeUsage == nil || !*opts.IncludeUsage {
				t.Fatalf("stream_options = %s, want include_usage true", fields["stream_options"])
			}
		}
		changed := []string{"vllm_xargs", "stream_options"}
		if model != "" {
			changed = append(changed, "model")
		}
		checkOthers(t, body, out, changed...)
	})
}
