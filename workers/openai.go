package workers

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// Engine kinds of `kvbus worker --engine`.
const (
	EngineSim    = "sim"
	EngineOpenAI = "openai"
)

// Defaults of OpenAIConfig.
const (
	DefaultEngineMaxConcurrency = 256
	DefaultEngineConnectTimeout = 5 * time.Second
	DefaultEngineHealthInterval = time.Second
	// DefaultEngineHealthTimeout bounds one /health poll: vLLM's /health
	// slows down under load, which is no reason to move its requests.
	DefaultEngineHealthTimeout = 5 * time.Second
	// engineHealthFailures is how many polls in a row must fail before a
	// healthy engine is marked not healthy (one that refuses connections
	// is marked at once).
	engineHealthFailures = 3
	// DefaultEngineUnavailableWait is as long as the scheduler's default
	// --no-group-wait: a request in flight on a dead engine ends no later
	// than a new one finding no ready group.
	DefaultEngineUnavailableWait = 2 * time.Second
	// maxEngineLine bounds one SSE line of an engine's stream, and
	// maxEngineBody a whole answer (or error) that does not stream: both
	// are sent on the bus, whose messages are smaller still.
	maxEngineLine = 4 << 20
	maxEngineBody = 8 << 20
)

// Retries of a request the engine did not take (see Generate).
const (
	// maxEngineAttempts bounds how often one request is sent to the
	// engine.
	maxEngineAttempts = 3
	// engineRetryBackoff is the pause before the second attempt, doubled
	// before each later one.
	engineRetryBackoff = 100 * time.Millisecond
)

// ErrEngineUnavailable is wrapped by errors of an engine that cannot be
// reached or answers 5xx before any output: the request did not run there,
// and may run on another group.
var ErrEngineUnavailable = errors.New("workers: engine unavailable")

// ErrEngineDied is wrapped by the error of a request whose stream broke
// off after its output began and whose engine's /health then failed: the
// engine died under it (killed, its core crashed). The answer cannot move
// to another group, but the failure is the group's, not the model's: the
// client hears group_failed (retry the request), as for a worker that died.
var ErrEngineDied = errors.New("workers: the engine died during the answer")

// ErrEngineTimeout is returned, with context.DeadlineExceeded, when a
// request took longer than OpenAIConfig.Timeout (--engine-timeout) at the
// engine, its attempts and waits included.
var ErrEngineTimeout = errors.New("workers: the engine did not answer within --engine-timeout")

// EngineError is an engine's answer that is not a success, relayed to the
// client as the engine sent it.
type EngineError struct {
	Status int    // the engine's HTTP status
	Body   []byte // the engine's error body (OpenAI's {"error": {...}})
}

func (e *EngineError) Error() string {
	msg := string(e.Body)
	var body struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(e.Body, &body) == nil && body.Error.Message != "" {
		msg = body.Error.Message
	}
	if len(msg) > 512 {
		msg = msg[:512] + "…"
	}
	return fmt.Sprintf("engine answered %d: %s", e.Status, msg)
}

// OpenAIConfig configures an OpenAIEngine.
type OpenAIConfig struct {
	// URL is the engine's base URL, http(s)://host:port (a path prefix is
	// kept); kvbus adds /v1/chat/completions, /v1/completions and /health.
	URL string
	// Model, if set, replaces the model name of every request: the name the
	// engine serves when it is not the one clients use (--engine-model).
	Model string
	// APIKey is sent as "Authorization: Bearer <key>" (vLLM's --api-key);
	// it is never logged.
	APIKey string
	// MaxConcurrency bounds the requests in flight at the engine; more
	// wait in the rank (default DefaultEngineMaxConcurrency).
	MaxConcurrency int
	// ConnectTimeout bounds connecting to the engine (default 5 s).
	ConnectTimeout time.Duration
	// Timeout bounds one engine request end to end; zero means only the
	// request's own deadline does.
	Timeout time.Duration
	// HealthInterval is how often /health is polled (default 1 s).
	HealthInterval time.Duration
	// HealthTimeout bounds one /health call, and one /metrics call that
	// reads the engine's start time (see restartRules) (default
	// DefaultEngineHealthTimeout). A healthy engine becomes unhealthy
	// after engineHealthFailures failed polls in a row, at once when
	// nothing accepts the connection or a request found it down.
	HealthTimeout time.Duration
	// UnavailableWait bounds how long a request waits for an engine that
	// is down (or for the scheduler to move it to another group) before it
	// fails with ErrEngineUnavailable (default
	// DefaultEngineUnavailableWait).
	UnavailableWait time.Duration
	// TLS configures https engines; nil means Go's defaults.
	TLS *tls.Config
	// Logger; nil means slog.Default().
	Logger *slog.Logger
}

// Validate checks the configuration.
func (c *OpenAIConfig) Validate() error {
	u, err := url.Parse(c.URL)
	switch {
	case c.URL == "":
		return fmt.Errorf("%w: --engine openai needs --engine-url http://HOST:PORT (the engine's base URL)", ErrConfig)
	case err != nil:
		return fmt.Errorf("%w: --engine-url %q: %v", ErrConfig, c.URL, err)
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("%w: --engine-url %q must start with http:// or https://", ErrConfig, c.URL)
	case u.Host == "":
		return fmt.Errorf("%w: --engine-url %q has no host", ErrConfig, c.URL)
	case u.RawQuery != "" || u.Fragment != "":
		return fmt.Errorf("%w: --engine-url %q must be a base URL, without query or fragment", ErrConfig, c.URL)
	case c.MaxConcurrency < 0 || c.ConnectTimeout < 0 || c.Timeout < 0 || c.HealthInterval < 0 || c.HealthTimeout < 0 || c.UnavailableWait < 0:
		return fmt.Errorf("%w: engine concurrency and timeouts must be >= 0 (0: default)", ErrConfig)
	}
	return nil
}

// OpenAIEngine is the Engine of a driver rank that fronts an
// OpenAI-compatible model server (vLLM, SGLang): it forwards each request
// as the client sent it, with kvbus's request id and the session id, and
// returns the engine's answer as it came. It polls the engine's /health
// (WatchHealth). Safe for concurrent use.
type OpenAIEngine struct {
	cfg    OpenAIConfig
	base   string
	client *http.Client
	slots  chan struct{}
	log    *slog.Logger

	// tokensWarned is set once the engine's prompt count was found to
	// differ from kvbus's (warnTokenMismatch).
	tokensWarned atomic.Bool
	// requestFoundGone is set by a request that could not connect to the
	// engine at all, for the health watcher's restart rules.
	requestFoundGone atomic.Bool

	mu      sync.Mutex
	healthy bool
	why     string
	changed chan struct{} // closed and replaced on every health change
}

// NewOpenAIEngine returns an engine adapter for cfg; it starts unhealthy
// until its first health check passes.
func NewOpenAIEngine(cfg OpenAIConfig) (*OpenAIEngine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.MaxConcurrency == 0 {
		cfg.MaxConcurrency = DefaultEngineMaxConcurrency
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = DefaultEngineConnectTimeout
	}
	if cfg.HealthInterval == 0 {
		cfg.HealthInterval = DefaultEngineHealthInterval
	}
	if cfg.HealthTimeout == 0 {
		cfg.HealthTimeout = DefaultEngineHealthTimeout
	}
	if cfg.UnavailableWait == 0 {
		cfg.UnavailableWait = DefaultEngineUnavailableWait
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	transport := &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         (&net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:     cfg.TLS,
		TLSHandshakeTimeout: cfg.ConnectTimeout,
		MaxIdleConns:        cfg.MaxConcurrency,
		MaxIdleConnsPerHost: cfg.MaxConcurrency,
		IdleConnTimeout:     90 * time.Second,
		ForceAttemptHTTP2:   cfg.TLS != nil,
	}
	return &OpenAIEngine{
		cfg:     cfg,
		base:    strings.TrimRight(cfg.URL, "/"),
		client:  &http.Client{Transport: transport},
		slots:   make(chan struct{}, cfg.MaxConcurrency),
		log:     log.With("engine_url", cfg.URL),
		why:     "engine health not checked yet",
		changed: make(chan struct{}),
	}, nil
}

func (e *OpenAIEngine) authorize(h http.Header) {
	if e.cfg.APIKey != "" {
		h.Set("Authorization", "Bearer "+e.cfg.APIKey)
	}
}

// Generate implements Engine: it runs req on the engine, emitting each
// streamed chunk (or the whole answer) as the engine sent it. prefilled is
// called with a stream's first chunk, and as a request that does not stream
// is sent (the engine tells nothing of its prefill before the whole answer).
//
// A request the engine did not take (unreachable, a 5xx, a stream that
// ended before any output or whose first event is an error of a 5xx)
// asks /health whether the engine is down:
//   - /health passes and the engine answered 5xx: the error is the
//     request's own; it is returned at once as the engine's *EngineError
//     (vLLM answers its client so), and the engine's health stays;
//   - /health fails: the engine is marked unhealthy (the rank is not ready,
//     and the scheduler moves the request to another group) and the
//     request waits for it, up to UnavailableWait from when it first found
//     the engine down;
//   - otherwise (the connection failed, /health passes) it is sent again.
//
// It is sent at most maxEngineAttempts times, with engineRetryBackoff
// doubling between attempts; past that, or past the wait, it fails with an
// error wrapping ErrEngineUnavailable.
func (e *OpenAIEngine) Generate(ctx context.Context, req EngineRequest, prefilled func(), emit func(Chunk) error) (_ EngineResult, err error) {
	select {
	case e.slots <- struct{}{}:
	case <-ctx.Done():
		return EngineResult{}, ctx.Err()
	}
	defer func() { <-e.slots }()
	if e.cfg.Timeout > 0 {
		parent := ctx
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, e.cfg.Timeout, ErrEngineTimeout)
		defer cancel()
		defer func() {
			if err != nil && parent.Err() == nil && errors.Is(context.Cause(ctx), ErrEngineTimeout) {
				// Said so: the client's own deadline did not pass.
				err = fmt.Errorf("%w (%s): %w", ErrEngineTimeout, e.cfg.Timeout, context.DeadlineExceeded)
			}
		}()
	}
	call, err := newEngineCall(req, e.cfg.Model)
	if err != nil {
		return EngineResult{}, err
	}
	var down time.Time // when this request first found the engine down
	failure := ""      // how the last attempt failed
	backoff := engineRetryBackoff
	for attempt := 1; ; attempt++ {
		if err := e.awaitHealthy(ctx, &down, failure); err != nil {
			return EngineResult{}, err
		}
		res, err := e.run(ctx, call, prefilled, emit)
		if errors.Is(err, errStreamBrokeOff) && ctx.Err() == nil {
			return res, e.brokeOff(ctx, req, err)
		}
		if !errors.Is(err, ErrEngineUnavailable) || call.started || ctx.Err() != nil {
			if err == nil {
				e.warnTokenMismatch(req, res)
			}
			return res, err
		}
		failure = strings.TrimPrefix(err.Error(), ErrEngineUnavailable.Error()+": ")
		ok, why, gone := e.checkHealth(ctx)
		if ctx.Err() != nil {
			return EngineResult{}, ctx.Err()
		}
		if gone {
			e.requestFoundGone.Store(true)
		}
		log := e.log.With("req_id", req.ReqID, "session_id", req.SessionID)
		var ee *EngineError
		switch {
		case ok && errors.As(err, &ee):
			log.Warn("engine answered the request with an error while its /health passes: relayed to the client",
				"status", ee.Status, "err", ee)
			return EngineResult{}, ee
		case !ok:
			e.setHealth(false, failure+"; "+why)
		}
		if attempt == maxEngineAttempts {
			return EngineResult{}, fmt.Errorf("%w: %s (sent %d times)", ErrEngineUnavailable, failure, attempt)
		}
		if ok {
			why = "passes"
		}
		log.Warn("engine did not take the request: sending it again, once the engine is healthy (it may move to another group first)",
			"attempt", attempt, "err", failure, "health", why, "retry_in", backoff)
		select {
		case <-ctx.Done():
			return EngineResult{}, ctx.Err()
		case <-time.After(backoff):
		}
		backoff *= 2
	}
}

// brokeOff asks /health about an engine whose stream broke off after the
// request's output began (err): an engine that fails it died under the
// request, which is marked so (ErrEngineDied) and takes the engine out at
// once, as a request that finds it down before any output does. An engine
// that passes broke this one stream: err is returned as it is.
func (e *OpenAIEngine) brokeOff(ctx context.Context, req EngineRequest, err error) error {
	ok, why, gone := e.checkHealth(ctx)
	if ok || ctx.Err() != nil {
		return err
	}
	if gone {
		e.requestFoundGone.Store(true)
	}
	e.setHealth(false, err.Error()+"; "+why)
	e.log.Warn("engine died during an answer: its stream broke off and its /health fails",
		"req_id", req.ReqID, "session_id", req.SessionID, "err", err, "health", why)
	return fmt.Errorf("%w: %w; %s", ErrEngineDied, err, why)
}

// warnTokenMismatch warns, once per engine, when the engine counted
// another number of prompt tokens than kvbus's tokenizer did for a prompt
// kvbus sent as text: the token ids differ, so kvbus's block hashes can
// never match the blocks of the engine's KV events. A request whose count
// the engine may rightly make otherwise is not compared (see
// comparablePrompt).
func (e *OpenAIEngine) warnTokenMismatch(req EngineRequest, res EngineResult) {
	if res.Usage == nil || res.Usage.PromptTokens == 0 || res.Usage.PromptTokens == len(req.PromptTokens) ||
		e.tokensWarned.Load() || !comparablePrompt(req) || !e.tokensWarned.CompareAndSwap(false, true) {
		return
	}
	e.log.Warn("kvbus's tokenizer does not match the engine's: it counted another number of prompt tokens; "+
		"KV-event placement cannot find the engine's cached blocks (reported once)",
		"req_id", req.ReqID, "session_id", req.SessionID, "kvbus_prompt_tokens", len(req.PromptTokens),
		"engine_prompt_tokens", res.Usage.PromptTokens,
		"hint", "run the frontend (or serve) with --tokenizer engine --tokenizer-url <the engine's URL>, which tokenizes with the model's own tokenizer and chat template")
}

// comparablePrompt reports whether the engine's usage.prompt_tokens for
// req must equal kvbus's count of it when both tokenize alike. With
// --tokenizer engine the frontend's ids are the engine's own /tokenize
// answer for the same messages or prompt, chat template included, so any
// difference is a tokenizer mismatch. Not comparable: a request sent as
// token ids (the engine took kvbus's), several prompts (kvbus counts the
// first, the engine all), truncate_prompt_tokens, and content parts other
// than text (images, audio: their placeholder tokens).
func comparablePrompt(req EngineRequest) bool {
	if len(req.Body) == 0 || len(req.PromptTokens) == 0 {
		return false
	}
	var body struct {
		Messages []struct {
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
		Prompt   json.RawMessage `json:"prompt"`
		Truncate json.RawMessage `json:"truncate_prompt_tokens"`
	}
	if json.Unmarshal(req.Body, &body) != nil || len(body.Truncate) > 0 && string(body.Truncate) != "null" {
		return false
	}
	if req.Endpoint == messages.EndpointChat {
		for _, m := range body.Messages {
			var parts []struct {
				Type string `json:"type"`
			}
			if c := bytes.TrimSpace(m.Content); len(c) > 0 && c[0] == '[' {
				if json.Unmarshal(m.Content, &parts) != nil {
					return false
				}
				for _, p := range parts {
					if p.Type != "text" {
						return false
					}
				}
			}
		}
		return len(body.Messages) > 0
	}
	var prompts []json.RawMessage
	switch {
	case len(body.Prompt) == 0:
		return false
	case body.Prompt[0] == '"':
		return true
	case json.Unmarshal(body.Prompt, &prompts) != nil || len(prompts) == 0:
		return false
	}
	// One prompt: token ids, or a list of one string or one list of ids.
	first := bytes.TrimSpace(prompts[0])
	return len(prompts) == 1 || len(first) > 0 && first[0] != '"' && first[0] != '['
}

// run sends the call once.
func (e *OpenAIEngine) run(ctx context.Context, c *engineCall, prefilled func(), emit func(Chunk) error) (EngineResult, error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, e.base+c.path, bytes.NewReader(c.body))
	if err != nil {
		return EngineResult{}, err
	}
	h := hr.Header
	h.Set("Content-Type", "application/json")
	h.Set("X-Request-Id", c.req.ReqID)
	if c.req.SessionID != "" {
		h.Set("X-Session-ID", c.req.SessionID)
	}
	if c.stream {
		h.Set("Accept", "text/event-stream")
	}
	e.authorize(h)
	if !c.stream {
		// A model server answers a request that does not stream only at its
		// end, and says nothing of its prefill, a small part of that time:
		// the request leaves the group's prefill queue as it reaches the
		// engine, which schedules its prefill itself. Counted until the
		// whole answer, every prompt in flight made its group look busy for
		// its whole generation, and placement moved sessions off the engine
		// that held their cache.
		c.prefill(prefilled)
	}
	resp, err := e.client.Do(hr)
	if err != nil {
		if ctx.Err() != nil {
			return EngineResult{}, ctx.Err()
		}
		return EngineResult{}, fmt.Errorf("%w: POST %s: %v", ErrEngineUnavailable, c.path, err)
	}
	defer resp.Body.Close() // an abort cancels ctx, which closes the stream
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, maxEngineBody))
		ee := &EngineError{Status: resp.StatusCode, Body: body}
		if resp.StatusCode >= 500 {
			return EngineResult{}, fmt.Errorf("%w: POST %s: %w", ErrEngineUnavailable, c.path, ee)
		}
		return EngineResult{}, ee
	}
	if c.stream {
		return e.readStream(ctx, c, resp.Body, prefilled, emit)
	}
	return e.readAnswer(ctx, c, resp.Body, prefilled, emit)
}
