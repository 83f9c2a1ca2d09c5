package testenv

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// Conversation is a multi-turn chat as a user's client runs it: every turn
// sends the whole history (a long system prompt, the user's messages and
// the assistant's answers) and goes out the moment the previous answer
// arrived. It is what the cache promise is about: each turn's prompt
// extends the previous one, whose KV blocks should be found cached.
type Conversation struct {
	// BaseURL is the frontend, e.g. http://127.0.0.1:8000.
	BaseURL string
	// Client defaults to http.DefaultClient.
	Client *http.Client
	// Headers go with every turn (e.g. X-Session-ID); nil sends none.
	Headers map[string]string
	Model   string
	// Seed makes the conversation's text its own; System is the system
	// prompt (default: about 600 tokens of instructions).
	Seed      int
	System    string
	MaxTokens int // default 16
}

// Turn is what one turn reported in its usage.
type Turn struct {
	RequestID    string
	PromptTokens int
	CachedTokens int
}

// Run sends turns back to back and returns what each reported. It stops at
// the first failure, with an error that says which turn and what came back.
func (c Conversation) Run(ctx context.Context, turns int) ([]Turn, error) {
	client := c.Client
	if client == nil {
		client = http.DefaultClient
	}
	system := c.System
	if system == "" {
		var b strings.Builder
		for i := range 60 {
			fmt.Fprintf(&b, "Rule %d of assistant %d: answer briefly and politely. ", i, c.Seed)
		}
		system = b.String()
	}
	maxTokens := c.MaxTokens
	if maxTokens == 0 {
		maxTokens = 16
	}
	msgs := []map[string]string{{"role": "system", "content": system}}
	var out []Turn
	for n := range turns {
		msgs = append(msgs, map[string]string{"role": "user",
			"content": fmt.Sprintf("Conversation %d, question %d: tell me about topic %d in a few words.", c.Seed, n+1, c.Seed*31+n)})
		body, err := json.Marshal(map[string]any{"model": c.Model, "messages": msgs, "max_tokens": maxTokens})
		if err != nil {
			return out, err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.BaseURL+"/v1/chat/completions", bytes.NewReader(body))
		if err != nil {
			return out, err
		}
		req.Header.Set("Content-Type", "application/json")
		for k, v := range c.Headers {
			req.Header.Set(k, v)
		}
		resp, err := client.Do(req)
		if err != nil {
			return out, fmt.Errorf("turn %d: %w", n+1, err)
		}
		raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if err != nil {
			return out, fmt.Errorf("turn %d: %w", n+1, err)
		}
		if resp.StatusCode != http.StatusOK {
			return out, fmt.Errorf("turn %d: status %d: %s", n+1, resp.StatusCode, raw)
		}
		var r struct {
			Choices []struct {
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
			} `json:"choices"`
			Usage struct {
				PromptTokens        int `json:"prompt_tokens"`
				PromptTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(raw, &r); err != nil || len(r.Choices) == 0 {
			return out, fmt.Errorf("turn %d: unexpected answer %s (%v)", n+1, raw, err)
		}
		msgs = append(msgs, map[string]string{"role": "assistant", "content": r.Choices[0].Message.Content})
		out = append(out, Turn{RequestID: resp.Header.Get("X-Request-Id"), PromptTokens: r.Usage.PromptTokens,
			CachedTokens: r.Usage.PromptTokensDetails.CachedTokens})
	}
	return out, nil
}

// PreviousShares returns, for turns 2 and later, the share of the previous
// turn's full prompt blocks (of blockSize tokens) that the turn found
// cached: 1.0 when every block of the previous prompt was loaded.
func PreviousShares(turns []Turn, blockSize int) []float64 {
	var out []float64
	for i := 1; i < len(turns); i++ {
		due := turns[i-1].PromptTokens / blockSize * blockSize
		if due == 0 {
			out = append(out, 1)
			continue
		}
		out = append(out, min(float64(turns[i].CachedTokens)/float64(due), 1))
	}
	return out
}
