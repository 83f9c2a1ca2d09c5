package frontend

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/kvbus/kvbus/messages"
)

// MaxSessionIDBytes is the longest accepted session id.
const MaxSessionIDBytes = messages.MaxSessionIDBytes

// DefaultSessionHeaders are the headers read for a session id, in order of
// precedence, when --session-header is not given.
var defaultSessionHeaders = []string{"X-Session-ID", "X-Correlation-ID"}

// DefaultSessionHeaders returns the default --session-header list.
func DefaultSessionHeaders() []string { return append([]string(nil), defaultSessionHeaders...) }

// Session id sources, as named in errors and logs.
const (
	SourceBody      = "session_id"
	SourceVLLMXargs = "vllm_xargs.session_id"
)

// SessionInput holds the raw body values that can carry a session id: the
// JSON of the body's session_id field and of vllm_xargs.session_id (nil when
// absent).
type SessionInput struct {
	BodySessionID  json.RawMessage
	XargsSessionID json.RawMessage
}

// ResolveSession applies kvbus's session rules (DESIGN §3): the first of body
// session_id, body vllm_xargs.session_id, then each of headers in order, that
// gives a value wins. It returns the session id ("" for none) and its source,
// or a 400 APIError naming the offending source.
func ResolveSession(in SessionInput, h http.Header, headers []string) (id, source string, err *APIError) {
	// Both body values are checked before either wins: one of the wrong
	// type is a 400 even when the other would have been chosen.
	var first, from string
	for _, b := range []struct {
		raw  json.RawMessage
		name string
	}{{in.BodySessionID, SourceBody}, {in.XargsSessionID, SourceVLLMXargs}} {
		v, given, err := bodySessionValue(b.raw, b.name)
		if err != nil {
			return "", "", err
		}
		if given && from == "" {
			first, from = v, b.name
		}
	}
	if from != "" {
		return checked(first, from)
	}
	for _, name := range headers {
		vals := headerValues(h, name)
		if len(vals) == 0 {
			continue
		}
		if v := strings.TrimSpace(vals[0]); v != "" { // only the first value counts
			return checked(v, name)
		}
	}
	return "", "", nil
}

func checked(v, source string) (string, string, *APIError) {
	if err := checkSessionID(v, source); err != nil {
		return "", "", err
	}
	return v, source, nil
}

// headerValues returns the values of a header, matching its name without
// regard to case even when h was built with non-canonical keys.
func headerValues(h http.Header, name string) []string {
	if vals := h.Values(name); len(vals) > 0 {
		return vals
	}
	for k, vals := range h {
		if strings.EqualFold(k, name) {
			return vals
		}
	}
	return nil
}

// bodySessionValue reads a body value: absent or null is not given; a string
// empty after trimming is not given; any other JSON type is an error.
func bodySessionValue(raw json.RawMessage, name string) (string, bool, *APIError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", false, nil
	}
	if raw[0] != '"' {
		return "", false, badRequest(name, "%s must be a string, got %s", name, jsonKind(raw))
	}
	// json.Unmarshal would quietly replace bad bytes, and a lone surrogate
	// escape, with U+FFFD: two different ids would be one session.
	if !utf8.Valid(raw) || hasLoneSurrogate(raw) {
		return "", false, badRequest(name, "%s is not valid UTF-8", name)
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", false, badRequest(name, "%s is not a valid JSON string: %v", name, err)
	}
	s = strings.TrimSpace(s)
	return s, s != "", nil
}

// sessionNotUTF8 names the body's session id field (SourceBody or
// SourceVLLMXargs, its keys matched as written) whose value is not valid
// UTF-8, or returns "": the whole body's check must not hide the source
// of a bad session id.
func sessionNotUTF8(body []byte) string {
	var top map[string]json.RawMessage
	if json.Unmarshal(body, &top) != nil {
		return ""
	}
	if v, ok := top[SourceBody]; ok && !utf8.Valid(v) {
		return SourceBody
	}
	var xargs map[string]json.RawMessage
	if json.Unmarshal(top["vllm_xargs"], &xargs) == nil {
		if v, ok := xargs[messages.ExtraArgSessionID]; ok && !utf8.Valid(v) {
			return SourceVLLMXargs
		}
	}
	return ""
}

// hasLoneSurrogate reports whether a JSON string literal holds a \uD800–
// \uDFFF escape that is not a high surrogate followed by a low one: no
// code point, so no UTF-8.
func hasLoneSurrogate(raw []byte) bool {
	for i := 0; i < len(raw)-1; i++ {
		if raw[i] != '\\' {
			continue
		}
		if raw[i+1] != 'u' {
			i++ // \" \\ \n ...: the escaped byte is no escape of its own
			continue
		}
		r, ok := hexEscape(raw, i)
		switch {
		case !ok:
			return false // json.Unmarshal refuses it
		case r >= 0xDC00 && r <= 0xDFFF:
			return true
		case r >= 0xD800 && r <= 0xDBFF:
			lo, ok := hexEscape(raw, i+6)
			if !ok || lo < 0xDC00 || lo > 0xDFFF {
				return true
			}
			i += 11
		default:
			i += 5
		}
	}
	return false
}

// hexEscape reads the \uXXXX escape at raw[i:].
func hexEscape(raw []byte, i int) (rune, bool) {
	if i+6 > len(raw) || raw[i] != '\\' || raw[i+1] != 'u' {
		return 0, false
	}
	var r rune
	for _, c := range raw[i+2 : i+6] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}

func checkSessionID(v, source string) *APIError {
	if err := messages.CheckSessionID(v); err != nil {
		return badRequest(source, "%s: %v", source, err)
	}
	return nil
}

func jsonKind(raw json.RawMessage) string {
	switch raw[0] {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case 't', 'f':
		return "a boolean"
	default:
		return "a number"
	}
}

// refusedSession is the session id of a request refused before its session
// was resolved, for the X-Session-ID echo: what ResolveSession makes of the
// body's session fields (when body is a JSON object) and the headers, or ""
// when there is none or it is invalid. body may be nil (not read).
func refusedSession(body []byte, h http.Header, headers []string) string {
	var in SessionInput
	var b struct {
		SessionID json.RawMessage `json:"session_id"`
		VLLMXargs json.RawMessage `json:"vllm_xargs"`
	}
	// A body that cannot hold a session_id key (not even \u-escaped; a key
	// is matched as written) is not decoded: a 429 under overload costs a
	// scan, not a decode.
	if mayHoldSessionID(body) && decodeJSON(body, &b) == nil {
		in.BodySessionID = b.SessionID
		var xargs map[string]json.RawMessage
		if json.Unmarshal(b.VLLMXargs, &xargs) == nil {
			in.XargsSessionID = xargs[messages.ExtraArgSessionID]
		}
	}
	id, _, err := ResolveSession(in, h, headers)
	if err != nil {
		return ""
	}
	return id
}

// mayHoldSessionID reports whether body may hold a session_id key: it
// spells it, or escapes some character (\u0073ession_id is the key too).
func mayHoldSessionID(body []byte) bool {
	return bytes.Contains(body, []byte(SourceBody)) || bytes.Contains(body, []byte(`\u`))
}
