package frontend

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/kvbus/kvbus/messages"
)

type chatRequest struct {
	commonParams
	Messages            []chatMessage `json:"messages"`
	MaxCompletionTokens *wholeInt     `json:"max_completion_tokens"`
	// AddGenerationPrompt (default true) and ContinueFinalMessage are
	// vLLM's: the prompt ends with a new assistant turn, or with the last
	// message left open for the model to continue (as /tokenize renders).
	AddGenerationPrompt  *bool `json:"add_generation_prompt"`
	ContinueFinalMessage bool  `json:"continue_final_message"`
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type completionRequest struct {
	commonParams
	Prompt json.RawMessage `json:"prompt"`
	// AddSpecialTokens is vLLM's (default true): false tokenizes the
	// prompt without the model's BOS, a prompt the client rendered itself.
	AddSpecialTokens *bool `json:"add_special_tokens"`
	// Suffix (fill in the middle) is refused by vLLM when not null
	// ("suffix is not currently supported"); the sim cannot honour it
	// either, and a real engine gets it as sent.
	Suffix json.RawMessage `json:"suffix"`
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
	// continuousUsage: usage on every streamed chunk
	// (stream_options.continuous_usage_stats with include_usage).
	continuousUsage bool
	// noSpecialTokens: a completion's add_special_tokens is false, its
	// prompts are tokenized without the model's special tokens.
	noSpecialTokens bool
	// requestID is the body's request_id, validated (empty: none).
	requestID  string
	session    SessionInput
	xargs      map[string]any
	kvTransfer map[string]any
	// cacheSalt is the body's cache_salt (empty: none).
	cacheSalt string

	// generationPrompt and continueFinal: how a chat's prompt ends
	// (add_generation_prompt, continue_final_message).
	generationPrompt, continueFinal bool
	// truncate is truncate_prompt_tokens (-1: max_model_len), set or not.
	truncate    int
	truncateSet bool
}

// readBody reads at most limit bytes of the body; more is a 413.
func readBody(w http.ResponseWriter, r *http.Request, limit int64, timeout time.Duration) ([]byte, *APIError) {
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Now().Add(timeout)) // not every ResponseWriter can
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		// After a timeout the deadline stays: net/http reads the rest of
		// a declared body before it closes the connection, and without
		// one it waited for as long as the client kept the connection.
		_ = rc.SetReadDeadline(time.Time{})
	}
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

// decodeJSON unmarshals a request body, turning type errors into 400s that
// name the field.
func decodeJSON(body []byte, v any) *APIError {
	if len(bytes.TrimSpace(body)) == 0 {
		return badRequest("", "request body is empty; send a JSON object")
	}
	if !utf8.Valid(body) { // encoding/json would quietly replace the bad bytes
		if name := sessionNotUTF8(body); name != "" {
			return badRequest(name, "%s is not valid UTF-8", name) // DESIGN §3 names the source
		}
		return badRequest("", "request body is not valid UTF-8")
	}
	if hasKeyVariant(body) {
		// Rare: decode the keys as written only (a second decode).
		body = exactKeys(body, requestSchema)
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

// parseChat validates a chat request's body. With an error, p is nil when
// the body did not decode, else it holds what was read before the error,
// the body's request_id among it (the caller names the response after it).
func parseChat(body []byte, o parseOptions) (*parsedRequest, *APIError) {
	var req chatRequest
	if err := decodeJSON(body, &req); err != nil {
		return nil, err
	}
	p := &parsedRequest{endpoint: messages.EndpointChat, body: body}
	if req.MaxCompletionTokens != nil {
		// vLLM reads max_tokens only without max_completion_tokens: an
		// SDK's max_tokens 0 beside it is not the request's limit.
		req.MaxTokens = nil
	}
	if err := parseCommon(&req.commonParams, p, o); err != nil {
		return p, err
	}
	if n := req.MaxCompletionTokens; n != nil {
		if *n < 1 {
			return p, badRequest("max_completion_tokens", "max_completion_tokens must be at least 1, got %d", *n)
		}
		p.params.MaxTokens, p.maxTokensSet = int(*n), true
	}
	if len(req.Messages) == 0 {
		return p, badRequest("messages", "messages must be a non-empty array")
	}
	p.generationPrompt = req.AddGenerationPrompt == nil || *req.AddGenerationPrompt
	p.continueFinal = req.ContinueFinalMessage
	if p.continueFinal && p.generationPrompt && !o.passthrough { // an engine answers it itself
		return p, badRequest("continue_final_message", "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
	}
	for i, m := range req.Messages {
		// Any role: vLLM's chat template path takes any string (custom
		// roles such as "observation" or "ipython"), and so does the sim's.
		param := fmt.Sprintf("messages[%d]", i)
		if m.Role == "" {
			return p, badRequest(param+".role", "%s.role is required: a string such as \"user\"", param)
		}
		text, err := messageText(m.Content, param+".content", m.Role == "assistant" || o.passthrough, o.passthrough)
		if err != nil {
			return p, err
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

// parseCompletion validates a completion request's body; p with an error
// as parseChat's.
func parseCompletion(body []byte, o parseOptions) (*parsedRequest, *APIError) {
	vocab := o.vocab
	var req completionRequest
	if err := decodeJSON(body, &req); err != nil {
		return nil, err
	}
	p := &parsedRequest{endpoint: messages.EndpointCompletions, body: body}
	if err := parseCommon(&req.commonParams, p, o); err != nil {
		return p, err
	}
	if v := bytes.TrimSpace(req.Suffix); !o.passthrough && len(v) > 0 && string(v) != "null" {
		// Any string, "" too, as vLLM: a fill-in-the-middle client falls
		// back to prefix-only completions on this 400, not on an answer
		// that ignored its suffix.
		return p, badRequest("suffix", "suffix is not supported by the sim engine, which would ignore it; leave it out, or run real engines (--engine openai), which get it as sent")
	}
	if !p.maxTokensSet {
		// OpenAI's and vLLM's default for completions, for a max_tokens
		// left out or null: vLLM's CompletionRequest turns null into the
		// default (normalize_null_max_tokens, vllm-project/vllm#45491). A
		// chat's null is the rest of the context (busRequest).
		p.params.MaxTokens, p.maxTokensSet = 16, true
	}
	p.noSpecialTokens = req.AddSpecialTokens != nil && !*req.AddSpecialTokens
	raw := bytes.TrimSpace(req.Prompt)
	const param = "prompt"
	if len(raw) == 0 || string(raw) == "null" {
		return p, badRequest(param, "prompt is required")
	}
	var one string
	if raw[0] == '"' {
		if err := json.Unmarshal(raw, &one); err != nil {
			return p, badRequest(param, "prompt is not a valid string")
		}
		p.texts = []string{one}
		return p, nil
	}
	// An array: its first element says of what (raw is valid JSON).
	first := bytes.TrimLeft(raw[min(1, len(raw)):], " \t\r\n")
	if raw[0] != '[' || len(first) == 0 || first[0] == ']' {
		return p, badRequest(param, "prompt must be a string, a non-empty array of strings, or an array of token ids")
	}
	switch first[0] {
	case '"':
		var texts []string
		if err := json.Unmarshal(raw, &texts); err != nil {
			return p, badRequest(param, "prompt must not mix strings with other types")
		}
		if len(texts) > MaxPrompts {
			return p, tooManyPrompts(len(texts))
		}
		p.texts = texts
	case '[':
		var lists []json.RawMessage
		if err := json.Unmarshal(raw, &lists); err != nil {
			return p, badRequest(param, "prompt must be an array of token-id arrays")
		}
		if len(lists) > MaxPrompts {
			return p, tooManyPrompts(len(lists))
		}
		for i, l := range lists {
			if l = bytes.TrimSpace(l); len(l) == 0 || l[0] != '[' {
				return p, badRequest(param, "prompt must be an array of token-id arrays")
			}
			ids, err := tokenIDs(l, vocab, fmt.Sprintf("prompt[%d]", i))
			if err != nil {
				if err.Message == notTokenIDs {
					err = badRequest(param, "prompt must be an array of token-id arrays")
				}
				return p, err
			}
			p.tokenPrompts = append(p.tokenPrompts, ids)
		}
	default:
		ids, err := tokenIDs(raw, vocab, param)
		if err != nil {
			if err.Message == notTokenIDs {
				err.Message = "prompt must be an array of integer token ids"
			}
			return p, err
		}
		p.tokenPrompts = [][]uint32{ids}
	}
	return p, nil
}

// MaxPrompts bounds the prompts of one completion request: each is a
// request of its own in the request log, published one after the other
// (a 4 MiB body held a million).
const MaxPrompts = 1024

func tooManyPrompts(n int) *APIError {
	return badRequest("prompt", "prompt holds %d prompts; at most %d go in one request: send the others in further requests", n, MaxPrompts)
}

// notTokenIDs is tokenIDs' message for an array that is not of integers.
const notTokenIDs = "not an array of integer token ids"

// tokenIDs decodes raw, a JSON array, as token ids below vocab: integers,
// or whole-number floats (1.0), which pydantic takes for integers.
// Integers decode straight into a slice; the others take a second, slower
// decode.
func tokenIDs(raw json.RawMessage, vocab int, param string) ([]uint32, *APIError) {
	var ids []int64
	if bytes.Contains(raw, []byte("null")) {
		// A null would decode as 0: find it, or what else is wrong.
		var l []*wholeInt
		if json.Unmarshal(raw, &l) != nil {
			return nil, badRequest(param, notTokenIDs)
		}
		for i, v := range l {
			if v == nil {
				return nil, badRequest(param, "%s[%d] is null; token ids must be integers", param, i)
			}
		}
		return nil, badRequest(param, notTokenIDs) // "null" was in a string
	}
	if json.Unmarshal(raw, &ids) != nil {
		var whole []wholeInt
		if json.Unmarshal(raw, &whole) != nil {
			return nil, badRequest(param, notTokenIDs)
		}
		ids = make([]int64, len(whole))
		for i, v := range whole {
			ids[i] = int64(v)
		}
	}
	if len(ids) == 0 {
		return nil, badRequest(param, "%s is an empty token-id array", param)
	}
	out := make([]uint32, len(ids))
	for i, v := range ids {
		if v < 0 || v >= int64(vocab) {
			return nil, badRequest(param, "token id %d in %s is out of vocabulary [0, %d)", v, param, vocab)
		}
		out[i] = uint32(v)
	}
	return out, nil
}
