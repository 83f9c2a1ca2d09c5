package frontend

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/kvbus/kvbus/messages"
)

// commonParams are the request fields shared by both endpoints.
type commonParams struct {
	Model            string          `json:"model"`
	MaxTokens        *int            `json:"max_tokens"`
	MinTokens        *int            `json:"min_tokens"`
	Temperature      *float64        `json:"temperature"`
	TopP             *float64        `json:"top_p"`
	N                *int            `json:"n"`
	Seed             *int64          `json:"seed"`
	Stop             json.RawMessage `json:"stop"`
	Stream           bool            `json:"stream"`
	StreamOptions    *streamOptions  `json:"stream_options"`
	IgnoreEOS        bool            `json:"ignore_eos"`
	SessionID        json.RawMessage `json:"session_id"`
	VLLMXargs        json.RawMessage `json:"vllm_xargs"`
	KVTransferParams map[string]any  `json:"kv_transfer_params"`
	// Fields the sim engine cannot honour: 400 with the sim, passed through
	// to a real engine.
	Tools          json.RawMessage `json:"tools"`
	ToolChoice     json.RawMessage `json:"tool_choice"`
	ResponseFormat json.RawMessage `json:"response_format"`
	Logprobs       json.RawMessage `json:"logprobs"`
	TopLogprobs    json.RawMessage `json:"top_logprobs"`
	Echo           json.RawMessage `json:"echo"`
	LogitBias      json.RawMessage `json:"logit_bias"`
	GuidedJSON     json.RawMessage `json:"guided_json"`
	GuidedRegex    json.RawMessage `json:"guided_regex"`
	GuidedChoice   json.RawMessage `json:"guided_choice"`
	GuidedGrammar  json.RawMessage `json:"guided_grammar"`
	Structured     json.RawMessage `json:"structured_outputs"`
}

// simUnsupported names the first field set in c that the sim engine
// cannot honour (a value that asks for nothing, such as null, false, 0,
// [] or tool_choice "none", is fine).
func (c *commonParams) simUnsupported() string {
	fields := []struct {
		name string
		raw  json.RawMessage
	}{{"tools", c.Tools}, {"tool_choice", c.ToolChoice}, {"response_format", c.ResponseFormat}, {"logprobs", c.Logprobs},
		{"top_logprobs", c.TopLogprobs}, {"echo", c.Echo}, {"logit_bias", c.LogitBias}, {"guided_json", c.GuidedJSON},
		{"guided_regex", c.GuidedRegex}, {"guided_choice", c.GuidedChoice}, {"guided_grammar", c.GuidedGrammar},
		{"structured_outputs", c.Structured}}
	for _, f := range fields {
		switch v := string(bytes.TrimSpace(f.raw)); v {
		case "", "null", "false", "0", "[]", "{}", `"none"`:
		default:
			if f.name == "response_format" && strings.ReplaceAll(v, " ", "") == `{"type":"text"}` {
				continue // the default: plain text
			}
			return f.name
		}
	}
	return ""
}

type streamOptions struct {
	// IncludeUsage is true when left out, as vLLM's StreamOptions has it
	// (and kvbus's real-engine path); null or false leaves usage out.
	IncludeUsage json.RawMessage `json:"include_usage"`
}

type chatRequest struct {
	commonParams
	Messages            []chatMessage `json:"messages"`
	MaxCompletionTokens *int          `json:"max_completion_tokens"`
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type completionRequest struct {
	commonParams
	Prompt json.RawMessage `json:"prompt"`
}

// parseOptions say what the requests will run on.
type parseOptions struct {
	// passthrough: real engines serve the requests (--engine openai) and
	// get the client's body: fields the sim cannot honour pass, n may be
	// above 1, content parts other than text are left to the engine.
	passthrough bool
	// vocab bounds token ids of token-id prompts.
	vocab int
}

// parsedRequest is a validated request, before session resolution.
type parsedRequest struct {
	body         []byte // the client's JSON body
	endpoint     string
	model        string
	turns        []ChatTurn // chat
	texts        []string   // completions with text prompts
	tokenPrompts [][]uint32 // completions with token-id prompts
	params       messages.SamplingParams
	maxTokensSet bool
	stream       bool
	includeUsage bool
	session      SessionInput
	xargs        map[string]any
	kvTransfer   map[string]any
}

// readBody reads at most limit bytes of the body; more is a 413.
func readBody(w http.ResponseWriter, r *http.Request, limit int64, timeout time.Duration) ([]byte, *APIError) {
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Now().Add(timeout)) // not every ResponseWriter can
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	_ = rc.SetReadDeadline(time.Time{})
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, &APIError{Status: http.StatusRequestEntityTooLarge, Type: typeInvalidRequest, Code: "request_too_large",
				Message: fmt.Sprintf("request body exceeds %d bytes (--max-body-bytes)", limit)}
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			w.Header().Set("Connection", "close")
			return nil, &APIError{Status: http.StatusRequestTimeout, Type: typeInvalidRequest, Code: "request_timeout",
				Message: fmt.Sprintf("the request body did not arrive within %s; send it whole", timeout)}
		}
		return nil, badRequest("", "cannot read request body: %v", err)
	}
	return body, nil
}

// hasKeyVariant reports whether body may hold a quoted string equal to one
// of keys but for case, and not that key itself: a key encoding/json would
// match to the key's field. One pass, no allocation for plain ASCII; a
// string written with escapes or non-ASCII bytes is decoded (encoding/json
// also matches "SESSION\u005fID", and "ſession_id", whose ſ folds to s).
// A false positive only costs the caller an exact look-up.
func hasKeyVariant(body []byte, keys ...string) bool {
	for i := 0; ; {
		j := bytes.IndexByte(body[i:], '"')
		if j < 0 {
			return false
		}
		i += j + 1
		for _, key := range keys {
			if end := i + len(key); end < len(body) && body[end] == '"' && foldsTo(body[i:end], key) && string(body[i:end]) != key {
				return true
			}
		}
		if encodedVariant(body[i-1:], keys) {
			return true
		}
	}
}

// maxEncodedKey bounds the written length of a key hasKeyVariant decodes:
// every letter of a 10-letter key as a \uXXXX escape, and its quotes.
const maxEncodedKey = 6*10 + 2

// encodedVariant reports whether the JSON string at the start of q (its
// opening quote) is written with escapes or non-ASCII bytes and decodes to
// a case variant of one of keys. Only a string of as many characters as a
// key is decoded: a body of short non-ASCII strings costs a scan.
func encodedVariant(q []byte, keys []string) bool {
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
			_, size := utf8.DecodeRune(q[n:])
			n += size - 1
		case c == '"':
			if plain || !slices.ContainsFunc(keys, func(k string) bool { return len(k) == runes }) {
				return false
			}
			var s string
			if json.Unmarshal(q[:n+1], &s) != nil {
				return false
			}
			for _, key := range keys {
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

// decodeJSON unmarshals a request body, turning type errors into 400s that
// name the field.
func decodeJSON(body []byte, v any) *APIError {
	if len(bytes.TrimSpace(body)) == 0 {
		return badRequest("", "request body is empty; send a JSON object")
	}
	if !utf8.Valid(body) { // encoding/json would quietly replace the bad bytes
		return badRequest("", "request body is not valid UTF-8")
	}
	if err := json.Unmarshal(body, v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			// Field is the path from the root, through the embedded struct.
			field := strings.TrimPrefix(te.Field, "commonParams.")
			if field == "" {
				return badRequest("", "request body must be a JSON object, got a JSON %s", te.Value)
			}
			return badRequest(field, "%s must be %s, got a JSON %s", field, goTypeName(te.Type.String()), te.Value)
		}
		return badRequest("", "request body is not valid JSON: %v", err)
	}
	return nil
}

func goTypeName(t string) string {
	t = strings.TrimPrefix(t, "*")
	switch {
	case strings.HasPrefix(t, "int"), strings.HasPrefix(t, "uint"):
		return "an integer"
	case strings.HasPrefix(t, "float"):
		return "a number"
	case t == "string":
		return "a string"
	case t == "bool":
		return "a boolean"
	case strings.HasPrefix(t, "[]"):
		return "an array"
	case strings.HasPrefix(t, "map"), strings.Contains(t, "."):
		return "an object"
	}
	return t
}

// parseCommon validates the shared fields into p.
func parseCommon(c *commonParams, p *parsedRequest, o parseOptions) *APIError {
	p.model = c.Model
	p.stream = c.Stream
	if c.StreamOptions != nil {
		if !c.Stream {
			return badRequest("stream_options", "stream_options is only allowed when stream is true")
		}
		switch v := string(bytes.TrimSpace(c.StreamOptions.IncludeUsage)); v {
		case "", "true":
			p.includeUsage = true
		case "null", "false":
		default:
			return badRequest("stream_options.include_usage", "stream_options.include_usage must be a boolean, got %s", v)
		}
	}
	sp := &p.params
	sp.Temperature, sp.TopP = 1, 1
	if c.Temperature != nil {
		if *c.Temperature < 0 || *c.Temperature > 2 || math.IsNaN(*c.Temperature) {
			return badRequest("temperature", "temperature must be between 0 and 2, got %g", *c.Temperature)
		}
		sp.Temperature = *c.Temperature
	}
	if c.TopP != nil {
		if *c.TopP <= 0 || *c.TopP > 1 || math.IsNaN(*c.TopP) {
			return badRequest("top_p", "top_p must be in (0, 1], got %g", *c.TopP)
		}
		sp.TopP = *c.TopP
	}
	if !o.passthrough {
		if c.N != nil && *c.N != 1 {
			return badRequest("n", "n must be 1: the sim engine generates one choice per prompt (real engines behind --engine openai take n)")
		}
		if f := c.simUnsupported(); f != "" {
			return badRequest(f, "%s is not supported by the sim engine, which would ignore it; leave it out, or run real engines (--engine openai), which get it as sent", f)
		}
	}
	if c.MaxTokens != nil {
		if *c.MaxTokens < 1 {
			return badRequest("max_tokens", "max_tokens must be at least 1, got %d", *c.MaxTokens)
		}
		sp.MaxTokens, p.maxTokensSet = *c.MaxTokens, true
	}
	if c.MinTokens != nil {
		if *c.MinTokens < 0 {
			return badRequest("min_tokens", "min_tokens must be >= 0, got %d", *c.MinTokens)
		}
		sp.MinTokens = *c.MinTokens
	}
	sp.Seed = c.Seed
	sp.IgnoreEOS = c.IgnoreEOS
	stop, err := parseStop(c.Stop)
	if err != nil {
		return err
	}
	sp.Stop = stop
	sid, xargs := c.SessionID, c.VLLMXargs
	if hasKeyVariant(p.body, "session_id", "vllm_xargs") {
		// encoding/json matched "SESSION_ID" or "Vllm_Xargs" to these
		// fields too, the last one winning; the session rules read the
		// keys as written, as vLLM does.
		var top map[string]json.RawMessage
		if err := json.Unmarshal(p.body, &top); err == nil {
			sid, xargs = top["session_id"], top["vllm_xargs"]
		}
	}
	p.session.BodySessionID = sid
	if x := bytes.TrimSpace(xargs); len(x) > 0 && string(x) != "null" {
		var raw map[string]json.RawMessage
		if x[0] != '{' || json.Unmarshal(x, &raw) != nil {
			return badRequest("vllm_xargs", "vllm_xargs must be an object")
		}
		p.session.XargsSessionID = raw[messages.ExtraArgSessionID]
		p.xargs = make(map[string]any, len(raw))
		for k, v := range raw {
			var val any
			_ = json.Unmarshal(v, &val) // valid: it came out of a valid object
			p.xargs[k] = val
		}
	}
	p.kvTransfer = c.KVTransferParams
	// What the bus's decoders would refuse is refused here, with a 400,
	// rather than dropped by the scheduler (the client would wait for its
	// timeout).
	if !messages.ArgsDepthOK(p.xargs) {
		return badRequest("vllm_xargs", "vllm_xargs nests too deeply (more than 16 levels of objects and arrays)")
	}
	if !messages.ArgsDepthOK(p.kvTransfer) {
		return badRequest("kv_transfer_params", "kv_transfer_params nests too deeply (more than 16 levels of objects and arrays)")
	}
	return nil
}

func parseStop(raw json.RawMessage) ([]string, *APIError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var one string
	if json.Unmarshal(raw, &one) == nil {
		if one == "" {
			return nil, nil
		}
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, badRequest("stop", "stop must be a string or an array of strings")
	}
	if len(many) > messages.MaxArrayLen { // the bus's decoders would refuse the request
		return nil, badRequest("stop", "stop has %d strings; at most %d", len(many), messages.MaxArrayLen)
	}
	out := many[:0]
	for _, s := range many {
		if s != "" {
			out = append(out, s)
		}
	}
	return out, nil
}

func parseChat(body []byte, o parseOptions) (*parsedRequest, *APIError) {
	var req chatRequest
	if err := decodeJSON(body, &req); err != nil {
		return nil, err
	}
	p := &parsedRequest{endpoint: messages.EndpointChat, body: body}
	if err := parseCommon(&req.commonParams, p, o); err != nil {
		return nil, err
	}
	if req.MaxCompletionTokens != nil {
		if *req.MaxCompletionTokens < 1 {
			return nil, badRequest("max_completion_tokens", "max_completion_tokens must be at least 1, got %d", *req.MaxCompletionTokens)
		}
		p.params.MaxTokens, p.maxTokensSet = *req.MaxCompletionTokens, true
	}
	if len(req.Messages) == 0 {
		return nil, badRequest("messages", "messages must be a non-empty array")
	}
	for i, m := range req.Messages {
		param := fmt.Sprintf("messages[%d]", i)
		switch {
		case m.Role == "system", m.Role == "developer", m.Role == "user", m.Role == "assistant", m.Role == "tool":
		case o.passthrough && m.Role != "": // the engine's template decides
		case m.Role == "":
			return nil, badRequest(param+".role", "%s.role is required", param)
		default:
			return nil, badRequest(param+".role", "%s.role %q is not one of system, developer, user, assistant, tool", param, m.Role)
		}
		text, err := messageText(m.Content, param+".content", m.Role == "assistant" || o.passthrough, o.passthrough)
		if err != nil {
			return nil, err
		}
		p.turns = append(p.turns, ChatTurn{Role: m.Role, Content: text})
	}
	return p, nil
}

// messageText flattens a message content: a string, or an array of text
// parts. Other part types are rejected, the sim engine reads text only,
// unless others are allowed (a real engine gets them, and tokenizes them).
func messageText(raw json.RawMessage, param string, nullOK, otherParts bool) (string, *APIError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		if nullOK {
			return "", nil
		}
		return "", badRequest(param, "%s is required", param)
	}
	var s string
	if raw[0] == '"' {
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", badRequest(param, "%s is not a valid string", param)
		}
		return s, nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if raw[0] != '[' || json.Unmarshal(raw, &parts) != nil {
		return "", badRequest(param, "%s must be a string or an array of content parts", param)
	}
	var b strings.Builder
	texts := 0 // text parts are joined by newlines, as vLLM does
	for i, part := range parts {
		if otherParts && (part.Type != "text" || part.Text == nil) {
			continue
		}
		if part.Type != "text" || part.Text == nil {
			return "", badRequest(fmt.Sprintf("%s[%d]", param, i), "content part type %q is not supported; only text parts are", part.Type)
		}
		if texts > 0 {
			b.WriteByte('\n')
		}
		texts++
		b.WriteString(*part.Text)
	}
	return b.String(), nil
}

func parseCompletion(body []byte, o parseOptions) (*parsedRequest, *APIError) {
	vocab := o.vocab
	var req completionRequest
	if err := decodeJSON(body, &req); err != nil {
		return nil, err
	}
	p := &parsedRequest{endpoint: messages.EndpointCompletions, body: body}
	if err := parseCommon(&req.commonParams, p, o); err != nil {
		return nil, err
	}
	if !p.maxTokensSet {
		p.params.MaxTokens, p.maxTokensSet = 16, true // OpenAI's and vLLM's default for completions
	}
	raw := bytes.TrimSpace(req.Prompt)
	const param = "prompt"
	if len(raw) == 0 || string(raw) == "null" {
		return nil, badRequest(param, "prompt is required")
	}
	var one string
	if raw[0] == '"' {
		if err := json.Unmarshal(raw, &one); err != nil {
			return nil, badRequest(param, "prompt is not a valid string")
		}
		p.texts = []string{one}
		return p, nil
	}
	var items []json.RawMessage
	if raw[0] != '[' || json.Unmarshal(raw, &items) != nil || len(items) == 0 {
		return nil, badRequest(param, "prompt must be a string, a non-empty array of strings, or an array of token ids")
	}
	switch first := bytes.TrimSpace(items[0]); {
	case len(first) > 0 && first[0] == '"':
		var texts []string
		if err := json.Unmarshal(raw, &texts); err != nil {
			return nil, badRequest(param, "prompt must not mix strings with other types")
		}
		p.texts = texts
	case len(first) > 0 && first[0] == '[':
		var lists [][]*int64
		if err := json.Unmarshal(raw, &lists); err != nil {
			return nil, badRequest(param, "prompt must be an array of token-id arrays")
		}
		for i, l := range lists {
			ids, err := tokenIDs(l, vocab, fmt.Sprintf("prompt[%d]", i))
			if err != nil {
				return nil, err
			}
			p.tokenPrompts = append(p.tokenPrompts, ids)
		}
	default:
		var l []*int64
		if err := json.Unmarshal(raw, &l); err != nil {
			return nil, badRequest(param, "prompt must be an array of integer token ids")
		}
		ids, err := tokenIDs(l, vocab, param)
		if err != nil {
			return nil, err
		}
		p.tokenPrompts = [][]uint32{ids}
	}
	return p, nil
}

func tokenIDs(l []*int64, vocab int, param string) ([]uint32, *APIError) {
	if len(l) == 0 {
		return nil, badRequest(param, "%s is an empty token-id array", param)
	}
	out := make([]uint32, len(l))
	for i, p := range l {
		if p == nil {
			return nil, badRequest(param, "%s[%d] is null; token ids must be integers", param, i)
		}
		v := *p
		if v < 0 || v >= int64(vocab) {
			return nil, badRequest(param, "token id %d in %s is out of vocabulary [0, %d)", v, param, vocab)
		}
		out[i] = uint32(v)
	}
	return out, nil
}
