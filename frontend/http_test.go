package frontend_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// newClient returns an HTTP client with its own transport whose idle
// connections are closed at cleanup, so goleak sees no transport goroutines.
func newClient(t *testing.T) *http.Client {
	t.Helper()
	tr := http.DefaultTransport.(*http.Transport).Clone()
	c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

type response struct {
	status int
	header http.Header
	body   []byte
}

// do sends one request to the cluster and reads the whole response.
func do(t *testing.T, c *testenv.Cluster, method, path, body string, headers map[string]string) response {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(t.Context(), method, c.URL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := newClient(t).Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, path, err)
	}
	return response{resp.StatusCode, resp.Header, b}
}

// decode unmarshals a JSON body into a generic map.
func decode(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("body is not a JSON object: %v\n%s", err, b)
	}
	return m
}

// path walks a decoded JSON value: string keys index objects, ints index
// arrays. It fails the test when the path does not exist.
func path(t *testing.T, v any, keys ...any) any {
	t.Helper()
	for i, k := range keys {
		switch k := k.(type) {
		case string:
			m, ok := v.(map[string]any)
			if !ok {
				t.Fatalf("%v: not an object at %v", keys, keys[:i])
			}
			if v, ok = m[k]; !ok {
				t.Fatalf("%v: no key %q", keys, k)
			}
		case int:
			a, ok := v.([]any)
			if !ok || k >= len(a) {
				t.Fatalf("%v: no element %d", keys, k)
			}
			v = a[k]
		}
	}
	return v
}

func has(v any, key string) bool {
	m, ok := v.(map[string]any)
	if !ok {
		return false
	}
	_, ok = m[key]
	return ok
}

// checkErrorBody asserts DESIGN §9's error shape: a JSON object
// {"error":{"message","type","param","code"}} with all four keys present.
// wantParam and wantCode of "" mean null.
func checkErrorBody(t *testing.T, r response, wantType, wantParam, wantCode string) {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type = %q, want application/json", ct)
	}
	var body struct {
		Error map[string]json.RawMessage `json:"error"`
	}
	if err := json.Unmarshal(r.body, &body); err != nil || body.Error == nil {
		t.Fatalf("error body is not {\"error\":{...}}: %v\n%s", err, r.body)
	}
	for _, k := range []string{"message", "type", "param", "code"} {
		if _, ok := body.Error[k]; !ok {
			t.Errorf("error body has no %q key: %s", k, r.body)
		}
	}
	var msg string
	if err := json.Unmarshal(body.Error["message"], &msg); err != nil || msg == "" {
		t.Errorf("error.message = %s, want a non-empty string", body.Error["message"])
	}
	str := func(s string) string {
		if s == "" {
			return "null"
		}
		b, _ := json.Marshal(s)
		return string(b)
	}
	for k, want := range map[string]string{"type": str(wantType), "param": str(wantParam), "code": str(wantCode)} {
		if got := string(body.Error[k]); got != want {
			t.Errorf("error.%s = %s, want %s", k, got, want)
		}
	}
}

func chatBody(model, content, extra string) string {
	return fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":8%s}`, model, content, extra)
}

func completionBody(model, prompt, extra string) string {
	return fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":8%s}`, model, prompt, extra)
}

// sseEvents splits a server-sent-events body that must consist only of
// "data: X\n\n" events and returns the X of each.
func sseEvents(t *testing.T, body []byte) []string {
	t.Helper()
	s := string(body)
	if !strings.HasSuffix(s, "\n\n") {
		t.Fatalf("SSE body does not end with a blank line: %q", s)
	}
	var out []string
	for ev := range strings.SplitSeq(strings.TrimSuffix(s, "\n\n"), "\n\n") {
		data, ok := strings.CutPrefix(ev, "data: ")
		if !ok || strings.Contains(data, "\n") {
			t.Fatalf("event %q is not a single \"data: ...\" line", ev)
		}
		out = append(out, data)
	}
	return out
}

// chunks checks that every event but a final [DONE] is a JSON object and
// returns them decoded.
func chunks(t *testing.T, events []string) []map[string]any {
	t.Helper()
	if len(events) == 0 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("last event is not [DONE]: %q", events)
	}
	var out []map[string]any
	for _, ev := range events[:len(events)-1] {
		var m map[string]any
		if err := json.Unmarshal([]byte(ev), &m); err != nil {
			t.Fatalf("event %q is not a JSON object: %v", ev, err)
		}
		out = append(out, m)
	}
	return out
}

// TestHTTP runs the HTTP surface against one in-process cluster (1 group ×
// 4 ranks, instant engine).
func TestHTTP(t *testing.T) {
	t.Parallel()
	c := testenv.StartCluster(t, testenv.ClusterConfig{})

	t.Run("GET /v1/models", func(t *testing.T) {
		t.Parallel()
		r := do(t, c, http.MethodGet, "/v1/models", "", nil)
		if r.status != http.StatusOK {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		m := decode(t, r.body)
		if got := path(t, m, "object"); got != "list" {
			t.Errorf("object = %v, want list", got)
		}
		data, _ := path(t, m, "data").([]any)
		if len(data) != 1 {
			t.Fatalf("data has %d models, want 1: %s", len(data), r.body)
		}
		if got := path(t, data, 0, "id"); got != c.Model {
			t.Errorf("data[0].id = %v, want %s", got, c.Model)
		}
		if got := path(t, data, 0, "object"); got != "model" {
			t.Errorf("data[0].object = %v, want model", got)
		}
		if got, _ := path(t, data, 0, "created").(float64); got <= 0 {
			t.Errorf("data[0].created = %v, want a unix time", got)
		}
		if got, _ := path(t, data, 0, "owned_by").(string); got == "" {
			t.Error("data[0].owned_by is empty")
		}
		if got, _ := path(t, data, 0, "max_model_len").(float64); got <= 0 {
			t.Errorf("data[0].max_model_len = %v", got)
		}
	})

	t.Run("GET /health", func(t *testing.T) {
		t.Parallel()
		r := do(t, c, http.MethodGet, "/health", "", nil)
		if r.status != http.StatusOK || len(r.body) != 0 {
			t.Errorf("GET /health = %d %q, want 200 with an empty body", r.status, r.body)
		}
	})

	t.Run("GET /healthz", func(t *testing.T) {
		t.Parallel()
		r := do(t, c, http.MethodGet, "/healthz", "", nil)
		if r.status != http.StatusOK {
			t.Errorf("GET /healthz = %d %s, want 200", r.status, r.body)
		}
	})

	t.Run("GET /metrics", func(t *testing.T) {
		t.Parallel()
		// The request counter has labels, so it is exported once a request
		// was counted.
		if r := do(t, c, http.MethodPost, "/v1/completions", completionBody(c.Model, `"metrics"`, ""), nil); r.status != http.StatusOK {
			t.Fatalf("completion: %d %s", r.status, r.body)
		}
		r := do(t, c, http.MethodGet, "/metrics", "", nil)
		if r.status != http.StatusOK {
			t.Fatalf("GET /metrics = %d", r.status)
		}
		if !bytes.Contains(r.body, []byte("kvbus_frontend_requests_total")) {
			t.Errorf("/metrics has no kvbus_frontend_requests_total:\n%s", r.body)
		}
	})

	t.Run("errors", func(t *testing.T) {
		t.Parallel()
		huge := `{"model":"` + c.Model + `","prompt":"` + strings.Repeat("a", 4<<20) + `"}`
		tests := []struct {
			name         string
			method, path string
			body         string
			headers      map[string]string
			status       int
			typ          string
			param, code  string // "" = null
			allow        string
		}{
			{name: "unknown path", method: http.MethodGet, path: "/v1/nope",
				status: http.StatusNotFound, typ: "not_found_error", code: "not_found"},
			{name: "POST /v1/models", method: http.MethodPost, path: "/v1/models", body: `{}`,
				status: http.StatusMethodNotAllowed, typ: "invalid_request_error", code: "method_not_allowed", allow: http.MethodGet},
			{name: "GET /v1/chat/completions", method: http.MethodGet, path: "/v1/chat/completions",
				status: http.StatusMethodNotAllowed, typ: "invalid_request_error", code: "method_not_allowed", allow: http.MethodPost},
			{name: "GET /v1/completions", method: http.MethodGet, path: "/v1/completions",
				status: http.StatusMethodNotAllowed, typ: "invalid_request_error", code: "method_not_allowed", allow: http.MethodPost},
			{name: "unknown model", method: http.MethodPost, path: "/v1/chat/completions", body: chatBody("no-such-model", "hi", ""),
				status: http.StatusNotFound, typ: "not_found_error", param: "model", code: "model_not_found"},
			{name: "unknown model (completions)", method: http.MethodPost, path: "/v1/completions", body: completionBody("no-such-model", `"hi"`, ""),
				status: http.StatusNotFound, typ: "not_found_error", param: "model", code: "model_not_found"},
			{name: "body over --max-body-bytes", method: http.MethodPost, path: "/v1/completions", body: huge,
				status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error", code: "request_too_large"},
			{name: "invalid JSON", method: http.MethodPost, path: "/v1/chat/completions", body: `{"messages":`,
				status: http.StatusBadRequest, typ: "invalid_request_error"},
			{name: "temperature out of range", method: http.MethodPost, path: "/v1/chat/completions", body: chatBody(c.Model, "hi", `,"temperature":3`),
				status: http.StatusBadRequest, typ: "invalid_request_error", param: "temperature"},
			{name: "body session_id not a string", method: http.MethodPost, path: "/v1/chat/completions", body: chatBody(c.Model, "hi", `,"session_id":42`),
				headers: map[string]string{"X-Session-ID": "h"},
				status:  http.StatusBadRequest, typ: "invalid_request_error", param: "session_id"},
			{name: "session header too long", method: http.MethodPost, path: "/v1/completions", body: completionBody(c.Model, `"hi"`, ""),
				headers: map[string]string{"X-Session-ID": strings.Repeat("s", 257)},
				status:  http.StatusBadRequest, typ: "invalid_request_error", param: "X-Session-ID"},
			{name: "X-Request-Id not printable ASCII", method: http.MethodPost, path: "/v1/completions", body: completionBody(c.Model, `"hi"`, ""),
				headers: map[string]string{"X-Request-Id": "id-\u00e9"},
				status:  http.StatusBadRequest, typ: "invalid_request_error", param: "X-Request-Id"},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				r := do(t, c, tt.method, tt.path, tt.body, tt.headers)
				if r.status != tt.status {
					t.Fatalf("status = %d, want %d: %s", r.status, tt.status, r.body)
				}
				checkErrorBody(t, r, tt.typ, tt.param, tt.code)
				if got := r.header.Get("Allow"); got != tt.allow {
					t.Errorf("Allow = %q, want %q", got, tt.allow)
				}
			})
		}
	})

	t.Run("chat completion shape", func(t *testing.T) {
		t.Parallel()
		r := do(t, c, http.MethodPost, "/v1/chat/completions", chatBody(c.Model, "Hello there", ""), nil)
		if r.status != http.StatusOK {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		if ct := r.header.Get("Content-Type"); ct != "application/json" {
			t.Errorf("Content-Type = %q", ct)
		}
		m := decode(t, r.body)
		id, _ := path(t, m, "id").(string)
		if !strings.HasPrefix(id, "chatcmpl-") {
			t.Errorf("id = %q, want chatcmpl-…", id)
		}
		if rid := r.header.Get("X-Request-Id"); rid == "" || id != "chatcmpl-"+rid {
			t.Errorf("X-Request-Id = %q, id = %q: want id = chatcmpl-<X-Request-Id>", rid, id)
		}
		if got := path(t, m, "object"); got != "chat.completion" {
			t.Errorf("object = %v", got)
		}
		if got := path(t, m, "model"); got != c.Model {
			t.Errorf("model = %v", got)
		}
		if got, _ := path(t, m, "created").(float64); got <= 0 {
			t.Errorf("created = %v", got)
		}
		choices, _ := path(t, m, "choices").([]any)
		if len(choices) != 1 {
			t.Fatalf("%d choices, want 1", len(choices))
		}
		if got := path(t, choices, 0, "index"); got != 0.0 {
			t.Errorf("index = %v", got)
		}
		if got := path(t, choices, 0, "message", "role"); got != "assistant" {
			t.Errorf("message.role = %v", got)
		}
		if got, ok := path(t, choices, 0, "message", "content").(string); !ok || got == "" {
			t.Errorf("message.content = %#v, want non-empty text", path(t, choices, 0, "message", "content"))
		}
		if got, ok := path(t, choices, 0, "finish_reason").(string); !ok || got == "" {
			t.Errorf("finish_reason = %#v, want non-null", path(t, choices, 0, "finish_reason"))
		}
		usage := path(t, m, "usage")
		pt, _ := path(t, usage, "prompt_tokens").(float64)
		ct, _ := path(t, usage, "completion_tokens").(float64)
		tt, _ := path(t, usage, "total_tokens").(float64)
		if pt <= 0 || ct <= 0 || tt != pt+ct {
			t.Errorf("usage = %v", usage)
		}
		if _, ok := path(t, usage, "prompt_tokens_details", "cached_tokens").(float64); !ok {
			t.Errorf("usage.prompt_tokens_details.cached_tokens missing: %v", usage)
		}
	})

	t.Run("completion shape", func(t *testing.T) {
		t.Parallel()
		r := do(t, c, http.MethodPost, "/v1/completions", completionBody(c.Model, `"Once upon a time"`, ""), nil)
		if r.status != http.StatusOK {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		m := decode(t, r.body)
		if id, _ := path(t, m, "id").(string); !strings.HasPrefix(id, "cmpl-") {
			t.Errorf("id = %q, want cmpl-…", id)
		}
		if got := path(t, m, "object"); got != "text_completion" {
			t.Errorf("object = %v", got)
		}
		if got, ok := path(t, m, "choices", 0, "text").(string); !ok || got == "" {
			t.Errorf("choices[0].text = %#v, want non-empty text", path(t, m, "choices", 0, "text"))
		}
		if has(path(t, m, "choices", 0), "message") {
			t.Error("a completion choice has a message")
		}
		if got, ok := path(t, m, "choices", 0, "finish_reason").(string); !ok || got == "" {
			t.Errorf("finish_reason = %#v", path(t, m, "choices", 0, "finish_reason"))
		}
		if got, _ := path(t, m, "usage", "prompt_tokens").(float64); got <= 0 {
			t.Errorf("usage.prompt_tokens = %v", got)
		}
	})

	t.Run("X-Request-Id honoured", func(t *testing.T) {
		t.Parallel()
		for _, ep := range []struct{ path, body, prefix string }{
			{"/v1/chat/completions", chatBody(c.Model, "hi", ""), "chatcmpl-"},
			{"/v1/completions", completionBody(c.Model, `"hi"`, ""), "cmpl-"},
		} {
			r := do(t, c, http.MethodPost, ep.path, ep.body, map[string]string{"X-Request-Id": "my-id-1"})
			if r.status != http.StatusOK {
				t.Fatalf("%s: status %d: %s", ep.path, r.status, r.body)
			}
			if got := r.header.Get("X-Request-Id"); got != "my-id-1" {
				t.Errorf("%s: X-Request-Id = %q, want my-id-1", ep.path, got)
			}
			if got := path(t, decode(t, r.body), "id"); got != ep.prefix+"my-id-1" {
				t.Errorf("%s: id = %v, want %smy-id-1", ep.path, got, ep.prefix)
			}
		}
	})

	t.Run("streaming chat", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			name         string
			extra        string
			includeUsage bool
		}{
			{"without stream_options", `,"stream":true`, false},
			{"include_usage false", `,"stream":true,"stream_options":{"include_usage":false}`, false},
			{"include_usage true", `,"stream":true,"stream_options":{"include_usage":true}`, true},
			// vLLM's StreamOptions defaults include_usage to true.
			{"stream_options empty", `,"stream":true,"stream_options":{}`, true},
			{"include_usage null", `,"stream":true,"stream_options":{"include_usage":null}`, false},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				r := do(t, c, http.MethodPost, "/v1/chat/completions", chatBody(c.Model, "Tell me a story", tc.extra), nil)
				if r.status != http.StatusOK {
					t.Fatalf("status %d: %s", r.status, r.body)
				}
				if ct := r.header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
					t.Errorf("Content-Type = %q, want text/event-stream; charset=utf-8", ct)
				}
				cs := chunks(t, sseEvents(t, r.body))
				if len(cs) < 2 {
					t.Fatalf("only %d chunks", len(cs))
				}
				if got := path(t, cs[0], "choices", 0, "delta", "role"); got != "assistant" {
					t.Errorf("first chunk delta.role = %v, want assistant", got)
				}
				var text strings.Builder
				finished := 0
				for i, ch := range cs {
					if got := path(t, ch, "object"); got != "chat.completion.chunk" {
						t.Errorf("chunk %d object = %v", i, got)
					}
					if ch["id"] != cs[0]["id"] {
						t.Errorf("chunk %d id = %v, first chunk's = %v", i, ch["id"], cs[0]["id"])
					}
					last := i == len(cs)-1
					if tc.includeUsage && last {
						continue
					}
					if has(ch, "usage") {
						t.Errorf("chunk %d has usage: %v", i, ch)
					}
					if s, ok := path(t, ch, "choices", 0, "delta").(map[string]any)["content"].(string); ok {
						text.WriteString(s)
					}
					if fr, ok := path(t, ch, "choices", 0, "finish_reason").(string); ok && fr != "" {
						finished++
					}
				}
				if finished != 1 {
					t.Errorf("%d chunks with a finish_reason, want 1", finished)
				}
				if text.Len() == 0 {
					t.Error("streamed no content")
				}
				if tc.includeUsage {
					last := cs[len(cs)-1]
					if ch, _ := path(t, last, "choices").([]any); ch == nil || len(ch) != 0 {
						t.Errorf("usage chunk choices = %#v, want []", path(t, last, "choices"))
					}
					if pt, _ := path(t, last, "usage", "prompt_tokens").(float64); pt <= 0 {
						t.Errorf("usage chunk = %v", last)
					}
					if ct, _ := path(t, last, "usage", "completion_tokens").(float64); ct <= 0 {
						t.Errorf("usage chunk = %v", last)
					}
				}
			})
		}
	})

	t.Run("streaming completions", func(t *testing.T) {
		t.Parallel()
		r := do(t, c, http.MethodPost, "/v1/completions", completionBody(c.Model, `"Once"`, `,"stream":true,"stream_options":{"include_usage":true}`), nil)
		if r.status != http.StatusOK {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		if ct := r.header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
			t.Errorf("Content-Type = %q, want text/event-stream; charset=utf-8", ct)
		}
		cs := chunks(t, sseEvents(t, r.body))
		if len(cs) < 2 {
			t.Fatalf("only %d chunks", len(cs))
		}
		var text strings.Builder
		finished := 0
		for i, ch := range cs[:len(cs)-1] {
			if got := path(t, ch, "object"); got != "text_completion" {
				t.Errorf("chunk %d object = %v", i, got)
			}
			if id, _ := ch["id"].(string); !strings.HasPrefix(id, "cmpl-") {
				t.Errorf("chunk %d id = %q", i, id)
			}
			s, _ := path(t, ch, "choices", 0, "text").(string)
			text.WriteString(s)
			if fr, ok := path(t, ch, "choices", 0, "finish_reason").(string); ok && fr != "" {
				finished++
			}
		}
		if text.Len() == 0 || finished != 1 {
			t.Errorf("streamed text %q with %d finish reasons, want text and 1", text.String(), finished)
		}
		if pt, _ := path(t, cs[len(cs)-1], "usage", "prompt_tokens").(float64); pt <= 0 {
			t.Errorf("last chunk has no usage: %v", cs[len(cs)-1])
		}
	})

	t.Run("X-Session-ID echo", func(t *testing.T) {
		t.Parallel()
		tests := []struct {
			name    string
			path    string
			body    string
			headers map[string]string
			want    string // "" = no X-Session-ID header
		}{
			{"from X-Session-ID", "/v1/chat/completions", chatBody(c.Model, "hi", ""), map[string]string{"X-Session-ID": "sess-h"}, "sess-h"},
			{"from X-Correlation-ID", "/v1/completions", completionBody(c.Model, `"hi"`, ""), map[string]string{"X-Correlation-ID": "corr-1"}, "corr-1"},
			{"from body session_id over header", "/v1/chat/completions", chatBody(c.Model, "hi", `,"session_id":"sess-b"`),
				map[string]string{"X-Session-ID": "sess-h"}, "sess-b"},
			{"from vllm_xargs", "/v1/completions", completionBody(c.Model, `"hi"`, `,"vllm_xargs":{"session_id":"sess-x"}`), nil, "sess-x"},
			{"trimmed", "/v1/chat/completions", chatBody(c.Model, "hi", ""), map[string]string{"X-Session-ID": "  sess-t  "}, "sess-t"},
			{"streaming", "/v1/chat/completions", chatBody(c.Model, "hi", `,"stream":true`), map[string]string{"X-Session-ID": "sess-s"}, "sess-s"},
			{"no session", "/v1/chat/completions", chatBody(c.Model, "hi", ""), nil, ""},
			{"no session, streaming", "/v1/completions", completionBody(c.Model, `"hi"`, `,"stream":true`), nil, ""},
			{"blank header is no session", "/v1/chat/completions", chatBody(c.Model, "hi", ""), map[string]string{"X-Session-ID": "   "}, ""},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				r := do(t, c, http.MethodPost, tt.path, tt.body, tt.headers)
				if r.status != http.StatusOK {
					t.Fatalf("status %d: %s", r.status, r.body)
				}
				got := r.header.Values("X-Session-ID")
				switch {
				case tt.want == "" && len(got) != 0:
					t.Errorf("X-Session-ID = %q, want no header", got)
				case tt.want != "" && (len(got) != 1 || got[0] != tt.want):
					t.Errorf("X-Session-ID = %q, want %q", got, tt.want)
				}
			})
		}
	})

	t.Run("completions with two prompts", func(t *testing.T) {
		t.Parallel()
		r := do(t, c, http.MethodPost, "/v1/completions", completionBody(c.Model, `["first prompt","second prompt"]`, ""), nil)
		if r.status != http.StatusOK {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		m := decode(t, r.body)
		choices, _ := path(t, m, "choices").([]any)
		if len(choices) != 2 {
			t.Fatalf("%d choices, want 2: %s", len(choices), r.body)
		}
		for i := range 2 {
			if got := path(t, choices, i, "index"); got != float64(i) {
				t.Errorf("choices[%d].index = %v", i, got)
			}
			if s, _ := path(t, choices, i, "text").(string); s == "" {
				t.Errorf("choices[%d].text is empty", i)
			}
		}
	})
}

// TestHTTPPromptTooLong checks --max-model-len on both endpoints.
func TestHTTPPromptTooLong(t *testing.T) {
	t.Parallel()
	c := testenv.StartCluster(t, testenv.ClusterConfig{MaxModelLen: 64})
	long := strings.Repeat("hello world ", 100) // about 200 tokens
	tests := []struct {
		name, path, body, param string
	}{
		{"chat", "/v1/chat/completions", chatBody(c.Model, long, ""), "messages"},
		{"chat without max_tokens", "/v1/chat/completions",
			fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}]}`, c.Model, long), "messages"},
		{"completions", "/v1/completions", completionBody(c.Model, fmt.Sprintf("%q", long), ""), "prompt"},
		{"completions, prompt fits but max_tokens does not", "/v1/completions",
			fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":64}`, c.Model), "prompt"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := do(t, c, http.MethodPost, tt.path, tt.body, nil)
			if r.status != http.StatusBadRequest {
				t.Fatalf("status = %d, want 400: %s", r.status, r.body)
			}
			checkErrorBody(t, r, "invalid_request_error", tt.param, "")
		})
	}
	// A short prompt still fits.
	if r := do(t, c, http.MethodPost, "/v1/completions", completionBody(c.Model, `"hi"`, ""), nil); r.status != http.StatusOK {
		t.Errorf("short prompt: status %d: %s", r.status, r.body)
	}
}
