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
	RequestID        string
	PromptTokens     int
	CachedTokens     int
	CompletionTokens int
	FinishReason     string
}

// Run sends turns back to back and returns what each reported. It stops at
// the first failure, with an error that says which turn and what came back.
func (c Conversation) Run(ctx context.Context, turns int) ([]Turn, error) {
	d := c.Start()
	for range turns {
		if _, err := d.Next(ctx); err != nil {
			return d.Turns, err
		}
	}
	return d.Turns, nil
}

// Dialog is a Conversation in progress: each Next sends one more turn with
// the whole history so far. Not safe for concurrent use.
type Dialog struct {
	c     Conversation
	msgs  []map[string]string
	Turns []Turn // what every turn so far reported
}

// Start begins the conversation; no turn is sent yet.
func (c Conversation) Start() *Dialog {
	if c.Client == nil {
		c.Client = http.DefaultClient
	}
	if c.System == "" {
		var b strings.Builder
		for i := range 60 {
			fmt.Fprintf(&b, "Rule %d of assistant %d: answer briefly and politely. ", i, c.Seed)
		}
		c.System = b.String()
	}
	if c.MaxTokens == 0 {
		c.MaxTokens = 16
	}
	return &Dialog{c: c, msgs: []map[string]string{{"role": "system", "content": c.System}}}
}

// Next sends the next turn and returns what it reported; on failure the
// error says which turn and what came back, and the history is unchanged.
func (d *Dialog) Next(ctx context.Context) (Turn, error) {
	c, n := d.c, len(d.Turns)
	msgs := append(d.msgs, map[string]string{"role": "user",
		"content": fmt.Sprintf("Conversation %d, question %d: tell me about topic %d in a few words.", c.Seed, n+1, c.Seed*31+n)})
	body, err := json.Marshal(map[string]any{"model": c.Model, "messages": msgs, "max_tokens": c.MaxTokens})
	if err != nil {
		return Turn{}, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.BaseURL+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return Turn{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range c.Headers {
		req.Header.Set(k, v)
	}
	resp, err := c.Client.Do(req)
	if err != nil {
		return Turn{}, fmt.Errorf("turn %d: %w", n+1, err)
	}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	if err != nil {
		return Turn{}, fmt.Errorf("turn %d: %w", n+1, err)
	}
	if resp.StatusCode != http.StatusOK {
		return Turn{}, fmt.Errorf("turn %d: status %d: %s", n+1, resp.StatusCode, raw)
	}
	var r struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			CompletionTokens    int `json:"completion_tokens"`
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(raw, &r); err != nil || len(r.Choices) == 0 {
		return Turn{}, fmt.Errorf("turn %d: unexpected answer %s (%v)", n+1, raw, err)
	}
	d.msgs = append(msgs, map[string]string{"role": "assistant", "content": r.Choices[0].Message.Content})
	turn := Turn{RequestID: resp.Header.Get("X-Request-Id"), PromptTokens: r.Usage.PromptTokens,
		CachedTokens: r.Usage.PromptTokensDetails.CachedTokens, CompletionTokens: r.Usage.CompletionTokens,
		FinishReason: r.Choices[0].FinishReason}
	d.Turns = append(d.Turns, turn)
	return turn, nil
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
