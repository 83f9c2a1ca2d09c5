package fakeengine_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/testenv/fakeengine"
)

// TestMain fails the package's tests if a goroutine outlives them.
// go-zeromq's PUB socket never stops its writer goroutine
// (pubSocket.Close does not close its pubMWriter, in v0.17.0).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

func newEngine(t *testing.T, cfg fakeengine.Config) *fakeengine.Engine {
	t.Helper()
	e, err := fakeengine.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return e
}

// do sends a request with a JSON body (nil: none) and returns the
// response with its body read.
func do(t *testing.T, method, url string, body any, header map[string]string) (*http.Response, []byte) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

// post posts body and decodes a 200 JSON answer.
func post(t *testing.T, e *fakeengine.Engine, path string, body any) map[string]any {
	t.Helper()
	resp, b := do(t, http.MethodPost, e.URL()+path, body, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s: %d %s", path, resp.StatusCode, b)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("POST %s: Content-Type %q", path, ct)
	}
	return decode(t, b)
}

func decode(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	return m
}

// stream posts a streaming request and returns its chunks, checking the
// SSE framing and the final [DONE].
func stream(t *testing.T, e *fakeengine.Engine, path string, body any) []map[string]any {
	t.Helper()
	resp, b := do(t, http.MethodPost, e.URL()+path, body, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s: %d %s", path, resp.StatusCode, b)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
		t.Fatalf("Content-Type %q", ct)
	}
	events := strings.Split(string(b), "\n\n")
	if events[len(events)-1] != "" || events[len(events)-2] != "data: [DONE]" {
		t.Fatalf("stream does not end with data: [DONE]: %q", b)
	}
	var chunks []map[string]any
	for _, ev := range events[:len(events)-2] {
		data, ok := strings.CutPrefix(ev, "data: ")
		if !ok || strings.Contains(data, "\n") {
			t.Fatalf("not an SSE data event: %q", ev)
		}
		chunks = append(chunks, decode(t, []byte(data)))
	}
	return chunks
}

func num(t *testing.T, v any) int {
	t.Helper()
	f, ok := v.(float64)
	if !ok {
		t.Fatalf("%v (%T) is not a number", v, v)
	}
	return int(f)
}

// usageOf returns usage's prompt, completion and total tokens and cached
// tokens (-1 when prompt_tokens_details is absent or null).
func usageOf(t *testing.T, resp map[string]any) (prompt, completion, total, cached int) {
	t.Helper()
	u, ok := resp["usage"].(map[string]any)
	if !ok {
		t.Fatalf("no usage in %v", resp)
	}
	cached = -1
	if d, ok := u["prompt_tokens_details"].(map[string]any); ok {
		cached = num(t, d["cached_tokens"])
	}
	return num(t, u["prompt_tokens"]), num(t, u["completion_tokens"]), num(t, u["total_tokens"]), cached
}

func choice0(t *testing.T, resp map[string]any) map[string]any {
	t.Helper()
	cs, ok := resp["choices"].([]any)
	if !ok || len(cs) != 1 {
		t.Fatalf("choices: %v", resp["choices"])
	}
	return cs[0].(map[string]any)
}

func msgs(kv ...string) []map[string]any {
	var out []map[string]any
	for i := 0; i+1 < len(kv); i += 2 {
		out = append(out, map[string]any{"role": kv[i], "content": kv[i+1]})
	}
	return out
}

// words returns n distinct words.
func words(prefix string, n int) string {
	ws := make([]string, n)
	for i := range ws {
		ws[i] = prefix + strings.Repeat("x", i%7) + string(rune('a'+i%26)) + string(rune('a'+i/26%26))
	}
	return strings.Join(ws, " ")
}

func TestChatCompletion(t *testing.T) {
	e := newEngine(t, fakeengine.Config{ModelName: "Qwen/Qwen3-8B"})
	messages := msgs("system", "be brief", "user", "hello there, engine")
	resp := post(t, e, "/v1/chat/completions", map[string]any{"model": "Qwen/Qwen3-8B", "messages": messages})
	if id, _ := resp["id"].(string); !strings.HasPrefix(id, "chatcmpl-") || len(id) != len("chatcmpl-")+32 {
		t.Errorf("id %q", id)
	}
	if resp["object"] != "chat.completion" || resp["model"] != "Qwen/Qwen3-8B" || num(t, resp["created"]) == 0 {
		t.Errorf("response %v", resp)
	}
	c := choice0(t, resp)
	msg := c["message"].(map[string]any)
	prompt := fakeengine.ChatTemplate([]fakeengine.Message{{"system", "be brief"}, {"user", "hello there, engine"}}, true, false, false)
	words, ids := fakeengine.Reply(prompt, fakeengine.DefaultReplyTokens)
	if msg["role"] != "assistant" || msg["content"] != fakeengine.ReplyText(words) {
		t.Errorf("message %v, want %q", msg, fakeengine.ReplyText(words))
	}
	if c["finish_reason"] != "stop" || c["index"] != 0.0 {
		t.Errorf("choice %v", c)
	}
	p, comp, total, cached := usageOf(t, resp)
	if p != len(prompt) || comp != len(ids)+1 || total != p+comp || cached != 0 {
		t.Errorf("usage %d %d %d %d, want %d %d", p, comp, total, cached, len(prompt), len(ids)+1)
	}
	// The Tokenize of the reply is its token ids: a conversation sending
	// it back hits the cache.
	if got := fakeengine.Tokenize(fakeengine.ReplyText(words), false); !slices.Equal(got, ids) {
		t.Errorf("Tokenize(reply) = %v, want %v", got, ids)
	}

	// max_completion_tokens (or max_tokens) cuts the reply.
	for _, field := range []string{"max_tokens", "max_completion_tokens"} {
		resp = post(t, e, "/v1/chat/completions", map[string]any{"messages": messages, field: 3})
		c = choice0(t, resp)
		if c["finish_reason"] != "length" || c["message"].(map[string]any)["content"] != fakeengine.ReplyText(words[:3]) {
			t.Errorf("%s 3: choice %v", field, c)
		}
		if _, comp, _, _ := usageOf(t, resp); comp != 3 {
			t.Errorf("%s 3: completion_tokens %d", field, comp)
		}
	}
	// Without prompt_tokens_details, as vLLM without
	// --enable-prompt-tokens-details.
	e2 := newEngine(t, fakeengine.Config{OmitPromptTokensDetails: true})
	resp = post(t, e2, "/v1/chat/completions", map[string]any{"messages": messages})
	if u := resp["usage"].(map[string]any); u["prompt_tokens_details"] != nil {
		t.Errorf("usage %v", u)
	}
	if _, ok := resp["usage"].(map[string]any)["prompt_tokens_details"]; !ok {
		t.Error("prompt_tokens_details is not null but absent")
	}
}

// TestChatStreaming: chunks as vLLM streams them, usage only when
// stream_options.include_usage asks for it.
func TestChatStreaming(t *testing.T) {
	e := newEngine(t, fakeengine.Config{})
	messages := msgs("user", "stream me something")
	full := post(t, e, "/v1/chat/completions", map[string]any{"messages": messages})
	want := choice0(t, full)["message"].(map[string]any)["content"]
	for _, tc := range []struct {
		name        string
		opts        any
		usage       bool
		continuous  bool
		maxTokens   any
		finish      string
		completions int
	}{
		{"no options", nil, false, false, nil, "stop", 9},
		{"include_usage", map[string]any{"include_usage": true}, true, false, nil, "stop", 9},
		{"include_usage false", map[string]any{"include_usage": false}, false, false, nil, "stop", 9},
		{"empty options", map[string]any{}, true, false, nil, "stop", 9},
		{"continuous", map[string]any{"include_usage": true, "continuous_usage_stats": true}, true, true, nil, "stop", 9},
		{"length", map[string]any{"include_usage": true}, true, false, 4, "length", 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := map[string]any{"messages": messages, "stream": true}
			if tc.opts != nil {
				body["stream_options"] = tc.opts
			}
			if tc.maxTokens != nil {
				body["max_tokens"] = tc.maxTokens
			}
			chunks := stream(t, e, "/v1/chat/completions", body)
			var text strings.Builder
			var id string
			for i, c := range chunks {
				if i == 0 {
					id, _ = c["id"].(string)
				}
				if c["id"] != id || !strings.HasPrefix(id, "chatcmpl-") || c["object"] != "chat.completion.chunk" ||
					c["model"] != fakeengine.DefaultModelName {
					t.Fatalf("chunk %d: %v", i, c)
				}
				_, hasUsage := c["usage"]
				last := tc.usage && i == len(chunks)-1
				if last {
					if cs := c["choices"].([]any); len(cs) != 0 {
						t.Fatalf("usage chunk with choices: %v", c)
					}
					p, comp, total, cached := usageOf(t, c)
					if comp != tc.completions || total != p+comp || cached < 0 {
						t.Fatalf("usage chunk %v", c)
					}
					continue
				}
				if hasUsage != tc.continuous {
					t.Fatalf("chunk %d: usage %v, continuous %v", i, c["usage"], tc.continuous)
				}
				ch := choice0(t, c)
				delta := ch["delta"].(map[string]any)
				if i == 0 {
					if delta["role"] != "assistant" || delta["content"] != "" || ch["finish_reason"] != nil {
						t.Fatalf("first chunk %v", c)
					}
					continue
				}
				text.WriteString(delta["content"].(string))
				wantFinish := any(nil)
				if i == len(chunks)-1 || (tc.usage && i == len(chunks)-2) {
					wantFinish = tc.finish
				}
				if ch["finish_reason"] != wantFinish {
					t.Fatalf("chunk %d of %d: finish_reason %v, want %v", i, len(chunks), ch["finish_reason"], wantFinish)
				}
			}
			n := 1 + tc.completions
			if tc.usage {
				n++
			}
			if len(chunks) != n {
				t.Fatalf("%d chunks, want %d", len(chunks), n)
			}
			if tc.finish == "stop" && text.String() != want {
				t.Fatalf("streamed %q, want %q", text.String(), want)
			}
			if tc.finish == "length" && !strings.HasPrefix(want.(string), text.String()) {
				t.Fatalf("streamed %q, not a prefix of %q", text.String(), want)
			}
		})
	}
	// stream_options without stream is refused, as vLLM does.
	resp, b := do(t, http.MethodPost, e.URL()+"/v1/chat/completions",
		map[string]any{"messages": messages, "stream_options": map[string]any{"include_usage": true}}, nil)
	checkError(t, resp, b, 400, "Bad Request", "stream_options")
}

func TestCompletions(t *testing.T) {
	e := newEngine(t, fakeengine.Config{})
	text := "Once upon a time, there was a fake engine"
	textTokens := fakeengine.Tokenize(text, true)
	if textTokens[0] != fakeengine.TokenBOS {
		t.Fatalf("Tokenize with special tokens = %v", textTokens)
	}
	big := []int{5, 200_001, 262_143, 199_999, 17, 250_000, 3, 210_000}
	bigTokens := []uint32{5, 200_001, 262_143, 199_999, 17, 250_000, 3, 210_000}
	for _, tc := range []struct {
		name   string
		prompt any
		tokens []uint32
	}{
		{"text", text, textTokens},
		{"text list", []string{text}, textTokens},
		{"token ids", big, bigTokens},
		{"token id list", [][]int{big}, bigTokens},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, e, "/v1/completions", map[string]any{"model": fakeengine.DefaultModelName, "prompt": tc.prompt})
			if id, _ := resp["id"].(string); !strings.HasPrefix(id, "cmpl-") || resp["object"] != "text_completion" {
				t.Errorf("response %v", resp)
			}
			words, ids := fakeengine.Reply(tc.tokens, fakeengine.DefaultReplyTokens)
			c := choice0(t, resp)
			if c["text"] != fakeengine.ReplyText(words) || c["finish_reason"] != "stop" {
				t.Errorf("choice %v", c)
			}
			if p, comp, total, _ := usageOf(t, resp); p != len(tc.tokens) || comp != len(ids)+1 || total != p+comp {
				t.Errorf("usage %v", resp["usage"])
			}
			reqs := e.Requests()
			if got := reqs[len(reqs)-1].PromptTokens; !slices.Equal(got, tc.tokens) {
				t.Errorf("prefilled %v, want %v", got, tc.tokens)
			}

			// Streamed, with usage.
			chunks := stream(t, e, "/v1/completions", map[string]any{"prompt": tc.prompt, "stream": true,
				"max_tokens": 5, "stream_options": map[string]any{"include_usage": true}})
			if len(chunks) != 6 {
				t.Fatalf("%d chunks", len(chunks))
			}
			var streamed strings.Builder
			for i, ch := range chunks[:5] {
				c := choice0(t, ch)
				streamed.WriteString(c["text"].(string))
				if ch["object"] != "text_completion" || (i == 4) != (c["finish_reason"] == "length") {
					t.Fatalf("chunk %d: %v", i, ch)
				}
			}
			if streamed.String() != fakeengine.ReplyText(words[:5]) {
				t.Errorf("streamed %q", streamed.String())
			}
			if p, comp, _, cached := usageOf(t, chunks[5]); p != len(tc.tokens) || comp != 5 || cached < 0 {
				t.Errorf("usage chunk %v", chunks[5])
			}
		})
	}
	// Without stream_options, no usage chunk.
	chunks := stream(t, e, "/v1/completions", map[string]any{"prompt": text, "stream": true})
	if len(chunks) != fakeengine.DefaultReplyTokens+1 {
		t.Fatalf("%d chunks", len(chunks))
	}
	for _, c := range chunks {
		if _, ok := c["usage"]; ok {
			t.Fatalf("usage without include_usage: %v", c)
		}
	}
	// add_special_tokens false: no BOS.
	post(t, e, "/v1/completions", map[string]any{"prompt": text, "add_special_tokens": false})
	reqs := e.Requests()
	if got := reqs[len(reqs)-1].PromptTokens; !slices.Equal(got, textTokens[1:]) {
		t.Errorf("without special tokens prefilled %v", got)
	}
	// max_tokens defaults to 16 for completions: the reply ends by itself.
	resp := post(t, e, "/v1/completions", map[string]any{"prompt": text})
	if choice0(t, resp)["finish_reason"] != "stop" {
		t.Errorf("default max_tokens: %v", resp)
	}
	// Refusals.
	for _, tc := range []struct {
		body  map[string]any
		typ   string
		param string
	}{
		{map[string]any{"prompt": []int{1, fakeengine.VocabSize}}, "BadRequestError", "prompt"},
		{map[string]any{"prompt": ""}, "Bad Request", ""},
		{map[string]any{"prompt": []string{"a", "b"}}, "BadRequestError", "prompt"},
		{map[string]any{"prompt": "hi", "max_tokens": 0}, "BadRequestError", "max_tokens"},
	} {
		resp, b := do(t, http.MethodPost, e.URL()+"/v1/completions", tc.body, nil)
		checkError(t, resp, b, 400, tc.typ, tc.param)
	}
}

// checkError checks vLLM's error body.
func checkError(t *testing.T, resp *http.Response, b []byte, status int, typ, param string) {
	t.Helper()
	if resp.StatusCode != status {
		t.Fatalf("status %d, want %d: %s", resp.StatusCode, status, b)
	}
	m := decode(t, b)
	info, ok := m["error"].(map[string]any)
	if !ok || len(m) != 1 {
		t.Fatalf("not vLLM's error shape: %s", b)
	}
	msg, _ := info["message"].(string)
	wantParam := any(nil)
	if param != "" {
		wantParam = param
	}
	if msg == "" || info["type"] != typ || num(t, info["code"]) != status || info["param"] != wantParam {
		t.Fatalf("error %s, want type %q param %q code %d", b, typ, param, status)
	}
	if _, ok := info["param"]; !ok {
		t.Fatalf("error without param: %s", b)
	}
}

// TestCachedTokens: a second request extending the first finds exactly
// the first request's full prompt blocks; a repeated prompt never finds
// its last token.
func TestCachedTokens(t *testing.T) {
	const bs = 16
	e := newEngine(t, fakeengine.Config{BlockSize: bs})
	first := msgs("system", words("sys", 30), "user", words("q", 21))
	resp := post(t, e, "/v1/chat/completions", map[string]any{"messages": first})
	p1, _, _, cached := usageOf(t, resp)
	if cached != 0 {
		t.Fatalf("first request cached %d", cached)
	}
	reply := choice0(t, resp)["message"].(map[string]any)["content"].(string)

	// /tokenize gives the same count the chat endpoint prefilled.
	tok := post(t, e, "/tokenize", map[string]any{"messages": first, "add_generation_prompt": true})
	if num(t, tok["count"]) != p1 {
		t.Fatalf("/tokenize count %d, prompt_tokens %d", num(t, tok["count"]), p1)
	}

	// The second request adds a user turn without the reply: its prompt
	// shares the first one's tokens but the generation prompt.
	second := append(slices.Clone(first), msgs("user", words("more", 40))...)
	resp = post(t, e, "/v1/chat/completions", map[string]any{"messages": second})
	p2, _, _, cached := usageOf(t, resp)
	shared := p1 - 1 // the first prompt without its generation prompt
	if want := shared / bs * bs; cached != want {
		t.Fatalf("second request cached %d of %d, want %d (the first's %d prompt tokens' full blocks, not past %d shared tokens)",
			cached, p2, want, p1, shared)
	}

	// A conversation sending the reply back hits the prompt and the
	// reply's computed blocks.
	third := append(slices.Clone(first), msgs("assistant", reply, "user", words("next", 40))...)
	resp = post(t, e, "/v1/chat/completions", map[string]any{"messages": third})
	p3, _, _, cached := usageOf(t, resp)
	// Shared with the first request's computed tokens: its prompt and
	// its reply's words (not the EOT: its KV was never computed).
	sharedWithFirst := p1 + fakeengine.DefaultReplyTokens
	if want := sharedWithFirst / bs * bs; cached != want {
		t.Fatalf("third request cached %d of %d, want %d", cached, p3, want)
	}

	// The same prompt again: all but the block holding the last token.
	resp = post(t, e, "/v1/chat/completions", map[string]any{"messages": third})
	if _, _, _, cached := usageOf(t, resp); cached != (p3-1)/bs*bs {
		t.Fatalf("repeated prompt of %d tokens cached %d, want %d", p3, cached, (p3-1)/bs*bs)
	}
	if got := e.CachedPrefix(e.Requests()[len(e.Requests())-1].PromptTokens); got != p3/bs*bs {
		t.Fatalf("CachedPrefix = %d, want %d", got, p3/bs*bs)
	}

	// A prompt of exactly two blocks, twice: the second time one block
	// is cached, not two, since the last token is always computed.
	prompt := make([]int, 2*bs)
	for i := range prompt {
		prompt[i] = 1000 + i
	}
	post(t, e, "/v1/completions", map[string]any{"prompt": prompt})
	resp = post(t, e, "/v1/completions", map[string]any{"prompt": prompt})
	if _, _, _, cached := usageOf(t, resp); cached != bs {
		t.Fatalf("exact-block prompt cached %d, want %d", cached, bs)
	}

	// Reset empties the cache.
	if err := e.Reset(); err != nil {
		t.Fatal(err)
	}
	if n := e.CachedBlocks(); n != 0 {
		t.Fatalf("%d blocks after Reset", n)
	}
	resp = post(t, e, "/v1/completions", map[string]any{"prompt": prompt})
	if _, _, _, cached := usageOf(t, resp); cached != 0 {
		t.Fatalf("cached %d after Reset", cached)
	}
}

// TestTokenize: /tokenize returns exactly what the completion endpoints
// prefill, and its counts predict cached_tokens.
func TestTokenize(t *testing.T) {
	const bs = 4
	e := newEngine(t, fakeengine.Config{BlockSize: bs, ModelName: "m"})
	conv := msgs("system", "You are a fake.", "user", "What is 2+2? Answer in words, please.")
	tok := post(t, e, "/tokenize", map[string]any{"model": "m", "messages": conv, "add_generation_prompt": true,
		"return_token_strs": true})
	chat := post(t, e, "/v1/chat/completions", map[string]any{"model": "m", "messages": conv})
	reqs := e.Requests()
	prefilled := reqs[len(reqs)-1].PromptTokens
	var tokens []uint32
	for _, v := range tok["tokens"].([]any) {
		tokens = append(tokens, uint32(num(t, v)))
	}
	if !slices.Equal(tokens, prefilled) || num(t, tok["count"]) != len(tokens) || num(t, tok["max_model_len"]) != fakeengine.DefaultMaxModelLen {
		t.Fatalf("/tokenize %v, chat prefilled %v", tok, prefilled)
	}
	if p, _, _, _ := usageOf(t, chat); p != len(tokens) {
		t.Fatalf("prompt_tokens %d, /tokenize count %d", p, len(tokens))
	}
	strs := tok["token_strs"].([]any)
	if len(strs) != len(tokens) || strs[0] != "<|bos|>" || strs[1] != "<|system|>" || strs[2] != "You" ||
		strs[len(strs)-1] != "<|assistant|>" {
		t.Fatalf("token_strs %v", strs)
	}
	// Without the generation prompt: one token less, the rest equal.
	tok2 := post(t, e, "/tokenize", map[string]any{"messages": conv, "add_generation_prompt": false})
	if num(t, tok2["count"]) != len(tokens)-1 || tok2["token_strs"] != nil {
		t.Fatalf("without generation prompt: %v", tok2)
	}
	// A prompt: BOS by default, as /v1/completions.
	text := "the quick brown fox jumps over the lazy dog"
	tok3 := post(t, e, "/tokenize", map[string]any{"prompt": text})
	post(t, e, "/v1/completions", map[string]any{"prompt": text})
	reqs = e.Requests()
	if num(t, tok3["count"]) != 10 || num(t, tok3["count"]) != len(reqs[len(reqs)-1].PromptTokens) {
		t.Fatalf("/tokenize prompt %v, completion prefilled %v", tok3, reqs[len(reqs)-1].PromptTokens)
	}
	// cached_tokens arithmetic: a prompt extending the tokenized text by
	// a word finds the text's full blocks.
	resp := post(t, e, "/v1/completions", map[string]any{"prompt": text + " again"})
	if _, _, _, cached := usageOf(t, resp); cached != 10/bs*bs {
		t.Fatalf("cached %d, want %d", cached, 10/bs*bs)
	}
	// Unknown model.
	resp2, b := do(t, http.MethodPost, e.URL()+"/tokenize", map[string]any{"model": "other", "prompt": "x"}, nil)
	checkError(t, resp2, b, 404, "NotFoundError", "model")
}

func TestErrors(t *testing.T) {
	e := newEngine(t, fakeengine.Config{MaxModelLen: 64, ModelName: "served"})
	for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
		body := map[string]any{"model": "other", "messages": msgs("user", "hi"), "prompt": "hi"}
		resp, b := do(t, http.MethodPost, e.URL()+path, body, nil)
		checkError(t, resp, b, 404, "NotFoundError", "model")
		if m := decode(t, b)["error"].(map[string]any)["message"]; m != "The model `other` does not exist." {
			t.Errorf("message %q", m)
		}
	}
	// Not JSON, or not sent as JSON.
	req, _ := http.NewRequest(http.MethodPost, e.URL()+"/v1/completions", strings.NewReader(`{"prompt": "hi"}`))
	req.Header.Set("Content-Type", "text/plain")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	checkError(t, resp, b, 400, "Bad Request", "")
	req, _ = http.NewRequest(http.MethodPost, e.URL()+"/v1/completions", strings.NewReader(`{"prompt": `))
	req.Header.Set("Content-Type", "application/json")
	if resp, err = http.DefaultClient.Do(req); err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	checkError(t, resp, b, 400, "Bad Request", "")
	// Context length.
	resp, b = do(t, http.MethodPost, e.URL()+"/v1/completions", map[string]any{"prompt": words("w", 70)}, nil)
	checkError(t, resp, b, 400, "BadRequestError", "input_tokens")
	resp, b = do(t, http.MethodPost, e.URL()+"/v1/completions", map[string]any{"prompt": "hi", "max_tokens": 63}, nil)
	checkError(t, resp, b, 400, "BadRequestError", "max_tokens")
	// Missing messages.
	resp, b = do(t, http.MethodPost, e.URL()+"/v1/chat/completions", map[string]any{"model": "served"}, nil)
	checkError(t, resp, b, 400, "Bad Request", "")
	// Unknown path: FastAPI's 404.
	resp, b = do(t, http.MethodGet, e.URL()+"/v2/nothing", nil, nil)
	if resp.StatusCode != 404 || string(b) != `{"detail":"Not Found"}` {
		t.Errorf("unknown path: %d %s", resp.StatusCode, b)
	}
}

func TestHealth(t *testing.T) {
	e := newEngine(t, fakeengine.Config{})
	resp, b := do(t, http.MethodGet, e.URL()+"/health", nil, nil)
	if resp.StatusCode != 200 || len(b) != 0 {
		t.Fatalf("/health: %d %q", resp.StatusCode, b)
	}
	e.SetHealthy(false)
	resp, b = do(t, http.MethodGet, e.URL()+"/health", nil, nil)
	if resp.StatusCode != 503 || len(b) != 0 {
		t.Fatalf("/health when dead: %d %q", resp.StatusCode, b)
	}
	resp, b = do(t, http.MethodPost, e.URL()+"/v1/chat/completions", map[string]any{"messages": msgs("user", "hi")}, nil)
	checkError(t, resp, b, 500, "InternalServerError", "")
	// The API server's own endpoints still answer.
	post(t, e, "/tokenize", map[string]any{"prompt": "hi"})
	e.SetHealthy(true)
	if resp, _ = do(t, http.MethodGet, e.URL()+"/health", nil, nil); resp.StatusCode != 200 {
		t.Fatalf("/health after recovery: %d", resp.StatusCode)
	}
	post(t, e, "/v1/chat/completions", map[string]any{"messages": msgs("user", "hi")})
}

func TestAPIKey(t *testing.T) {
	e := newEngine(t, fakeengine.Config{APIKey: "sk-secret"})
	body := map[string]any{"messages": msgs("user", "hi")}
	for _, auth := range []string{"", "Bearer sk-wrong", "Basic sk-secret", "Bearer"} {
		h := map[string]string{}
		if auth != "" {
			h["Authorization"] = auth
		}
		resp, b := do(t, http.MethodPost, e.URL()+"/v1/chat/completions", body, h)
		if resp.StatusCode != 401 || string(b) != `{"error":"Unauthorized"}` {
			t.Errorf("Authorization %q: %d %s", auth, resp.StatusCode, b)
		}
		if resp, _ := do(t, http.MethodGet, e.URL()+"/v1/models", nil, h); resp.StatusCode != 401 {
			t.Errorf("/v1/models with Authorization %q: %d", auth, resp.StatusCode)
		}
	}
	for _, auth := range []string{"Bearer sk-secret", "bearer sk-secret"} {
		resp, b := do(t, http.MethodPost, e.URL()+"/v1/chat/completions", body, map[string]string{"Authorization": auth})
		if resp.StatusCode != 200 {
			t.Errorf("Authorization %q: %d %s", auth, resp.StatusCode, b)
		}
	}
	// Outside /v1, no key is needed, as in vLLM.
	if resp, _ := do(t, http.MethodGet, e.URL()+"/health", nil, nil); resp.StatusCode != 200 {
		t.Errorf("/health: %d", resp.StatusCode)
	}
	if resp, _ := do(t, http.MethodPost, e.URL()+"/tokenize", map[string]any{"prompt": "x"}, nil); resp.StatusCode != 200 {
		t.Errorf("/tokenize: %d", resp.StatusCode)
	}
}

// TestRequests: every request is recorded with its headers and body.
func TestRequests(t *testing.T) {
	e := newEngine(t, fakeengine.Config{APIKey: "k"})
	body := map[string]any{
		"model": fakeengine.DefaultModelName, "messages": msgs("user", "hi"), "stream": true,
		"vllm_xargs":         map[string]any{"kvbus_rank": "r1", "n": 3},
		"kv_transfer_params": map[string]any{"do_remote_prefill": true},
	}
	resp, b := do(t, http.MethodPost, e.URL()+"/v1/chat/completions", body, map[string]string{
		"Authorization": "Bearer k", "X-Session-ID": "sess-1", "X-Request-Id": "req-42",
	})
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"id":"chatcmpl-req-42"`) {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	do(t, http.MethodGet, e.URL()+"/health", nil, nil)
	reqs := e.Requests()
	if len(reqs) != 2 {
		t.Fatalf("%d requests", len(reqs))
	}
	r := reqs[0]
	if r.Method != "POST" || r.Path != "/v1/chat/completions" || r.Status != 200 || r.Model != fakeengine.DefaultModelName || !r.Stream {
		t.Errorf("received %+v", r)
	}
	if r.Header.Get("X-Session-ID") != "sess-1" || r.Header.Get("X-Request-Id") != "req-42" || r.Header.Get("Authorization") != "Bearer k" {
		t.Errorf("headers %v", r.Header)
	}
	if r.VLLMXArgs["kvbus_rank"] != "r1" || r.VLLMXArgs["n"] != 3.0 || r.KVTransferParams["do_remote_prefill"] != true {
		t.Errorf("xargs %v, kv_transfer_params %v", r.VLLMXArgs, r.KVTransferParams)
	}
	if r.Body["messages"] == nil || len(r.RawBody) == 0 || len(r.PromptTokens) == 0 || r.Time.IsZero() {
		t.Errorf("body %v", r.Body)
	}
	if h := reqs[1]; h.Method != "GET" || h.Path != "/health" || h.Status != 200 || h.Body != nil {
		t.Errorf("health request %+v", h)
	}
	// The copy is the caller's.
	reqs[0].Header.Set("X-Session-ID", "changed")
	if e.Requests()[0].Header.Get("X-Session-ID") != "sess-1" {
		t.Error("Requests shares its headers")
	}
	// The body's request_id names the response when no header does.
	resp2, b2 := do(t, http.MethodPost, e.URL()+"/v1/completions", map[string]any{"prompt": "x", "request_id": "body-id"},
		map[string]string{"Authorization": "Bearer k"})
	if resp2.StatusCode != 200 || decode(t, b2)["id"] != "cmpl-body-id" {
		t.Errorf("%d %s", resp2.StatusCode, b2)
	}
}

func TestModels(t *testing.T) {
	e := newEngine(t, fakeengine.Config{ModelName: "meta-llama/Llama-3.1-8B", MaxModelLen: 2048})
	resp, b := do(t, http.MethodGet, e.URL()+"/v1/models", nil, nil)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	m := decode(t, b)
	data := m["data"].([]any)
	card := data[0].(map[string]any)
	if m["object"] != "list" || len(data) != 1 || card["id"] != "meta-llama/Llama-3.1-8B" || card["object"] != "model" ||
		card["owned_by"] != "vllm" || num(t, card["max_model_len"]) != 2048 || len(card["permission"].([]any)) != 1 {
		t.Fatalf("models %s", b)
	}
}

// TestLatency: the latency knobs delay replies, streamed or not.
func TestLatency(t *testing.T) {
	e := newEngine(t, fakeengine.Config{TimeToFirstToken: 60 * time.Millisecond, InterTokenLatency: 5 * time.Millisecond,
		ReplyTokens: 4})
	start := time.Now()
	post(t, e, "/v1/completions", map[string]any{"prompt": "hi"})
	if d := time.Since(start); d < 60*time.Millisecond+4*5*time.Millisecond {
		t.Errorf("non-streaming reply in %v", d)
	}
	// Streamed: the first chunk after the time to first token.
	body, _ := json.Marshal(map[string]any{"prompt": "hi", "stream": true})
	start = time.Now()
	resp, err := http.Post(e.URL()+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	if _, err := rd.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 60*time.Millisecond {
		t.Errorf("first chunk after %v", d)
	}
	_, _ = io.Copy(io.Discard, rd)
}

// TestCloseDuringStream: Close ends a slow stream and returns promptly.
func TestCloseDuringStream(t *testing.T) {
	e, err := fakeengine.New(fakeengine.Config{InterTokenLatency: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := json.Marshal(map[string]any{"prompt": "hi", "stream": true})
	resp, err := http.Post(e.URL()+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	if _, err := rd.ReadString('\n'); err != nil { // the first token
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- e.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatal("Close did not return")
	}
	_, _ = io.Copy(io.Discard, rd)
	if err := e.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg fakeengine.Config
		ok  bool
	}{
		{fakeengine.Config{}, true},
		{fakeengine.Config{MaxModelLen: 100000}, true}, // the default capacity grows
		{fakeengine.Config{MaxModelLen: 128, BlockSize: 16, CacheBlocks: 8}, true},
		{fakeengine.Config{MaxModelLen: 128, BlockSize: 16, CacheBlocks: 7}, false},
		{fakeengine.Config{BlockSize: -1}, false},
		{fakeengine.Config{ReplyTokens: -1}, false},
		{fakeengine.Config{TimeToFirstToken: -time.Second}, false},
		{fakeengine.Config{KVEvents: &fakeengine.KVEventsConfig{Endpoint: "tcp://*:5557"}}, true},
		{fakeengine.Config{KVEvents: &fakeengine.KVEventsConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}}, true},
		{fakeengine.Config{KVEvents: &fakeengine.KVEventsConfig{Endpoint: "tcp://kvbus:5557", Connect: true}}, true},
		{fakeengine.Config{KVEvents: &fakeengine.KVEventsConfig{Endpoint: "ipc:///tmp/kv.sock"}}, true},
		{fakeengine.Config{KVEvents: &fakeengine.KVEventsConfig{}}, false},
		{fakeengine.Config{KVEvents: &fakeengine.KVEventsConfig{Endpoint: "tcp://*:5557", Connect: true}}, false},
		{fakeengine.Config{KVEvents: &fakeengine.KVEventsConfig{Endpoint: "udp://h:1"}}, false},
		{fakeengine.Config{KVEvents: &fakeengine.KVEventsConfig{Endpoint: "tcp://h:1", EventForm: "json"}}, false},
		{fakeengine.Config{KVEvents: &fakeengine.KVEventsConfig{Endpoint: "tcp://h:1", BufferSteps: -1}}, false},
	} {
		err := tc.cfg.Validate()
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, fakeengine.ErrConfig)) {
			t.Errorf("%+v: Validate = %v", tc.cfg, err)
		}
	}
	if _, err := fakeengine.New(fakeengine.Config{BlockSize: -1}); err == nil {
		t.Error("New accepted an invalid Config")
	}
}

// TestRecordingIsBounded: a long-lived engine (a compose service polled for
// health every second) keeps only the last MaxRecorded requests, and
// RequestsSince hands out each new one once.
func TestRecordingIsBounded(t *testing.T) {
	e := newEngine(t, fakeengine.Config{MaxRecorded: 100})
	client := &http.Client{}
	defer client.CloseIdleConnections()
	next, got := 0, 0
	for i := range 1000 {
		resp, err := client.Get(e.URL() + "/health")
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if i%30 == 0 {
			var reqs []fakeengine.Received
			reqs, next = e.RequestsSince(next)
			got += len(reqs)
		}
	}
	reqs, next := e.RequestsSince(next)
	got += len(reqs)
	if n := len(e.Requests()); n > 100 || n < 50 {
		t.Errorf("%d requests kept of 1,000, want at most MaxRecorded (100) and at least half of it", n)
	}
	if got != 1000 || next != 1000 {
		t.Errorf("RequestsSince handed out %d requests, up to number %d; want each of the 1,000 once", got, next)
	}
}

// TestMetricsScrapes: GET /metrics answers in the Prometheus text format
// (Prometheus scrapes the engines of docker-compose.engine.yml; the fake
// answered 404, a target always down).
func TestMetricsScrapes(t *testing.T) {
	e := newEngine(t, fakeengine.Config{})
	do(t, http.MethodGet, e.URL()+"/health", nil, nil)
	resp, b := do(t, http.MethodGet, e.URL()+"/metrics", nil, nil)
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") ||
		!strings.Contains(string(b), "\nfakeengine_http_requests_total 2\n") || !strings.Contains(string(b), "\nfakeengine_cached_blocks 0\n") {
		t.Errorf("/metrics: %d %q\n%s", resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}
}
