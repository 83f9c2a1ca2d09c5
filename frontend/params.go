package frontend

import (
	"bytes"
	"encoding/json"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"github.com/kvbus/kvbus/messages"
)

// commonParams are the request fields shared by both endpoints.
type commonParams struct {
	Model            string          `json:"model"`
	MaxTokens        *wholeInt       `json:"max_tokens"`
	MinTokens        *wholeInt       `json:"min_tokens"`
	Temperature      *float64        `json:"temperature"`
	TopP             *float64        `json:"top_p"`
	N                *wholeInt       `json:"n"`
	Seed             *wholeInt       `json:"seed"`
	Stop             json.RawMessage `json:"stop"`
	Stream           bool            `json:"stream"`
	StreamOptions    json.RawMessage `json:"stream_options"`
	IgnoreEOS        bool            `json:"ignore_eos"`
	IncludeStopStr   bool            `json:"include_stop_str_in_output"`
	RequestID        json.RawMessage `json:"request_id"`
	SessionID        json.RawMessage `json:"session_id"`
	VLLMXargs        json.RawMessage `json:"vllm_xargs"`
	KVTransferParams map[string]any  `json:"kv_transfer_params"`
	StopTokenIDs     json.RawMessage `json:"stop_token_ids"`
	CacheSalt        json.RawMessage `json:"cache_salt"`
	// TruncatePromptTokens is vLLM's: keep the prompt's last k tokens
	// (-1: max_model_len's worth).
	TruncatePromptTokens *wholeInt `json:"truncate_prompt_tokens"`
	// Sampling fields that steer nothing in the sim but are checked as
	// vLLM's SamplingParams checks them (checkSamplingRanges).
	PresencePenalty   *float64  `json:"presence_penalty"`
	FrequencyPenalty  *float64  `json:"frequency_penalty"`
	RepetitionPenalty *float64  `json:"repetition_penalty"`
	TopK              *wholeInt `json:"top_k"`
	MinP              *float64  `json:"min_p"`
	// Fields the sim engine cannot honour: 400 with the sim, passed through
	// to a real engine.
	Tools          json.RawMessage `json:"tools"`
	ToolChoice     json.RawMessage `json:"tool_choice"`
	ResponseFormat json.RawMessage `json:"response_format"`
	Logprobs       json.RawMessage `json:"logprobs"`
	TopLogprobs    json.RawMessage `json:"top_logprobs"`
	PromptLogprobs json.RawMessage `json:"prompt_logprobs"`
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
// 0.0, [] or tool_choice "none", is fine). On /v1/completions (endpoint)
// logprobs is a count, not chat's boolean, and 0 asks too: vLLM answers
// every logprobs that is not null with the chosen tokens' logprobs
// (serving_completion.py: "if request.logprobs is not None"). Other
// values (true, 5) are refused below as on chat.
func (c *commonParams) simUnsupported(endpoint string) string {
	if endpoint == messages.EndpointCompletions {
		if v := bytes.TrimSpace(c.Logprobs); len(v) > 0 && (v[0] == '-' || v[0] >= '0' && v[0] <= '9') {
			return "logprobs" // a number (false and null ask for nothing)
		}
	}
	// vLLM's prompt_logprobs (both endpoints) is a count too: any but
	// null asks, 0 included (each prompt token's own logprob).
	if v := bytes.TrimSpace(c.PromptLogprobs); len(v) > 0 && string(v) != "null" {
		return "prompt_logprobs"
	}
	fields := []struct {
		name string
		raw  json.RawMessage
	}{{"tools", c.Tools}, {"tool_choice", c.ToolChoice}, {"response_format", c.ResponseFormat}, {"logprobs", c.Logprobs},
		{"top_logprobs", c.TopLogprobs}, {"echo", c.Echo}, {"logit_bias", c.LogitBias}, {"guided_json", c.GuidedJSON},
		{"guided_regex", c.GuidedRegex}, {"guided_choice", c.GuidedChoice}, {"guided_grammar", c.GuidedGrammar},
		{"structured_outputs", c.Structured}}
	for _, f := range fields {
		// Compact: an indented body ("tools": [ ], a response_format
		// over three lines) asks for nothing more than a compact one.
		var compact bytes.Buffer
		if json.Compact(&compact, f.raw) != nil {
			compact.Write(bytes.TrimSpace(f.raw))
		}
		switch v := compact.String(); v {
		case "", "null", "false", "0", "[]", "{}", `"none"`:
		default:
			if f.name == "response_format" && v == `{"type":"text"}` {
				continue // the default: plain text
			}
			if n, err := strconv.ParseFloat(v, 64); err == nil && n == 0 && v[0] != '"' {
				continue // 0.0, as pydantic takes it for 0
			}
			return f.name
		}
	}
	return ""
}

// checkSamplingRanges refuses, with vLLM's 400 and message
// (SamplingParams._verify_args), the sampling fields kvbus does not use
// but vLLM checks: a request vLLM refuses is refused here too, rather than
// served by the sim and refused once real engines run. null is vLLM's
// default (0, 0, 1, disabled, 0).
func (c *commonParams) checkSamplingRanges() *APIError {
	for _, f := range []struct {
		name string
		v    *float64
	}{{"presence_penalty", c.PresencePenalty}, {"frequency_penalty", c.FrequencyPenalty}} {
		if f.v != nil && !(*f.v >= -2 && *f.v <= 2) {
			return badRequest(f.name, "%s must be in [-2, 2], got %g.", f.name, *f.v)
		}
	}
	if v := c.RepetitionPenalty; v != nil && !(*v > 0) {
		return badRequest("repetition_penalty", "repetition_penalty must be greater than zero, got %g.", *v)
	}
	if v := c.TopK; v != nil && *v < -1 {
		return badRequest("top_k", "top_k must be 0 (disable), or at least 1, got %d.", *v)
	}
	if v := c.MinP; v != nil && !(*v >= 0 && *v <= 1) {
		return badRequest("min_p", "min_p must be in [0, 1], got %g.", *v)
	}
	return nil
}

// wholeInt is an integer field that also takes a number with a zero
// fraction (4.0, 4e0), as vLLM's pydantic models do; 4.5 is a type error.
type wholeInt int64

// UnmarshalJSON implements json.Unmarshaler. null leaves n as it is (a
// *wholeInt field is left nil without a call).
func (n *wholeInt) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil
	}
	v, ok := parseWholeNumber(b)
	if !ok {
		return &json.UnmarshalTypeError{Value: typeErrorValue(b), Type: reflect.TypeFor[int64]()}
	}
	*n = wholeInt(v)
	return nil
}

// parseWholeNumber reads a JSON number that is a whole number within
// int64: an integer literal, or a number with a zero fraction.
func parseWholeNumber(b []byte) (int64, bool) {
	if len(b) == 0 || (b[0] != '-' && (b[0] < '0' || b[0] > '9')) {
		return 0, false
	}
	if !bytes.ContainsAny(b, ".eE") {
		v, err := strconv.ParseInt(string(b), 10, 64)
		if err != nil {
			return 0, false
		}
		return v, true
	}
	f, err := strconv.ParseFloat(string(b), 64)
	// -2^63 is exact in a float64, and 2^63 the first float above int64.
	if err != nil || f != math.Trunc(f) || f < math.MinInt64 || f >= math.MaxInt64 {
		return 0, false
	}
	return int64(f), true
}

// typeErrorValue names a JSON value as encoding/json's type errors do.
func typeErrorValue(b []byte) string {
	switch b = bytes.TrimSpace(b); {
	case len(b) == 0:
		return "value"
	case b[0] == '"':
		return "string"
	case b[0] == 't' || b[0] == 'f':
		return "bool"
	case b[0] == '[':
		return "array"
	case b[0] == '{':
		return "object"
	}
	return "number " + string(b)
}

// parseCommon validates the shared fields into p.
func parseCommon(c *commonParams, p *parsedRequest, o parseOptions) *APIError {
	// First: the request's id names even the error of a later field.
	id, err := bodyRequestID(c.RequestID)
	if err != nil {
		return err
	}
	p.requestID = id
	p.model = c.Model
	p.stream = c.Stream
	if err := parseStreamOptions(c.StreamOptions, p); err != nil {
		return err
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
	if err := c.checkSamplingRanges(); err != nil {
		return err
	}
	if !o.passthrough {
		if c.N != nil && *c.N != 1 {
			return badRequest("n", "n must be 1: the sim engine generates one choice per prompt (real engines behind --engine openai take n)")
		}
		if f := c.simUnsupported(p.endpoint); f != "" {
			return badRequest(f, "%s is not supported by the sim engine, which would ignore it; leave it out, or run real engines (--engine openai), which get it as sent", f)
		}
	}
	if n := c.MaxTokens; n != nil {
		if *n == 0 && o.passthrough && p.endpoint == messages.EndpointCompletions && isTrue(c.Echo) {
			// vLLM's echo without generation (the prompt back, with its
			// logprobs): it computes one token it does not return.
			sp.MaxTokens, p.maxTokensSet = 1, true
		} else if *n < 1 {
			return badRequest("max_tokens", "max_tokens must be at least 1, got %d", *n)
		} else {
			sp.MaxTokens, p.maxTokensSet = int(*n), true
		}
	}
	if c.MinTokens != nil {
		if *c.MinTokens < 0 {
			return badRequest("min_tokens", "min_tokens must be >= 0, got %d", *c.MinTokens)
		}
		sp.MinTokens = int(*c.MinTokens)
	}
	if k := c.TruncatePromptTokens; k != nil {
		if *k < -1 { // pydantic's ge=-1
			return badRequest("truncate_prompt_tokens", "truncate_prompt_tokens must be >= -1 (-1: max_model_len), got %d", *k)
		}
		p.truncate, p.truncateSet = int(*k), true
	}
	sp.Seed = (*int64)(c.Seed)
	sp.IgnoreEOS, sp.IncludeStopStr = c.IgnoreEOS, c.IncludeStopStr
	stop, err := parseStop(c.Stop)
	if err != nil {
		return err
	}
	sp.Stop = stop
	if v := bytes.TrimSpace(c.StopTokenIDs); len(v) > 0 && string(v) != "null" && string(v) != "[]" {
		// vLLM's list[int]: ids past the vocabulary are allowed (never
		// generated), as they are there.
		ids, err := tokenIDs(v, 1<<32, "stop_token_ids")
		if err != nil {
			return err
		}
		if len(ids) > messages.MaxArrayLen {
			return badRequest("stop_token_ids", "stop_token_ids has %d ids; at most %d", len(ids), messages.MaxArrayLen)
		}
		sp.StopTokenIDs = ids
	}
	// The keys were matched as written (decodeJSON), as vLLM reads them.
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
	salt, err := parseCacheSalt(c.CacheSalt)
	if err != nil {
		return err
	}
	p.cacheSalt = salt
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

// isTrue reports whether a boolean field is JSON true.
func isTrue(raw json.RawMessage) bool {
	return string(bytes.TrimSpace(raw)) == "true"
}

// parseCacheSalt reads the body's cache_salt as vLLM does: null or absent
// is none; anything but a non-empty string is refused.
func parseCacheSalt(raw json.RawMessage) (string, *APIError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var salt string
	if raw[0] != '"' || json.Unmarshal(raw, &salt) != nil || salt == "" {
		return "", badRequest("cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided.")
	}
	if len(salt) > messages.MaxCacheSaltBytes {
		return "", badRequest("cache_salt", "cache_salt has %d bytes; at most %d", len(salt), messages.MaxCacheSaltBytes)
	}
	return salt, nil
}

// validRequestID reports whether id may name a request: at most
// maxRequestIDBytes printable ASCII characters (X-Request-Id's rule).
func validRequestID(id string) bool {
	return len(id) <= maxRequestIDBytes && !strings.ContainsFunc(id, func(r rune) bool { return r > unicode.MaxASCII || !unicode.IsPrint(r) })
}

// bodyRequestID reads the body's request_id (vLLM's ChatCompletionRequest
// and CompletionRequest field): a string, validated as X-Request-Id is;
// null, or a string empty after trimming, is none.
func bodyRequestID(raw json.RawMessage) (string, *APIError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var id string
	if raw[0] != '"' || json.Unmarshal(raw, &id) != nil {
		return "", badRequest("request_id", "request_id must be a string, got %s", jsonKind(raw))
	}
	id = strings.TrimSpace(id)
	if !validRequestID(id) {
		return "", badRequest("request_id", "request_id must be at most %d printable ASCII characters", maxRequestIDBytes)
	}
	return id, nil
}

// streamOptions is vLLM's StreamOptions.
type streamOptions struct {
	// IncludeUsage is true when left out, as vLLM's StreamOptions has it
	// (and kvbus's real-engine path); null or false leaves usage out.
	IncludeUsage         json.RawMessage `json:"include_usage"`
	ContinuousUsageStats json.RawMessage `json:"continuous_usage_stats"`
}

// parseStreamOptions reads stream_options into p. Like vLLM, which
// refuses a stream_options that Python finds true without stream, an
// empty object (or null) is fine without stream; anything else needs it.
func parseStreamOptions(raw json.RawMessage, p *parsedRequest) *APIError {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	if raw[0] != '{' {
		return badRequest("stream_options", "stream_options must be an object, such as {\"include_usage\": true}")
	}
	if !p.stream {
		if len(bytes.TrimSpace(raw[1:len(raw)-1])) == 0 {
			return nil // {}
		}
		return badRequest("stream_options", "stream_options is only allowed when stream is true")
	}
	var so streamOptions
	if json.Unmarshal(raw, &so) != nil {
		return badRequest("stream_options", "stream_options must be an object, such as {\"include_usage\": true}")
	}
	var err *APIError
	if p.includeUsage, err = optionalBool("stream_options.include_usage", so.IncludeUsage, true); err != nil {
		return err
	}
	continuous, err := optionalBool("stream_options.continuous_usage_stats", so.ContinuousUsageStats, false)
	if err != nil {
		return err
	}
	// vLLM's should_include_usage: continuous usage needs include_usage.
	p.continuousUsage = p.includeUsage && continuous
	return nil
}

// optionalBool reads an optional boolean: unset when left out, false when
// null.
func optionalBool(param string, v json.RawMessage, unset bool) (bool, *APIError) {
	switch v := string(bytes.TrimSpace(v)); v {
	case "":
		return unset, nil
	case "true":
		return true, nil
	case "null", "false":
		return false, nil
	default:
		return false, badRequest(param, "%s must be a boolean, got %s", param, v)
	}
}

// MaxStopStrings bounds a request's stop strings. The engine looks for each
// in the text after every token it generates (as vLLM's detokenizer does):
// with the 262,143 the bus takes, one answer of 2,048 tokens cost the
// driver 4.7 s of CPU, 10 times one with 4. OpenAI takes 4; vLLM sets no
// bound.
const MaxStopStrings = 1024

// parseStop reads stop: a string or an array of strings, none empty (vLLM's
// SamplingParams refuses an empty one, in its words).
func parseStop(raw json.RawMessage) ([]string, *APIError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	const empty = "stop cannot contain an empty string."
	var one string
	if json.Unmarshal(raw, &one) == nil {
		if one == "" {
			return nil, badRequest("stop", empty)
		}
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, badRequest("stop", "stop must be a string or an array of strings")
	}
	if len(many) > MaxStopStrings {
		return nil, badRequest("stop", "stop has %d strings; at most %d (the engine looks for each after every token it generates)", len(many), MaxStopStrings)
	}
	if slices.Contains(many, "") {
		return nil, badRequest("stop", empty)
	}
	if len(many) == 0 {
		return nil, nil
	}
	return many, nil
}
