package workers

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/kvbus/kvbus/messages"
)

// engineCall is one request as sent to the engine.
type engineCall struct {
	req       EngineRequest
	path      string
	body      []byte
	stream    bool
	wantUsage bool // the client asked for usage in the stream
	started   bool // output reached emit
	prefilled bool // the prefill was reported (prefill)
}

// prefill reports the prefill (calls f) once per request, retries
// included.
func (c *engineCall) prefill(f func()) {
	if !c.prefilled && f != nil {
		c.prefilled = true
		f()
	}
}

func newEngineCall(req EngineRequest, model string) (*engineCall, error) {
	c := &engineCall{req: req, path: "/v1/completions"}
	if req.Endpoint == messages.EndpointChat && len(req.Body) > 0 {
		// A request without a client body has only token ids, which the
		// chat endpoint does not take: it goes to /v1/completions.
		c.path = "/v1/chat/completions"
	}
	var err error
	if len(req.Body) == 0 {
		c.body, err = traceBody(req, model)
		c.stream = true
	} else {
		c.body, c.stream, c.wantUsage, err = clientBody(req, model)
	}
	if err != nil {
		return nil, fmt.Errorf("workers: building the engine request: %w", err)
	}
	return c, nil
}

// clientBody is the client's body with the session id (in vllm_xargs and
// in the client's own session_id field), the engine's model name for
// kvbus's and, when streaming, usage in the stream: every other field goes
// to the engine as the client sent it.
func clientBody(req EngineRequest, model string) (body []byte, stream, wantUsage bool, err error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(req.Body, &fields); err != nil {
		return nil, false, false, fmt.Errorf("client body is not a JSON object: %w", err)
	} else if fields == nil {
		return nil, false, false, errors.New("client body is not a JSON object: null")
	}
	set := func(k string, v any) {
		b, _ := json.Marshal(v)
		fields[k] = b
	}
	// The engine's name stands for kvbus's (the bus's model, unknown to
	// an older scheduler): a model the engine lists itself (a LoRA adapter
	// of its model, another name) keeps the client's name.
	var asked string
	_ = json.Unmarshal(fields["model"], &asked)
	if model != "" && (asked == "" || req.Model == "" || asked == req.Model) {
		set("model", model)
	}
	// vllm_xargs.session_id is where vLLM's Mooncake connector reads the
	// session (it lands in sampling_params.extra_args); the frontend
	// resolved it by the session rules, so it replaces the client's.
	xargs := map[string]json.RawMessage{}
	if raw, ok := fields["vllm_xargs"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &xargs); err != nil {
			return nil, false, false, fmt.Errorf("vllm_xargs is not an object: %w", err)
		}
	}
	delete(xargs, messages.ExtraArgSessionID)
	if req.SessionID != "" {
		xargs[messages.ExtraArgSessionID], _ = json.Marshal(req.SessionID)
	}
	if len(xargs) > 0 {
		set("vllm_xargs", xargs)
	} else {
		delete(fields, "vllm_xargs")
	}
	// A later vLLM reads the body's own session_id before X-Session-ID and
	// vllm_xargs: a client's field goes as the resolved id (trimmed, or the
	// header's when it was blank), or not at all when there is no session.
	if _, ok := fields[messages.ExtraArgSessionID]; ok {
		if req.SessionID != "" {
			set(messages.ExtraArgSessionID, req.SessionID)
		} else {
			delete(fields, messages.ExtraArgSessionID)
		}
	}
	_ = json.Unmarshal(fields["stream"], &stream)
	if stream {
		// kvbus needs the engine's usage (cached tokens) at the end of the
		// stream; the client gets that chunk only if it asked. vLLM's
		// StreamOptions.include_usage defaults to true when stream_options
		// is given (vllm/entrypoints/openai/protocol.py); an explicit null
		// is None there, which should_include_usage reads as false.
		opts := map[string]json.RawMessage{}
		if raw, ok := fields["stream_options"]; ok && string(raw) != "null" {
			if err := json.Unmarshal(raw, &opts); err != nil {
				return nil, false, false, fmt.Errorf("stream_options is not an object: %w", err)
			}
			wantUsage = true
			var include *bool
			if v, ok := opts["include_usage"]; ok && json.Unmarshal(v, &include) == nil {
				wantUsage = include != nil && *include
			}
		}
		if !wantUsage {
			// Without include_usage vLLM ignores continuous_usage_stats; with
			// it forced on, usage would ride on every chunk the client sees.
			delete(opts, "continuous_usage_stats")
		}
		opts["include_usage"] = json.RawMessage("true")
		set("stream_options", opts)
	}
	body, err = json.Marshal(fields)
	return body, stream, wantUsage, err
}

// traceBody is the /v1/completions body of a request that came without a
// client body (a replayed trace: token ids only), streamed.
func traceBody(req EngineRequest, model string) ([]byte, error) {
	p := req.Params
	body := map[string]any{
		"prompt": req.PromptTokens, "max_tokens": max(p.MaxTokens, 1), "temperature": p.Temperature, "top_p": p.TopP,
		"stream": true, "stream_options": map[string]bool{"include_usage": true},
	}
	if model != "" {
		body["model"] = model
	} else if req.Model != "" {
		body["model"] = req.Model
	}
	if p.TopP == 0 {
		body["top_p"] = 1
	}
	p.PutSetFields(body)
	xargs := map[string]any{}
	for k, v := range p.ExtraArgs {
		xargs[k] = v
	}
	delete(xargs, messages.ExtraArgSessionID)
	if req.SessionID != "" {
		xargs[messages.ExtraArgSessionID] = req.SessionID
	}
	if len(xargs) > 0 {
		body["vllm_xargs"] = xargs
	}
	if len(req.KVTransferParams) > 0 {
		body["kv_transfer_params"] = req.KVTransferParams
	}
	if req.CacheSalt != "" {
		body["cache_salt"] = req.CacheSalt
	}
	return json.Marshal(body)
}
