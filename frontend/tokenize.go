package frontend

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// vLLM's POST /tokenize and POST /detokenize: how kvbus tokenizes a prompt
// is what its block hashes, and so its cache hits, stand on; an operator
// checks it here. With --tokenizer engine the engines answer (relayed), as
// they tokenize every request.

// tokenizeRequest is vLLM's TokenizeCompletionRequest (prompt) or
// TokenizeChatRequest (messages).
type tokenizeRequest struct {
	Model                string          `json:"model"`
	Prompt               json.RawMessage `json:"prompt"`
	Messages             []chatMessage   `json:"messages"`
	AddSpecialTokens     *bool           `json:"add_special_tokens"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
	ContinueFinalMessage bool            `json:"continue_final_message"`
	ReturnTokenStrs      bool            `json:"return_token_strs"`
}

// detokenizeRequest is vLLM's DetokenizeRequest.
type detokenizeRequest struct {
	Model  string          `json:"model"`
	Tokens json.RawMessage `json:"tokens"`
}

// tokenizeResponse is vLLM's TokenizeResponse.
type tokenizeResponse struct {
	Count       int       `json:"count"`
	MaxModelLen int       `json:"max_model_len"`
	Tokens      []uint32  `json:"tokens"`
	TokenStrs   *[]string `json:"token_strs"`
}

func (s *Server) serveTokenize(w http.ResponseWriter, r *http.Request) {
	body, model, e := s.readTokenizeBody(w, r)
	if e == nil && s.relayTokenize(w, r, "/tokenize", body, model) {
		return
	}
	var req tokenizeRequest
	if e == nil {
		e = decodeJSON(body, &req)
	}
	var ids []uint32
	if e == nil {
		ids, e = s.tokenizeForClient(&req)
	}
	if e != nil {
		writeError(w, e)
		return
	}
	if ids == nil {
		ids = []uint32{} // an empty prompt: "tokens": [], as vLLM answers, not null
	}
	out := tokenizeResponse{Count: len(ids), MaxModelLen: s.cfg.MaxModelLen, Tokens: ids}
	if req.ReturnTokenStrs {
		strs := make([]string, len(ids))
		if d, ok := s.tok.(Detokenizer); ok {
			for i, id := range ids {
				strs[i], _ = d.Decode([]uint32{id}) // ids the tokenizer just made
			}
		}
		out.TokenStrs = &strs
	}
	writeJSON(w, http.StatusOK, out)
}

// tokenizeForClient tokenizes a /tokenize request with kvbus's own
// tokenizer, as a chat or completion request's prompt is.
func (s *Server) tokenizeForClient(req *tokenizeRequest) ([]uint32, *APIError) {
	hasPrompt := len(bytes.TrimSpace(req.Prompt)) > 0 && string(bytes.TrimSpace(req.Prompt)) != "null"
	switch {
	case hasPrompt && req.Messages != nil:
		return nil, badRequest("prompt", "send either prompt (a completion's) or messages (a chat's), not both")
	case hasPrompt:
		var text string
		if req.Prompt[0] != '"' || json.Unmarshal(req.Prompt, &text) != nil {
			return nil, badRequest("prompt", "prompt must be a string")
		}
		// add_special_tokens: the o200k vocabulary has no BOS to add.
		ids, err := s.tok.Encode(text)
		if err != nil {
			return nil, tokenizeError("prompt", err)
		}
		return ids, nil
	case req.Messages == nil:
		return nil, badRequest("prompt", "send prompt (a string, tokenized as a completion's) or messages (tokenized as a chat's)")
	}
	generationPrompt := req.AddGenerationPrompt == nil || *req.AddGenerationPrompt
	if req.ContinueFinalMessage && generationPrompt {
		return nil, badRequest("continue_final_message", "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
	}
	turns := make([]ChatTurn, 0, len(req.Messages))
	for i, m := range req.Messages {
		param := fmt.Sprintf("messages[%d]", i)
		if m.Role == "" {
			return nil, badRequest(param+".role", "%s.role is required: a string such as \"user\"", param)
		}
		text, err := messageText(m.Content, param+".content", m.Role == "assistant", false)
		if err != nil {
			return nil, err
		}
		turns = append(turns, ChatTurn{Role: m.Role, Content: text})
	}
	var ids []uint32
	var err error
	switch cr, ok := s.tok.(ChatRenderer); {
	case ok:
		ids, err = cr.RenderChat(turns, generationPrompt, req.ContinueFinalMessage)
	case generationPrompt:
		ids, err = s.tok.ApplyChatTemplate(turns)
	default:
		return nil, badRequest("add_generation_prompt", "the %s tokenizer always ends a chat with the generation prompt", s.tok.Name())
	}
	if err != nil {
		return nil, tokenizeError("messages", err)
	}
	return ids, nil
}

func (s *Server) serveDetokenize(w http.ResponseWriter, r *http.Request) {
	body, model, e := s.readTokenizeBody(w, r)
	if e == nil && s.relayTokenize(w, r, "/detokenize", body, model) {
		return
	}
	var req detokenizeRequest
	if e == nil {
		e = decodeJSON(body, &req)
	}
	var ids []uint32
	if e == nil {
		switch raw := bytes.TrimSpace(req.Tokens); {
		case len(raw) == 0:
			e = badRequest("tokens", "tokens is required: an array of token ids")
		case bytes.Equal(raw, []byte("[]")): // no text
		default:
			ids, e = tokenIDs(req.Tokens, s.tok.VocabSize(), "tokens")
		}
	}
	d, ok := s.tok.(Detokenizer)
	if e == nil && !ok {
		e = &APIError{Status: http.StatusNotImplemented, Type: typeInvalidRequest, Code: "not_implemented",
			Message: fmt.Sprintf("the %s tokenizer cannot turn token ids back into text", s.tok.Name())}
	}
	var text string
	if e == nil {
		var err error
		if text, err = d.Decode(ids); err != nil {
			e = badRequest("tokens", "%v", err)
		}
	}
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, struct {
		Prompt string `json:"prompt"`
	}{text})
}

// readTokenizeBody reads a /tokenize or /detokenize body and its model,
// checked as the generate routes check it: absent is the first served
// model, an unknown one a 404.
func (s *Server) readTokenizeBody(w http.ResponseWriter, r *http.Request) ([]byte, string, *APIError) {
	body, e := readBody(w, r, s.cfg.MaxBodyBytes, s.cfg.ReadBodyTimeout)
	if e != nil {
		return nil, "", e
	}
	var m struct {
		Model json.RawMessage `json:"model"`
	}
	if e := decodeJSON(body, &m); e != nil {
		return nil, "", e
	}
	var model string
	if raw := bytes.TrimSpace(m.Model); len(raw) > 0 && string(raw) != "null" {
		if raw[0] != '"' || json.Unmarshal(raw, &model) != nil {
			return nil, "", badRequest("model", "model must be a string")
		}
	}
	if model == "" || s.serves(model) {
		return body, model, nil
	}
	if served, ok := s.engineServes(r.Context(), model); !ok {
		return nil, "", &APIError{Status: http.StatusNotFound, Type: typeNotFound, Param: "model", Code: "model_not_found",
			Message: fmt.Sprintf("The model `%s` does not exist. Served models: %s.", model, strings.Join(served, ", "))}
	}
	return body, model, nil
}

// relayTokenize answers a /tokenize or /detokenize request with the
// engines' answer when the frontend tokenizes through them (--tokenizer
// engine), and reports whether it did. kvbus's own model names are the
// engine's default model there: the body goes without them.
func (s *Server) relayTokenize(w http.ResponseWriter, r *http.Request, path string, body []byte, model string) bool {
	et, ok := s.tok.(*EngineTokenizer)
	if !ok {
		return false
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil || fields == nil {
		writeError(w, badRequest("", "request body must be a JSON object"))
		return true
	}
	if model == "" || s.serves(model) {
		delete(fields, "model")
	}
	status, answer, err := et.Relay(r.Context(), path, fields)
	if err != nil {
		e := tokenizeError("", err)
		if !errors.Is(err, ErrTokenizerUnavailable) {
			e = &APIError{Status: http.StatusBadGateway, Type: typeUnavailable, Code: "tokenizer_unavailable",
				Message: "cannot ask the engine's tokenizer: " + err.Error()}
		}
		writeError(w, e)
		return true
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(answer)
	return true
}
