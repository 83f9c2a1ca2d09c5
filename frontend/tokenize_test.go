package frontend_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/testenv/fakeengine"
)

// tokenized is /tokenize's answer.
type tokenized struct {
	Count       int       `json:"count"`
	MaxModelLen int       `json:"max_model_len"`
	Tokens      []uint32  `json:"tokens"`
	TokenStrs   *[]string `json:"token_strs"`
}

func tokenizeOK(t *testing.T, c *testenv.Cluster, body string) tokenized {
	t.Helper()
	r := do(t, c, http.MethodPost, "/tokenize", body, nil)
	if r.status != http.StatusOK {
		t.Fatalf("/tokenize %s: status %d: %s", body, r.status, r.body)
	}
	var out tokenized
	if err := json.Unmarshal(r.body, &out); err != nil {
		t.Fatal(err)
	}
	if out.Count != len(out.Tokens) {
		t.Errorf("count %d for %d tokens", out.Count, len(out.Tokens))
	}
	return out
}

func detokenizeOK(t *testing.T, c *testenv.Cluster, ids []uint32) string {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"tokens": ids})
	r := do(t, c, http.MethodPost, "/detokenize", string(b), nil)
	if r.status != http.StatusOK {
		t.Fatalf("/detokenize: status %d: %s", r.status, r.body)
	}
	var out struct{ Prompt *string }
	if err := json.Unmarshal(r.body, &out); err != nil || out.Prompt == nil {
		t.Fatalf("/detokenize answered %s (%v): want {\"prompt\": ...}", r.body, err)
	}
	return *out.Prompt
}

// promptTokens is usage.prompt_tokens of a generate request's answer.
func promptTokens(t *testing.T, c *testenv.Cluster, route, body string) int {
	t.Helper()
	r := do(t, c, http.MethodPost, route, body, nil)
	if r.status != http.StatusOK {
		t.Fatalf("%s: status %d: %s", route, r.status, r.body)
	}
	n, _ := path(t, decode(t, r.body), "usage", "prompt_tokens").(float64)
	return int(n)
}

// TestTokenizeIsWhatRequestsAreCharged: vLLM's /tokenize and /detokenize
// on the frontend give exactly the tokens a chat or completion request of
// the same prompt is charged for (its usage.prompt_tokens), and turn them
// back into the text the template rendered.
func TestTokenizeIsWhatRequestsAreCharged(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{MaxModelLen: 4096})
	msgs := `[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello there, how are you?"}]`

	chat := tokenizeOK(t, c, `{"model":"`+c.Model+`","messages":`+msgs+`}`)
	if want := promptTokens(t, c, "/v1/chat/completions", `{"model":"`+c.Model+`","max_tokens":2,"messages":`+msgs+`}`); chat.Count != want {
		t.Errorf("/tokenize of the messages: %d tokens; the chat request was charged %d", chat.Count, want)
	}
	if chat.MaxModelLen != 4096 {
		t.Errorf("max_model_len %d, want 4096", chat.MaxModelLen)
	}
	if chat.TokenStrs != nil {
		t.Errorf("token_strs %v without return_token_strs", *chat.TokenStrs)
	}
	rendered := "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|>Hello there, how are you?<|im_end|>"
	if got := detokenizeOK(t, c, chat.Tokens); got != rendered+"<|im_start|>assistant<|im_sep|>" {
		t.Errorf("/detokenize of the chat's tokens: %q", got)
	}
	b, _ := json.Marshal(map[string]any{"tokens": chat.Tokens})
	if r := do(t, c, http.MethodPost, "/detokenize", string(b), nil); !strings.Contains(string(r.body), `"<|im_start|>system`) {
		t.Errorf("the markers are written escaped (vLLM writes them as they are): %s", r.body)
	}
	noPrompt := tokenizeOK(t, c, `{"messages":`+msgs+`,"add_generation_prompt":false}`)
	if got := detokenizeOK(t, c, noPrompt.Tokens); got != rendered {
		t.Errorf("add_generation_prompt false: %q, want %q", got, rendered)
	}
	open := tokenizeOK(t, c, `{"messages":`+msgs+`,"add_generation_prompt":false,"continue_final_message":true}`)
	if got, want := detokenizeOK(t, c, open.Tokens), strings.TrimSuffix(rendered, "<|im_end|>"); got != want {
		t.Errorf("continue_final_message: %q, want %q", got, want)
	}

	const text = "Once upon a time, in a land far away — naïve café."
	comp := tokenizeOK(t, c, `{"prompt":`+strings.TrimSpace(mustJSON(t, text))+`,"return_token_strs":true}`)
	if want := promptTokens(t, c, "/v1/completions", `{"max_tokens":2,"prompt":`+mustJSON(t, text)+`}`); comp.Count != want {
		t.Errorf("/tokenize of the prompt: %d tokens; the completion was charged %d", comp.Count, want)
	}
	if got := detokenizeOK(t, c, comp.Tokens); got != text {
		t.Errorf("/detokenize round trip: %q, want %q", got, text)
	}
	if comp.TokenStrs == nil || len(*comp.TokenStrs) != comp.Count {
		t.Fatalf("return_token_strs: %v for %d tokens", comp.TokenStrs, comp.Count)
	}
	if got := detokenizeOK(t, c, []uint32{}); got != "" {
		t.Errorf("/detokenize of no tokens: %q", got)
	}

	for _, tc := range []struct {
		name, route, body string
		status            int
		param             string
	}{
		{"both prompt and messages", "/tokenize", `{"prompt":"a","messages":` + msgs + `}`, 400, "prompt"},
		{"neither", "/tokenize", `{"model":"` + c.Model + `"}`, 400, "prompt"},
		{"prompt not a string", "/tokenize", `{"prompt":[1,2]}`, 400, "prompt"},
		{"both generation prompt and continue", "/tokenize", `{"messages":` + msgs + `,"continue_final_message":true}`, 400, "continue_final_message"},
		{"unknown model", "/tokenize", `{"model":"nope","prompt":"a"}`, 404, "model"},
		{"token out of vocabulary", "/detokenize", `{"tokens":[1,999999999]}`, 400, "tokens"},
		{"no tokens", "/detokenize", `{}`, 400, "tokens"},
		{"not JSON", "/detokenize", `{"tokens":`, 400, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := do(t, c, http.MethodPost, tc.route, tc.body, nil)
			if r.status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.status, tc.status, r.body)
			}
			if got, _ := path(t, decode(t, r.body), "error", "param").(string); got != tc.param {
				t.Errorf("param %q, want %q: %s", got, tc.param, r.body)
			}
		})
	}
	if r := do(t, c, http.MethodGet, "/tokenize", "", nil); r.status != http.StatusMethodNotAllowed {
		t.Errorf("GET /tokenize: %d, want 405", r.status)
	}
}

// TestChatGenerationPromptFieldsAreCharged: a chat request's own
// add_generation_prompt and continue_final_message (vLLM's
// ChatCompletionRequest fields) shape its prompt as they shape /tokenize's:
// a client continuing an assistant's message is charged, and its blocks
// hashed, without the new assistant turn /tokenize leaves out. Both true
// is vLLM's 400.
func TestChatGenerationPromptFieldsAreCharged(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	msgs := `[{"role":"user","content":"Write a poem."},{"role":"assistant","content":"Roses are"}]`
	for _, fields := range []string{``, `,"add_generation_prompt":true`, `,"add_generation_prompt":false`,
		`,"add_generation_prompt":false,"continue_final_message":true`} {
		want := tokenizeOK(t, c, `{"messages":`+msgs+fields+`}`).Count
		if got := promptTokens(t, c, "/v1/chat/completions", `{"max_tokens":2,"messages":`+msgs+fields+`}`); got != want {
			t.Errorf("chat with %q was charged %d prompt tokens; /tokenize of the same says %d", fields, got, want)
		}
	}
	r := do(t, c, http.MethodPost, "/v1/chat/completions", `{"max_tokens":2,"messages":`+msgs+`,"continue_final_message":true}`, nil)
	if r.status != http.StatusBadRequest {
		t.Fatalf("continue_final_message beside the default add_generation_prompt: status %d, want 400: %s", r.status, r.body)
	}
	if got, _ := path(t, decode(t, r.body), "error", "param").(string); got != "continue_final_message" {
		t.Errorf("param %q, want continue_final_message: %s", got, r.body)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestTokenizeRelaysTheEngines: with --tokenizer engine, /tokenize and
// /detokenize are the engine's own answers, relayed whole (its errors
// too), with the engine's model name where the client named kvbus's.
func TestTokenizeRelaysTheEngines(t *testing.T) {
	e := startFakeEngine(t, fakeengine.Config{ModelName: "engine-model"})
	var mu sync.Mutex
	var detok []map[string]any
	detokURL := testenv.ServeEngine(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/detokenize" {
			http.NotFound(w, r)
			return
		}
		var body map[string]any
		raw, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(raw, &body)
		mu.Lock()
		detok = append(detok, body)
		mu.Unlock()
		if toks, _ := body["tokens"].([]any); len(toks) > 2 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"too many","type":"BadRequestError","param":null,"code":400}}`)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"prompt":"from the engine"}`)
	})
	tok := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: []string{e.URL()}, Model: "engine-model"})
	c := testenv.StartCluster(t, testenv.ClusterConfig{Tokenizer: tok})

	body := `{"model":"` + c.Model + `","messages":[{"role":"user","content":"hello engine"}],"return_token_strs":true}`
	r := do(t, c, http.MethodPost, "/tokenize", body, nil)
	direct := strings.Replace(body, `"model":"`+c.Model+`"`, `"model":"engine-model"`, 1)
	status, _, want := testenv.Send(t, http.MethodPost, e.URL()+"/tokenize", direct, nil)
	if r.status != http.StatusOK || status != http.StatusOK || !jsonEqual(t, r.body, want) {
		t.Errorf("/tokenize relayed %d %s; the engine answers %d %s", r.status, r.body, status, want)
	}
	got := received(e, "/tokenize")
	if m := got[len(got)-2].Model; m != "engine-model" {
		t.Errorf("the engine was asked for model %q, want engine-model", m)
	}

	// /detokenize: a second tokenizer, on an engine that has it.
	tok2 := newEngineTokenizer(t, frontend.EngineTokenizerConfig{URLs: []string{detokURL}, Model: "engine-model"})
	c2 := testenv.StartCluster(t, testenv.ClusterConfig{Tokenizer: tok2})
	r = do(t, c2, http.MethodPost, "/detokenize", `{"tokens":[5,6]}`, nil)
	if r.status != http.StatusOK || !jsonEqual(t, r.body, []byte(`{"prompt":"from the engine"}`)) {
		t.Errorf("/detokenize relayed %d %s", r.status, r.body)
	}
	r = do(t, c2, http.MethodPost, "/detokenize", `{"tokens":[5,6,7]}`, nil)
	if r.status != http.StatusBadRequest || !strings.Contains(string(r.body), "too many") {
		t.Errorf("the engine's 400 relayed as %d %s", r.status, r.body)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(detok) != 2 || detok[0]["model"] != "engine-model" {
		t.Errorf("the engine got %v, want two bodies with model engine-model", detok)
	}
}

func jsonEqual(t *testing.T, a, b []byte) bool {
	t.Helper()
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return string(xa) == string(ya)
}

// TestTokenizeEmptyPrompt: an empty prompt is no tokens, answered as
// vLLM's TokenizeResponse answers it, an empty list ("tokens": []), not
// null, which a client iterating the list cannot read.
func TestTokenizeEmptyPrompt(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	for _, body := range []string{`{"prompt":""}`, `{"prompt":"","return_token_strs":true}`} {
		r := do(t, c, http.MethodPost, "/tokenize", body, nil)
		if r.status != http.StatusOK {
			t.Fatalf("/tokenize %s: status %d: %s", body, r.status, r.body)
		}
		tokens, ok := path(t, decode(t, r.body), "tokens").([]any)
		if !ok || len(tokens) != 0 {
			t.Errorf("/tokenize %s: %s, want \"tokens\": []", body, r.body)
		}
	}
}

// TestTruncatePromptTokens: vLLM's truncate_prompt_tokens keeps a prompt's
// last k tokens, before the length checks, on both routes; the request is
// charged, and its blocks hashed and cached, as truncated. -1 is
// max_model_len's worth, k above max_model_len vLLM's 400. The sim
// ignored the field: the whole prompt was charged, and one over
// max_model_len refused where vLLM serves its end.
func TestTruncatePromptTokens(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{MaxModelLen: 64})
	ids := func(from, to int) string { // token ids from..to-1 as a JSON array
		b, _ := json.Marshal(func() (out []int) {
			for i := from; i < to; i++ {
				out = append(out, 1000+i)
			}
			return out
		}())
		return string(b)
	}
	long := strings.Repeat("a quick brown fox jumps over the lazy dog ", 12) // > 64 tokens
	for _, tc := range []struct {
		route, body string
		want        int // prompt tokens charged
	}{
		{"/v1/completions", `{"max_tokens":2,"prompt":` + ids(0, 40) + `,"truncate_prompt_tokens":16}`, 16},
		{"/v1/completions", `{"max_tokens":2,"prompt":` + ids(0, 10) + `,"truncate_prompt_tokens":16}`, 10},
		{"/v1/completions", `{"max_tokens":4,"prompt":"` + long + `","truncate_prompt_tokens":32}`, 32},
		{"/v1/completions", `{"max_tokens":4,"prompt":["` + long + `","short"],"truncate_prompt_tokens":32.0}`, 32 + 1},
		{"/v1/chat/completions", `{"max_tokens":4,"messages":[{"role":"user","content":"` + long + `"}],"truncate_prompt_tokens":8}`, 8},
	} {
		if got := promptTokens(t, c, tc.route, tc.body); got != tc.want {
			t.Errorf("%s %.120s…: charged %d prompt tokens, want %d", tc.route, tc.body, got, tc.want)
		}
	}
	for _, tc := range []struct {
		body, param string
	}{
		{`{"max_tokens":4,"prompt":"` + long + `"}`, "prompt"}, // too long without it
		{`{"max_tokens":4,"prompt":"` + long + `","truncate_prompt_tokens":65}`, "truncate_prompt_tokens"},
		{`{"max_tokens":1,"prompt":"` + long + `","truncate_prompt_tokens":-1}`, "prompt"}, // 64 tokens leave no room
		{`{"max_tokens":4,"prompt":"x","truncate_prompt_tokens":-2}`, "truncate_prompt_tokens"},
		{`{"max_tokens":4,"prompt":"x","truncate_prompt_tokens":0}`, "truncate_prompt_tokens"},
		{`{"max_tokens":4,"prompt":"x","truncate_prompt_tokens":1.5}`, "truncate_prompt_tokens"},
	} {
		r := do(t, c, http.MethodPost, "/v1/completions", tc.body, nil)
		if r.status != http.StatusBadRequest {
			t.Errorf("%.120s…: status %d, want 400: %s", tc.body, r.status, r.body)
			continue
		}
		if got, _ := path(t, decode(t, r.body), "error", "param").(string); got != tc.param {
			t.Errorf("%.120s…: param %q, want %q: %s", tc.body, got, tc.param, r.body)
		}
	}
	// What is cached is the truncated prompt: ids 16..47 (two blocks of
	// 16) are found by a prompt that begins with them.
	promptTokens(t, c, "/v1/completions", `{"max_tokens":1,"prompt":`+ids(0, 48)+`,"truncate_prompt_tokens":32}`)
	r := do(t, c, http.MethodPost, "/v1/completions", `{"max_tokens":1,"prompt":`+ids(16, 56)+`}`, nil)
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	if got, _ := path(t, decode(t, r.body), "usage", "prompt_tokens_details", "cached_tokens").(float64); got != 32 {
		t.Errorf("a prompt beginning with the truncated one found %v cached tokens, want its 32 (two blocks)", got)
	}
}
