package frontend

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
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
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
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

// parsedRequest is a validated request, before session resolution.
type parsedRequest struct {
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
func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, *APIError) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, &APIError{Status: http.StatusRequestEntityTooLarge, Type: typeInvalidRequest, Code: "request_too_large",
				Message: fmt.Sprintf("request body exceeds %d bytes (--max-body-bytes)", limit)}
		}
		return nil, badRequest("", "cannot read request body: %v", err)
	}
	return body, nil
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
func parseCommon(c *commonParams, p *parsedRequest) *APIError {
	p.model = c.Model
	p.stream = c.Stream
	if c.StreamOptions != nil {
		if !c.Stream {
			return badRequest("stream_options", "stream_options is only allowed when stream is true")
		}
		p.includeUsage = c.StreamOptions.IncludeUsage
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
	if c.N != nil && *c.N != 1 {
		return badRequest("n", "n must be 1: kvbus generates one choice per prompt")
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
	p.session.BodySessionID = c.SessionID
	if x := bytes.TrimSpace(c.VLLMXargs); len(x) > 0 && string(x) != "null" {
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
	out := many[:0]
	for _, s := range many {
		if s != "" {
			out = append(out, s)
		}
	}
	return out, nil
}

func parseChat(body []byte) (*parsedRequest, *APIError) {
	var req chatRequest
	if err := decodeJSON(body, &req); err != nil {
		return nil, err
	}
	p := &parsedRequest{endpoint: messages.EndpointChat}
	if err := parseCommon(&req.commonParams, p); err != nil {
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
		switch m.Role {
		case "system", "developer", "user", "assistant", "tool":
		case "":
			return nil, badRequest(param+".role", "%s.role is required", param)
		default:
			return nil, badRequest(param+".role", "%s.role %q is not one of system, developer, user, assistant, tool", param, m.Role)
		}
		text, err := messageText(m.Content, param+".content", m.Role == "assistant")
		if err != nil {
			return nil, err
		}
		p.turns = append(p.turns, ChatTurn{Role: m.Role, Content: text})
	}
	return p, nil
}

// messageText flattens a message content: a string, or an array of text
// parts. Other part types are rejected: the sim engine reads text only.
func messageText(raw json.RawMessage, param string, nullOK bool) (string, *APIError) {
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
	for i, part := range parts {
		if part.Type != "text" || part.Text == nil {
			return "", badRequest(fmt.Sprintf("%s[%d]", param, i), "content part type %q is not supported; only text parts are", part.Type)
		}
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(*part.Text)
	}
	return b.String(), nil
}

func parseCompletion(body []byte, vocab int) (*parsedRequest, *APIError) {
	var req completionRequest
	if err := decodeJSON(body, &req); err != nil {
		return nil, err
	}
	p := &parsedRequest{endpoint: messages.EndpointCompletions}
	if err := parseCommon(&req.commonParams, p); err != nil {
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
