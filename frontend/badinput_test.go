package frontend_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/kvbus/kvbus/testenv"
)

// TestBadInput: every bad request gets an OpenAI error with the right
// status, error.type and error.param, over real HTTP.
func TestBadInput(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{MaxModelLen: 512})
	chat := func(extra string) string {
		return `{"model":"` + c.Model + `","messages":[{"role":"user","content":"hi"}]` + extra + `}`
	}
	big := strings.Repeat("x", 70<<10)
	tests := []struct {
		name, method, path, body string
		headers                  map[string]string
		status                   int
		typ, param               string
	}{
		{"temperature not a number", "POST", "/v1/chat/completions", chat(`,"temperature":"hot"`), nil, 400, "invalid_request_error", "temperature"},
		{"temperature out of range", "POST", "/v1/chat/completions", chat(`,"temperature":2.5`), nil, 400, "invalid_request_error", "temperature"},
		{"top_p zero", "POST", "/v1/chat/completions", chat(`,"top_p":0`), nil, 400, "invalid_request_error", "top_p"},
		{"max_tokens zero", "POST", "/v1/chat/completions", chat(`,"max_tokens":0`), nil, 400, "invalid_request_error", "max_tokens"},
		// n + max_tokens wrapped: answered 200 and generated forever.
		{"max_tokens beyond any context", "POST", "/v1/chat/completions", chat(`,"max_tokens":9223372036854775807`), nil, 400, "invalid_request_error", "messages"},
		{"max_completion_tokens beyond any context", "POST", "/v1/chat/completions", chat(`,"max_completion_tokens":9223372036854775807`), nil, 400, "invalid_request_error", "messages"},
		// The bus's decoders refuse what nests deeper than 16 levels: a 400
		// here, not a request the scheduler drops and a 504 a minute later.
		{"vllm_xargs nested too deeply", "POST", "/v1/chat/completions", chat(`,"vllm_xargs":{"deep":` + strings.Repeat("[", 20) + "1" + strings.Repeat("]", 20) + `}`), nil, 400, "invalid_request_error", "vllm_xargs"},
		{"kv_transfer_params nested too deeply", "POST", "/v1/chat/completions", chat(`,"kv_transfer_params":{"deep":` + strings.Repeat("[", 20) + "1" + strings.Repeat("]", 20) + `}`), nil, 400, "invalid_request_error", "kv_transfer_params"},
		{"min_tokens above max_tokens", "POST", "/v1/chat/completions", chat(`,"max_tokens":4,"min_tokens":5`), nil, 400, "invalid_request_error", "min_tokens"},
		// Above the default max_tokens (max_model_len less the prompt), as
		// vLLM refuses it: it was accepted.
		{"min_tokens above the default max_tokens", "POST", "/v1/chat/completions", chat(`,"min_tokens":9000`), nil, 400, "invalid_request_error", "min_tokens"},
		{"max_tokens a string", "POST", "/v1/chat/completions", chat(`,"max_tokens":"ten"`), nil, 400, "invalid_request_error", "max_tokens"},
		{"n above 1", "POST", "/v1/chat/completions", chat(`,"n":2`), nil, 400, "invalid_request_error", "n"},
		{"empty messages", "POST", "/v1/chat/completions", `{"model":"` + c.Model + `","messages":[]}`, nil, 400, "invalid_request_error", "messages"},
		{"role missing", "POST", "/v1/chat/completions", `{"messages":[{"content":"hi"}]}`, nil, 400, "invalid_request_error", "messages[0].role"},
		{"image part", "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`, nil, 400, "invalid_request_error", "messages[0].content[0]"},
		// vLLM's own check: "Parameter 'cache_salt' must be a non-empty
		// string if provided." Accepted and ignored before.
		{"cache_salt empty", "POST", "/v1/chat/completions", chat(`,"cache_salt":""`), nil, 400, "invalid_request_error", "cache_salt"},
		{"cache_salt a number", "POST", "/v1/completions", `{"prompt":"hi","cache_salt":7}`, nil, 400, "invalid_request_error", "cache_salt"},
		{"cache_salt too long", "POST", "/v1/chat/completions", chat(`,"cache_salt":"` + strings.Repeat("s", 1025) + `"`), nil, 400, "invalid_request_error", "cache_salt"},
		{"session_id a number", "POST", "/v1/chat/completions", chat(`,"session_id":7`), nil, 400, "invalid_request_error", "session_id"},
		{"session header too long", "POST", "/v1/chat/completions", chat(""), map[string]string{"X-Session-ID": strings.Repeat("s", 300)}, 400, "invalid_request_error", "X-Session-ID"},
		{"prompt over max-model-len", "POST", "/v1/completions", `{"prompt":"` + strings.Repeat("word ", 600) + `"}`, nil, 400, "invalid_request_error", "prompt"},
		{"token id out of vocabulary", "POST", "/v1/completions", `{"prompt":[1,2,999999999]}`, nil, 400, "invalid_request_error", "prompt"},
		{"invalid JSON", "POST", "/v1/chat/completions", `{"messages":`, nil, 400, "invalid_request_error", ""},
		{"invalid UTF-8", "POST", "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"a\xffb\"}]}", nil, 400, "invalid_request_error", ""},
		// DESIGN §3 names the source of a session id that is not UTF-8;
		// the whole body's check came first and named nothing.
		{"session_id not UTF-8", "POST", "/v1/chat/completions", chat(",\"session_id\":\"a\xffb\""), nil, 400, "invalid_request_error", "session_id"},
		{"vllm_xargs.session_id not UTF-8", "POST", "/v1/completions", "{\"prompt\":\"hi\",\"vllm_xargs\":{\"session_id\":\"a\xffb\"}}", nil, 400, "invalid_request_error", "vllm_xargs.session_id"},
		{"body too large", "POST", "/v1/completions", `{"prompt":"` + strings.Repeat("a", 5<<20) + `"}`, nil, 413, "invalid_request_error", ""},
		{"headers too large", "GET", "/v1/models", "", map[string]string{"X-Big": big}, 431, "invalid_request_error", ""},
		{"unknown model", "POST", "/v1/chat/completions", `{"model":"nope","messages":[{"role":"user","content":"hi"}]}`, nil, 404, "not_found_error", "model"},
		{"wrong method", "GET", "/v1/chat/completions", "", nil, 405, "invalid_request_error", ""},
		{"unknown path", "GET", "/v2/everything", "", nil, 404, "not_found_error", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := map[string]string{"Content-Type": "application/json"}
			for k, v := range tc.headers {
				h[k] = v
			}
			status, _, body := send(t, tc.method, c.URL+tc.path, tc.body, h)
			if status != tc.status {
				t.Fatalf("status %d, want %d: %.300s", status, tc.status, body)
			}
			var e struct {
				Error map[string]any `json:"error"`
			}
			if err := json.Unmarshal(body, &e); err != nil || e.Error == nil {
				t.Fatalf("not an OpenAI error body: %.300s", body)
			}
			for _, k := range []string{"message", "type", "param", "code"} {
				if _, ok := e.Error[k]; !ok {
					t.Errorf("error has no %q: %s", k, body)
				}
			}
			if e.Error["type"] != tc.typ {
				t.Errorf("type %v, want %s", e.Error["type"], tc.typ)
			}
			param, _ := e.Error["param"].(string)
			if param != tc.param {
				t.Errorf("param %q, want %q", param, tc.param)
			}
		})
	}
	// A repeated session header is not an error: its first value counts.
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(chat(`,"max_tokens":2`)))
	req.Header.Add("X-Session-ID", "first")
	req.Header.Add("X-Session-ID", "second")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	http.DefaultClient.CloseIdleConnections()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Session-ID") != "first" {
		t.Errorf("repeated X-Session-ID: status %d, echo %q; want 200 and first", resp.StatusCode, resp.Header.Get("X-Session-ID"))
	}
	// Errors after the session id is known echo it too (DESIGN: the
	// response echoes it): an unknown model, a prompt too long, a bad
	// X-Request-Id.
	for _, tc := range []struct {
		name, body string
		headers    map[string]string
		status     int
	}{
		{"unknown model", `{"model":"nope","messages":[{"role":"user","content":"hi"}]}`, map[string]string{"X-Session-ID": "echo"}, 404},
		{"prompt too long", chat(`,"session_id":"echo","messages":[{"role":"user","content":"` + strings.Repeat("word ", 600) + `"}]`), nil, 400},
		{"bad X-Request-Id", chat(""), map[string]string{"X-Session-ID": "echo", "X-Request-Id": strings.Repeat("r", 1000)}, 400},
		// Refused before the session was resolved: a bad field, a body that
		// does not decode, a body too large. Not echoed before.
		{"max_tokens zero, header", chat(`,"max_tokens":0`), map[string]string{"X-Session-ID": "echo"}, 400},
		{"max_tokens zero, body", chat(`,"max_tokens":0,"session_id":"echo"`), map[string]string{"X-Session-ID": "other"}, 400},
		{"max_tokens zero, body key escaped", chat(`,"max_tokens":0,"\u0073ession_id":"echo"`), map[string]string{"X-Session-ID": "other"}, 400},
		{"temperature out of range, vllm_xargs", chat(`,"temperature":3,"vllm_xargs":{"session_id":"echo"}`), map[string]string{"X-Correlation-ID": "other"}, 400},
		{"invalid JSON", `{"messages":`, map[string]string{"X-Session-ID": "echo"}, 400},
		{"body too large", chat(`,"pad":"` + strings.Repeat("x", 5<<20) + `"`), map[string]string{"X-Session-ID": "echo"}, 413},
	} {
		status, h, body := send(t, http.MethodPost, c.URL+"/v1/chat/completions", tc.body, tc.headers)
		if status != tc.status || h.Get("X-Session-ID") != "echo" {
			t.Errorf("%s: status %d, X-Session-ID %q (%.200s); want %d and the session echoed", tc.name, status, h.Get("X-Session-ID"), body, tc.status)
		}
	}
	// A session that is itself invalid is not echoed, whatever else the
	// request got wrong.
	for _, extra := range []string{`,"max_tokens":0,"session_id":7`, `,"max_tokens":0,"session_id":"` + strings.Repeat("s", 300) + `"`} {
		status, h, body := send(t, http.MethodPost, c.URL+"/v1/chat/completions", chat(extra), map[string]string{"X-Session-ID": "hdr"})
		if status != http.StatusBadRequest || h.Get("X-Session-ID") != "" {
			t.Errorf("%.40s: status %d, X-Session-ID %q (%.200s); want 400 and no echo", extra, status, h.Get("X-Session-ID"), body)
		}
	}
	// Body keys are read as written (vLLM's are): encoding/json matched
	// "SESSION_ID" to session_id, the last one winning, so a null there
	// let the header override an explicit body value, and a variant could
	// hide a session_id of the wrong type.
	for _, tc := range []struct {
		extra, want string
		status      int
	}{
		{`,"session_id":"a","SESSION_ID":null`, "a", 200},
		{`,"Session_Id":"x"`, "hdr", 200},
		{`,"session_id":5,"Session_Id":"x"`, "", 400},
		{`,"VLLM_XARGS":{"session_id":"x"}`, "hdr", 200},
		{`,"vllm_xargs":{"session_id":"x"},"Vllm_Xargs":null`, "x", 200},
		// Variants written with an escape, or with a non-ASCII letter that
		// folds to an ASCII one (ſ, U+017F, folds to s), match too; a key
		// that is session_id once unescaped is session_id.
		{`,"session_id":"a","SESSION\u005fID":null`, "a", 200},
		{`,"session_id":"a","ſession_id":null`, "a", 200},
		{`,"ſession_id":"evil"`, "hdr", 200},
		{`,"\u0073ession_id":"esc"`, "esc", 200},
		{`,"vllm_xargs":{"session_id":"x"},"VLLM\u005fxargs":null`, "x", 200},
	} {
		status, h, body := send(t, http.MethodPost, c.URL+"/v1/chat/completions", chat(`,"max_tokens":2`+tc.extra),
			map[string]string{"Content-Type": "application/json", "X-Session-ID": "hdr"})
		if status != tc.status || (tc.status == 200 && h.Get("X-Session-ID") != tc.want) {
			t.Errorf("%s: status %d, session %q (%.200s); want %d, %q", tc.extra, status, h.Get("X-Session-ID"), body, tc.status, tc.want)
		}
	}
}

// TestSimUnsupportedFields: over real HTTP, a request to the sim engine
// that asks for what the sim cannot honour (tools, structured output,
// logprobs, several choices...) gets a 400 whose param is the field and
// whose message says the sim engine cannot honour it, on both endpoints;
// the same fields with values that ask for nothing are served.
func TestSimUnsupportedFields(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	chat := func(extra string) string {
		return `{"model":"` + c.Model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2` + extra + `}`
	}
	completion := func(extra string) string {
		return `{"model":"` + c.Model + `","prompt":"hi","max_tokens":2` + extra + `}`
	}
	unsupported := []struct{ field, value string }{
		{"tools", `[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]`},
		{"tool_choice", `"auto"`},
		{"tool_choice", `{"type":"function","function":{"name":"get_weather"}}`},
		{"response_format", `{"type":"json_object"}`},
		{"logprobs", `true`},
		{"logprobs", `5`},
		{"top_logprobs", `2`},
		{"echo", `true`},
		{"logit_bias", `{"50256":-100}`},
		{"guided_json", `{"type":"object"}`},
		{"guided_regex", `"[a-z]+"`},
		{"guided_choice", `["yes","no"]`},
		{"guided_grammar", `"root ::= \"a\""`},
		{"structured_outputs", `{"choice":["yes","no"]}`},
		{"n", `2`},
	}
	for _, u := range unsupported {
		for path, body := range map[string]string{
			"/v1/chat/completions": chat(`,"` + u.field + `":` + u.value),
			"/v1/completions":      completion(`,"` + u.field + `":` + u.value),
		} {
			t.Run(u.field+"="+u.value+" "+path, func(t *testing.T) {
				status, _, raw := send(t, http.MethodPost, c.URL+path, body, nil)
				if status != http.StatusBadRequest {
					t.Fatalf("status %d, want 400: %.300s", status, raw)
				}
				var e struct {
					Error struct {
						Message string  `json:"message"`
						Type    string  `json:"type"`
						Param   *string `json:"param"`
					} `json:"error"`
				}
				if err := json.Unmarshal(raw, &e); err != nil {
					t.Fatalf("not an OpenAI error body: %s", raw)
				}
				if e.Error.Param == nil || *e.Error.Param != u.field || e.Error.Type != "invalid_request_error" {
					t.Errorf("error %s, want type invalid_request_error, param %q", raw, u.field)
				}
				msg := e.Error.Message
				if !strings.HasPrefix(msg, u.field+" ") || !strings.Contains(msg, "the sim engine") || !strings.Contains(msg, "--engine openai") {
					t.Errorf("message %q: want it to name %s, say the sim engine cannot honour it and point at --engine openai", msg, u.field)
				}
			})
		}
	}
	harmless := []string{
		`,"tools":null`, `,"tools":[]`, `,"tool_choice":"none"`, `,"tool_choice":null`,
		`,"response_format":{"type":"text"}`, `,"response_format":{"type": "text"}`, `,"response_format":null`,
		`,"logprobs":false`, `,"logprobs":null`, `,"top_logprobs":0`, `,"echo":false`,
		`,"logit_bias":{}`, `,"logit_bias":null`, `,"guided_json":null`, `,"guided_choice":[]`,
		`,"structured_outputs":null`, `,"n":1`, `,"n":null`,
		`,"tools":[],"tool_choice":"none","response_format":{"type":"text"},"logprobs":false,"echo":false,"logit_bias":{}`,
		// Indented, as json.dumps(indent=2) or curl -d @file.json sends
		// them: these were refused as asking for more.
		",\n  \"response_format\": {\n    \"type\": \"text\"\n  }", ",\"tools\": [ ]", ",\"logit_bias\": {\n}",
	}
	// logprobs differs by endpoint: chat's is a boolean (0 is false, as
	// pydantic takes it), completions' a count for which vLLM answers any
	// value but null with the chosen tokens' logprobs, 0 included. It failed
	// before: the sim answered completions' logprobs 0 with "logprobs": null.
	//
	// suffix is completions' alone (chat has none: an unknown field there).
	// vLLM refuses any suffix that is not null ("suffix is not currently
	// supported"), and fill-in-the-middle clients fall back to prefix-only
	// completions on that 400; the sim served it, the suffix ignored, so
	// such a client took its answers for fill-in-the-middle ones.
	for _, tc := range []struct {
		path, body string
		status     int
		param      string
	}{
		{"/v1/chat/completions", chat(`,"logprobs":0`), http.StatusOK, ""},
		{"/v1/completions", completion(`,"logprobs":0`), http.StatusBadRequest, "logprobs"},
		{"/v1/completions", completion(`,"logprobs":0.0`), http.StatusBadRequest, "logprobs"},
		{"/v1/completions", completion(`,"logprobs": 0 `), http.StatusBadRequest, "logprobs"},
		{"/v1/completions", completion(`,"logprobs":null`), http.StatusOK, ""},
		{"/v1/completions", completion(`,"suffix":"\n}\n"`), http.StatusBadRequest, "suffix"},
		{"/v1/completions", completion(`,"suffix":""`), http.StatusBadRequest, "suffix"},
		{"/v1/completions", completion(`,"suffix":null`), http.StatusOK, ""},
		{"/v1/chat/completions", chat(`,"suffix":"x"`), http.StatusOK, ""},
		// prompt_logprobs (vLLM's, both endpoints): any count asks, 0
		// too (each prompt token's own logprob), as completions'
		// logprobs; the sim answered without it.
		{"/v1/completions", completion(`,"prompt_logprobs":0`), http.StatusBadRequest, "prompt_logprobs"},
		{"/v1/completions", completion(`,"prompt_logprobs":1`), http.StatusBadRequest, "prompt_logprobs"},
		{"/v1/chat/completions", chat(`,"prompt_logprobs":0`), http.StatusBadRequest, "prompt_logprobs"},
		{"/v1/chat/completions", chat(`,"prompt_logprobs":null`), http.StatusOK, ""},
		{"/v1/completions", completion(`,"prompt_logprobs":null`), http.StatusOK, ""},
	} {
		status, _, raw := send(t, http.MethodPost, c.URL+tc.path, tc.body, nil)
		if status != tc.status {
			t.Errorf("%s %s: status %d, want %d: %.300s", tc.path, tc.body, status, tc.status, raw)
			continue
		}
		if status == http.StatusBadRequest && !strings.Contains(string(raw), `"param":"`+tc.param+`"`) {
			t.Errorf("%s %s: %s; want param %s", tc.path, tc.body, raw, tc.param)
		}
	}
	for _, extra := range harmless {
		for path, body := range map[string]string{"/v1/chat/completions": chat(extra), "/v1/completions": completion(extra)} {
			t.Run("harmless"+extra+" "+path, func(t *testing.T) {
				status, _, raw := send(t, http.MethodPost, c.URL+path, body, nil)
				if status != http.StatusOK {
					t.Fatalf("status %d, want 200: %.300s", status, raw)
				}
				var resp struct {
					Choices []json.RawMessage `json:"choices"`
				}
				if err := json.Unmarshal(raw, &resp); err != nil || len(resp.Choices) != 1 {
					t.Errorf("want a completion with one choice: %.300s", raw)
				}
			})
		}
	}
}

// TestSamplingRangesAsVLLM: the sampling fields the sim does not use but
// vLLM's SamplingParams checks (presence_penalty, frequency_penalty,
// repetition_penalty, top_k, min_p) are refused where vLLM refuses them,
// with its message and the field as param, on both routes, and served
// where vLLM serves them. They were ignored: an application written
// against kvbus sent presence_penalty 3 and got a 200 that vLLM answers
// with a 400.
func TestSamplingRangesAsVLLM(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	bodies := map[string]func(string) string{
		"/v1/chat/completions": func(extra string) string {
			return `{"model":"` + c.Model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2` + extra + `}`
		},
		"/v1/completions": func(extra string) string {
			return `{"model":"` + c.Model + `","prompt":"hi","max_tokens":2` + extra + `}`
		},
	}
	refused := []struct{ extra, param, msg string }{
		{`,"presence_penalty":2.5`, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5."},
		{`,"presence_penalty":-3`, "presence_penalty", "presence_penalty must be in [-2, 2], got -3."},
		{`,"frequency_penalty":2.01`, "frequency_penalty", "frequency_penalty must be in [-2, 2], got 2.01."},
		{`,"repetition_penalty":0`, "repetition_penalty", "repetition_penalty must be greater than zero, got 0."},
		{`,"repetition_penalty":-1.5`, "repetition_penalty", "repetition_penalty must be greater than zero, got -1.5."},
		{`,"top_k":-2`, "top_k", "top_k must be 0 (disable), or at least 1, got -2."},
		{`,"min_p":1.5`, "min_p", "min_p must be in [0, 1], got 1.5."},
		{`,"min_p":-0.1`, "min_p", "min_p must be in [0, 1], got -0.1."},
		// pydantic's types: an int field takes 4.0 but not 4.5 or "4".
		{`,"top_k":4.5`, "top_k", ""},
		{`,"presence_penalty":"high"`, "presence_penalty", ""},
	}
	served := []string{
		`,"presence_penalty":-2,"frequency_penalty":2`,
		`,"presence_penalty":null,"frequency_penalty":null,"repetition_penalty":null,"top_k":null,"min_p":null`,
		`,"repetition_penalty":0.01,"top_k":-1,"min_p":0`,
		`,"repetition_penalty":1.3,"top_k":0,"min_p":1`,
		`,"top_k":40.0,"min_p":0.05`,
	}
	for path, body := range bodies {
		for _, tc := range refused {
			status, _, b := send(t, http.MethodPost, c.URL+path, body(tc.extra), nil)
			var e struct {
				Error struct {
					Message, Type string
					Param         *string
				} `json:"error"`
			}
			_ = json.Unmarshal(b, &e)
			if status != http.StatusBadRequest || e.Error.Type != "invalid_request_error" || e.Error.Param == nil || *e.Error.Param != tc.param {
				t.Errorf("%s %s: status %d, %.200s; want 400 invalid_request_error naming %s", path, tc.extra, status, b, tc.param)
				continue
			}
			if tc.msg != "" && e.Error.Message != tc.msg {
				t.Errorf("%s %s: message %q, want vLLM's %q", path, tc.extra, e.Error.Message, tc.msg)
			}
		}
		for _, extra := range served {
			if status, _, b := send(t, http.MethodPost, c.URL+path, body(extra), nil); status != http.StatusOK {
				t.Errorf("%s %s: status %d, %.200s; want 200 as vLLM serves it", path, extra, status, b)
			}
		}
	}
}
