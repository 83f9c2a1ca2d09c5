package workers

import (
	"bufio"
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

// Healthy reports whether the engine takes requests, and why not.
func (e *OpenAIEngine) Healthy() (bool, string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.healthy, e.why
}

// setHealth records a health change and reports whether it was one.
func (e *OpenAIEngine) setHealth(ok bool, why string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.setHealthLocked(ok, why)
}

// setPolled records the result of a health poll that began when the
// health's change channel was since. It reports whether the poll changed
// the health, and returns the channel that the next change closes. A poll
// that overlapped a change (a request that found the engine down) is stale
// and dropped, since returned closed: it would undo what the request saw.
func (e *OpenAIEngine) setPolled(since chan struct{}, ok bool, why string) (bool, chan struct{}) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.changed != since {
		return false, since
	}
	return e.setHealthLocked(ok, why), e.changed
}

func (e *OpenAIEngine) setHealthLocked(ok bool, why string) bool {
	if e.healthy == ok {
		e.why = why
		return false
	}
	e.healthy, e.why = ok, why
	close(e.changed)
	e.changed = make(chan struct{})
	if ok {
		e.log.Info("engine healthy: the group takes requests")
	} else {
		e.log.Warn("engine not healthy: the group takes no requests", "reason", why)
	}
	return true
}

// WatchHealth polls GET /health every HealthInterval until ctx ends and
// calls changed (if not nil) after each change of health, also when a
// request found the engine down. Only a poll makes the engine healthy
// again: a request's failure is followed by the next regular poll, not by
// one at once, so that health cannot flip as fast as requests fail. A
// healthy engine is marked not healthy by engineHealthFailures failed
// polls in a row (a slow or failed /health under load would otherwise move
// every request not yet answered), or by one that could not connect at all.
func (e *OpenAIEngine) WatchHealth(ctx context.Context, changed func()) {
	e.WatchHealthAndRestarts(ctx, changed, nil)
}

// WatchHealthAndRestarts is WatchHealth that also tells restarted (if not
// nil) when the engine restarted, by the rules of restartRules: before the
// poll that found it changes the health, so a rank clears the engine's
// blocks before it heartbeats ready again.
func (e *OpenAIEngine) WatchHealthAndRestarts(ctx context.Context, changed func(), restarted func(EngineRestart)) {
	t := time.NewTicker(e.cfg.HealthInterval)
	defer t.Stop()
	fails := 0 // polls failed in a row
	rules := newRestartRules()
	for poll := true; ; {
		e.mu.Lock()
		ch, healthy := e.changed, e.healthy
		e.mu.Unlock()
		if poll {
			at := time.Now()
			ok, why, gone := e.checkHealth(ctx)
			if ctx.Err() != nil {
				return
			}
			if e.requestFoundGone.Swap(false) {
				rules.requestFoundGone()
			}
			if ok {
				fails = 0
				var start float64
				read := rules.wantIdentity()
				if read {
					start = e.startTime(ctx)
					if ctx.Err() != nil {
						return
					}
				}
				if rs, restart := rules.pollPassed(at, read, start); restart && restarted != nil {
					restarted(rs)
				}
			} else {
				fails++
				rules.pollFailed(gone)
			}
			switch {
			case !ok && healthy && !gone && fails < engineHealthFailures:
				e.log.Info("engine /health failed: the group stays ready unless it fails again",
					"reason", why, "failed_polls", fails, "of", engineHealthFailures)
			default:
				if !ok && fails >= engineHealthFailures {
					why = fmt.Sprintf("%s (%d polls in a row)", why, fails)
				}
				var moved bool
				if moved, ch = e.setPolled(ch, ok, why); moved && changed != nil {
					changed()
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			poll = true
		case <-ch: // a request found the engine down: tell the cluster now
			poll = false
			if changed != nil {
				changed()
			}
		}
	}
}

// checkHealth asks GET /health, within HealthTimeout. gone reports a
// failure to connect at all (refused, no such host): the engine is not
// there, as opposed to slow or answering an error.
func (e *OpenAIEngine) checkHealth(ctx context.Context) (ok bool, why string, gone bool) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.HealthTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.base+"/health", nil)
	if err != nil {
		return false, err.Error(), true
	}
	e.authorize(req.Header)
	resp, err := e.client.Do(req)
	if err != nil {
		var op *net.OpError
		gone := errors.As(err, &op) && op.Op == "dial" && !op.Timeout()
		return false, fmt.Sprintf("GET /health: %v", err), gone
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return false, fmt.Sprintf("GET /health answered %d", resp.StatusCode), false
	}
	return true, "", false
}

// awaitHealthy waits until the engine is healthy, or ctx ends, or
// UnavailableWait has passed since *down: when the request first found the
// engine down, which is set now if it is zero and the engine is down.
// failure is how the request's last attempt failed ("" before the first).
func (e *OpenAIEngine) awaitHealthy(ctx context.Context, down *time.Time, failure string) error {
	for {
		e.mu.Lock()
		ok, why, ch := e.healthy, e.why, e.changed
		e.mu.Unlock()
		if ok {
			return nil
		}
		if down.IsZero() {
			*down = time.Now()
		}
		left := e.cfg.UnavailableWait - time.Since(*down)
		if left <= 0 {
			if failure != "" && !strings.Contains(why, failure) {
				why = failure + "; " + why
			}
			return fmt.Errorf("%w: %s; it did not recover within %s, and no other worker group took the request",
				ErrEngineUnavailable, why, e.cfg.UnavailableWait)
		}
		timer := time.NewTimer(left)
		select {
		case <-ctx.Done():
			timer.Stop()
			return ctx.Err()
		case <-ch:
			timer.Stop()
		case <-timer.C:
		}
	}
}

func (e *OpenAIEngine) authorize(h http.Header) {
	if e.cfg.APIKey != "" {
		h.Set("Authorization", "Bearer "+e.cfg.APIKey)
	}
}

// Generate implements Engine: it runs req on the engine, emitting each
// streamed chunk (or the whole answer) as the engine sent it. prefilled is
// called with the first chunk.
//
// A request the engine did not take (unreachable, a 5xx, a stream that
// ended before any output) asks /health whether the engine is down:
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
func (e *OpenAIEngine) Generate(ctx context.Context, req EngineRequest, prefilled func(), emit func(Chunk) error) (EngineResult, error) {
	select {
	case e.slots <- struct{}{}:
	case <-ctx.Done():
		return EngineResult{}, ctx.Err()
	}
	defer func() { <-e.slots }()
	if e.cfg.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, e.cfg.Timeout)
		defer cancel()
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

// engineCall is one request as sent to the engine.
type engineCall struct {
	req       EngineRequest
	path      string
	body      []byte
	stream    bool
	wantUsage bool // the client asked for usage in the stream
	started   bool // output reached emit
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

// clientBody is the client's body with the session id, the engine's model
// name and, when streaming, usage in the stream: every other field goes
// to the engine as the client sent it.
func clientBody(req EngineRequest, model string) (body []byte, stream, wantUsage bool, err error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(req.Body, &fields); err != nil || fields == nil {
		return nil, false, false, fmt.Errorf("client body is not a JSON object: %v", err)
	}
	set := func(k string, v any) {
		b, _ := json.Marshal(v)
		fields[k] = b
	}
	if model != "" {
		set("model", model)
	}
	// vllm_xargs.session_id is where vLLM's Mooncake connector reads the
	// session (it lands in sampling_params.extra_args); the frontend
	// resolved it by the session rules, so it replaces the client's.
	xargs := map[string]json.RawMessage{}
	if raw, ok := fields["vllm_xargs"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &xargs); err != nil {
			return nil, false, false, fmt.Errorf("vllm_xargs is not an object: %v", err)
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
				return nil, false, false, fmt.Errorf("stream_options is not an object: %v", err)
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
	if p.MinTokens > 0 {
		body["min_tokens"] = p.MinTokens
	}
	if p.Seed != nil {
		body["seed"] = *p.Seed
	}
	if len(p.Stop) > 0 {
		body["stop"] = p.Stop
	}
	if p.IgnoreEOS {
		body["ignore_eos"] = true
	}
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
	return json.Marshal(body)
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
	if prefilled != nil {
		prefilled()
	}
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
	for sc.Scan() {
		line := sc.Bytes()
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue // blank lines, comments, event: and id: fields
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			return res, nil
		}
		var a engineAnswer
		if err := json.Unmarshal(data, &a); err != nil {
			return res, fmt.Errorf("workers: engine stream chunk is not JSON: %w", err)
		}
		if len(a.Error) > 0 && string(a.Error) != "null" {
			// vLLM reports an error inside a started stream as a data chunk
			// {"error": {...}} (serving_engine.py create_streaming_error_response).
			return res, &EngineError{Status: http.StatusInternalServerError, Body: bytes.Clone(data)}
		}
		text := a.apply(&res)
		if !c.started {
			c.started = true
			if prefilled != nil {
				prefilled()
			}
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
	if err == nil {
		err = io.ErrUnexpectedEOF
	}
	if !c.started {
		return res, fmt.Errorf("%w: stream ended before any output: %v", ErrEngineUnavailable, err)
	}
	return res, fmt.Errorf("workers: the engine's stream broke off: %w", err)
}
