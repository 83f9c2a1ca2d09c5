package frontend

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"unicode/utf8"
)

// Exact keys. encoding/json matches object keys to struct fields ignoring
// case; vLLM's pydantic models match them exactly. A body written with a
// case variant of a field's key ("STREAM") is decoded as vLLM would,
// with the variant ignored as an unknown field.

// fieldSchema names the keys of a JSON object that the parser decodes into
// a struct, each with the schema of its value: of the object, or of the
// objects of the array, it holds (nil: a value decoded whole, such as a
// number or a json.RawMessage kept as sent). It is read-only.
type fieldSchema map[string]fieldSchema

// requestSchema is every field of chatRequest, completionRequest,
// tokenizeRequest and detokenizeRequest, with the objects inside them that
// are decoded into structs: stream_options, messages and their content
// parts. Read-only; TestRequestSchema keeps it
// in step with the structs.
var requestSchema = fieldSchema{
	"model": nil, "max_tokens": nil, "min_tokens": nil, "temperature": nil, "top_p": nil, "n": nil, "seed": nil,
	"presence_penalty": nil, "frequency_penalty": nil, "repetition_penalty": nil, "top_k": nil, "min_p": nil,
	"stop": nil, "stream": nil, "stream_options": {"include_usage": nil, "continuous_usage_stats": nil},
	"ignore_eos": nil, "include_stop_str_in_output": nil, "request_id": nil, "session_id": nil, "stop_token_ids": nil, "vllm_xargs": nil, "kv_transfer_params": nil,
	"tools": nil, "tool_choice": nil, "response_format": nil, "logprobs": nil, "top_logprobs": nil, "prompt_logprobs": nil, "echo": nil,
	"logit_bias": nil, "guided_json": nil, "guided_regex": nil, "guided_choice": nil, "guided_grammar": nil,
	"structured_outputs":     nil,
	"messages":               {"role": nil, "content": {"type": nil, "text": nil}},
	"max_completion_tokens":  nil,
	"prompt":                 nil,
	"add_special_tokens":     nil,
	"suffix":                 nil,
	"cache_salt":             nil,
	"truncate_prompt_tokens": nil,
	// /tokenize and /detokenize (tokenizeRequest, detokenizeRequest)
	"add_generation_prompt":  nil,
	"continue_final_message": nil,
	"return_token_strs":      nil,
	"tokens":                 nil,
}

// maxKeyLen is the length of the longest key of requestSchema.
const maxKeyLen = len("include_stop_str_in_output")

// requestKeysByLen holds the keys of requestSchema, at every level, by
// length. Read-only.
var requestKeysByLen = keysByLen(requestSchema)

func keysByLen(s fieldSchema) *[maxKeyLen + 1][]string {
	var out [maxKeyLen + 1][]string
	var walk func(fieldSchema)
	walk = func(s fieldSchema) {
		for k, sub := range s {
			if !slices.Contains(out[len(k)], k) {
				out[len(k)] = append(out[len(k)], k)
			}
			walk(sub)
		}
	}
	walk(s)
	return &out
}

// exactKeys returns raw, a JSON value of schema s, with every object key
// that is not one of s's fields as written left out, at every level s
// describes; the other keys and values are kept, in the same meaning.
// encoding/json matches keys to fields ignoring case ("STREAM" sets
// Stream); with this done first, only exact keys are matched, as
// pydantic does (vLLM ignores "STREAM" as an unknown field). Invalid JSON
// is returned as it is, for the decoder to report.
func exactKeys(raw json.RawMessage, s fieldSchema) json.RawMessage {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return raw
	}
	switch raw[0] {
	case '{':
		var m map[string]json.RawMessage
		if json.Unmarshal(raw, &m) != nil {
			return raw
		}
		for k, v := range m {
			sub, ok := s[k]
			switch {
			case !ok:
				delete(m, k)
			case sub != nil:
				m[k] = exactKeys(v, sub)
			}
		}
		if out, err := json.Marshal(m); err == nil {
			return out
		}
	case '[':
		var a []json.RawMessage
		if json.Unmarshal(raw, &a) != nil {
			return raw
		}
		for i, v := range a {
			a[i] = exactKeys(v, s)
		}
		if out, err := json.Marshal(a); err == nil {
			return out
		}
	}
	return raw
}

// hasKeyVariant reports whether body may hold a quoted string that
// encoding/json would match to a key of requestSchema without being that
// key as written: a case variant ("STREAM"), or one written with a
// non-ASCII letter that folds to an ASCII one (ſ, U+017F, folds to s; K,
// U+212A, to k). One pass, no allocation for plain ASCII; a string written
// with escapes is decoded (encoding/json also matches "STREA\u004d"). A
// false positive (a value such as "Text", or a quote inside a string) only
// costs the caller an exact decode.
func hasKeyVariant(body []byte) bool {
	for i := 0; ; {
		j := bytes.IndexByte(body[i:], '"')
		if j < 0 {
			return false
		}
		i += j + 1
		if i >= len(body) {
			return false
		}
		switch c := body[i]; {
		case c == '\\' || c >= utf8.RuneSelf:
			if encodedVariant(body[i-1:]) {
				return true
			}
			continue
		case !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'): // every key starts with a letter
			continue
		}
		n := 0 // the string's length, while plain ASCII
		for ; n <= maxKeyLen && i+n < len(body); n++ {
			if c := body[i+n]; c == '"' || c == '\\' || c >= utf8.RuneSelf {
				break
			}
		}
		if i+n >= len(body) || n > maxKeyLen {
			continue
		}
		if body[i+n] != '"' {
			if encodedVariant(body[i-1:]) {
				return true
			}
			continue
		}
		for _, key := range requestKeysByLen[n] {
			if foldsTo(body[i:i+n], key) && string(body[i:i+n]) != key {
				return true
			}
		}
	}
}

// maxEncodedKey bounds the written length of a key hasKeyVariant decodes:
// every letter of the longest key as a \uXXXX escape, and its quotes.
const maxEncodedKey = 6*maxKeyLen + 2

// encodedVariant reports whether the JSON string at the start of q (its
// opening quote) is written with escapes or non-ASCII letters and decodes
// to a case variant of a key of requestSchema. Only a string of as many
// characters as a key, and without non-ASCII letters other than the two
// that fold to ASCII ones, is decoded: a body of short non-ASCII strings
// costs a scan.
func encodedVariant(q []byte) bool {
	plain, runes := true, 0
	for n := 1; n < len(q) && n < maxEncodedKey; n++ {
		switch c := q[n]; {
		case c == '\\':
			plain = false
			runes++
			if n+1 < len(q) && q[n+1] == 'u' {
				n += 5 // \uXXXX
			} else {
				n++ // the escaped byte
			}
		case c >= utf8.RuneSelf:
			plain = false
			runes++
			r, size := utf8.DecodeRune(q[n:])
			if r != 'ſ' && r != 'K' { // U+017F, U+212A: the only ones that fold to ASCII
				return false
			}
			n += size - 1
		case c == '"':
			if plain || runes > maxKeyLen || len(requestKeysByLen[runes]) == 0 {
				return false
			}
			var s string
			if json.Unmarshal(q[:n+1], &s) != nil {
				return false
			}
			for _, key := range requestKeysByLen[runes] {
				if s != key && strings.EqualFold(s, key) {
					return true
				}
			}
			return false
		default:
			runes++
		}
	}
	return false
}

// foldsTo reports whether w equals key, a lowercase ASCII key, ignoring
// the case of letters.
func foldsTo(w []byte, key string) bool {
	for k := range len(key) {
		b := w[k]
		if 'A' <= b && b <= 'Z' {
			b += 'a' - 'A'
		}
		if b != key[k] {
			return false
		}
	}
	return true
}
