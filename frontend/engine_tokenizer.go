package frontend

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// tokenizeCoolOff is how long an engine whose /tokenize timed out is asked
// only after the others: a hung engine (stopped, swapping) would otherwise
// cost every request a whole attempt.
const tokenizeCoolOff = 10 * time.Second

// ErrTokenizerUnavailable is wrapped when the engine's /tokenize cannot be
// reached or fails on its side: the request gets a 503.
var ErrTokenizerUnavailable = errors.New("frontend: engine tokenizer unavailable")

// TokenizeError is the engine refusing to tokenize a request (a 4xx):
// the client's request is at fault, and gets the engine's message.
type TokenizeError struct {
	Status  int
	Message string
}

func (e *TokenizeError) Error() string {
	return fmt.Sprintf("engine /tokenize answered %d: %s", e.Status, e.Message)
}

// RequestTokenizer tokenizes a request from its JSON body as the engine
// that will serve it does, with the request's messages, tools and
// template arguments. Safe for concurrent use.
type RequestTokenizer interface {
	Tokenizer
	// TokenizeChat returns the prompt tokens of a chat request's body.
	TokenizeChat(ctx context.Context, body []byte) ([]uint32, error)
	// TokenizePrompt returns the tokens of a completion prompt, with the
	// model's special tokens (BOS) when addSpecialTokens is set, as the
	// request's add_special_tokens asks.
	TokenizePrompt(ctx context.Context, text string, addSpecialTokens bool) ([]uint32, error)
}

// EngineTokenizerConfig configures an EngineTokenizer.
type EngineTokenizerConfig struct {
	// URLs are base URLs of engines serving the model (their POST
	// /tokenize is used): the first that answers tokenizes, so one engine
	// down does not stop the frontend.
	URLs []string
	// Model is the model name sent with each request; empty sends none
	// (the engine's default).
	Model string
	// APIKey, if set, is sent as "Authorization: Bearer <key>".
	APIKey string
	// Timeout bounds one /tokenize call to one engine (default 5 s): an
	// engine that does not answer within it is left for the next one, and
	// asked last for the next tokenizeCoolOff.
	Timeout time.Duration
	// TLS configures an https engine; nil means Go's defaults.
	TLS *tls.Config
}

// EngineTokenizer tokenizes through an engine's POST /tokenize (vLLM's
// TokenizeChatRequest / TokenizeCompletionRequest, answering
// {"count", "max_model_len", "tokens"}), so that the model's own
// vocabulary and chat template apply and kvbus's block hashes match the
// engine's cache. Token ids may be any uint32.
type EngineTokenizer struct {
	cfg    EngineTokenizerConfig
	bases  []string
	client *http.Client
	next   atomic.Int64 // the engine that answered last: tried first
	// timedOut holds, per base, when its last /tokenize timed out (unix
	// nanoseconds; 0: never): such an engine is asked after the others
	// until tokenizeCoolOff has passed.
	timedOut []atomic.Int64
}

// maxTokenizeAnswer bounds /tokenize's answer (a million token ids).
const maxTokenizeAnswer = 16 << 20

// Validate checks that there is at least one URL and that each is
// http(s)://HOST[:PORT] (--tokenizer-url), and that Timeout
// (--tokenizer-timeout) is not negative (0: 5 s). Errors wrap ErrConfig.
// NewEngineTokenizer calls it.
func (c EngineTokenizerConfig) Validate() error {
	if len(c.URLs) == 0 {
		return fmt.Errorf("%w: --tokenizer engine needs --tokenizer-url http://HOST:PORT (an engine's base URL; several, comma-separated, are tried in turn)", ErrConfig)
	}
	for _, raw := range c.URLs {
		u, err := url.Parse(raw)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%w: --tokenizer-url %q is not http(s)://HOST:PORT", ErrConfig, raw)
		}
	}
	if c.Timeout < 0 {
		return fmt.Errorf("%w: --tokenizer-timeout %s must be >= 0 (0: 5s)", ErrConfig, c.Timeout)
	}
	return nil
}

// NewEngineTokenizer returns a tokenizer for cfg, which it validates
// (cfg.Validate).
func NewEngineTokenizer(cfg EngineTokenizerConfig) (*EngineTokenizer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	bases := make([]string, 0, len(cfg.URLs))
	for _, raw := range cfg.URLs {
		bases = append(bases, strings.TrimRight(raw, "/"))
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 5 * time.Second
	}
	return &EngineTokenizer{cfg: cfg, bases: bases, timedOut: make([]atomic.Int64, len(bases)),
		client: &http.Client{Transport: &http.Transport{Proxy: http.ProxyFromEnvironment, TLSClientConfig: cfg.TLS, MaxIdleConnsPerHost: 64}}}, nil
}

// Name implements Tokenizer.
func (t *EngineTokenizer) Name() string { return "engine " + strings.Join(t.bases, ",") }

// VocabSize implements Tokenizer: any uint32 is a valid id.
func (t *EngineTokenizer) VocabSize() int { return 1 << 32 }

// Encode implements Tokenizer: a completion prompt, with the special
// tokens vLLM's /v1/completions adds by default.
func (t *EngineTokenizer) Encode(text string) ([]uint32, error) {
	return t.TokenizePrompt(context.Background(), text, true)
}

// TokenizePrompt implements RequestTokenizer.
func (t *EngineTokenizer) TokenizePrompt(ctx context.Context, text string, addSpecialTokens bool) ([]uint32, error) {
	body, err := json.Marshal(map[string]any{"prompt": text, "add_special_tokens": addSpecialTokens})
	if err != nil {
		return nil, err
	}
	return t.tokenize(ctx, body)
}

// ApplyChatTemplate implements Tokenizer for plain text turns.
func (t *EngineTokenizer) ApplyChatTemplate(msgs []ChatTurn) ([]uint32, error) {
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	out := make([]msg, len(msgs))
	for i, m := range msgs {
		out[i] = msg(m)
	}
	body, err := json.Marshal(map[string]any{"messages": out, "add_generation_prompt": true})
	if err != nil {
		return nil, err
	}
	return t.tokenize(context.Background(), body)
}

// TokenizeChat implements RequestTokenizer.
func (t *EngineTokenizer) TokenizeChat(ctx context.Context, body []byte) ([]uint32, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil {
		return nil, &TokenizeError{Status: http.StatusBadRequest, Message: "request body is not a JSON object"}
	}
	// The fields vLLM's TokenizeChatRequest shares with
	// ChatCompletionRequest (vllm/entrypoints/openai/protocol.py): the
	// prompt is rendered exactly as the chat endpoint renders it.
	req := map[string]json.RawMessage{}
	for _, k := range [...]string{"messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
		"chat_template", "chat_template_kwargs", "mm_processor_kwargs", "tools"} {
		if v, ok := fields[k]; ok {
			req[k] = v
		}
	}
	if _, ok := req["add_generation_prompt"]; !ok {
		req["add_generation_prompt"] = json.RawMessage("true") // the chat endpoint's default
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	return t.tokenize(ctx, b)
}

// tokenize posts a /tokenize body (without the model, added here) to the
// engines in turn (ask) and returns the tokens of the first answer.
func (t *EngineTokenizer) tokenize(ctx context.Context, body []byte) ([]uint32, error) {
	if t.cfg.Model != "" {
		m, _ := json.Marshal(t.cfg.Model)
		body = append(append(append([]byte(`{"model":`), m...), ','), body[1:]...)
	}
	var ids []uint32
	err := t.ask(ctx, "/tokenize", body, func(status int, data []byte) error {
		var err error
		ids, err = tokenizeAnswer(status, data)
		return err
	})
	return ids, err
}

// Relay posts a client's /tokenize or /detokenize body (path) to the
// engines in turn (ask), its model set to the engine's (Config.Model) when
// the body names none, and returns the first engine's answer that is not
// its own failure (a 5xx, 401 or 404 leaves the engine for the next one).
func (t *EngineTokenizer) Relay(ctx context.Context, path string, body map[string]json.RawMessage) (int, []byte, error) {
	if _, ok := body["model"]; !ok && t.cfg.Model != "" {
		body["model"], _ = json.Marshal(t.cfg.Model)
	}
	data, err := json.Marshal(body)
	if err != nil {
		return 0, nil, err
	}
	var status int
	var answer []byte
	err = t.ask(ctx, path, data, func(st int, data []byte) error {
		if st >= 500 || st == http.StatusUnauthorized || st == http.StatusNotFound {
			return fmt.Errorf("%w: %s answered %d: %s", ErrTokenizerUnavailable, path, st, errorMessage(data))
		}
		if len(data) > maxTokenizeAnswer {
			return fmt.Errorf("%w: %s's answer exceeds %d bytes", ErrTokenizerUnavailable, path, maxTokenizeAnswer)
		}
		status, answer = st, data
		return nil
	})
	return status, answer, err
}

// ask posts body to path of the engines in turn, from the one that
// answered last, until one answers: handle reads an engine's status and
// body, and an error of it that wraps ErrTokenizerUnavailable leaves the
// engine for the next. Each engine gets its own attempt of cfg.Timeout:
// one that does not answer within it is left for the next, and tried
// after the others for tokenizeCoolOff. Only ctx (the request's deadline)
// bounds the whole.
func (t *EngineTokenizer) ask(ctx context.Context, path string, body []byte, handle func(status int, data []byte) error) error {
	var errs []error
	for _, n := range t.order() {
		actx, cancel := context.WithTimeout(ctx, t.cfg.Timeout)
		err := t.post(actx, t.bases[n], path, body, handle)
		timedOut := err != nil && ctx.Err() == nil && errors.Is(actx.Err(), context.DeadlineExceeded)
		cancel()
		if timedOut {
			t.timedOut[n].Store(time.Now().UnixNano())
			errs = append(errs, fmt.Errorf("%w: POST %s%s: no answer within %s (--tokenizer-timeout); asked after the others for %s",
				ErrTokenizerUnavailable, t.bases[n], path, t.cfg.Timeout, tokenizeCoolOff))
			continue
		}
		if !errors.Is(err, ErrTokenizerUnavailable) || ctx.Err() != nil {
			if err == nil {
				t.next.Store(int64(n))
				t.timedOut[n].Store(0)
			}
			return err
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// order returns the engines to ask, by index: from the one that answered
// last, round the list, with those that timed out within tokenizeCoolOff
// moved to the end (longest ago first). All are asked: an engine cooling
// off may be the only one left.
func (t *EngineTokenizer) order() []int {
	first := int(t.next.Load())
	now := time.Now().UnixNano()
	var fresh, cooling []int
	for i := range t.bases {
		n := (first + i) % len(t.bases)
		if at := t.timedOut[n].Load(); at != 0 && now-at < int64(tokenizeCoolOff) {
			cooling = append(cooling, n)
		} else {
			fresh = append(fresh, n)
		}
	}
	slices.SortStableFunc(cooling, func(a, b int) int { return cmp.Compare(t.timedOut[a].Load(), t.timedOut[b].Load()) })
	return append(fresh, cooling...)
}

// post asks one engine and hands its answer to handle.
func (t *EngineTokenizer) post(ctx context.Context, base, path string, body []byte, handle func(status int, data []byte) error) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if t.cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+t.cfg.APIKey)
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return fmt.Errorf("%w: POST %s%s: %v", ErrTokenizerUnavailable, base, path, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxTokenizeAnswer+1))
	if err != nil {
		return fmt.Errorf("%w: reading %s's answer: %v", ErrTokenizerUnavailable, path, err)
	}
	return handle(resp.StatusCode, data)
}

// errorMessage is an engine's error body's message, or the body.
func errorMessage(data []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(data, &e) == nil && e.Error.Message != "" {
		return e.Error.Message
	}
	return strings.TrimSpace(string(data))
}

// tokenizeAnswer reads /tokenize's answer: its tokens, the engine's
// refusal of the request (a TokenizeError), or its failure
// (ErrTokenizerUnavailable).
func tokenizeAnswer(status int, data []byte) ([]uint32, error) {
	if status != http.StatusOK {
		msg := errorMessage(data)
		if status >= 400 && status < 500 && status != http.StatusUnauthorized && status != http.StatusNotFound {
			return nil, &TokenizeError{Status: status, Message: msg}
		}
		return nil, fmt.Errorf("%w: /tokenize answered %d: %s", ErrTokenizerUnavailable, status, msg)
	}
	if len(data) > maxTokenizeAnswer {
		return nil, fmt.Errorf("%w: /tokenize's answer exceeds %d bytes", ErrTokenizerUnavailable, maxTokenizeAnswer)
	}
	var out struct {
		Tokens *[]uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("%w: /tokenize's answer has no token list: %v", ErrTokenizerUnavailable, err)
	}
	if out.Tokens == nil { // not an empty prompt: no answer of vLLM's
		return nil, fmt.Errorf("%w: /tokenize's answer has no token list (no \"tokens\" array)", ErrTokenizerUnavailable)
	}
	return *out.Tokens, nil
}
