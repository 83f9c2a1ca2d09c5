package frontend_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/testenv"
)

// errorParamMessage returns error.param and error.message of an OpenAI
// error body.
func errorParamMessage(t *testing.T, body []byte) (param, message string) {
	t.Helper()
	var e struct {
		Error struct {
			Message string  `json:"message"`
			Param   *string `json:"param"`
		} `json:"error"`
	}
	if err := json.Unmarshal(body, &e); err != nil {
		t.Fatalf("not an OpenAI error body: %s", body)
	}
	if e.Error.Param != nil {
		param = *e.Error.Param
	}
	return param, e.Error.Message
}

// TestVLLMCompat covers request and response details where vLLM's OpenAI
// server and kvbus differed, over real HTTP against one cluster.
func TestVLLMCompat(t *testing.T) {
	t.Parallel()
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	chat := func(extra string) string { return chatBody(c.Model, "Tell me a story", extra) }
	completion := func(extra string) string { return completionBody(c.Model, `"Once upon a time"`, extra) }

	// vLLM names the response after X-Request-Id, else after the body's
	// request_id.
	t.Run("body request_id", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			name, path, body string
			headers          map[string]string
			want             string // response id
			wantHeader       string
		}{
			{"chat", "/v1/chat/completions", chat(`,"request_id":"body-id-1"`), nil, "chatcmpl-body-id-1", "body-id-1"},
			{"completions", "/v1/completions", completion(`,"request_id":"body-id-2"`), nil, "cmpl-body-id-2", "body-id-2"},
			{"the header wins", "/v1/chat/completions", chat(`,"request_id":"body-id-3"`), map[string]string{"X-Request-Id": "hdr-id-3"},
				"chatcmpl-hdr-id-3", "hdr-id-3"},
			{"a blank header leaves the body's", "/v1/completions", completion(`,"request_id":"body-id-4"`), map[string]string{"X-Request-Id": "  "},
				"cmpl-body-id-4", "body-id-4"},
			{"null is none", "/v1/completions", completion(`,"request_id":null`), nil, "", ""},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				r := do(t, c, http.MethodPost, tc.path, tc.body, tc.headers)
				if r.status != http.StatusOK {
					t.Fatalf("status %d: %s", r.status, r.body)
				}
				id, _ := path(t, decode(t, r.body), "id").(string)
				rid := r.header.Get("X-Request-Id")
				if tc.want == "" {
					if rid == "" || !strings.HasSuffix(id, "-"+rid) {
						t.Errorf("id %q, X-Request-Id %q: want a generated id in both", id, rid)
					}
					return
				}
				if id != tc.want || rid != tc.wantHeader {
					t.Errorf("id %q, X-Request-Id %q; want %q, %q", id, rid, tc.want, tc.wantHeader)
				}
			})
		}
		// Every chunk of a stream has the id.
		r := do(t, c, http.MethodPost, "/v1/chat/completions", chat(`,"stream":true,"request_id":"body-stream"`), nil)
		if r.status != http.StatusOK {
			t.Fatalf("stream: status %d: %s", r.status, r.body)
		}
		for i, ch := range chunks(t, sseEvents(t, r.body)) {
			if ch["id"] != "chatcmpl-body-stream" {
				t.Errorf("stream chunk %d id = %v, want chatcmpl-body-stream", i, ch["id"])
			}
		}
		// Validated as the header is.
		for _, bad := range []string{`"id-\u00e9"`, `"` + strings.Repeat("a", 129) + `"`, `"tab\there"`, `7`, `["a"]`, `true`} {
			r := do(t, c, http.MethodPost, "/v1/completions", completion(`,"request_id":`+bad), nil)
			if r.status != http.StatusBadRequest {
				t.Errorf("request_id %s: status %d, want 400: %s", bad, r.status, r.body)
				continue
			}
			checkErrorBody(t, r, "invalid_request_error", "request_id", "")
		}
	})

	// Errors raised before the request reaches the bus carry X-Request-Id
	// too: the client's, or a generated one.
	t.Run("X-Request-Id on early errors", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			name, path, body string
			headers          map[string]string
			status           int
			want             string // "" = generated
		}{
			{"invalid JSON", "/v1/chat/completions", `{"messages":`, map[string]string{"X-Request-Id": "early-1"}, 400, "early-1"},
			{"invalid JSON, no id", "/v1/chat/completions", `{"messages":`, nil, 400, ""},
			{"unknown model", "/v1/completions", completionBody("nope", `"hi"`, ""), map[string]string{"X-Request-Id": "early-2"}, 404, "early-2"},
			{"unknown model, body id", "/v1/completions", completionBody("nope", `"hi"`, `,"request_id":"early-3"`), nil, 404, "early-3"},
			{"bad field after the body id", "/v1/chat/completions", chat(`,"request_id":"early-4","temperature":9`), nil, 400, "early-4"},
			{"bad X-Request-Id", "/v1/chat/completions", chat(""), map[string]string{"X-Request-Id": "bad\u00e9"}, 400, ""},
			{"bad body id", "/v1/chat/completions", chat(`,"request_id":5`), nil, 400, ""},
			{"body too large", "/v1/completions", `{"prompt":"` + strings.Repeat("a", 5<<20) + `"}`, map[string]string{"X-Request-Id": "early-5"}, 413, "early-5"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				r := do(t, c, http.MethodPost, tc.path, tc.body, tc.headers)
				if r.status != tc.status {
					t.Fatalf("status %d, want %d: %s", r.status, tc.status, r.body)
				}
				got := r.header.Values("X-Request-Id")
				switch {
				case len(got) != 1:
					t.Errorf("X-Request-Id = %q, want one value", got)
				case tc.want != "" && got[0] != tc.want:
					t.Errorf("X-Request-Id = %q, want %q", got[0], tc.want)
				case tc.want == "" && (got[0] == "" || strings.Contains(got[0], "bad")):
					t.Errorf("X-Request-Id = %q, want a generated id", got[0])
				}
			})
		}
	})

	// stream_options.continuous_usage_stats with include_usage puts the
	// usage so far on every chunk, the role chunk included (vLLM's
	// should_include_usage).
	t.Run("continuous_usage_stats", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			name, path, body string
			continuous       bool
			final            bool // the usage-only last chunk
		}{
			{"chat", "/v1/chat/completions", chat(`,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}`), true, true},
			{"chat, include_usage left out", "/v1/chat/completions", chat(`,"stream":true,"stream_options":{"continuous_usage_stats":true}`), true, true},
			{"chat, include_usage false", "/v1/chat/completions", chat(`,"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":true}`), false, false},
			{"chat, continuous false", "/v1/chat/completions", chat(`,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":false}`), false, true},
			{"completions", "/v1/completions", completion(`,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}`), true, true},
			{"completions, two prompts", "/v1/completions", completionBody(c.Model, `["first prompt","a much longer second prompt"]`,
				`,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}`), true, true},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				r := do(t, c, http.MethodPost, tc.path, tc.body, nil)
				if r.status != http.StatusOK {
					t.Fatalf("status %d: %s", r.status, r.body)
				}
				cs := chunks(t, sseEvents(t, r.body))
				body := cs
				if tc.final {
					body = cs[:len(cs)-1]
					if !has(cs[len(cs)-1], "usage") {
						t.Fatalf("no final usage chunk: %v", cs[len(cs)-1])
					}
				}
				prompt := map[float64]float64{}           // choice → prompt_tokens
				completionTokens := map[float64]float64{} // choice → completion_tokens so far
				for i, ch := range body {
					if !tc.continuous {
						if has(ch, "usage") {
							t.Errorf("chunk %d has usage: %v", i, ch)
						}
						continue
					}
					if !has(ch, "usage") {
						t.Fatalf("chunk %d has no usage: %v", i, ch)
					}
					idx, _ := path(t, ch, "choices", 0, "index").(float64)
					pt, _ := path(t, ch, "usage", "prompt_tokens").(float64)
					ct, _ := path(t, ch, "usage", "completion_tokens").(float64)
					tt, _ := path(t, ch, "usage", "total_tokens").(float64)
					if pt <= 0 || tt != pt+ct {
						t.Errorf("chunk %d usage %v", i, ch["usage"])
					}
					if has(ch["usage"], "prompt_tokens_details") {
						t.Errorf("chunk %d usage has prompt_tokens_details, which vLLM leaves out of chunks: %v", i, ch["usage"])
					}
					if p, ok := prompt[idx]; ok && p != pt {
						t.Errorf("chunk %d: prompt_tokens %v, earlier %v", i, pt, p)
					}
					prompt[idx] = pt
					if ct < completionTokens[idx] {
						t.Errorf("chunk %d: completion_tokens fell from %v to %v", i, completionTokens[idx], ct)
					}
					completionTokens[idx] = ct
					if i == 0 && strings.HasPrefix(tc.path, "/v1/chat") {
						if role := path(t, ch, "choices", 0, "delta", "role"); role != "assistant" || ct != 0 {
							t.Errorf("role chunk: role %v, completion_tokens %v; want assistant, 0", role, ct)
						}
					}
				}
				if !tc.continuous || !tc.final {
					return
				}
				var sumPrompt, sumCompletion float64
				for idx := range prompt {
					sumPrompt += prompt[idx]
					sumCompletion += completionTokens[idx]
				}
				last := cs[len(cs)-1]
				if pt, _ := path(t, last, "usage", "prompt_tokens").(float64); pt != sumPrompt {
					t.Errorf("final prompt_tokens %v, chunks' %v", pt, sumPrompt)
				}
				if ct, _ := path(t, last, "usage", "completion_tokens").(float64); ct != sumCompletion {
					t.Errorf("final completion_tokens %v, chunks' last %v", ct, sumCompletion)
				}
				if strings.Contains(tc.name, "two prompts") && (len(prompt) != 2 || prompt[0] == prompt[1]) {
					t.Errorf("prompt_tokens by choice %v: want each choice's own prompt", prompt)
				}
			})
		}
	})

	// stop_reason: null when the answer ended by length or EOS, in every
	// choice; in a stream, on the chat chunk that finishes (vLLM sets it
	// there only) and on every completion chunk.
	t.Run("stop_reason", func(t *testing.T) {
		t.Parallel()
		for _, p := range []struct{ path, body string }{
			{"/v1/chat/completions", chat(`,"ignore_eos":true`)},
			{"/v1/completions", completion(`,"ignore_eos":true`)},
		} {
			r := do(t, c, http.MethodPost, p.path, p.body, nil)
			if r.status != http.StatusOK {
				t.Fatalf("%s: status %d: %s", p.path, r.status, r.body)
			}
			ch := path(t, decode(t, r.body), "choices", 0)
			if fr := path(t, ch, "finish_reason"); fr != "length" {
				t.Errorf("%s: finish_reason %v, want length", p.path, fr)
			}
			if v := path(t, ch, "stop_reason"); v != nil {
				t.Errorf("%s: stop_reason %v, want null", p.path, v)
			}
		}
		r := do(t, c, http.MethodPost, "/v1/chat/completions", chat(`,"ignore_eos":true,"stream":true`), nil)
		for i, ch := range chunks(t, sseEvents(t, r.body)) {
			choice := path(t, ch, "choices", 0)
			finished := path(t, choice, "finish_reason") != nil
			if has(choice, "stop_reason") != finished {
				t.Errorf("chat chunk %d: stop_reason present %v, finish_reason %v: want it on the finishing chunk only", i, has(choice, "stop_reason"), path(t, choice, "finish_reason"))
			}
			if finished && path(t, choice, "stop_reason") != nil {
				t.Errorf("chat chunk %d: stop_reason %v, want null", i, path(t, choice, "stop_reason"))
			}
		}
		r = do(t, c, http.MethodPost, "/v1/completions", completion(`,"ignore_eos":true,"stream":true`), nil)
		for i, ch := range chunks(t, sseEvents(t, r.body)) {
			if v := path(t, ch, "choices", 0, "stop_reason"); v != nil {
				t.Errorf("completion chunk %d: stop_reason %v, want null", i, v)
			}
		}
		// Stopped at a stop string: the engine says which, and it is the
		// stop_reason.
		for _, p := range []struct{ path, body string }{
			{"/v1/chat/completions", chat(`,"ignore_eos":true,"max_tokens":60,"stop":"e"`)},
			{"/v1/completions", completion(`,"ignore_eos":true,"max_tokens":60,"stop":["e"]`)},
			{"/v1/chat/completions", chat(`,"ignore_eos":true,"max_tokens":60,"stop":["zzz","e"]`)},
		} {
			r := do(t, c, http.MethodPost, p.path, strings.Replace(p.body, `"max_tokens":8,`, "", 1), nil)
			ch := path(t, decode(t, r.body), "choices", 0)
			if fr, sr := path(t, ch, "finish_reason"), path(t, ch, "stop_reason"); fr != "stop" || sr != "e" {
				t.Errorf("%s: finish_reason %v, stop_reason %v; want stop, e", p.path, fr, sr)
			}
		}
		// include_stop_str_in_output: the text goes on to the end of the
		// stop string, which ended it (vLLM's); it was ignored before
		// 2026-12-07, the text cut before the string.
		for _, include := range []bool{false, true} {
			body := strings.Replace(completion(fmt.Sprintf(`,"ignore_eos":true,"max_tokens":60,"stop":"e","seed":3,"include_stop_str_in_output":%v`, include)), `"max_tokens":8,`, "", 1)
			r := do(t, c, http.MethodPost, "/v1/completions", body, nil)
			text, _ := path(t, decode(t, r.body), "choices", 0, "text").(string)
			if n := strings.Count(text, "e"); include && (n != 1 || !strings.HasSuffix(text, "e")) || !include && n != 0 {
				t.Errorf("include_stop_str_in_output %v: text %q; want the stop string \"e\" at its end only when included", include, text)
			}
		}
		r = do(t, c, http.MethodPost, "/v1/completions", strings.Replace(completion(`,"ignore_eos":true,"max_tokens":60,"stop":"e","stream":true`), `"max_tokens":8,`, "", 1), nil)
		cs := chunks(t, sseEvents(t, r.body))
		for i, ch := range cs {
			want := any(nil)
			if i == len(cs)-1 {
				want = "e"
			}
			if v := path(t, ch, "choices", 0, "stop_reason"); v != want {
				t.Errorf("completion chunk %d of %d: stop_reason %v, want %v", i, len(cs), v, want)
			}
		}
	})

	t.Run("empty stop string", func(t *testing.T) {
		t.Parallel()
		for _, stop := range []string{`""`, `["a",""]`, `[""]`} {
			for p, body := range map[string]string{"/v1/chat/completions": chat(`,"stop":` + stop), "/v1/completions": completion(`,"stop":` + stop)} {
				r := do(t, c, http.MethodPost, p, body, nil)
				if r.status != http.StatusBadRequest {
					t.Errorf("%s stop %s: status %d, want 400: %s", p, stop, r.status, r.body)
					continue
				}
				checkErrorBody(t, r, "invalid_request_error", "stop", "")
				if _, msg := errorParamMessage(t, r.body); msg != "stop cannot contain an empty string." {
					t.Errorf("%s stop %s: message %q, want vLLM's", p, stop, msg)
				}
			}
		}
		most := `[` + strings.Repeat(`"zzz",`, frontend.MaxStopStrings-1) + `"x"]` // as many as are taken
		for _, stop := range []string{`null`, `[]`, `"x"`, most} {
			if r := do(t, c, http.MethodPost, "/v1/completions", completion(`,"stop":`+stop), nil); r.status != http.StatusOK {
				t.Errorf("stop %s: status %d: %s", stop, r.status, r.body)
			}
		}
	})

	// vLLM's pydantic models take 4.0 for an integer; 4.5 is refused.
	t.Run("whole-number floats", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			path, extra string
			tokens      float64 // completion_tokens, 0: not checked
		}{
			{"/v1/chat/completions", `,"max_tokens":4.0,"ignore_eos":true`, 4},
			{"/v1/chat/completions", `,"max_completion_tokens":3.0,"ignore_eos":true`, 3},
			{"/v1/completions", `,"max_tokens":5e0,"ignore_eos":true`, 5},
			{"/v1/chat/completions", `,"seed":7.0,"n":1.0,"min_tokens":1.0,"top_k":5.0`, 0},
			{"/v1/completions", `,"seed":-7.0,"n":1.0,"min_tokens":2.00`, 0},
			{"/v1/chat/completions", `,"top_logprobs":0.0,"logprobs":false`, 0},
		} {
			body := chat(tc.extra)
			if tc.path == "/v1/completions" {
				body = completion(tc.extra)
			}
			r := do(t, c, http.MethodPost, tc.path, strings.Replace(body, `"max_tokens":8,`, "", 1), nil)
			if r.status != http.StatusOK {
				t.Errorf("%s %s: status %d: %s", tc.path, tc.extra, r.status, r.body)
				continue
			}
			if got, _ := path(t, decode(t, r.body), "usage", "completion_tokens").(float64); tc.tokens > 0 && got != tc.tokens {
				t.Errorf("%s %s: completion_tokens %v, want %v", tc.path, tc.extra, got, tc.tokens)
			}
		}
		// Token ids too.
		if r := do(t, c, http.MethodPost, "/v1/completions", completionBody(c.Model, `[1.0,2,3e0]`, ""), nil); r.status != http.StatusOK {
			t.Errorf("token ids 1.0: status %d: %s", r.status, r.body)
		}
		if r := do(t, c, http.MethodPost, "/v1/completions", completionBody(c.Model, `[[1.0],[2]]`, ""), nil); r.status != http.StatusOK {
			t.Errorf("token id lists 1.0: status %d: %s", r.status, r.body)
		}
		for _, tc := range []struct{ path, body, param string }{
			{"/v1/chat/completions", strings.Replace(chat(`,"max_tokens":4.5`), `"max_tokens":8,`, "", 1), "max_tokens"},
			{"/v1/chat/completions", chat(`,"seed":7.25`), "seed"},
			{"/v1/chat/completions", chat(`,"n":1.5`), "n"},
			{"/v1/chat/completions", chat(`,"max_completion_tokens":2.5`), "max_completion_tokens"},
			{"/v1/completions", completion(`,"min_tokens":0.5`), "min_tokens"},
			{"/v1/completions", completionBody(c.Model, `[1.5,2]`, ""), "prompt"},
			{"/v1/completions", completion(`,"seed":1e30`), "seed"},
		} {
			r := do(t, c, http.MethodPost, tc.path, tc.body, nil)
			if r.status != http.StatusBadRequest {
				t.Errorf("%s: status %d, want 400: %s", tc.body, r.status, r.body)
				continue
			}
			if param, msg := errorParamMessage(t, r.body); param != tc.param || !strings.Contains(msg, "integer") {
				t.Errorf("%s: param %q message %q; want %s and a message saying it must be an integer", tc.body, param, msg, tc.param)
			}
		}
	})

	// vLLM's chat template takes any role; the sim renders it as it does
	// the others.
	t.Run("custom roles", func(t *testing.T) {
		t.Parallel()
		for _, role := range []string{"observation", "developer", "ipython", "Function Result"} {
			body := `{"model":"` + c.Model + `","max_tokens":2,"messages":[{"role":"` + role + `","content":"x"},{"role":"user","content":"hi"}]}`
			if r := do(t, c, http.MethodPost, "/v1/chat/completions", body, nil); r.status != http.StatusOK {
				t.Errorf("role %q: status %d: %s", role, r.status, r.body)
			}
		}
		for _, m := range []string{`{"content":"x"}`, `{"role":"","content":"x"}`, `{"role":null,"content":"x"}`, `{"role":5,"content":"x"}`, `{"role":["user"],"content":"x"}`} {
			body := `{"model":"` + c.Model + `","messages":[` + m + `]}`
			r := do(t, c, http.MethodPost, "/v1/chat/completions", body, nil)
			if r.status != http.StatusBadRequest {
				t.Errorf("message %s: status %d, want 400: %s", m, r.status, r.body)
				continue
			}
			if param, _ := errorParamMessage(t, r.body); !strings.HasSuffix(param, "role") {
				t.Errorf("message %s: param %q, want the role", m, param)
			}
		}
	})

	// vLLM refuses stream_options without stream only when it is a
	// non-empty object.
	t.Run("stream_options without stream", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			extra  string
			status int
		}{
			{`,"stream_options":{}`, 200},
			{`,"stream_options":{ }`, 200},
			{`,"stream":false,"stream_options":{}`, 200},
			{`,"stream_options":null`, 200},
			{`,"stream_options":{"include_usage":true}`, 400},
			{`,"stream":false,"stream_options":{"continuous_usage_stats":false}`, 400},
			{`,"stream_options":{"other":1}`, 400},
			{`,"stream":true,"stream_options":"yes"`, 400},
		} {
			for p, body := range map[string]string{"/v1/chat/completions": chat(tc.extra), "/v1/completions": completion(tc.extra)} {
				r := do(t, c, http.MethodPost, p, body, nil)
				if r.status != tc.status {
					t.Errorf("%s %s: status %d, want %d: %s", p, tc.extra, r.status, tc.status, r.body)
					continue
				}
				if tc.status == 400 {
					checkErrorBody(t, r, "invalid_request_error", "stream_options", "")
				} else if ct := r.header.Get("Content-Type"); ct != "application/json" {
					t.Errorf("%s %s: Content-Type %q, want a JSON answer", p, tc.extra, ct)
				}
			}
		}
	})

	// Field names match exactly, as pydantic's do: "STREAM" is an unknown
	// field, ignored like any other.
	t.Run("field names are case-sensitive", func(t *testing.T) {
		t.Parallel()
		msgs := `"messages":[{"role":"user","content":"hi"}]`
		for _, tc := range []struct {
			name, path, body string
			status           int
			check            func(t *testing.T, r response)
		}{
			{"STREAM", "/v1/chat/completions", `{` + msgs + `,"max_tokens":2,"STREAM":true}`, 200, func(t *testing.T, r response) {
				if ct := r.header.Get("Content-Type"); ct != "application/json" {
					t.Errorf("Content-Type %q: STREAM streamed", ct)
				}
			}},
			{"Stream on completions", "/v1/completions", `{"prompt":"hi","max_tokens":2,"Stream":true}`, 200, func(t *testing.T, r response) {
				if ct := r.header.Get("Content-Type"); ct != "application/json" {
					t.Errorf("Content-Type %q: Stream streamed", ct)
				}
			}},
			{"Max_Tokens", "/v1/completions", `{"prompt":"hi","Max_Tokens":40,"ignore_eos":true}`, 200, func(t *testing.T, r response) {
				if got := path(t, decode(t, r.body), "usage", "completion_tokens"); got != 16.0 {
					t.Errorf("completion_tokens %v, want the default 16", got)
				}
			}},
			{"Model", "/v1/chat/completions", `{` + msgs + `,"max_tokens":2,"Model":"nope"}`, 200, nil},
			{"MESSAGES only", "/v1/chat/completions", `{"MESSAGES":[{"role":"user","content":"hi"}]}`, 400, func(t *testing.T, r response) {
				checkErrorBody(t, r, "invalid_request_error", "messages", "")
			}},
			{"PROMPT only", "/v1/completions", `{"PROMPT":"hi"}`, 400, func(t *testing.T, r response) {
				checkErrorBody(t, r, "invalid_request_error", "prompt", "")
			}},
			{"escaped exact key", "/v1/completions", `{"prompt":"hi","max_tokens":2,"str\u0065am":true}`, 200, func(t *testing.T, r response) {
				if ct := r.header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
					t.Errorf("Content-Type %q: an escaped \"stream\" is stream", ct)
				}
			}},
			{"ſtream (folds to stream)", "/v1/completions", `{"prompt":"hi","max_tokens":2,"ſtream":true}`, 200, func(t *testing.T, r response) {
				if ct := r.header.Get("Content-Type"); ct != "application/json" {
					t.Errorf("Content-Type %q: ſtream streamed", ct)
				}
			}},
			{"ROLE in a message", "/v1/chat/completions", `{"messages":[{"ROLE":"user","content":"hi"}]}`, 400, func(t *testing.T, r response) {
				checkErrorBody(t, r, "invalid_request_error", "messages[0].role", "")
			}},
			{"Content in a message", "/v1/chat/completions", `{"messages":[{"role":"user","Content":"hi"}]}`, 400, func(t *testing.T, r response) {
				checkErrorBody(t, r, "invalid_request_error", "messages[0].content", "")
			}},
			{"TYPE in a content part", "/v1/chat/completions", `{"messages":[{"role":"user","content":[{"TYPE":"text","text":"hi"}]}]}`, 400, func(t *testing.T, r response) {
				checkErrorBody(t, r, "invalid_request_error", "messages[0].content[0]", "")
			}},
			{"INCLUDE_USAGE in stream_options", "/v1/completions", `{"prompt":"hi","max_tokens":2,"stream":true,"stream_options":{"INCLUDE_USAGE":false}}`, 200, func(t *testing.T, r response) {
				cs := chunks(t, sseEvents(t, r.body))
				if !has(cs[len(cs)-1], "usage") {
					t.Error("no usage chunk: INCLUDE_USAGE counted as include_usage")
				}
			}},
			{"exact keys next to variants", "/v1/completions", `{"prompt":"hi","max_tokens":3,"MAX_TOKENS":50,"ignore_eos":true,"Prompt":7}`, 200, func(t *testing.T, r response) {
				if got := path(t, decode(t, r.body), "usage", "completion_tokens"); got != 3.0 {
					t.Errorf("completion_tokens %v, want 3", got)
				}
			}},
			{"a value that looks like a key", "/v1/chat/completions", `{"messages":[{"role":"user","content":"STREAM"}],"max_tokens":2,"vllm_xargs":{"Stream":1}}`, 200, nil},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				r := do(t, c, http.MethodPost, tc.path, tc.body, nil)
				if r.status != tc.status {
					t.Fatalf("status %d, want %d: %s", r.status, tc.status, r.body)
				}
				if tc.check != nil {
					tc.check(t, r)
				}
			})
		}
	})
}

// TestRequestIDOnRefusals: the refusals before the body is read (no ready
// scheduler, --max-inflight) carry X-Request-Id, the client's or a
// generated one.
func TestRequestIDOnRefusals(t *testing.T) {
	t.Parallel()
	t.Run("no ready scheduler", func(t *testing.T) {
		t.Parallel()
		s := startStandalone(t, false, func(*frontend.Config) {})
		for _, id := range []string{"refused-1", ""} {
			h := map[string]string{}
			if id != "" {
				h["X-Request-Id"] = id
			}
			status, header, body := testenv.Send(t, http.MethodPost, s.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`, h)
			if status != http.StatusServiceUnavailable {
				t.Fatalf("status %d, want 503: %s", status, body)
			}
			if got := header.Get("X-Request-Id"); got == "" || (id != "" && got != id) {
				t.Errorf("X-Request-Id %q, want %q (or a generated one)", got, id)
			}
		}
	})
	t.Run("API key and method", func(t *testing.T) {
		t.Parallel()
		s := startFrontend(t, func(c *frontend.Config) { c.APIKey = "k" })
		for _, tc := range []struct {
			method, id string
			status     int
		}{{http.MethodPost, "auth-1", http.StatusUnauthorized}, {http.MethodPost, "", http.StatusUnauthorized}, {http.MethodGet, "method-1", http.StatusMethodNotAllowed}} {
			h := map[string]string{}
			if tc.id != "" {
				h["X-Request-Id"] = tc.id
			}
			if tc.status == http.StatusMethodNotAllowed {
				h["Authorization"] = "Bearer k"
			}
			status, header, body := testenv.Send(t, tc.method, s.url+"/v1/completions", `{"prompt":"hi"}`, h)
			if status != tc.status {
				t.Fatalf("%s: status %d, want %d: %s", tc.method, status, tc.status, body)
			}
			if got := header.Get("X-Request-Id"); got == "" || (tc.id != "" && got != tc.id) {
				t.Errorf("%s %d: X-Request-Id %q, want %q (or a generated one)", tc.method, status, got, tc.id)
			}
		}
	})
	t.Run("max-inflight", func(t *testing.T) {
		t.Parallel()
		// Nothing consumes the log: the first request waits for its timeout.
		s := startFrontend(t, func(c *frontend.Config) { c.MaxInflight = 1; c.RequestTimeout = 3 * time.Second })
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			testenv.Send(t, http.MethodPost, s.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`, nil)
		}()
		testenv.Eventually(t, 5*time.Second, "the first request in the log", func() bool { return s.logState(t).Msgs == 1 })
		status, header, body := testenv.Send(t, http.MethodPost, s.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`,
			map[string]string{"X-Request-Id": "over-1"})
		if status != http.StatusTooManyRequests {
			t.Errorf("status %d, want 429: %s", status, body)
		}
		if got := header.Get("X-Request-Id"); got != "over-1" {
			t.Errorf("X-Request-Id %q, want over-1", got)
		}
		wg.Wait()
	})
}

// TestContinuousUsageCountsEachChunk: with a decoding engine (a chunk per
// token) each chunk's usage counts the tokens streamed up to it, one more
// per chunk, and the last equals the final usage.
func TestContinuousUsageCountsEachChunk(t *testing.T) {
	t.Parallel()
	c := testenv.StartCluster(t, testenv.ClusterConfig{TimeScale: 0.1})
	for _, p := range []string{"/v1/chat/completions", "/v1/completions"} {
		body := `{"model":"` + c.Model + `","max_tokens":12,"ignore_eos":true,"stream":true,"stream_options":{"continuous_usage_stats":true},` +
			`"messages":[{"role":"user","content":"count"}],"prompt":"count"}`
		r := do(t, c, http.MethodPost, p, body, nil)
		if r.status != http.StatusOK {
			t.Fatalf("%s: status %d: %s", p, r.status, r.body)
		}
		cs := chunks(t, sseEvents(t, r.body))
		content := cs[:len(cs)-1]
		if p == "/v1/chat/completions" {
			content = content[1:] // the role chunk: 0
		}
		if len(content) < 12 {
			t.Fatalf("%s: %d chunks, want one per token: %s", p, len(content), r.body)
		}
		for i, ch := range content {
			want := float64(min(i+1, 12)) // a token each, then perhaps a chunk that only finishes
			if got := path(t, ch, "usage", "completion_tokens"); got != want {
				t.Errorf("%s: chunk %d completion_tokens %v, want %v", p, i, got, want)
			}
		}
		if got := path(t, cs[len(cs)-1], "usage", "completion_tokens"); got != 12.0 {
			t.Errorf("%s: final completion_tokens %v, want 12", p, got)
		}
	}
}

// TestCompletionNullMaxTokensIsSixteen: a completion's max_tokens null
// (LangChain's and other clients' max_tokens=None) is the default of 16, as
// left out, as vLLM's CompletionRequest.normalize_null_max_tokens makes it
// (vllm-project/vllm#45491; before it vLLM answered null with a 500). It
// was the rest of the context here (--max-model-len less the prompt): a
// client that did not ask for a limit got a generation to the end of the
// context, and a real engine behind kvbus stopped at 16 while the bus
// request said otherwise.
func TestCompletionNullMaxTokensIsSixteen(t *testing.T) {
	t.Parallel()
	c := testenv.StartCluster(t, testenv.ClusterConfig{MaxModelLen: 64})
	for _, tt := range []struct {
		name, field string
	}{{"absent", ``}, {"null", `"max_tokens":null,`}} {
		body := `{"model":"` + c.Model + `",` + tt.field + `"ignore_eos":true,"prompt":"hi there"}`
		r := do(t, c, http.MethodPost, "/v1/completions", body, nil)
		if r.status != http.StatusOK {
			t.Fatalf("%s: status %d: %s", tt.name, r.status, r.body)
		}
		m := decode(t, r.body)
		if completion := path(t, m, "usage", "completion_tokens"); completion != 16.0 {
			t.Errorf("max_tokens %s: completion_tokens %v, want 16 (prompt %v, max_model_len 64)", tt.name, completion, path(t, m, "usage", "prompt_tokens"))
		}
	}
}

// TestChatMaxCompletionTokensReplacesMaxTokens: with max_completion_tokens
// given, vLLM does not read max_tokens, so a max_tokens it would refuse
// alone (0) beside it is no 400; the answer is max_completion_tokens long.
func TestChatMaxCompletionTokensReplacesMaxTokens(t *testing.T) {
	t.Parallel()
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	body := `{"model":"` + c.Model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":0,"max_completion_tokens":3,"ignore_eos":true}`
	r := do(t, c, http.MethodPost, "/v1/chat/completions", body, nil)
	if r.status != http.StatusOK {
		t.Fatalf("status %d, want 200: %s", r.status, r.body)
	}
	if got := path(t, decode(t, r.body), "usage", "completion_tokens"); got != 3.0 {
		t.Errorf("completion_tokens %v, want 3", got)
	}
	// max_tokens alone is still checked.
	r = do(t, c, http.MethodPost, "/v1/chat/completions", chatBody(c.Model, "hi", `,"max_tokens":0`), nil)
	if r.status != http.StatusBadRequest {
		t.Errorf("max_tokens 0 alone: status %d, want 400: %s", r.status, r.body)
	}
}
