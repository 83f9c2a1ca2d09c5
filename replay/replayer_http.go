package replay

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// doHTTP sends a streaming /v1/completions request with a token-id prompt.
func (r *Replayer) doHTTP(ctx context.Context, req *messages.Request, res *Result) {
	sp := req.SamplingParams
	body := map[string]any{
		"model": cmp.Or(req.LoRAName, req.Model), "prompt": req.PromptTokenIDs, "max_tokens": max(sp.MaxTokens, 1),
		"stream": true, "stream_options": map[string]bool{"include_usage": true},
	}
	sp.PutSetFields(body)
	if len(sp.ExtraArgs) > 0 {
		body["vllm_xargs"] = sp.ExtraArgs // carries session_id and original_request_id
	}
	if req.CacheSalt != "" {
		body["cache_salt"] = req.CacheSalt
	}
	data, err := json.Marshal(body)
	if err != nil {
		res.Err = err.Error()
		return
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, r.httpURL, bytes.NewReader(data))
	if err != nil {
		res.Err = err.Error()
		return
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set("X-Request-Id", req.RequestID)
	if r.cfg.APIKey != "" {
		hreq.Header.Set("Authorization", "Bearer "+r.cfg.APIKey)
	}
	res.Sent = time.Now()
	resp, err := r.http.Do(hreq)
	if err != nil {
		res.Err = "http: " + err.Error()
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		res.Err = fmt.Sprintf("http %d: %s", resp.StatusCode, bytes.TrimSpace(b))
		return
	}
	readStream(resp.Body, len(req.PromptTokenIDs), res)
}

// readStream reads a streamed /v1/completions answer (server-sent events)
// into res: TTFT at the first event, E2E at [DONE], the cached tokens of
// the usage chunk, an error chunk's code and message. res.Sent is when the
// request was sent. An answer without [DONE], or whose usage has cached
// tokens outside the prompt's (a server's bug, which would put a hit ratio
// over 1), is a failure.
func readStream(body io.Reader, promptTokens int, res *Result) {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 1<<16), 16<<20)
	for sc.Scan() {
		line, ok := bytes.CutPrefix(sc.Bytes(), []byte("data: "))
		if !ok {
			continue
		}
		if res.TTFT == 0 {
			res.TTFT = max(time.Since(res.Sent), 1)
		}
		if string(line) == "[DONE]" {
			res.E2E = max(time.Since(res.Sent), res.TTFT)
			return
		}
		var chunk struct {
			Usage *struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
			Error *struct {
				Message string `json:"message"`
				Code    string `json:"code"`
			} `json:"error"`
		}
		if json.Unmarshal(line, &chunk) != nil {
			continue
		}
		if chunk.Usage != nil {
			res.CachedTokens = chunk.Usage.Details.Cached
			// The prompt was sent as token ids: the server's has as many.
			if res.CachedTokens < 0 || res.CachedTokens > promptTokens {
				res.Err = fmt.Sprintf("usage: %d cached tokens of a prompt of %d: the server's count is wrong", res.CachedTokens, promptTokens)
				res.CachedTokens = 0
			}
		}
		if chunk.Error != nil {
			res.Err = chunk.Error.Code + ": " + chunk.Error.Message
		}
	}
	if res.Err == "" {
		res.Err = "stream ended without [DONE]"
		if err := sc.Err(); err != nil {
			res.Err += ": " + err.Error()
		}
	}
}
