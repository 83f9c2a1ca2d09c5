package testenv_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbus/kvbus/cluster"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/testenv/fakeengine"
	"github.com/kvbus/kvbus/workers"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// engineCluster starts n fake vLLM engines publishing KV events and a
// kvbus in front of them (--engine openai, --tokenizer engine). Even
// engines bind their PUB socket and kvbus connects (vLLM), odd ones connect
// to a SUB socket kvbus binds (--kv-events-bind) and send a prompt's first
// blocks with parent 0 (llm-d's simulator); they also alternate vLLM's two
// event forms and hash kinds. An engine given a replay endpoint is
// replayed from.
func engineCluster(t *testing.T, n int, mod func(i int, c *fakeengine.Config)) (*testenv.Cluster, []*fakeengine.Engine) {
	t.Helper()
	return engineClusterWith(t, n, mod, nil)
}

// engineClusterWith is engineCluster with the cluster's configuration
// changed by modCluster (when not nil) before it starts.
func engineClusterWith(t *testing.T, n int, mod func(i int, c *fakeengine.Config), modCluster func(*testenv.ClusterConfig)) (*testenv.Cluster, []*fakeengine.Engine) {
	t.Helper()
	var engines []*fakeengine.Engine
	var backends []cluster.EngineBackend
	for i := range n {
		ev := &fakeengine.KVEventsConfig{Endpoint: "tcp://127.0.0.1:0", EventForm: fakeengine.EventFormMap}
		sub := &vllmevents.Config{}
		if i%2 == 1 {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			addr := "tcp://" + ln.Addr().String()
			ln.Close()
			ev = &fakeengine.KVEventsConfig{Endpoint: addr, Connect: true, EventForm: fakeengine.EventFormArray, ZeroRootParent: true}
			sub = &vllmevents.Config{Endpoint: addr, Bind: true}
		}
		cfg := fakeengine.Config{ModelName: "kvbus-sim", HashBytes: i%2 == 0, KVEvents: ev}
		if mod != nil {
			mod(i, &cfg)
		}
		e, err := fakeengine.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = e.Close() })
		engines = append(engines, e)
		if !sub.Bind {
			sub.Endpoint = e.KVEventsAddr()
		}
		sub.ReplayEndpoint = e.ReplayAddr()
		backends = append(backends, cluster.EngineBackend{
			OpenAI:   workers.OpenAIConfig{URL: e.URL(), HealthInterval: 100 * time.Millisecond},
			KVEvents: sub,
		})
	}
	tok, err := frontend.NewEngineTokenizer(frontend.EngineTokenizerConfig{URLs: []string{engines[0].URL()}})
	if err != nil {
		t.Fatal(err)
	}
	cc := testenv.ClusterConfig{Engines: backends, Tokenizer: tok, Policy: "kv", MaxModelLen: 8192}
	if modCluster != nil {
		modCluster(&cc)
	}
	c := testenv.StartCluster(t, cc)
	for _, e := range engines {
		// Setup, not the property: 30 s, as a fresh-clone CI run on 2
		// busy cores once took more than 10 s (unexplained since).
		began := time.Now()
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		if err := e.WaitSubscribed(ctx); err != nil {
			t.Fatalf("the rank never subscribed to the engine's KV events: %v", err)
		}
		cancel()
		if took := time.Since(began); took > 5*time.Second {
			t.Logf("the rank took %v to subscribe to the engine's KV events", took.Round(time.Millisecond))
		}
	}
	return c, engines
}

// engineOf returns the index of the engine that received a request with
// this X-Request-Id prefix, and the request.
func engineOf(t *testing.T, engines []*fakeengine.Engine, reqID string) (int, fakeengine.Received) {
	t.Helper()
	for i, e := range engines {
		for _, r := range e.Requests() {
			if strings.HasPrefix(r.Header.Get("X-Request-Id"), reqID) && strings.HasPrefix(r.Path, "/v1/") {
				return i, r
			}
		}
	}
	t.Fatalf("no engine received request %s", reqID)
	return -1, fakeengine.Received{}
}

// TestEngineConversationKeepsItsCache: a conversation with a session id
// runs on one engine, which receives the session id as X-Session-ID and
// as vllm_xargs.session_id with kvbus's request id; every turn finds the
// whole previous prompt in the engine's own cache, and the client's
// cached_tokens is the engine's.
func TestEngineConversationKeepsItsCache(t *testing.T) {
	c, engines := engineCluster(t, 2, nil)
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	turns, err := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 7,
		Headers: map[string]string{"X-Session-ID": "conv-engine-7"}}.Run(t.Context(), 4)
	if err != nil {
		t.Fatal(err)
	}
	home := -1
	for i, turn := range turns {
		e, got := engineOf(t, engines, turn.RequestID)
		if home == -1 {
			home = e
		}
		if e != home {
			t.Errorf("turn %d ran on engine %d, the conversation's earlier turns on %d", i+1, e, home)
		}
		if h := got.Header.Get("X-Session-ID"); h != "conv-engine-7" {
			t.Errorf("turn %d: engine got X-Session-ID %q", i+1, h)
		}
		if s := got.VLLMXArgs["session_id"]; s != "conv-engine-7" {
			t.Errorf("turn %d: engine got vllm_xargs.session_id %v", i+1, s)
		}
		if turn.CachedTokens != got.CachedTokens || turn.PromptTokens != len(got.PromptTokens) {
			t.Errorf("turn %d: client saw %d of %d tokens cached, the engine %d of %d", i+1, turn.CachedTokens, turn.PromptTokens,
				got.CachedTokens, len(got.PromptTokens))
		}
	}
	// The engine stores the prompt and the reply: the next turn finds the
	// whole previous prompt (its full blocks).
	for i, share := range testenv.PreviousShares(turns, fakeengine.DefaultBlockSize) {
		if share < 1 {
			t.Errorf("turn %d found %.2f of the previous prompt cached in the engine, want 1.00", i+2, share)
		}
	}
	if l := c.Logs.Lines(tokenizerWarning); len(l) != 0 {
		t.Errorf("tokenizer warning with --tokenizer engine: %q", l)
	}
}

// TestEngineKVEventsSteerPlacement: a prompt computed on engine 1 behind
// kvbus's back is known to kvbus only through engine 1's KV events; a
// request without a session id that shares it goes to engine 1 and finds
// it cached, whichever engine round-robin would have picked.
func TestEngineKVEventsSteerPlacement(t *testing.T) {
	c, engines := engineCluster(t, 2, nil)
	chat := sharedDocChat(c.Model)
	cacheBehindKvbus(t, c, engines[1], "g1", chat)
	expectPlacedOnItsPrefix(t, c, engines, 1, chat)
}

// cacheBehindKvbus sends chat's first question directly to engine e, so
// that kvbus learns of the blocks it caches only from its KV events, and
// waits until group g's blocks in the index are the engine's.
func cacheBehindKvbus(t *testing.T, c *testenv.Cluster, e *fakeengine.Engine, g string, chat func(string) []byte) {
	t.Helper()
	resp, err := http.Post(e.URL()+"/v1/chat/completions", "application/json", bytes.NewReader(chat("first question")))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	testenv.Eventually(t, 10*time.Second, "the engine's KV events reach the index", func() bool {
		return c.Scheduler.Index().GroupBlocks(g) == e.CachedBlocks()
	})
}

// TestWorkerRestartReplaysItsEnginesCache: a worker restarted beside a
// running engine (an upgrade of kvbus) asks the engine's replay buffer for
// what it published before, so the engine's cache is indexed again at
// once, not only once the engine stores new blocks, and a prompt it holds
// is placed on it. Engine 1 is llm-d's simulator's kind: it connects to
// the worker, numbers its chains' first blocks from parent 0 and replays.
func TestWorkerRestartReplaysItsEnginesCache(t *testing.T) {
	c, engines := engineCluster(t, 2, func(i int, cfg *fakeengine.Config) {
		if i == 1 {
			cfg.KVEvents.ReplayEndpoint = "tcp://127.0.0.1:0"
		}
	})
	chat := sharedDocChat(c.Model)
	cacheBehindKvbus(t, c, engines[1], "g1", chat)
	want := engines[1].CachedBlocks()
	c.CrashRestartRank(t, "g1", 0)
	c.WaitReady(t)
	testenv.Eventually(t, 10*time.Second, "the new rank subscribed", func() bool {
		return len(c.Logs.Lines("engine KV events: subscribing", "group=g1")) == 2
	})
	testenv.Eventually(t, 10*time.Second, "engine 1's cache indexed again, with no new request", func() bool {
		return c.Scheduler.Index().GroupBlocks("g1") == want
	})
	if n := engines[1].CachedBlocks(); n != want {
		t.Fatalf("engine 1 cached %d blocks, want the %d of before", n, want)
	}
	expectPlacedOnItsPrefix(t, c, engines, 1, chat)
}

// sharedDocChat returns a chat body builder whose prompts share a long
// system prompt (~1,000 tokens) and differ in the question.
func sharedDocChat(model string) func(question string) []byte {
	var b strings.Builder
	for i := range 80 {
		fmt.Fprintf(&b, "Shared document line %d about caches and prefixes. ", i)
	}
	doc := b.String()
	return func(question string) []byte {
		body, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 4,
			"messages": []map[string]string{{"role": "system", "content": doc}, {"role": "user", "content": question}}})
		return body
	}
}

// expectPlacedOnItsPrefix sends three questions on chat's shared prompt
// through kvbus and checks that each ran on engine holder, which caches
// the prompt, and found all of its shared prefix there.
func expectPlacedOnItsPrefix(t *testing.T, c *testenv.Cluster, engines []*fakeengine.Engine, holder int, chat func(string) []byte) {
	t.Helper()
	for i := range 3 {
		status, hdr, body := testenv.Send(t, "POST", c.URL+"/v1/chat/completions", string(chat(fmt.Sprintf("question %d", i))), nil)
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
		e, got := engineOf(t, engines, hdr.Get("X-Request-Id"))
		if e != holder {
			t.Fatalf("request %d went to engine %d; engine %d holds its prefix", i, e, holder)
		}
		u, ok := answerOf{status, body}.usage()
		if !ok {
			t.Fatalf("request %d: no usage in %s", i, body)
		}
		// The shared part is the system prompt: all of its full blocks.
		shared := engines[holder].CachedPrefix(got.PromptTokens)
		if u.Details.CachedTokens < shared || shared < u.PromptTokens*8/10 {
			t.Errorf("request %d: %d of %d prompt tokens cached, want the %d-token shared prefix (>= 80%%)", i,
				u.Details.CachedTokens, u.PromptTokens, shared)
		}
	}
}

// TestEngineUnhealthyMovesRequests: an engine that fails /health takes its
// group out; a session bound to it continues on the other engine. An
// engine that is gone when a request reaches it does the same: the
// request moves before any output and the client gets its answer.
func TestEngineUnhealthyMovesRequests(t *testing.T) {
	c, engines := engineCluster(t, 2, nil)
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	d := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 11,
		Headers: map[string]string{"X-Session-ID": "moving"}}.Start()
	first, err := d.Next(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	home, _ := engineOf(t, engines, first.RequestID)
	other := 1 - home
	homeGroup := fmt.Sprintf("g%d", home)

	engines[home].SetHealthy(false)
	testenv.Eventually(t, 5*time.Second, "the unhealthy engine's group leaves the ready groups", func() bool {
		for _, g := range c.Scheduler.PlaceableGroups(time.Now()) {
			if g.Name == homeGroup {
				return false
			}
		}
		return true
	})
	second, err := d.Next(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if e, _ := engineOf(t, engines, second.RequestID); e != other {
		t.Fatalf("with engine %d unhealthy the turn ran on engine %d", home, e)
	}

	// Back to health; then the engine dies between two turns, before the
	// cluster can notice: the turn is placed on it and must move.
	engines[home].SetHealthy(true)
	testenv.Eventually(t, 5*time.Second, "the engine's group is ready again", func() bool {
		return len(c.Scheduler.PlaceableGroups(time.Now())) == 2
	})
	// Pin the conversation back home: a fresh session that starts there.
	var pinned *testenv.Dialog
	var turn testenv.Turn
	for i := range 20 {
		pinned = testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 100 + i,
			Headers: map[string]string{"X-Session-ID": fmt.Sprint("pinned-", i)}}.Start()
		if turn, err = pinned.Next(t.Context()); err != nil {
			t.Fatal(err)
		}
		if e, _ := engineOf(t, engines, turn.RequestID); e == home {
			break
		}
		pinned = nil
	}
	if pinned == nil {
		t.Fatal("no conversation started on the engine under test")
	}
	before := testenv.CounterSum(t, c.Registry, "kvbus_scheduler_requests_total", map[string]string{"outcome": "redispatched"})
	if err := engines[home].Close(); err != nil {
		t.Fatal(err)
	}
	turn, err = pinned.Next(t.Context())
	if err != nil {
		t.Fatalf("the turn placed on a dead engine did not move: %v", err)
	}
	if e, _ := engineOf(t, engines, turn.RequestID); e != other {
		t.Fatalf("the turn ran on engine %d", e)
	}
	if after := testenv.CounterSum(t, c.Registry, "kvbus_scheduler_requests_total", map[string]string{"outcome": "redispatched"}); after != before+1 {
		t.Errorf("redispatched requests went from %v to %v: the turn did not go to the dead engine first (the fault did not take effect)", before, after)
	}
}

// TestEngineErrorsAndStreams: an engine's 400 reaches the client with the
// engine's status and body; a streamed answer carries the engine's chunks,
// with usage (and the engine's cached tokens) only when the client asks.
func TestEngineErrorsAndStreams(t *testing.T) {
	c, _ := engineCluster(t, 1, func(_ int, cfg *fakeengine.Config) { cfg.MaxModelLen = 512 })
	long := strings.Repeat("word ", 600)
	status, _, body := testenv.Send(t, "POST", c.URL+"/v1/completions",
		fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":4}`, c.Model, long), nil)
	if status != http.StatusBadRequest || !strings.Contains(string(body), "BadRequestError") {
		t.Fatalf("prompt too long for the engine: status %d body %s; want the engine's 400", status, body)
	}
	for _, usage := range []bool{false, true} {
		req := fmt.Sprintf(`{"model":%q,"prompt":"tell me a story","max_tokens":5,"stream":true}`, c.Model)
		if usage {
			req = fmt.Sprintf(`{"model":%q,"prompt":"tell me a story","max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`, c.Model)
		}
		status, _, body := testenv.Send(t, "POST", c.URL+"/v1/completions", req, nil)
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
		var chunks, usageChunks int
		sc := bufio.NewScanner(bytes.NewReader(body))
		last := ""
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			last = data
			if data == "[DONE]" {
				continue
			}
			var ch struct {
				Object  string            `json:"object"`
				Choices []json.RawMessage `json:"choices"`
				Usage   *struct {
					CompletionTokens int `json:"completion_tokens"`
				} `json:"usage"`
			}
			if err := json.Unmarshal([]byte(data), &ch); err != nil || ch.Object != "text_completion" {
				t.Fatalf("chunk %s is not the engine's (%v)", data, err)
			}
			chunks++
			if len(ch.Choices) == 0 && ch.Usage != nil {
				usageChunks++
			}
		}
		if last != "[DONE]" || chunks < 5 {
			t.Errorf("usage=%v: %d chunks, last %q", usage, chunks, last)
		}
		if want := map[bool]int{false: 0, true: 1}[usage]; usageChunks != want {
			t.Errorf("include_usage=%v: %d usage chunks, want %d", usage, usageChunks, want)
		}
	}
}

// TestEngineGetsOneSessionID: the engine gets the session id kvbus
// resolved in every place it reads one. A later vLLM reads the body's own
// session_id first (then X-Session-ID, then vllm_xargs.session_id), so the
// client's session_id field is the resolved id too: trimmed, or the
// header's when the body's was blank, or gone when there is no session.
// Before, it went as the client sent it ("  conv  ", ""), a session of its
// own beside the X-Session-ID and vllm_xargs.session_id kvbus set.
func TestEngineGetsOneSessionID(t *testing.T) {
	c, engines := engineCluster(t, 1, nil)
	tests := []struct {
		name    string
		body    string // the request's fields after model and prompt
		headers map[string]string
		want    string // the session id; "" for none
	}{
		{name: "body value trimmed", body: `,"session_id":"  conv-a  "`, want: "conv-a"},
		{name: "blank body value, header's id", body: `,"session_id":" "`,
			headers: map[string]string{"X-Session-ID": "conv-b"}, want: "conv-b"},
		{name: "null body value, correlation id", body: `,"session_id":null`,
			headers: map[string]string{"X-Correlation-ID": "conv-c"}, want: "conv-c"},
		{name: "empty body value, no session", body: `,"session_id":""`},
		{name: "body value beside another in vllm_xargs", body: `,"session_id":"conv-d","vllm_xargs":{"session_id":"other"}`,
			headers: map[string]string{"X-Session-ID": "conv-h"}, want: "conv-d"},
	}
	for i, tt := range tests {
		id := fmt.Sprint("one-session-", i)
		h := map[string]string{"X-Request-Id": id}
		for k, v := range tt.headers {
			h[k] = v
		}
		body := fmt.Sprintf(`{"model":%q,"prompt":"where is the session","max_tokens":2%s}`, c.Model, tt.body)
		status, hdr, resp := testenv.Send(t, "POST", c.URL+"/v1/completions", body, h)
		if status != http.StatusOK {
			t.Fatalf("%s: status %d: %s", tt.name, status, resp)
		}
		if got := hdr.Get("X-Session-ID"); got != tt.want {
			t.Errorf("%s: X-Session-ID echo %q, want %q", tt.name, got, tt.want)
		}
		_, got := engineOf(t, engines, id)
		if s := got.Header.Get("X-Session-ID"); s != tt.want {
			t.Errorf("%s: engine got X-Session-ID %q, want %q", tt.name, s, tt.want)
		}
		xs, hasX := got.VLLMXArgs["session_id"]
		if tt.want != "" && xs != tt.want || tt.want == "" && hasX {
			t.Errorf("%s: engine got vllm_xargs.session_id %v, want %q", tt.name, xs, tt.want)
		}
		bs, hasB := got.Body["session_id"]
		if tt.want != "" && bs != tt.want || tt.want == "" && hasB {
			t.Errorf("%s: engine got the body's session_id %#v, want %q (absent when none)", tt.name, bs, tt.want)
		}
	}
}

// TestEngineRelaysFieldForField: kvbus forwards the client's body as it
// came (tools, response_format, logprobs, n, chat_template_kwargs,
// kv_transfer_params, vLLM's extra fields), changing only
// vllm_xargs.session_id and stream_options, and the client gets the
// engine's answer byte for byte.
func TestEngineRelaysFieldForField(t *testing.T) {
	const answer = `{"id":"chatcmpl-engine","object":"chat.completion","created":1,"model":"kvbus-sim","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},"logprobs":{"content":[]},"finish_reason":"tool_calls","stop_reason":null},{"index":1,"message":{"role":"assistant","content":"{}"},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":40,"completion_tokens":9,"total_tokens":49,"prompt_tokens_details":{"cached_tokens":32}},"prompt_logprobs":null,"kv_transfer_params":{"remote_block_ids":[1,2]}}`
	streamed := []string{
		`{"id":"chatcmpl-s","object":"chat.completion.chunk","created":1,"model":"kvbus-sim","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
		`{"id":"chatcmpl-s","object":"chat.completion.chunk","created":1,"model":"kvbus-sim","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":""}}]},"logprobs":null,"finish_reason":null}]}`,
		`{"id":"chatcmpl-s","object":"chat.completion.chunk","created":1,"model":"kvbus-sim","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls"}]}`,
		`{"id":"chatcmpl-s","object":"chat.completion.chunk","created":1,"model":"kvbus-sim","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,"total_tokens":43,"prompt_tokens_details":{"cached_tokens":16}}}`,
	}
	type seen struct {
		header http.Header
		body   map[string]any
	}
	got := make(chan seen, 4)
	engine := testenv.ServeEngine(t, func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		_ = json.NewDecoder(r.Body).Decode(&body)
		got <- seen{r.Header.Clone(), body}
		if body["stream"] == true {
			w.Header().Set("Content-Type", "text/event-stream")
			for _, ch := range streamed {
				fmt.Fprintf(w, "data: %s\n\n", ch)
			}
			fmt.Fprint(w, "data: [DONE]\n\n")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, answer)
	})
	c := testenv.StartCluster(t, testenv.ClusterConfig{Engines: []cluster.EngineBackend{{OpenAI: workers.OpenAIConfig{URL: engine, HealthInterval: 100 * time.Millisecond}}}})
	client := map[string]any{
		"model":    c.Model,
		"messages": []any{map[string]any{"role": "user", "content": "weather in Paris?"}},
		"tools": []any{map[string]any{"type": "function", "function": map[string]any{"name": "get_weather",
			"parameters": map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string"}}}}}},
		"tool_choice": "auto", "response_format": map[string]any{"type": "json_object"}, "logprobs": true, "top_logprobs": 2.0,
		"n": 2.0, "chat_template_kwargs": map[string]any{"enable_thinking": false}, "kv_transfer_params": map[string]any{"do_remote_decode": true},
		"vllm_xargs": map[string]any{"session_id": "from-body", "priority_hint": "low"}, "repetition_penalty": 1.1,
	}
	raw, _ := json.Marshal(client)
	status, hdr, body := testenv.Send(t, "POST", c.URL+"/v1/chat/completions", string(raw), map[string]string{"X-Session-ID": "from-header"})
	if status != http.StatusOK || string(body) != answer {
		t.Fatalf("status %d, body\n%s\nwant the engine's answer\n%s", status, body, answer)
	}
	if hdr.Get("X-Session-ID") != "from-body" {
		t.Errorf("X-Session-ID echo %q, want the body's session id", hdr.Get("X-Session-ID"))
	}
	s := <-got
	if s.header.Get("X-Session-ID") != "from-body" || !strings.HasPrefix(s.header.Get("X-Request-Id"), hdr.Get("X-Request-Id")) {
		t.Errorf("engine got X-Session-ID %q X-Request-Id %q", s.header.Get("X-Session-ID"), s.header.Get("X-Request-Id"))
	}
	var want map[string]any
	_ = json.Unmarshal(raw, &want)
	if !jsonEqual(s.body, want) {
		t.Errorf("engine got body\n%v\nwant the client's\n%v", s.body, want)
	}

	// Streaming without include_usage: the engine is asked for usage (kvbus
	// needs its cached tokens), the client does not get that chunk.
	client["stream"] = true
	raw, _ = json.Marshal(client)
	status, _, body = testenv.Send(t, "POST", c.URL+"/v1/chat/completions", string(raw), nil)
	var wantSSE strings.Builder
	for _, ch := range streamed[:3] {
		fmt.Fprintf(&wantSSE, "data: %s\n\n", ch)
	}
	wantSSE.WriteString("data: [DONE]\n\n")
	if status != http.StatusOK || string(body) != wantSSE.String() {
		t.Fatalf("status %d, stream\n%s\nwant\n%s", status, body, wantSSE.String())
	}
	s = <-got
	opts, _ := s.body["stream_options"].(map[string]any)
	if opts["include_usage"] != true {
		t.Errorf("engine got stream_options %v, want include_usage true", s.body["stream_options"])
	}
	delete(s.body, "stream_options")
	want["stream"] = true
	if !jsonEqual(s.body, want) {
		t.Errorf("engine got body\n%v\nwant\n%v", s.body, want)
	}
}

func jsonEqual(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y)
}

// TestEngineReplaysTraces: a replayed trace has token ids only; its
// requests reach the engine's /v1/completions as token-id prompts with the
// session id, and the replay's cached tokens are the engine's: the second
// turn finds the whole first prompt (64 tokens, 4 blocks) cached.
func TestEngineReplaysTraces(t *testing.T) {
	c, engines := engineCluster(t, 2, nil)
	nc := testenv.Connect(t, c.NATS)
	first := testenv.PromptTokens(1, 64)
	second := append(append([]uint32(nil), first...), testenv.PromptTokens(2, 40)...)
	r, err := replay.New(replay.Config{Target: c.NATS.ClientURL(), Conn: nc, Model: c.Model, Mode: replay.ModeSession, Timeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	results, _, err := r.Run(t.Context(), []replay.Item{
		{SessionID: "trace-session", Prompt: first, OutputTokens: 4},
		{At: time.Millisecond, SessionID: "trace-session", Prompt: second, OutputTokens: 4},
	})
	if err != nil {
		t.Fatal(err)
	}
	for i, res := range results {
		if res.Err != "" {
			t.Fatalf("request %d: %s", i, res.Err)
		}
	}
	if results[1].CachedTokens != len(first) {
		t.Errorf("the second turn found %d tokens cached, want the first prompt's %d", results[1].CachedTokens, len(first))
	}
	e, got := engineOf(t, engines, results[1].ReqID)
	if got.Path != "/v1/completions" || got.VLLMXArgs["session_id"] != "trace-session" || got.CachedTokens != results[1].CachedTokens {
		t.Errorf("engine %d got %s with vllm_xargs %v, %d cached", e, got.Path, got.VLLMXArgs, got.CachedTokens)
	}
	if len(got.PromptTokens) != len(second) || got.PromptTokens[len(second)-1] != second[len(second)-1] {
		t.Errorf("engine got a %d-token prompt, want the trace's %d token ids", len(got.PromptTokens), len(second))
	}
}

// TestEngineReplayKeepsTheCacheSalt: a replayed captured request that
// has no client body (captured in front of the sim) reaches the engine
// with its cache_salt, which the scheduler hashed its blocks with: without
// it, vLLM would cache the salted prompt as an unsalted one, shared with
// every tenant's same prompt.
func TestEngineReplayKeepsTheCacheSalt(t *testing.T) {
	c, engines := engineCluster(t, 1, nil)
	nc := testenv.Connect(t, c.NATS)
	prompt := testenv.PromptTokens(1, 40)
	r, err := replay.New(replay.Config{Target: c.NATS.ClientURL(), Conn: nc, Model: c.Model, Timeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	captured := &messages.Request{RequestID: "captured-1", Model: c.Model, PromptTokenIDs: prompt, Endpoint: messages.EndpointCompletions,
		SamplingParams: messages.SamplingParams{MaxTokens: 2, Temperature: 1, TopP: 1}, CacheSalt: "tenant-a"}
	results, _, err := r.Run(t.Context(), []replay.Item{{Prompt: prompt, Request: captured}})
	if err != nil {
		t.Fatal(err)
	}
	if results[0].Err != "" {
		t.Fatalf("request: %s", results[0].Err)
	}
	e, got := engineOf(t, engines, results[0].ReqID)
	if got.Body["cache_salt"] != "tenant-a" {
		t.Errorf("engine %d got %s, want cache_salt tenant-a", e, got.RawBody)
	}
}

// TestEngineKVEventGapClearsTheGroup: a batch the engine's subscriber
// missed, with no replay endpoint, leaves the engine's state unknown: the
// group's blocks leave the index until the engine stores them again.
func TestEngineKVEventGapClearsTheGroup(t *testing.T) {
	c, engines := engineCluster(t, 1, nil)
	ask := func(q string) {
		status, _, body := testenv.Send(t, "POST", c.URL+"/v1/completions",
			fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, c.Model, strings.Repeat(q+" ", 100)), nil)
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
	}
	ask("first")
	testenv.Eventually(t, 5*time.Second, "the engine's blocks in the index", func() bool {
		return c.Scheduler.Index().GroupBlocks("g0") == engines[0].CachedBlocks()
	})
	if c.Scheduler.Index().GroupBlocks("g0") < 6 {
		t.Fatalf("only %d blocks indexed", c.Scheduler.Index().GroupBlocks("g0"))
	}
	engines[0].SkipSeq(1) // the next batch's seq jumps: one batch lost
	ask("second")
	// After the gap, only what the engine stores from now on is indexed.
	ask("third")
	testenv.Eventually(t, 5*time.Second, "the index cleared and refilled by the later batch", func() bool {
		n := c.Scheduler.Index().GroupBlocks("g0")
		return n > 0 && n < engines[0].CachedBlocks()
	})
	// The warning is the worker's, logged as it handles the batch after
	// the gap: not necessarily before the index shows the refill.
	testenv.Eventually(t, 5*time.Second, "the gap warning", func() bool {
		return len(c.Logs.Lines("engine KV events lost and not replayed")) > 0
	})
	if lines := c.Logs.Lines("engine KV events lost and not replayed"); len(lines) != 1 {
		t.Errorf("%d gap warnings, want 1", len(lines))
	}
}

// TestEngineBlockSizeMismatchIsReportedOnce: an engine whose block size is
// not kvbus's has its blocks left out of the index, and the operator reads
// why and what to do once, not per batch.
func TestEngineBlockSizeMismatchIsReportedOnce(t *testing.T) {
	c, _ := engineCluster(t, 1, func(_ int, cfg *fakeengine.Config) { cfg.BlockSize = 32 })
	for i := range 3 {
		status, _, body := testenv.Send(t, "POST", c.URL+"/v1/completions",
			fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, c.Model, strings.Repeat(fmt.Sprint("text ", i, " "), 100)), nil)
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
	}
	testenv.Eventually(t, 5*time.Second, "the mismatch reported", func() bool {
		return len(c.Logs.Lines("set kvbus's --block-size")) > 0
	})
	time.Sleep(300 * time.Millisecond) // the later batches arrive too
	if n := len(c.Logs.Lines("set kvbus's --block-size")); n != 1 {
		t.Errorf("the block size mismatch was reported %d times, want once", n)
	}
	if n := c.Scheduler.Index().GroupBlocks("g0"); n != 0 {
		t.Errorf("%d blocks of the wrong size indexed", n)
	}
}

// TestEngineAbortClosesTheEngineStream: a client that leaves mid-stream
// aborts its request, and the engine's stream is closed (vLLM aborts a
// request whose connection closes).
func TestEngineAbortClosesTheEngineStream(t *testing.T) {
	closed := make(chan struct{})
	engine := testenv.ServeEngine(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, `data: {"id":"x","object":"text_completion","created":1,"model":"kvbus-sim","choices":[{"index":0,"text":"one","logprobs":null,"finish_reason":null}]}`+"\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
			close(closed)
		case <-time.After(20 * time.Second):
		}
	})
	c := testenv.StartCluster(t, testenv.ClusterConfig{Engines: []cluster.EngineBackend{{OpenAI: workers.OpenAIConfig{URL: engine, HealthInterval: 100 * time.Millisecond}}}})
	ctx, cancel := context.WithCancel(t.Context())
	req, _ := http.NewRequestWithContext(ctx, "POST", c.URL+"/v1/completions",
		strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":"go on","max_tokens":100,"stream":true}`, c.Model)))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.Contains(line, `"one"`) {
		t.Fatalf("first chunk %q (%v)", line, err)
	}
	cancel() // the client leaves
	resp.Body.Close()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the engine's stream stayed open after the client left")
	}
}

// TestEngine5xxReachesTheClientAtOnce: an engine that answers a request
// 500 (or 503) while its /health answers 200 has failed that request, as
// vLLM answers its client: the client gets the engine's status and body at
// once, the engine gets the request once, and the group stays ready (no
// health flapping in the log). It failed before: the worker sent the
// request again ~40 times a second until the client's timeout (a 504),
// logging "engine not healthy"/"engine healthy" each time.
func TestEngine5xxReachesTheClientAtOnce(t *testing.T) {
	const body500 = `{"error":{"message":"CUDA error: an illegal memory access was encountered","type":"InternalServerError","param":null,"code":500}}`
	const body503 = `{"error":{"message":"The engine is busy","type":"ServiceUnavailableError","param":null,"code":503}}`
	var mu sync.Mutex
	posts := 0
	engine := testenv.ServeEngine(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		posts++
		mu.Unlock()
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		if strings.Contains(r.Header.Get("X-Request-Id"), "busy") {
			w.WriteHeader(http.StatusServiceUnavailable)
			io.WriteString(w, body503)
			return
		}
		w.WriteHeader(http.StatusInternalServerError)
		io.WriteString(w, body500)
	})
	c := testenv.StartCluster(t, testenv.ClusterConfig{RequestTimeout: 15 * time.Second,
		Engines: []cluster.EngineBackend{{OpenAI: workers.OpenAIConfig{URL: engine, HealthInterval: 50 * time.Millisecond}}}})
	tests := []struct {
		name, path, reqID, body string
		status                  int
		want                    string
	}{
		{"chat 500", "/v1/chat/completions", "five-hundred", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}]}`, c.Model), 500, body500},
		{"streamed completion 503", "/v1/completions", "busy-1", fmt.Sprintf(`{"model":%q,"prompt":"hi","stream":true}`, c.Model), 503, body503},
	}
	for _, tt := range tests {
		mu.Lock()
		before := posts
		mu.Unlock()
		start := time.Now()
		status, _, body := testenv.Send(t, "POST", c.URL+tt.path, tt.body, map[string]string{"X-Request-Id": tt.reqID})
		took := time.Since(start)
		if status != tt.status || string(body) != tt.want {
			t.Fatalf("%s: status %d body %s after %s; want the engine's %d and body", tt.name, status, body, took.Round(time.Millisecond), tt.status)
		}
		if took > 5*time.Second {
			t.Errorf("%s: the engine's error took %s to reach the client", tt.name, took)
		}
		mu.Lock()
		n := posts - before
		mu.Unlock()
		if n != 1 {
			t.Errorf("%s: the engine got the request %d times, want once", tt.name, n)
		}
	}
	if n := len(c.Logs.Lines("engine not healthy")); n != 0 {
		t.Errorf("%d \"engine not healthy\" lines: a request's error moved the engine's health", n)
	}
	if groups := c.Scheduler.PlaceableGroups(time.Now()); len(groups) != 1 {
		t.Errorf("the group left the ready groups: %v", groups)
	}
}

// TestEngineDeathMidRequestFailsFast: the only engine dies while a request
// is in flight (its connection is reset, then refused, /health too). The
// request ends within seconds with 503 group_failed and Retry-After, as a
// new request gets no_ready_group after --no-group-wait, not a 504 at its
// deadline. It failed before: the worker waited for the engine until the
// client's timeout.
func TestEngineDeathMidRequestFailsFast(t *testing.T) {
	arrived := make(chan struct{}, 1)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case arrived <- struct{}{}:
		default:
		}
		<-r.Context().Done() // prefilling until the process dies
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	c := testenv.StartCluster(t, testenv.ClusterConfig{RequestTimeout: 30 * time.Second,
		Engines: []cluster.EngineBackend{{OpenAI: workers.OpenAIConfig{URL: srv.URL, HealthInterval: 100 * time.Millisecond}}}})
	type answer struct {
		status int
		hdr    http.Header
		body   []byte
	}
	done := make(chan answer, 1)
	go func() {
		var a answer
		defer func() { done <- a }()
		client := &http.Client{Timeout: 40 * time.Second}
		defer client.CloseIdleConnections()
		resp, err := client.Post(c.URL+"/v1/chat/completions", "application/json",
			strings.NewReader(fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"a long prompt"}],"stream":true}`, c.Model)))
		if err != nil {
			a.body = []byte(err.Error())
			return
		}
		defer resp.Body.Close()
		a.status, a.hdr = resp.StatusCode, resp.Header
		a.body, _ = io.ReadAll(resp.Body)
	}()
	select {
	case <-arrived:
	case <-time.After(20 * time.Second):
		t.Fatal("the request never reached the engine")
	}
	// The engine process dies: connections reset, then refused.
	srv.Listener.Close()
	srv.CloseClientConnections()
	died := time.Now()
	var a answer
	select {
	case a = <-done:
	case <-time.After(25 * time.Second):
		t.Fatal("no answer 25 s after the engine died")
	}
	took := time.Since(died)
	var e struct {
		Error struct {
			Message, Code string
		} `json:"error"`
	}
	_ = json.Unmarshal(a.body, &e)
	if a.status != http.StatusServiceUnavailable || e.Error.Code != "group_failed" || a.hdr.Get("Retry-After") == "" {
		t.Fatalf("status %d, Retry-After %q, body %s after %s; want 503 group_failed with Retry-After",
			a.status, a.hdr.Get("Retry-After"), a.body, took.Round(time.Millisecond))
	}
	if !strings.Contains(e.Error.Message, "engine") || !strings.Contains(e.Error.Message, "retry") {
		t.Errorf("message %q does not say the engine failed and to retry", e.Error.Message)
	}
	if took > 8*time.Second {
		t.Errorf("the request ended %s after the engine died", took)
	}
	t.Logf("503 %s after the engine died: %s", took.Round(time.Millisecond), e.Error.Message)
}

// TestEngineStreamBreakOffNamesTheCause: an engine whose stream stops
// after a few chunks, without [DONE], ends the client's stream with an
// error event that says why. It said "generation stopped: <nil>" before.
func TestEngineStreamBreakOffNamesTheCause(t *testing.T) {
	engine := testenv.ServeEngine(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for _, text := range []string{"one", " two"} {
			fmt.Fprintf(w, `data: {"id":"x","object":"text_completion","created":1,"model":"kvbus-sim","choices":[{"index":0,"text":%q,"logprobs":null,"finish_reason":null}]}`+"\n\n", text)
		}
		w.(http.Flusher).Flush()
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close() // the engine's end of the stream is gone
		}
	})
	c := testenv.StartCluster(t, testenv.ClusterConfig{Engines: []cluster.EngineBackend{{OpenAI: workers.OpenAIConfig{URL: engine, HealthInterval: 100 * time.Millisecond}}}})
	status, _, body := testenv.Send(t, "POST", c.URL+"/v1/completions",
		fmt.Sprintf(`{"model":%q,"prompt":"count","max_tokens":10,"stream":true}`, c.Model), nil)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, body)
	}
	e := brokenStreamError(t, body)
	if e.Code != "engine_error" {
		t.Fatalf("the stream's error %+v: want an engine_error", e)
	}
	if strings.Contains(e.Message, "<nil>") || !strings.Contains(e.Message, "stream broke off") {
		t.Errorf("error message %q does not name the cause (the engine's stream broke off)", e.Message)
	}
}

// brokenStreamError reads a stream that broke off after the engine's two
// chunks: the engine's chunks, an error event, [DONE]. It returns the
// error event's error.
func brokenStreamError(t *testing.T, body []byte) (e struct{ Message, Code string }) {
	t.Helper()
	var events []string
	for _, line := range strings.Split(string(body), "\n") {
		if data, ok := strings.CutPrefix(line, "data: "); ok {
			events = append(events, data)
		}
	}
	if len(events) < 4 || events[len(events)-1] != "[DONE]" || !strings.Contains(events[1], `" two"`) {
		t.Fatalf("events %q: want the engine's two chunks, an error, [DONE]", events)
	}
	var ev struct {
		Error struct{ Message, Code string } `json:"error"`
	}
	if err := json.Unmarshal([]byte(events[len(events)-2]), &ev); err != nil {
		t.Fatalf("last event %s: %v", events[len(events)-2], err)
	}
	return ev.Error
}

// TestEngineDeathMidStreamIsRetryable: an engine killed after a stream
// began (its stream breaks off and its /health is refused) ends the
// client's stream with group_failed, which says to retry, as a worker that
// dies does, and takes the engine out at once. It ended with engine_error
// (a server_error, as for a fault of the model) before: in a review's run
// with engines as processes, a kill -9 of one under 6 conversational
// clients ended 2 streams so, where a killed worker's ended with
// group_failed.
func TestEngineDeathMidStreamIsRetryable(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for _, text := range []string{"one", " two"} {
			fmt.Fprintf(w, `data: {"id":"x","object":"text_completion","created":1,"model":"kvbus-sim","choices":[{"index":0,"text":%q,"logprobs":null,"finish_reason":null}]}`+"\n\n", text)
		}
		w.(http.Flusher).Flush()
		// The engine process dies: its connections reset, new ones refused.
		srv.Listener.Close()
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close()
		}
	})
	c := testenv.StartCluster(t, testenv.ClusterConfig{Engines: []cluster.EngineBackend{{OpenAI: workers.OpenAIConfig{URL: srv.URL, HealthInterval: 100 * time.Millisecond}}}})
	status, _, body := testenv.Send(t, "POST", c.URL+"/v1/completions",
		fmt.Sprintf(`{"model":%q,"prompt":"count","max_tokens":10,"stream":true}`, c.Model), nil)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, body)
	}
	e := brokenStreamError(t, body)
	if e.Code != "group_failed" {
		t.Fatalf("the stream's error %+v: want a group_failed (the engine died: retry)", e)
	}
	for _, want := range []string{"stream broke off", "engine died", "retry"} {
		if !strings.Contains(e.Message, want) {
			t.Errorf("error message %q does not say %q", e.Message, want)
		}
	}
	if len(c.Logs.Lines("engine not healthy")) == 0 {
		t.Error("the engine that died was not taken out")
	}
}

// TestEngineTokenizerMismatchWarnsOnce: kvbus's default tokenizer (o200k)
// in front of an engine with another one counts other prompt lengths than
// the engine: the worker says so once, with both counts and the fix
// (--tokenizer engine). With --tokenizer engine nothing is said
// (TestEngineConversationKeepsItsCache).
func TestEngineTokenizerMismatchWarnsOnce(t *testing.T) {
	e, err := fakeengine.New(fakeengine.Config{ModelName: "kvbus-sim"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	c := testenv.StartCluster(t, testenv.ClusterConfig{ // the frontend's default tokenizer: o200k
		Engines: []cluster.EngineBackend{{OpenAI: workers.OpenAIConfig{URL: e.URL(), HealthInterval: 100 * time.Millisecond}}}})
	for i := range 3 {
		status, _, body := testenv.Send(t, "POST", c.URL+"/v1/chat/completions",
			fmt.Sprintf(`{"model":%q,"max_tokens":2,"messages":[{"role":"user","content":"question %d: what do caches hold, and why?"}]}`, c.Model, i), nil)
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
	}
	lines := c.Logs.Lines(tokenizerWarning)
	if len(lines) != 1 {
		t.Fatalf("%d tokenizer warnings, want 1: %q", len(lines), lines)
	}
	for _, want := range []string{"kvbus_prompt_tokens=", "engine_prompt_tokens=", "--tokenizer engine", "req_id="} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("warning %q lacks %q", lines[0], want)
		}
	}
	t.Log(lines[0])
}

// tokenizerWarning is in the worker's warning of a tokenizer that does not
// match the engine's.
const tokenizerWarning = "kvbus's tokenizer does not match the engine's"

// TestEngineLoRAAdapterSharesNoBlocksWithItsModel: an engine serves a LoRA
// adapter of its model (vLLM's --lora-modules; GET /v1/models lists it
// with the model as its parent). vLLM keys an adapter's blocks with its
// name, so a prompt the model cached is computed again for the adapter.
// kvbus hashes the adapter's prompt with the adapter too: it predicts none
// of the model's blocks for it, as the engine finds none; the adapter's
// next identical prompt, and the model's, are predicted whole, as the
// engine finds them. Before, the adapter's prompt was hashed as the
// model's: its ReqMeta predicted 608 cached tokens where the engine found
// none.
func TestEngineLoRAAdapterSharesNoBlocksWithItsModel(t *testing.T) {
	c, engines := engineCluster(t, 1, func(_ int, cfg *fakeengine.Config) { cfg.LoRAModules = []string{"sql-lora"} })
	metas := c.Observe(t, "kvbus.meta.>")
	var b strings.Builder
	for i := range 60 {
		fmt.Fprintf(&b, "Schema line %d: table orders, column amount. ", i)
	}
	chat := func(model string) string {
		body, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 4,
			"messages": []map[string]string{{"role": "system", "content": b.String()}, {"role": "user", "content": "total per day?"}}})
		return string(body)
	}
	send := func(model string) (*messages.LoadSpec, int, int, string) {
		t.Helper()
		status, hdr, body := testenv.Send(t, "POST", c.URL+"/v1/chat/completions", chat(model), nil)
		if status != http.StatusOK {
			t.Fatalf("%s: status %d: %s", model, status, body)
		}
		var r struct {
			Model string `json:"model"`
			Usage struct {
				PromptTokens        int `json:"prompt_tokens"`
				PromptTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(body, &r); err != nil {
			t.Fatal(err)
		}
		return metaOf(t, metas, hdr.Get("X-Request-Id")).LoadSpec, r.Usage.PromptTokens, r.Usage.PromptTokensDetails.CachedTokens, r.Model
	}

	// The model's prompt, then the index holds what the engine cached.
	if _, _, _, model := send(c.Model); model != c.Model {
		t.Fatalf("the model's answer names %q", model)
	}
	testenv.Eventually(t, 10*time.Second, "the engine's KV events reach the index", func() bool {
		return c.Scheduler.Index().GroupBlocks("g0") >= engines[0].CachedBlocks()-1 && c.Scheduler.Index().Plans() == 0
	})
	full := 0
	for _, turn := range []string{"sql-lora", "sql-lora", c.Model} {
		spec, prompt, cached, model := send(turn)
		if model != turn {
			t.Errorf("%s: the answer names model %q", turn, model)
		}
		full = (prompt - 1) / 16 * 16
		t.Logf("%s: %d-token prompt, predicted %d cached, the engine found %d", turn, prompt, spec.KVPoolCachedTokens, cached)
		if spec.KVPoolCachedTokens != cached {
			t.Errorf("%s: kvbus predicted %d cached tokens where the engine found %d", turn, spec.KVPoolCachedTokens, cached)
		}
	}
	if full < 600 {
		t.Fatalf("the prompt has %d full-block tokens: too short to show a prediction", full)
	}

	// A captured adapter request replayed over HTTP asks for the adapter.
	r, err := replay.New(replay.Config{Target: c.URL, Timeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	prompt := testenv.PromptTokens(3, 40)
	captured := &messages.Request{RequestID: "captured-lora", Model: c.Model, LoRAName: "sql-lora", PromptTokenIDs: prompt,
		Endpoint: messages.EndpointCompletions, SamplingParams: messages.SamplingParams{MaxTokens: 2, Temperature: 1, TopP: 1}}
	results, _, err := r.Run(t.Context(), []replay.Item{{Prompt: prompt, Request: captured}})
	if err != nil || results[0].Err != "" {
		t.Fatalf("replay: %v %s", err, results[0].Err)
	}
	if _, got := engineOf(t, engines, results[0].ReqID); got.Body["model"] != "sql-lora" {
		t.Errorf("the replayed adapter request reached the engine as %s, want model sql-lora", got.RawBody)
	}
}

// TestEngineAnswerIDKeepsAClientIDThatJSONEscapes: a client's request id
// may hold any printable ASCII, so also a quote or a backslash, which the
// engine escapes in its JSON ("chatcmpl-a\"b\\c-<nuid>"). The client gets
// chatcmpl-<its id>, escaped alike, as from vLLM directly, streamed or not,
// from the X-Request-Id header or the body's request_id. It failed before:
// the frontend looked for the engine's id unescaped, found nothing, and the
// client got the bus id, chatcmpl-a\"b\\c-<nuid>.
func TestEngineAnswerIDKeepsAClientIDThatJSONEscapes(t *testing.T) {
	c, _ := engineCluster(t, 1, nil)
	const clientID = `a"b\c`
	wantID, _ := json.Marshal("chatcmpl-" + clientID)
	for _, tc := range []struct {
		name, body string
		header     map[string]string
	}{
		{"header", `{"model":%q,"messages":[{"role":"user","content":"hi"}],"max_tokens":3%s}`, map[string]string{"X-Request-Id": clientID}},
		{"body", `{"model":%q,"request_id":"a\"b\\c","messages":[{"role":"user","content":"hi"}],"max_tokens":3%s}`, nil},
	} {
		for _, stream := range []string{"", `,"stream":true`} {
			status, h, body := testenv.Send(t, "POST", c.URL+"/v1/chat/completions", fmt.Sprintf(tc.body, c.Model, stream), tc.header)
			if status != http.StatusOK || h.Get("X-Request-Id") != clientID {
				t.Fatalf("%s%s: %d, X-Request-Id %q: %s", tc.name, stream, status, h.Get("X-Request-Id"), body)
			}
			want := `"id":` + string(wantID) + `,`
			if n := strings.Count(string(body), `"id":`); n == 0 || strings.Count(string(body), want) != n {
				t.Errorf("%s%s: answer %s; want every id %s", tc.name, stream, body, wantID)
			}
		}
	}
}

// TestEngineTakesTokenIDsOfItsOwnVocabulary: with --engine openai and the
// embedded o200k tokenizer (the default), a token-id prompt goes to the
// engine, which knows its vocabulary: an id the engine has but o200k does
// not (the fake's vocabulary is 2^18, as Gemma 3's 262,144; Llama 4's is
// 202,048, o200k's 201,088) is answered, and one beyond the engine's gets
// the engine's own 400. It failed before: the frontend refused the first
// with its 400 "out of vocabulary [0, 201088)", where vLLM answers it.
func TestEngineTakesTokenIDsOfItsOwnVocabulary(t *testing.T) {
	e, err := fakeengine.New(fakeengine.Config{ModelName: "kvbus-sim"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	c := testenv.StartCluster(t, testenv.ClusterConfig{
		Engines: []cluster.EngineBackend{{OpenAI: workers.OpenAIConfig{URL: e.URL(), HealthInterval: 100 * time.Millisecond}}}})
	for _, prompt := range []string{`[1, 201088, 250000]`, `[[1, 201088, 250000]]`} {
		for _, stream := range []string{"", `,"stream":true`} {
			status, _, body := testenv.Send(t, "POST", c.URL+"/v1/completions",
				fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":2%s}`, c.Model, prompt, stream), nil)
			if status != http.StatusOK || !strings.Contains(string(body), `"text_completion"`) {
				t.Errorf("prompt %s%s: %d %.300s; want the engine's answer", prompt, stream, status, body)
			}
		}
	}
	status, _, body := testenv.Send(t, "POST", c.URL+"/v1/completions",
		fmt.Sprintf(`{"model":%q,"prompt":[1, %d],"max_tokens":2}`, c.Model, fakeengine.VocabSize), nil)
	if status != http.StatusBadRequest || !strings.Contains(string(body), "BadRequestError") {
		t.Errorf("an id beyond the engine's vocabulary: %d %s; want the engine's 400", status, body)
	}
}

// TestEngineAnswerLargerThanTheBusTakes: an engine's whole answer larger
// than the NATS server's max payload (here 32 KiB; a stock nats-server
// takes 1 MiB, a few thousand tokens with top logprobs) reaches the client
// whole, as from the engine directly. Before, the client got a 500
// engine_error naming the max payload.
func TestEngineAnswerLargerThanTheBusTakes(t *testing.T) {
	c, engines := engineClusterWith(t, 1, func(_ int, cfg *fakeengine.Config) { cfg.ReplyTokens, cfg.MaxModelLen = 6000, 8192 },
		func(cc *testenv.ClusterConfig) { cc.MaxPayload = 32 << 10 })
	body := fmt.Sprintf(`{"model":%q,"max_tokens":7000,"messages":[{"role":"user","content":"write a long answer"}]}`, c.Model)
	answer := func(url string) (int, string, []byte) {
		status, _, raw := testenv.Send(t, "POST", url+"/v1/chat/completions", body, nil)
		var r struct {
			Choices []struct {
				Message struct{ Content string }
			}
		}
		if err := json.Unmarshal(raw, &r); err != nil || len(r.Choices) != 1 {
			return status, "", raw
		}
		return status, r.Choices[0].Message.Content, raw
	}
	_, want, _ := answer(engines[0].URL())
	status, got, raw := answer(c.URL)
	if len(want) <= 32<<10 {
		t.Fatalf("the engine's answer has %d bytes of text: too short to need splitting", len(want))
	}
	if status != http.StatusOK || got != want {
		t.Fatalf("through kvbus: %d, %d bytes of text (answer %.300s); want 200 and the engine's %d bytes", status, len(got), raw, len(want))
	}
}

// TestEngineModelKeepsAnAdapterTheEngineServes: with --engine-model (the
// engine serves the model under another name than kvbus's --model), a
// request for kvbus's name reaches the engine under the engine's, and a
// request for a LoRA adapter the engine lists keeps the adapter's name, as
// any model the engines list keeps its name in the body they get. It
// failed before: the worker put the engine's model name in every body, so
// the adapter's request ran on the base model (its answer named it),
// while kvbus hashed its prompt as the adapter's.
func TestEngineModelKeepsAnAdapterTheEngineServes(t *testing.T) {
	c, _ := engineClusterWith(t, 1, func(_ int, cfg *fakeengine.Config) {
		cfg.ModelName, cfg.LoRAModules = "org/served-model", []string{"sql-lora"}
	}, func(cc *testenv.ClusterConfig) {
		for i := range cc.Engines {
			cc.Engines[i].OpenAI.Model = "org/served-model"
		}
	})
	for _, tc := range []struct{ asked, want string }{{c.Model, "org/served-model"}, {"sql-lora", "sql-lora"}} {
		status, _, body := testenv.Send(t, "POST", c.URL+"/v1/chat/completions",
			fmt.Sprintf(`{"model":%q,"max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`, tc.asked), nil)
		var r struct{ Model string }
		if err := json.Unmarshal(body, &r); status != http.StatusOK || err != nil || r.Model != tc.want {
			t.Errorf("model %s: %d %.300s; want the answer of %s", tc.asked, status, body, tc.want)
		}
	}
	// GET /v1/models/{model} (OpenAI's retrieve) answers the engines' own
	// entry for each id they list, slashes and all, and 404 for another.
	for _, id := range []string{"org/served-model", "sql-lora", c.Model} {
		status, _, body := testenv.Send(t, "GET", c.URL+"/v1/models/"+id, "", nil)
		var m struct {
			ID, Object string
		}
		if err := json.Unmarshal(body, &m); status != http.StatusOK || err != nil || m.ID != id || m.Object != "model" {
			t.Errorf("GET /v1/models/%s: %d %.300s; want its entry", id, status, body)
		}
	}
	if status, _, body := testenv.Send(t, "GET", c.URL+"/v1/models/org/other-model", "", nil); status != http.StatusNotFound ||
		!strings.Contains(string(body), `"code":"model_not_found"`) || !strings.Contains(string(body), "org/served-model") {
		t.Errorf("GET /v1/models/org/other-model: %d %.300s; want 404 model_not_found naming the served ones", status, body)
	}
}

// TestEngineSilentKVEventsWarnOnce: a worker whose --kv-events hears
// nothing of its engine (here its topic is not the engine's; a wrong port
// or an engine started without --kv-events-config is the same to it) says
// so, once, when the engine has stored new blocks and no batch came within
// KVEventsSilence; a worker wired right says it heard the first batch and
// never warns. Before, the deaf worker said nothing: placement silently
// could not see that engine's cache.
func TestEngineSilentKVEventsWarnOnce(t *testing.T) {
	var engines []*fakeengine.Engine
	var backends []cluster.EngineBackend
	for i := range 2 {
		e, err := fakeengine.New(fakeengine.Config{ModelName: "kvbus-sim",
			KVEvents: &fakeengine.KVEventsConfig{Endpoint: "tcp://127.0.0.1:0", Topic: "kv-events", EventForm: fakeengine.EventFormMap}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = e.Close() })
		engines = append(engines, e)
		topic := "kv-events"
		if i == 0 {
			topic = "kv-events-of-another-engine"
		}
		backends = append(backends, cluster.EngineBackend{
			OpenAI:          workers.OpenAIConfig{URL: e.URL(), HealthInterval: 100 * time.Millisecond},
			KVEvents:        &vllmevents.Config{Endpoint: e.KVEventsAddr(), Topic: topic},
			KVEventsSilence: 400 * time.Millisecond,
		})
	}
	tok, err := frontend.NewEngineTokenizer(frontend.EngineTokenizerConfig{URLs: []string{engines[0].URL()}})
	if err != nil {
		t.Fatal(err)
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{Engines: backends, Tokenizer: tok, Policy: "round-robin", MaxModelLen: 8192})
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := engines[1].WaitSubscribed(ctx); err != nil {
		t.Fatalf("the rank wired right never subscribed: %v", err)
	}
	answered := func(e *fakeengine.Engine) bool {
		return slices.ContainsFunc(e.Requests(), func(r fakeengine.Received) bool { return r.Path == "/v1/completions" })
	}
	for i := 0; !answered(engines[0]) || !answered(engines[1]); i++ {
		if i == 20 {
			t.Fatal("round-robin placement sent no request to one of the engines")
		}
		status, _, body := testenv.Send(t, "POST", c.URL+"/v1/completions",
			fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, c.Model, strings.Repeat(fmt.Sprint("prompt ", i, " "), 40)), nil)
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
	}
	const warning = "engine KV events: none heard"
	testenv.Eventually(t, 5*time.Second, "the deaf worker's warning", func() bool {
		return len(c.Logs.Lines(warning, "group=g0")) > 0
	})
	time.Sleep(time.Second) // a second warning would come within a silence or two
	if n := len(c.Logs.Lines(warning)); n != 1 {
		t.Errorf("%d warnings of silent KV events, want one, from g0: %q", n, c.Logs.Lines(warning))
	}
	if lines := c.Logs.Lines(warning, "group=g0"); len(lines) == 1 && !strings.Contains(lines[0], "kv-events-of-another-engine") {
		t.Errorf("the warning does not name the topic kvbus subscribed to: %s", lines[0])
	}
	if n := len(c.Logs.Lines("engine KV events: the first batch was heard", "group=g1")); n != 1 {
		t.Errorf("the worker wired right said %d times that it heard the first batch, want once", n)
	}
	if n := c.Scheduler.Index().GroupBlocks("g1"); n == 0 {
		t.Error("the worker wired right indexed none of its engine's blocks")
	}
}

// TestEngineCacheSaltSharesNoBlocks: the engine keys a salted prompt's
// blocks apart, as vLLM does (the salt is an extra key of its first
// block), and kvbus predicts what the engine finds: none for the same
// prompt under another salt or none, all of it for the salt's repeat.
// Before, the fake engine ignored cache_salt: a salted prompt found the
// unsalted one's 592 tokens, and a replay of salted requests beat its own
// ideal hit ratio.
func TestEngineCacheSaltSharesNoBlocks(t *testing.T) {
	c, engines := engineCluster(t, 1, nil)
	metas := c.Observe(t, "kvbus.meta.>")
	prompt := strings.Repeat("The same long system prompt for every tenant. ", 60)
	send := func(salt string) (predicted, prompted, cached int) {
		t.Helper()
		b := map[string]any{"model": c.Model, "max_tokens": 4, "messages": []map[string]string{{"role": "user", "content": prompt}}}
		if salt != "" {
			b["cache_salt"] = salt
		}
		body, _ := json.Marshal(b)
		status, hdr, raw := testenv.Send(t, "POST", c.URL+"/v1/chat/completions", string(body), nil)
		if status != http.StatusOK {
			t.Fatalf("salt %q: status %d: %s", salt, status, raw)
		}
		u, ok := answerOf{status, raw}.usage()
		if !ok {
			t.Fatalf("salt %q: no usage in %s", salt, raw)
		}
		return metaOf(t, metas, hdr.Get("X-Request-Id")).LoadSpec.KVPoolCachedTokens, u.PromptTokens, u.Details.CachedTokens
	}
	send("") // the unsalted prompt, cached by the engine and indexed from its events
	testenv.Eventually(t, 10*time.Second, "the engine's KV events reach the index", func() bool {
		return c.Scheduler.Index().GroupBlocks("g0") >= engines[0].CachedBlocks()-1 && c.Scheduler.Index().Plans() == 0
	})
	var full int
	for _, step := range []struct {
		salt  string
		whole bool // the engine finds the whole prompt's full blocks
	}{{"tenant-a", false}, {"tenant-a", true}, {"tenant-b", false}, {"", true}} {
		predicted, prompted, cached := send(step.salt)
		full = (prompted - 1) / 16 * 16
		want := 0
		if step.whole {
			want = full
		}
		t.Logf("salt %q: %d-token prompt, predicted %d cached, the engine found %d", step.salt, prompted, predicted, cached)
		if cached != want {
			t.Errorf("salt %q: the engine found %d cached tokens, want %d", step.salt, cached, want)
		}
		if predicted != cached {
			t.Errorf("salt %q: kvbus predicted %d cached tokens where the engine found %d", step.salt, predicted, cached)
		}
	}
	if full < 500 {
		t.Fatalf("the prompt has %d full-block tokens: too short to show a prediction", full)
	}
	if status, _, body := testenv.Send(t, "POST", engines[0].URL()+"/v1/completions",
		fmt.Sprintf(`{"model":%q,"prompt":"hi","cache_salt":""}`, c.Model), nil); status != http.StatusBadRequest || !strings.Contains(string(body), "cache_salt") {
		t.Errorf("an empty cache_salt: %d %s, want vLLM's 400 naming cache_salt", status, body)
	}
}

// TestEngineSilentKVEventsBindHint: a worker that binds its SUB socket
// (--kv-events-bind, for engines that dial their subscriber, as llm-d's
// simulator does) and hears nothing says what the engine must do in that
// wiring: publish to the address the worker bound. Before, the hint was the
// one for --kv-events: start vLLM binding "tcp://*:5557" and point
// --kv-events at it, which is the other wiring (a vLLM that binds never
// reaches a worker that binds too) and names a flag the operator does not
// use.
func TestEngineSilentKVEventsBindHint(t *testing.T) {
	free := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return "tcp://" + ln.Addr().String()
	}
	bound, elsewhere := free(), free()
	// The engine publishes to another address than the worker binds: a
	// simulator started with the wrong --zmq-endpoint.
	e, err := fakeengine.New(fakeengine.Config{ModelName: "kvbus-sim",
		KVEvents: &fakeengine.KVEventsConfig{Endpoint: elsewhere, Connect: true, EventForm: fakeengine.EventFormArray, ZeroRootParent: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	tok, err := frontend.NewEngineTokenizer(frontend.EngineTokenizerConfig{URLs: []string{e.URL()}})
	if err != nil {
		t.Fatal(err)
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{Tokenizer: tok, Policy: "kv", MaxModelLen: 8192,
		Engines: []cluster.EngineBackend{{
			OpenAI:          workers.OpenAIConfig{URL: e.URL(), HealthInterval: 100 * time.Millisecond},
			KVEvents:        &vllmevents.Config{Endpoint: bound, Bind: true},
			KVEventsSilence: 400 * time.Millisecond,
		}}})
	status, _, body := testenv.Send(t, "POST", c.URL+"/v1/completions",
		fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, c.Model, strings.Repeat("a prompt of several blocks ", 40)), nil)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, body)
	}
	const warning = "engine KV events: none heard"
	testenv.Eventually(t, 5*time.Second, "the deaf worker's warning", func() bool {
		return len(c.Logs.Lines(warning)) > 0
	})
	line := c.Logs.Lines(warning)[0]
	for _, want := range []string{"--kv-events-bind", strings.TrimPrefix(bound, "tcp://")} {
		if !strings.Contains(line, want) {
			t.Errorf("the warning of a worker that binds does not say %q: %s", want, line)
		}
	}
	if strings.Contains(line, "tcp://*:5557") {
		t.Errorf("the warning of a worker that binds tells the engine to bind too: %s", line)
	}
}

// TestEngineUnknownParentIsAnErrorFromTheFirstBatch: a worker that heard
// its engine's KV events from the engine's first batch on knows every block
// the engine announced, so a block chained from one it never heard of is
// an error of the engine's stream, logged at ERROR, whether the engine
// numbers its batches from 0 (vLLM) or from 1 (llm-d's inference
// simulator, whose replay endpoint held nothing when the worker joined).
// Before, only a batch numbered 0 counted as the first: behind the
// simulator every such error was logged once at INFO as expected after a
// worker restart, which it was not.
func TestEngineUnknownParentIsAnErrorFromTheFirstBatch(t *testing.T) {
	for _, first := range []uint64{0, 1} {
		t.Run(fmt.Sprint("first batch ", first), func(t *testing.T) {
			c, engines := engineCluster(t, 1, func(_ int, cfg *fakeengine.Config) {
				cfg.KVEvents.FirstSeq = first
				cfg.KVEvents.ReplayEndpoint = "tcp://127.0.0.1:0"
			})
			e := engines[0]
			client := &http.Client{Timeout: 30 * time.Second}
			defer client.CloseIdleConnections()
			d := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 9,
				Headers: map[string]string{"X-Session-ID": "orphans"}}.Start()
			e.LoseNext(1) // the first turn's blocks: announced by no event
			if _, err := d.Next(t.Context()); err != nil {
				t.Fatal(err)
			}
			if _, err := d.Next(t.Context()); err != nil { // chained from them
				t.Fatal(err)
			}
			testenv.Eventually(t, 5*time.Second, "the second turn's batch heard", func() bool {
				return len(c.Logs.Lines("engine KV events: the first batch was heard")) == 1
			})
			testenv.Eventually(t, 5*time.Second, "the unknown parent reported", func() bool {
				return len(c.Logs.Lines("blocks skipped", "unknown parent")) > 0 ||
					len(c.Logs.Lines("blocks chained from blocks the engine cached before")) > 0
			})
			if l := c.Logs.Lines("blocks skipped", "unknown parent", "level=ERROR"); len(l) != 1 {
				t.Errorf("engine numbering from %d: ERROR lines %q, want one; INFO: %q", first, l,
					c.Logs.Lines("blocks chained from blocks the engine cached before"))
			}
		})
	}
}
