package fakeengine

import (
	"bytes"
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"mime"
	"net/http"
	"slices"
	"time"
)

// The wire shapes below follow vLLM's pydantic models and serving code
// (read in vllm-project/vllm): vllm/entrypoints/openai/engine/protocol.py
// (ErrorResponse/ErrorInfo, UsageInfo, PromptTokenUsageInfo, ModelCard,
// StreamOptions, CompletionRequest/Response/StreamResponse),
// chat_completion/protocol.py and chat_completion/serving.py,
// completion/serving.py, serve/tokenize/protocol.py, serve/utils/
// api_utils.py (should_include_usage, validate_json_request),
// openai/server_utils.py (AuthenticationMiddleware, the validation error
// handler) and serve/instrumentator/health.py.

// errorInfo and errorResponse are vLLM's ErrorInfo and ErrorResponse:
// {"error": {"message", "type", "param", "code"}}, code being the HTTP
// status.
type errorInfo struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

type errorResponse struct {
	Error errorInfo `json:"error"`
}

// apiError is an error answered with vLLM's error body.
type apiError struct {
	status int
	info   errorInfo
}

func (e *apiError) Error() string { return e.info.Message }

func newAPIError(status int, typ, param, format string, args ...any) *apiError {
	ae := &apiError{status: status, info: errorInfo{Message: fmt.Sprintf(format, args...), Type: typ, Code: status}}
	if param != "" {
		ae.info.Param = &param
	}
	return ae
}

// badRequest is create_error_response's default: a BadRequestError, as
// for a VLLMValidationError raised while serving.
func badRequest(param, format string, args ...any) *apiError {
	return newAPIError(http.StatusBadRequest, "BadRequestError", param, format, args...)
}

// invalidRequest is the validation_exception_handler's answer to a body
// pydantic rejects: type "Bad Request" (HTTPStatus.BAD_REQUEST.phrase).
func invalidRequest(param, format string, args ...any) *apiError {
	return newAPIError(http.StatusBadRequest, "Bad Request", param, format, args...)
}

// errEngineDead is what a request to a dead engine gets: the
// EngineDeadError handler answers create_error_response(exc), an
// InternalServerError.
func errEngineDead() *apiError {
	return newAPIError(http.StatusInternalServerError, "InternalServerError", "",
		"EngineCore encountered an issue. See stack trace (above) for the root cause.")
}

func writeError(w http.ResponseWriter, ae *apiError) {
	writeJSON(w, ae.status, errorResponse{Error: ae.info})
}

// checkJSON is vLLM's validate_json_request dependency of the completion
// and tokenize routes.
func checkJSON(r *http.Request) *apiError {
	mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if mt != "application/json" {
		return invalidRequest("", "Unsupported Media Type: Only 'application/json' is allowed")
	}
	return nil
}

// decodeBody decodes a JSON request body into v.
func decodeBody(r *http.Request, v any) *apiError {
	if ae := checkJSON(r); ae != nil {
		return ae
	}
	var buf bytes.Buffer
	_, _ = buf.ReadFrom(r.Body)
	if err := json.Unmarshal(buf.Bytes(), v); err != nil {
		return invalidRequest("", "JSON decode error: %v", err)
	}
	return nil
}

// checkModel is vLLM's _check_model: no model, the served one or one of
// its LoRA adapters is served, any other is a 404.
func (e *Engine) checkModel(model *string) *apiError {
	if model == nil || *model == "" || *model == e.cfg.ModelName || e.adapterID(*model) > 0 {
		return nil
	}
	return newAPIError(http.StatusNotFound, "NotFoundError", "model", "The model `%s` does not exist.", *model)
}

// adapterID is vLLM's lora_int_id of the LoRA adapter named model (its
// place in LoRAModules, from 1), or 0 when model names none.
func (e *Engine) adapterID(model string) int {
	return slices.Index(e.cfg.LoRAModules, model) + 1
}

// adapterOf returns the LoRA adapter a request's model names; empty for
// the model itself.
func (e *Engine) adapterOf(model *string) string {
	if model == nil || e.adapterID(*model) == 0 {
		return ""
	}
	return *model
}

// randomUUID is vLLM's random_uuid(): uuid4().hex.
func randomUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return hex.EncodeToString(b[:])
}

// requestID is vLLM's _base_request_id: the X-Request-Id header, else the
// body's request_id, else a random uuid.
func requestID(r *http.Request, bodyID string) string {
	if id := r.Header.Get("X-Request-Id"); id != "" {
		return id
	}
	if bodyID != "" {
		return bodyID
	}
	return randomUUID()
}

// streamOptions is vLLM's StreamOptions; include_usage defaults to true
// when stream_options is given.
type streamOptions struct {
	IncludeUsage         *bool `json:"include_usage"`
	ContinuousUsageStats bool  `json:"continuous_usage_stats"`
}

// usage returns (include_usage, continuous_usage_stats) as vLLM's
// should_include_usage (without --enable-force-include-usage): usage only
// when stream_options is given and its include_usage is not false;
// continuous usage only with it.
func (o *streamOptions) usage() (include, continuous bool) {
	if o == nil {
		return false, false
	}
	include = o.IncludeUsage == nil || *o.IncludeUsage
	return include, include && o.ContinuousUsageStats
}

// promptTokensDetails is vLLM's PromptTokenUsageInfo.
type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// usageInfo is vLLM's UsageInfo as non-streaming responses dump it (every
// field, prompt_tokens_details null when not enabled).
type usageInfo struct {
	PromptTokens        int                  `json:"prompt_tokens"`
	TotalTokens         int                  `json:"total_tokens"`
	CompletionTokens    int                  `json:"completion_tokens"`
	PromptTokensDetails *promptTokensDetails `json:"prompt_tokens_details"`
}

// streamUsage is UsageInfo as the final usage chunk dumps it
// (exclude_none: no null prompt_tokens_details).
type streamUsage struct {
	PromptTokens        int                  `json:"prompt_tokens"`
	TotalTokens         int                  `json:"total_tokens"`
	CompletionTokens    int                  `json:"completion_tokens"`
	PromptTokensDetails *promptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

// generation is the fake model's answer to one prompt.
type generation struct {
	// model is the name answers carry: the model, or the LoRA adapter the
	// request named (lora).
	model  string
	lora   string
	prompt []uint32
	cached int
	words  []string // the reply's words, one per output token but TokenEOT
	output []uint32 // the output token ids, TokenEOT last if finish is "stop"
	finish string
}

func (g *generation) usage(details bool) usageInfo {
	u := usageInfo{PromptTokens: len(g.prompt), CompletionTokens: len(g.output),
		TotalTokens: len(g.prompt) + len(g.output)}
	if details {
		u.PromptTokensDetails = &promptTokensDetails{CachedTokens: g.cached}
	}
	return u
}

// delta returns output token i's text: the word, after a space but for
// the first; "" for TokenEOT.
func (g *generation) delta(i int) string {
	if i >= len(g.words) {
		return ""
	}
	if i == 0 {
		return g.words[0]
	}
	return " " + g.words[i]
}

// generate runs one prompt: it checks it against the context length as
// vLLM does (the prompt must be shorter than max_model_len, prompt plus
// max_tokens no longer; maxTokens nil means the rest of the context),
// computes the reply, and admits the request to the cache, publishing the
// KV events of what it did. idx is the request's Received; lora the LoRA
// adapter the request named and salt its cache_salt, empty for none.
func (e *Engine) generate(idx int, prompt []uint32, maxTokens *int, lora, salt string) (*generation, *apiError) {
	if !e.healthy.Load() {
		return nil, errEngineDead()
	}
	maxLen := e.cfg.MaxModelLen
	if len(prompt) >= maxLen {
		return nil, badRequest("input_tokens", "This model's maximum context length is %d tokens. "+
			"However, your request has %d input tokens. Please reduce the length of the input messages.",
			maxLen, len(prompt))
	}
	limit := maxLen - len(prompt)
	if maxTokens != nil {
		if *maxTokens < 1 {
			return nil, badRequest("max_tokens", "max_tokens must be at least 1, got %d.", *maxTokens)
		}
		if *maxTokens > limit {
			return nil, badRequest("max_tokens", "'max_tokens' or 'max_completion_tokens' is too large: %d. "+
				"This model's maximum context length is %d tokens and your request has %d input tokens "+
				"(%d > %d - %d).", *maxTokens, maxLen, len(prompt), *maxTokens, maxLen, len(prompt))
		}
		limit = *maxTokens
	}
	g := &generation{prompt: prompt, model: cmp.Or(lora, e.cfg.ModelName), lora: lora}
	if n := e.cfg.ReplyTokens; limit > n {
		var ids []uint32
		g.words, ids = Reply(prompt, n)
		g.output = append(ids, TokenEOT)
		g.finish = "stop"
	} else {
		g.words, g.output = Reply(prompt, limit)
		g.finish = "length"
	}
	// The KV of every token but the last sampled one was computed.
	computed := append(slices.Clip(prompt), g.output[:len(g.output)-1]...)

	e.mu.Lock()
	defer e.mu.Unlock()
	a := e.cache.admit(prompt, computed, lora, salt)
	g.cached = a.cachedTokens
	if i := idx - e.first; i >= 0 { // else forgotten already
		e.requests[i].PromptTokens = prompt
		e.requests[i].CachedTokens = g.cached
	}
	if e.pub != nil {
		if evs := eventsOf(a, e.cfg.BlockSize, lora, e.adapterID(lora), salt); len(evs) > 0 {
			if err := e.pub.send(evs); err != nil {
				return nil, newAPIError(http.StatusInternalServerError, "InternalServerError", "", "%v", err)
			}
		}
	}
	return g, nil
}

// receivedKey keys the index of a request's Received in its context.
type receivedKey struct{}

// receivedIndex returns the index of the Received of r.
func (e *Engine) receivedIndex(r *http.Request) int {
	idx, _ := r.Context().Value(receivedKey{}).(int)
	return idx
}

// chatRequest holds the fields of vLLM's ChatCompletionRequest the fake
// uses; the whole body is in Received.Body.
type chatRequest struct {
	generateFields
	Messages             *[]chatMessage `json:"messages"`
	MaxTokens            *int           `json:"max_tokens"`
	MaxCompletionTokens  *int           `json:"max_completion_tokens"`
	AddGenerationPrompt  *bool          `json:"add_generation_prompt"`
	ContinueFinalMessage bool           `json:"continue_final_message"`
	AddSpecialTokens     bool           `json:"add_special_tokens"`
}

// generateFields are the fields chat and completion requests share.
type generateFields struct {
	Model          *string        `json:"model"`
	N              *int           `json:"n"`
	Stream         bool           `json:"stream"`
	StreamOptions  *streamOptions `json:"stream_options"`
	RequestID      string         `json:"request_id"`
	ReturnTokenIDs bool           `json:"return_token_ids"`
	// CacheSalt keys the prompt's blocks apart from every other salt's
	// and the unsalted ones (vLLM mixes it into the first block's hash).
	CacheSalt *string `json:"cache_salt"`
}

// salt is the request's cache_salt, empty for none.
func (g *generateFields) salt() string {
	if g.CacheSalt == nil {
		return ""
	}
	return *g.CacheSalt
}

// check refuses what vLLM refuses before it looks at the prompt.
func (e *Engine) check(g *generateFields) *apiError {
	if g.StreamOptions != nil && !g.Stream {
		return invalidRequest("stream_options", "Stream options can only be defined when `stream=True`.")
	}
	if g.N != nil && *g.N != 1 {
		return badRequest("n", "fakeengine: only n=1 is supported")
	}
	if g.CacheSalt != nil && *g.CacheSalt == "" {
		return badRequest("cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided.")
	}
	return e.checkModel(g.Model)
}

// chatMessage is a message; content is a string, a list of parts or null.
type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// messages converts chat messages for the template: text parts are joined
// with newlines, as vLLM's "string" content format does; other parts are
// ignored.
func messages(in []chatMessage) ([]Message, *apiError) {
	out := make([]Message, len(in))
	for i, m := range in {
		out[i].Role = m.Role
		c := bytes.TrimSpace(m.Content)
		switch {
		case len(c) == 0 || string(c) == "null":
		case c[0] == '"':
			if err := json.Unmarshal(c, &out[i].Content); err != nil {
				return nil, invalidRequest("", "messages[%d].content: %v", i, err)
			}
		case c[0] == '[':
			var parts []struct {
				Type string `json:"type"`
				Text string `json:"text"`
			}
			if err := json.Unmarshal(c, &parts); err != nil {
				return nil, invalidRequest("", "messages[%d].content: %v", i, err)
			}
			var texts []string
			for _, p := range parts {
				if p.Type == "text" {
					texts = append(texts, p.Text)
				}
			}
			out[i].Content = joinLines(texts)
		default:
			return nil, invalidRequest("", "messages[%d].content: not a string or a list of parts", i)
		}
	}
	return out, nil
}

func joinLines(s []string) string {
	var b bytes.Buffer
	for i, t := range s {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(t)
	}
	return b.String()
}

// chatPrompt renders a chat request's prompt.
func chatPrompt(req *chatRequest) ([]uint32, *apiError) {
	if req.Messages == nil {
		return nil, invalidRequest("", "messages: Field required")
	}
	addGen := req.AddGenerationPrompt == nil || *req.AddGenerationPrompt
	if req.ContinueFinalMessage && addGen && req.AddGenerationPrompt != nil {
		return nil, invalidRequest("", "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
	}
	msgs, ae := messages(*req.Messages)
	if ae != nil {
		return nil, ae
	}
	return ChatTemplate(msgs, addGen, req.ContinueFinalMessage, req.AddSpecialTokens), nil
}

func (e *Engine) handleChat(w http.ResponseWriter, r *http.Request) {
	var req chatRequest
	if ae := decodeBody(r, &req); ae != nil {
		writeError(w, ae)
		return
	}
	if ae := e.check(&req.generateFields); ae != nil {
		writeError(w, ae)
		return
	}
	prompt, ae := chatPrompt(&req)
	if ae != nil {
		writeError(w, ae)
		return
	}
	maxTokens := req.MaxCompletionTokens
	if maxTokens == nil {
		maxTokens = req.MaxTokens
	}
	g, ae := e.generate(e.receivedIndex(r), prompt, maxTokens, e.adapterOf(req.Model), req.salt())
	if ae != nil {
		writeError(w, ae)
		return
	}
	id := "chatcmpl-" + requestID(r, req.RequestID)
	created := time.Now().Unix()
	if req.Stream {
		e.streamChat(w, r, &req, g, id, created)
		return
	}
	if !e.sleep(r.Context(), e.cfg.TimeToFirstToken+time.Duration(len(g.output)-1)*e.cfg.InterTokenLatency) {
		return
	}
	text := ""
	for i := range g.output {
		text += g.delta(i)
	}
	choice := map[string]any{
		"index": 0,
		"message": map[string]any{"role": "assistant", "content": text, "refusal": nil,
			"annotations": nil, "audio": nil, "function_call": nil, "reasoning": nil},
		"logprobs": nil, "finish_reason": g.finish, "stop_reason": nil, "token_ids": nil,
	}
	resp := map[string]any{
		"id": id, "object": "chat.completion", "created": created, "model": g.model,
		"choices": []any{choice}, "service_tier": nil, "system_fingerprint": nil,
		"usage": g.usage(!e.cfg.OmitPromptTokensDetails), "prompt_logprobs": nil,
		"prompt_token_ids": nil, "kv_transfer_params": nil,
	}
	if req.ReturnTokenIDs {
		choice["token_ids"] = g.output
		resp["prompt_token_ids"] = g.prompt
	}
	writeJSON(w, http.StatusOK, resp)
}

// sse writes Server-Sent Events as vLLM streams them: "data: <json>\n\n"
// per chunk, "data: [DONE]\n\n" last.
type sse struct {
	w   http.ResponseWriter
	err error
}

func newSSE(w http.ResponseWriter) *sse {
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	return &sse{w: w}
}

func (s *sse) send(v any) {
	if s.err != nil {
		return
	}
	b, err := json.Marshal(v)
	if err != nil {
		s.err = err
		return
	}
	s.raw(b)
}

func (s *sse) raw(b []byte) {
	if s.err != nil {
		return
	}
	if _, s.err = fmt.Fprintf(s.w, "data: %s\n\n", b); s.err == nil {
		if f, ok := s.w.(http.Flusher); ok {
			f.Flush()
		}
	}
}

func (s *sse) done() { s.raw([]byte("[DONE]")) }

// streamChat streams a chat completion as vLLM's
// chat_completion_stream_generator: a first chunk with the role and empty
// content, one chunk per output token (the last with finish_reason; the
// EOS token's content is ""), then, if usage is included, a chunk with no
// choices and the usage (prompt_tokens_details only there), then [DONE].
func (e *Engine) streamChat(w http.ResponseWriter, r *http.Request, req *chatRequest, g *generation, id string, created int64) {
	includeUsage, continuous := req.StreamOptions.usage()
	s := newSSE(w)
	chunk := func(choice map[string]any, completion int) map[string]any {
		c := map[string]any{"id": id, "object": "chat.completion.chunk", "created": created,
			"model": g.model, "choices": []any{choice}}
		if continuous {
			c["usage"] = streamUsage{PromptTokens: len(g.prompt), CompletionTokens: completion,
				TotalTokens: len(g.prompt) + completion}
		}
		return c
	}
	if !e.sleep(r.Context(), e.cfg.TimeToFirstToken) {
		return
	}
	s.send(chunk(map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""},
		"logprobs": nil, "finish_reason": nil}, 0))
	for i := range g.output {
		if i > 0 && !e.sleep(r.Context(), e.cfg.InterTokenLatency) {
			return
		}
		choice := map[string]any{"index": 0, "delta": map[string]any{"content": g.delta(i)},
			"logprobs": nil, "finish_reason": nil, "token_ids": nil}
		if i == len(g.output)-1 {
			choice["finish_reason"] = g.finish
			choice["stop_reason"] = nil
		}
		if req.ReturnTokenIDs {
			choice["token_ids"] = g.output[i : i+1]
		}
		s.send(chunk(choice, i+1))
	}
	if includeUsage {
		e.sendUsage(s, "chat.completion.chunk", g, id, created)
	}
	s.done()
}

// sendUsage sends the final usage chunk (dumped with exclude_none).
func (e *Engine) sendUsage(s *sse, object string, g *generation, id string, created int64) {
	u := g.usage(!e.cfg.OmitPromptTokensDetails)
	s.send(map[string]any{"id": id, "object": object, "created": created, "model": g.model,
		"choices": []any{}, "usage": streamUsage(u)})
}

// completionRequest holds the fields of vLLM's CompletionRequest the fake
// uses.
type completionRequest struct {
	generateFields
	Prompt           json.RawMessage `json:"prompt"`
	MaxTokens        *int            `json:"max_tokens"`
	AddSpecialTokens *bool           `json:"add_special_tokens"`
}

// completionPrompt returns a completion request's prompt tokens. vLLM
// accepts str | list[str] | list[int] | list[list[int]]; the fake serves
// one prompt: a string (tokenized, with TokenBOS unless add_special_tokens
// is false), a list of token ids (used as they are, as vLLM does), or a
// list of one of either.
func completionPrompt(raw json.RawMessage, addSpecial bool) ([]uint32, *apiError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" || string(raw) == `""` {
		return nil, invalidRequest("", "Either prompt or prompt_embeds must be provided and non-empty.")
	}
	var text string
	if json.Unmarshal(raw, &text) == nil {
		return Tokenize(text, addSpecial), nil
	}
	var ids []int64
	if json.Unmarshal(raw, &ids) == nil {
		if len(ids) == 0 {
			return nil, invalidRequest("", "Either prompt or prompt_embeds must be provided and non-empty.")
		}
		out := make([]uint32, len(ids))
		for i, id := range ids {
			if id < 0 || id >= VocabSize {
				return nil, badRequest("prompt", "Token id %d is out of vocabulary", id)
			}
			out[i] = uint32(id)
		}
		return out, nil
	}
	var many []json.RawMessage
	if json.Unmarshal(raw, &many) == nil {
		if len(many) != 1 {
			return nil, badRequest("prompt", "fakeengine: only one prompt per request is supported, got %d", len(many))
		}
		return completionPrompt(many[0], addSpecial)
	}
	return nil, invalidRequest("prompt", "prompt: not a string, a list of strings or a list of token ids")
}

func (e *Engine) handleCompletions(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	if ae := decodeBody(r, &req); ae != nil {
		writeError(w, ae)
		return
	}
	if ae := e.check(&req.generateFields); ae != nil {
		writeError(w, ae)
		return
	}
	prompt, ae := completionPrompt(req.Prompt, req.AddSpecialTokens == nil || *req.AddSpecialTokens)
	if ae != nil {
		writeError(w, ae)
		return
	}
	maxTokens := req.MaxTokens
	if maxTokens == nil {
		sixteen := 16 // CompletionRequest.max_tokens' default
		maxTokens = &sixteen
	}
	g, ae := e.generate(e.receivedIndex(r), prompt, maxTokens, e.adapterOf(req.Model), req.salt())
	if ae != nil {
		writeError(w, ae)
		return
	}
	id := "cmpl-" + requestID(r, req.RequestID)
	created := time.Now().Unix()
	if req.Stream {
		e.streamCompletion(w, r, &req, g, id, created)
		return
	}
	if !e.sleep(r.Context(), e.cfg.TimeToFirstToken+time.Duration(len(g.output)-1)*e.cfg.InterTokenLatency) {
		return
	}
	text := ""
	for i := range g.output {
		text += g.delta(i)
	}
	choice := map[string]any{"index": 0, "text": text, "logprobs": nil, "finish_reason": g.finish,
		"stop_reason": nil, "prompt_logprobs": nil}
	if req.ReturnTokenIDs {
		choice["token_ids"] = g.output
		choice["prompt_token_ids"] = g.prompt
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"id": id, "object": "text_completion", "created": created, "model": g.model,
		"choices": []any{choice}, "service_tier": nil, "system_fingerprint": nil,
		"usage": g.usage(!e.cfg.OmitPromptTokensDetails), "kv_transfer_params": nil,
	})
}

// streamCompletion streams a completion as vLLM's
// completion_stream_generator: one chunk per output token (the last with
// finish_reason), then the usage chunk if included, then [DONE].
func (e *Engine) streamCompletion(w http.ResponseWriter, r *http.Request, req *completionRequest, g *generation, id string, created int64) {
	includeUsage, continuous := req.StreamOptions.usage()
	s := newSSE(w)
	if !e.sleep(r.Context(), e.cfg.TimeToFirstToken) {
		return
	}
	for i := range g.output {
		if i > 0 && !e.sleep(r.Context(), e.cfg.InterTokenLatency) {
			return
		}
		choice := map[string]any{"index": 0, "text": g.delta(i), "logprobs": nil,
			"finish_reason": nil, "stop_reason": nil}
		if i == len(g.output)-1 {
			choice["finish_reason"] = g.finish
		}
		if req.ReturnTokenIDs {
			choice["token_ids"] = g.output[i : i+1]
			if i == 0 {
				choice["prompt_token_ids"] = g.prompt
			}
		}
		c := map[string]any{"id": id, "object": "text_completion", "created": created,
			"model": g.model, "choices": []any{choice}}
		if continuous {
			c["usage"] = streamUsage{PromptTokens: len(g.prompt), CompletionTokens: i + 1,
				TotalTokens: len(g.prompt) + i + 1}
		}
		s.send(c)
	}
	if includeUsage {
		e.sendUsage(s, "text_completion", g, id, created)
	}
	s.done()
}

// tokenizeRequest is vLLM's TokenizeCompletionRequest (prompt) or
// TokenizeChatRequest (messages).
type tokenizeRequest struct {
	Model                *string        `json:"model"`
	Prompt               *string        `json:"prompt"`
	Messages             *[]chatMessage `json:"messages"`
	AddGenerationPrompt  *bool          `json:"add_generation_prompt"`
	ContinueFinalMessage bool           `json:"continue_final_message"`
	AddSpecialTokens     *bool          `json:"add_special_tokens"`
	ReturnTokenStrs      bool           `json:"return_token_strs"`
}

// handleTokenize serves POST /tokenize: {"count", "max_model_len",
// "tokens", "token_strs"}. A prompt is tokenized with TokenBOS unless
// add_special_tokens is false (its default is true); messages are rendered
// by the chat template (add_generation_prompt defaults to true,
// add_special_tokens to false), exactly as the chat endpoint prefills them.
func (e *Engine) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var req tokenizeRequest
	if ae := decodeBody(r, &req); ae != nil {
		writeError(w, ae)
		return
	}
	if ae := e.checkModel(req.Model); ae != nil {
		writeError(w, ae)
		return
	}
	var ids []uint32
	var strs []string
	switch {
	case req.Messages != nil:
		addGen := req.AddGenerationPrompt == nil || *req.AddGenerationPrompt
		if req.ContinueFinalMessage && addGen && req.AddGenerationPrompt != nil {
			writeError(w, invalidRequest("", "Cannot set both `continue_final_message` and `add_generation_prompt` to True."))
			return
		}
		msgs, ae := messages(*req.Messages)
		if ae != nil {
			writeError(w, ae)
			return
		}
		ids, strs = chatTemplate(msgs, addGen, req.ContinueFinalMessage,
			req.AddSpecialTokens != nil && *req.AddSpecialTokens, req.ReturnTokenStrs)
	case req.Prompt != nil:
		ids, strs = tokenize(*req.Prompt, req.AddSpecialTokens == nil || *req.AddSpecialTokens, req.ReturnTokenStrs)
	default:
		writeError(w, invalidRequest("", "prompt or messages: Field required"))
		return
	}
	if ids == nil {
		ids = []uint32{}
	}
	resp := map[string]any{"count": len(ids), "max_model_len": e.cfg.MaxModelLen, "tokens": ids, "token_strs": nil}
	if req.ReturnTokenStrs {
		resp["token_strs"] = strs
	}
	writeJSON(w, http.StatusOK, resp)
}

// handleHealth is vLLM's /health: 200 with an empty body, 503 when the
// engine is dead (EngineDeadError).
func (e *Engine) handleHealth(w http.ResponseWriter, r *http.Request) {
	if e.healthy.Load() {
		w.WriteHeader(http.StatusOK)
		return
	}
	w.WriteHeader(http.StatusServiceUnavailable)
}

// handleModels is vLLM's /v1/models: a ModelList of the served model,
// then its LoRA adapters, each with the model as its parent and its path
// as its root (vLLM's show_available_models).
func (e *Engine) handleModels(w http.ResponseWriter, r *http.Request) {
	now := time.Now().Unix()
	card := func(id, root string, parent any) map[string]any {
		return map[string]any{
			"id": id, "object": "model", "created": now, "owned_by": "vllm",
			"root": root, "parent": parent, "max_model_len": e.cfg.MaxModelLen,
			"permission": []any{map[string]any{
				"id": "modelperm-" + randomUUID(), "object": "model_permission", "created": now,
				"allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
				"allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
				"organization": "*", "group": nil, "is_blocking": false,
			}},
		}
	}
	data := []any{card(e.cfg.ModelName, e.cfg.ModelName, nil)}
	for _, name := range e.cfg.LoRAModules {
		data = append(data, card(name, "/adapters/"+name, e.cfg.ModelName))
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

// handleReset is vLLM's POST /reset_prefix_cache (a development endpoint
// there): it empties the cache, publishing AllBlocksCleared.
func (e *Engine) handleReset(w http.ResponseWriter, r *http.Request) {
	if err := e.Reset(); err != nil {
		writeError(w, newAPIError(http.StatusInternalServerError, "InternalServerError", "", "%v", err))
		return
	}
	w.WriteHeader(http.StatusOK)
}
