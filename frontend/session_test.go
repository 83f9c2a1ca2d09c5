package frontend_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/kvbus/kvbus/frontend"
)

// hdr builds a canonicalised header from name/value pairs; a name may repeat.
func hdr(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Add(kv[i], kv[i+1])
	}
	return h
}

// TestResolveSession has one row per rule of DESIGN §3.
func TestResolveSession(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("a", frontend.MaxSessionIDBytes+1)
	exact := strings.Repeat("a", frontend.MaxSessionIDBytes)
	exactMultibyte := strings.Repeat("é", frontend.MaxSessionIDBytes/2) // 2 bytes each
	quote := func(s string) json.RawMessage {
		b, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	all := hdr("X-Session-ID", "h", "X-Correlation-ID", "c")

	tests := []struct {
		name    string
		in      frontend.SessionInput
		h       http.Header
		headers []string // nil: the default list
		wantID  string
		wantSrc string
		// wantParam != "" means a 400 naming that source is expected.
		wantParam string
	}{
		{
			name:   "body session_id wins over everything",
			in:     frontend.SessionInput{BodySessionID: quote("b"), XargsSessionID: quote("x")},
			h:      all,
			wantID: "b", wantSrc: frontend.SourceBody,
		},
		{
			// DESIGN §3: another type is a 400, never silently dropped —
			// even where the other body value would have won.
			name:      "vllm_xargs.session_id a number beside a body session_id",
			in:        frontend.SessionInput{BodySessionID: quote("b"), XargsSessionID: json.RawMessage("7")},
			h:         all,
			wantParam: frontend.SourceVLLMXargs,
		},
		{
			name:   "vllm_xargs.session_id used when body absent",
			in:     frontend.SessionInput{XargsSessionID: quote("x")},
			h:      all,
			wantID: "x", wantSrc: frontend.SourceVLLMXargs,
		},
		{
			name:   "explicit body value wins over headers",
			in:     frontend.SessionInput{BodySessionID: quote("b")},
			h:      hdr("X-Session-ID", "h"),
			wantID: "b", wantSrc: frontend.SourceBody,
		},
		{
			name:   "X-Session-ID used when no body value",
			h:      all,
			wantID: "h", wantSrc: "X-Session-ID",
		},
		{
			name:   "X-Correlation-ID used when no X-Session-ID",
			h:      hdr("X-Correlation-ID", "c"),
			wantID: "c", wantSrc: "X-Correlation-ID",
		},
		{
			name:   "header name case-insensitive: raw lower-case map key",
			h:      http.Header{"x-session-id": {"lower"}},
			wantID: "lower", wantSrc: "X-Session-ID",
		},
		{
			name:   "header name case-insensitive: lower-case Header.Add",
			h:      hdr("x-session-id", "lower"),
			wantID: "lower", wantSrc: "X-Session-ID",
		},
		{
			name:    "header name case-insensitive: lower-case configured name",
			h:       hdr("X-Session-ID", "h"),
			headers: []string{"x-session-id"},
			wantID:  "h", wantSrc: "x-session-id",
		},
		{
			name:   "repeated header: only first value counts",
			h:      hdr("X-Session-ID", "a", "X-Session-ID", "b"),
			wantID: "a", wantSrc: "X-Session-ID",
		},
		{
			name:   "repeated header whose first value is blank falls through to next source",
			h:      hdr("X-Session-ID", "  ", "X-Session-ID", "b", "X-Correlation-ID", "c"),
			wantID: "c", wantSrc: "X-Correlation-ID",
		},
		{
			name:   "value trimmed",
			h:      hdr("X-Session-ID", " \t abc \t "),
			wantID: "abc", wantSrc: "X-Session-ID",
		},
		{
			name:   "body value trimmed",
			in:     frontend.SessionInput{BodySessionID: quote("  abc\n")},
			wantID: "abc", wantSrc: frontend.SourceBody,
		},
		{
			name:   "header empty after trimming falls through",
			h:      hdr("X-Session-ID", " \t ", "X-Correlation-ID", "c"),
			wantID: "c", wantSrc: "X-Correlation-ID",
		},
		{
			name:   "body null = not given (falls through)",
			in:     frontend.SessionInput{BodySessionID: json.RawMessage("null"), XargsSessionID: json.RawMessage(" null ")},
			h:      hdr("X-Session-ID", "h"),
			wantID: "h", wantSrc: "X-Session-ID",
		},
		{
			name:   "body string empty after trim = not given",
			in:     frontend.SessionInput{BodySessionID: quote(" \t "), XargsSessionID: quote("")},
			h:      hdr("X-Session-ID", "h"),
			wantID: "h", wantSrc: "X-Session-ID",
		},
		{
			name:      "body number is a 400",
			in:        frontend.SessionInput{BodySessionID: json.RawMessage("42")},
			h:         hdr("X-Session-ID", "h"), // never silently dropped in favour of a header
			wantParam: frontend.SourceBody,
		},
		{
			name:      "body bool is a 400",
			in:        frontend.SessionInput{BodySessionID: json.RawMessage("true")},
			wantParam: frontend.SourceBody,
		},
		{
			name:      "body list is a 400",
			in:        frontend.SessionInput{BodySessionID: json.RawMessage(`["a"]`)},
			wantParam: frontend.SourceBody,
		},
		{
			name:      "body object is a 400",
			in:        frontend.SessionInput{BodySessionID: json.RawMessage(`{"id":"a"}`)},
			wantParam: frontend.SourceBody,
		},
		{
			name:      "vllm_xargs.session_id non-string is a 400",
			in:        frontend.SessionInput{XargsSessionID: json.RawMessage("7")},
			h:         hdr("X-Session-ID", "h"),
			wantParam: frontend.SourceVLLMXargs,
		},
		{
			name:      "body value over 256 bytes is a 400 naming the body field",
			in:        frontend.SessionInput{BodySessionID: quote(long)},
			wantParam: frontend.SourceBody,
		},
		{
			name:      "vllm_xargs value over 256 bytes is a 400 naming vllm_xargs.session_id",
			in:        frontend.SessionInput{XargsSessionID: quote(long)},
			wantParam: frontend.SourceVLLMXargs,
		},
		{
			name:      "header value over 256 bytes is a 400 naming the header",
			h:         hdr("X-Session-ID", long),
			wantParam: "X-Session-ID",
		},
		{
			name:      "custom header value over 256 bytes is a 400 naming the configured header",
			h:         hdr("X-Dynamo-Session-ID", long),
			headers:   []string{"X-Dynamo-Session-ID"},
			wantParam: "X-Dynamo-Session-ID",
		},
		{
			name:   "exactly 256 bytes accepted",
			h:      hdr("X-Session-ID", exact),
			wantID: exact, wantSrc: "X-Session-ID",
		},
		{
			name:   "exactly 256 bytes of multi-byte UTF-8 accepted in the body",
			in:     frontend.SessionInput{BodySessionID: quote(exactMultibyte)},
			wantID: exactMultibyte, wantSrc: frontend.SourceBody,
		},
		{
			name:      "invalid UTF-8 in header is a 400",
			h:         hdr("X-Session-ID", "ab\xffcd"),
			wantParam: "X-Session-ID",
		},
		{
			name:      "invalid UTF-8 in the body is a 400",
			in:        frontend.SessionInput{BodySessionID: json.RawMessage("\"ab\xffcd\"")},
			wantParam: frontend.SourceBody,
		},
		{
			name:      "a lone high surrogate escape in the body is a 400 (json.Unmarshal makes it U+FFFD)",
			in:        frontend.SessionInput{BodySessionID: json.RawMessage(`"a\ud800b"`)},
			wantParam: frontend.SourceBody,
		},
		{
			name:      "a lone low surrogate escape in vllm_xargs is a 400",
			in:        frontend.SessionInput{XargsSessionID: json.RawMessage(`"a\uDC00b"`)},
			wantParam: frontend.SourceVLLMXargs,
		},
		{
			name:      "a high surrogate escape at the end of the body's id is a 400",
			in:        frontend.SessionInput{BodySessionID: json.RawMessage(`"ab\ud83d"`)},
			wantParam: frontend.SourceBody,
		},
		{
			name:      "surrogates the wrong way round are a 400",
			in:        frontend.SessionInput{BodySessionID: json.RawMessage(`"\ude00\ud83d"`)},
			wantParam: frontend.SourceBody,
		},
		{
			name:   "a surrogate pair escape is its code point",
			in:     frontend.SessionInput{BodySessionID: json.RawMessage(`"a\ud83d\ude00"`)},
			wantID: "a\U0001F600", wantSrc: frontend.SourceBody,
		},
		{
			name:   "an escaped backslash before u is no escape",
			in:     frontend.SessionInput{BodySessionID: json.RawMessage(`"a\\ud800"`)},
			wantID: `a\ud800`, wantSrc: frontend.SourceBody,
		},
		{
			name:      "control character U+0001 is a 400",
			h:         hdr("X-Session-ID", "a\x01b"),
			wantParam: "X-Session-ID",
		},
		{
			name:      "control character U+007F is a 400",
			h:         hdr("X-Session-ID", "a\x7fb"),
			wantParam: "X-Session-ID",
		},
		{
			name:      "control character U+0085 is a 400",
			h:         hdr("X-Session-ID", "a\u0085b"),
			wantParam: "X-Session-ID",
		},
		{
			name:      "control character in the body (JSON escape) is a 400",
			in:        frontend.SessionInput{BodySessionID: json.RawMessage(`"a\u0000b"`)},
			wantParam: frontend.SourceBody,
		},
		{
			name:    "configurable header list: the configured header is used",
			h:       hdr("X-Dynamo-Session-ID", "d", "X-Session-ID", "h"),
			headers: []string{"X-Dynamo-Session-ID"},
			wantID:  "d", wantSrc: "X-Dynamo-Session-ID",
		},
		{
			name:    "configurable header list: X-Session-ID ignored when not configured",
			h:       all,
			headers: []string{"X-Dynamo-Session-ID"},
			wantID:  "", wantSrc: "",
		},
		{
			name:    "order = precedence with a custom list",
			h:       all,
			headers: []string{"X-Correlation-ID", "X-Session-ID"},
			wantID:  "c", wantSrc: "X-Correlation-ID",
		},
		{
			name:    "body still wins over a custom header list",
			in:      frontend.SessionInput{XargsSessionID: quote("x")},
			h:       hdr("X-Dynamo-Session-ID", "d"),
			headers: []string{"X-Dynamo-Session-ID"},
			wantID:  "x", wantSrc: frontend.SourceVLLMXargs,
		},
		{
			name:   "no source at all gives no session and no error",
			h:      hdr("Content-Type", "application/json"),
			wantID: "", wantSrc: "",
		},
		{
			name:   "nil header and empty input give no session",
			wantID: "", wantSrc: "",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			headers := tt.headers
			if headers == nil {
				headers = frontend.DefaultSessionHeaders()
			}
			id, src, err := frontend.ResolveSession(tt.in, tt.h, headers)
			if tt.wantParam != "" {
				if err == nil {
					t.Fatalf("ResolveSession = (%q, %q, nil), want a 400 naming %q", id, src, tt.wantParam)
				}
				if err.Status != http.StatusBadRequest || err.Type != "invalid_request_error" || err.Param != tt.wantParam {
					t.Errorf("error = {Status: %d, Type: %q, Param: %q}, want {400, invalid_request_error, %q}",
						err.Status, err.Type, err.Param, tt.wantParam)
				}
				if err.Message == "" {
					t.Error("error has an empty Message")
				}
				return
			}
			if err != nil {
				t.Fatalf("ResolveSession error: %v", err)
			}
			if id != tt.wantID || src != tt.wantSrc {
				t.Errorf("ResolveSession = (%q, %q), want (%q, %q)", id, src, tt.wantID, tt.wantSrc)
			}
		})
	}
}

func FuzzResolveSession(f *testing.F) {
	seeds := []struct {
		body, xargs []byte
		header      string
	}{
		{nil, nil, ""},
		{[]byte(`"abc"`), nil, "h"},
		{nil, []byte(`"x"`), "h"},
		{[]byte(`null`), []byte(`null`), " h "},
		{[]byte(`"  "`), nil, "\t"},
		{[]byte(`42`), nil, ""},
		{[]byte(`true`), nil, ""},
		{[]byte(`["a"]`), nil, ""},
		{nil, []byte(`{"a":1}`), ""},
		{[]byte(`"a\u0000b"`), nil, ""},
		{[]byte(`"\ud800"`), nil, ""},
		{[]byte("\"\xff\""), nil, ""},
		{[]byte(`"abc`), nil, ""},
		{nil, nil, "a\u0085b"},
		{nil, nil, "\u0085abc\u0085"},
		{nil, nil, "ab\xffcd"},
		{nil, nil, strings.Repeat("x", 257)},
	}
	for _, s := range seeds {
		f.Add(s.body, s.xargs, s.header)
	}
	headers := frontend.DefaultSessionHeaders()
	f.Fuzz(func(t *testing.T, body, xargs []byte, header string) {
		h := http.Header{}
		if header != "" {
			h.Set("X-Session-ID", header)
		}
		id, src, err := frontend.ResolveSession(frontend.SessionInput{BodySessionID: body, XargsSessionID: xargs}, h, headers)
		if err != nil {
			if err.Status != http.StatusBadRequest || err.Type != "invalid_request_error" || err.Param == "" || err.Message == "" {
				t.Fatalf("bad error shape: %+v", err)
			}
			return
		}
		if !utf8.ValidString(id) {
			t.Errorf("id %q is not valid UTF-8", id)
		}
		// U+FFFD only when sent: never one made up for a bad byte or escape.
		if strings.ContainsRune(id, utf8.RuneError) {
			sent := string(body) + string(xargs) + header
			if !strings.ContainsRune(sent, utf8.RuneError) && !strings.Contains(strings.ToLower(sent), `\ufffd`) {
				t.Errorf("id %q holds U+FFFD that the request did not send", id)
			}
		}
		if strings.ContainsFunc(id, unicode.IsControl) {
			t.Errorf("id %q contains a control character", id)
		}
		if len(id) > frontend.MaxSessionIDBytes {
			t.Errorf("id is %d bytes, more than %d", len(id), frontend.MaxSessionIDBytes)
		}
		if strings.TrimSpace(id) != id {
			t.Errorf("id %q is not trimmed", id)
		}
		if (id != "") != (src != "") {
			t.Errorf("id %q with source %q: one is empty and the other is not", id, src)
		}
	})
}

func BenchmarkResolveSession(b *testing.B) {
	headers := frontend.DefaultSessionHeaders()
	b.Run("header", func(b *testing.B) {
		h := http.Header{}
		h.Set("Content-Type", "application/json")
		h.Set("X-Session-ID", "  conversation-0123456789abcdef  ")
		b.ReportAllocs()
		for b.Loop() {
			if _, _, err := frontend.ResolveSession(frontend.SessionInput{}, h, headers); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("body", func(b *testing.B) {
		in := frontend.SessionInput{BodySessionID: json.RawMessage(`"conversation-0123456789abcdef"`)}
		h := http.Header{}
		h.Set("X-Session-ID", "ignored")
		b.ReportAllocs()
		for b.Loop() {
			if _, _, err := frontend.ResolveSession(in, h, headers); err != nil {
				b.Fatal(err)
			}
		}
	})
}
