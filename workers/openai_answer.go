package workers

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/kvbus/kvbus/messages"
)

// Reading an engine's answer, whole or streamed (SSE): relayed as it came,
// with what kvbus needs of it (text, finish reason, usage) read on the way.

// engineAnswer is what kvbus reads of an engine's answer or chunk: the
// rest is relayed as it came.
type engineAnswer struct {
	Error   json.RawMessage `json:"error"`
	Choices []struct {
		Index        int     `json:"index"`
		Text         string  `json:"text"`
		FinishReason *string `json:"finish_reason"`
		Delta        *struct {
			Content *string `json:"content"`
		} `json:"delta"`
		Message *struct {
			Content *string `json:"content"`
		} `json:"message"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

// apply folds a into res and returns the text of its first choice.
func (a *engineAnswer) apply(res *EngineResult) string {
	if u := a.Usage; u != nil {
		res.Usage = &messages.Usage{PromptTokens: u.PromptTokens, CompletionTokens: u.CompletionTokens}
		if u.PromptTokensDetails != nil {
			res.Usage.CachedTokens = u.PromptTokensDetails.CachedTokens
		}
		res.CompletionTokens = u.CompletionTokens
	}
	text := ""
	for _, ch := range a.Choices {
		if ch.FinishReason != nil && *ch.FinishReason != "" && (res.FinishReason == "" || ch.Index == 0) {
			res.FinishReason = *ch.FinishReason
		}
		if ch.Index != 0 {
			continue
		}
		switch {
		case ch.Delta != nil && ch.Delta.Content != nil:
			text = *ch.Delta.Content
		case ch.Message != nil && ch.Message.Content != nil:
			text = *ch.Message.Content
		default:
			text = ch.Text
		}
	}
	return text
}

// readAnswer reads a whole (not streamed) answer.
func (e *OpenAIEngine) readAnswer(ctx context.Context, c *engineCall, r io.Reader, prefilled func(), emit func(Chunk) error) (EngineResult, error) {
	body, err := io.ReadAll(io.LimitReader(r, maxEngineBody+1))
	switch {
	case err != nil && ctx.Err() != nil:
		return EngineResult{}, ctx.Err()
	case err != nil:
		return EngineResult{}, fmt.Errorf("%w: reading the answer: %v", ErrEngineUnavailable, err)
	case len(body) > maxEngineBody:
		return EngineResult{}, fmt.Errorf("workers: the engine's answer exceeds %d bytes", maxEngineBody)
	}
	var a engineAnswer
	if err := json.Unmarshal(body, &a); err != nil {
		return EngineResult{}, fmt.Errorf("workers: the engine's answer is not JSON: %w", err)
	}
	var res EngineResult
	text := a.apply(&res)
	c.prefill(prefilled) // at the latest: run reported it as the request was sent
	c.started = true
	if err := emit(Chunk{Text: text, Raw: body}); err != nil {
		return res, err
	}
	return res, nil
}

// readStream reads server-sent events until "data: [DONE]".
func (e *OpenAIEngine) readStream(ctx context.Context, c *engineCall, r io.Reader, prefilled func(), emit func(Chunk) error) (EngineResult, error) {
	var res EngineResult
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxEngineLine)
	events, other := false, false // a line of the event stream's syntax came; one of another
	for sc.Scan() {
		line := sc.Bytes()
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			// Blank lines, comments, event:, id: and retry: fields.
			if isSSELine(line) {
				events = true
			} else {
				other = true
			}
			continue
		}
		events = true
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			return res, nil
		}
		var a engineAnswer
		if err := json.Unmarshal(data, &a); err != nil {
			return res, fmt.Errorf("workers: engine stream chunk is not JSON: %w", err)
		}
		if len(a.Error) > 0 && string(a.Error) != "null" {
			// vLLM reports an error inside a stream as a data chunk
			// {"error": {..., "code": status}} (serving_engine.py
			// create_streaming_error_response, 400 unless told otherwise):
			// a request's validation error comes so, before any output.
			ee := &EngineError{Status: streamErrorStatus(a.Error), Body: bytes.Clone(data)}
			if !c.started && ee.Status >= 500 {
				// Before any output it is a 5xx answer (an engine core
				// that died answers so): Generate asks /health.
				return res, fmt.Errorf("%w: POST %s: %w", ErrEngineUnavailable, c.path, ee)
			}
			return res, ee
		}
		text := a.apply(&res)
		if !c.started {
			c.started = true
			c.prefill(prefilled)
		}
		if len(a.Choices) == 0 && a.Usage != nil && !c.wantUsage {
			continue // the usage chunk kvbus asked for, not the client
		}
		chunk := Chunk{Text: text}
		if len(c.req.Body) > 0 {
			chunk.Raw = bytes.Clone(data)
		}
		if err := emit(chunk); err != nil {
			return res, err
		}
	}
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	err := sc.Err()
	switch {
	case errors.Is(err, bufio.ErrTooLong):
		// The engine sends it so again: no retry, nor another group, helps.
		return res, fmt.Errorf("workers: an event of the engine's stream exceeds %d bytes", maxEngineLine)
	case err == nil && other && !events:
		return res, errors.New("workers: the engine's answer is not a stream of server-sent events (it sent no data: line); does it take \"stream\": true?")
	case err == nil:
		err = io.ErrUnexpectedEOF
	}
	if !c.started {
		return res, fmt.Errorf("%w: stream ended before any output: %v", ErrEngineUnavailable, err)
	}
	return res, fmt.Errorf("%w: %w", errStreamBrokeOff, err)
}

// errStreamBrokeOff is wrapped by the error of a stream that ended, after
// its output began, without the engine's [DONE].
var errStreamBrokeOff = errors.New("workers: the engine's stream broke off")

// streamErrorStatus is the HTTP status an error event of a stream names in
// its "code" (vLLM's), or 500 when it names none.
func streamErrorStatus(raw json.RawMessage) int {
	var e struct {
		Code any `json:"code"`
	}
	if json.Unmarshal(raw, &e) == nil {
		if code, ok := e.Code.(float64); ok && code >= 400 && code < 600 && code == float64(int(code)) {
			return int(code)
		}
	}
	return http.StatusInternalServerError
}

// isSSELine reports whether line, not a data: field, is of the event
// stream's syntax: blank, a comment, or an event:, id: or retry: field.
func isSSELine(line []byte) bool {
	if len(bytes.TrimSpace(line)) == 0 || line[0] == ':' {
		return true
	}
	for _, f := range []string{"event:", "id:", "retry:"} {
		if bytes.HasPrefix(line, []byte(f)) {
			return true
		}
	}
	return false
}
