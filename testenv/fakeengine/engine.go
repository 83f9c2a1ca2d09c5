package fakeengine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// maxBodyBytes bounds a request body.
const maxBodyBytes = 64 << 20

// Engine is a fake vLLM OpenAI-compatible server with a prefix cache and,
// optionally, vLLM's KV event publisher. Its methods are safe for
// concurrent use. Close it when done.
type Engine struct {
	cfg Config // with defaults
	srv *http.Server
	url string
	pub *publisher // nil without KV events

	healthy  atomic.Bool
	started  time.Time       // when New started it: its /metrics process_start_time_seconds
	ctx      context.Context // ends at Close: in-flight requests stop
	cancel   context.CancelFunc
	handlers sync.WaitGroup
	serveErr chan error
	closed   sync.Once

	// mu guards the cache, the requests and the publisher's sequence:
	// a request's admission and its batch are atomic, so batches go out
	// in the order of the cache's changes.
	mu       sync.Mutex
	cache    *prefixCache
	requests []Received // the last MaxRecorded or fewer
	first    int        // the number (from 0) of requests[0] among all received
}

// Received is a request the Engine received, for assertions.
type Received struct {
	// Time is when it arrived.
	Time   time.Time
	Method string
	Path   string
	// Header are its headers (X-Session-ID, X-Request-Id,
	// Authorization, ...).
	Header http.Header
	// Body is its JSON body, decoded (nil if it has none or is not
	// JSON); RawBody is the body as received. Body, RawBody, VLLMXArgs
	// and KVTransferParams are shared by every copy Requests returns:
	// read them, do not modify them.
	Body    map[string]any
	RawBody []byte
	// Model, Stream, VLLMXArgs and KVTransferParams are the body's
	// fields of those names, when present.
	Model            string
	Stream           bool
	VLLMXArgs        map[string]any
	KVTransferParams map[string]any
	// Status is the HTTP status the Engine answered (0 while it has not).
	Status int
	// PromptTokens are the tokens a completion request prefilled, and
	// CachedTokens how many of them the cache held (0 for other
	// requests).
	PromptTokens []uint32
	CachedTokens int
}

// New starts an Engine for cfg, which it validates: an HTTP server on
// 127.0.0.1 at an ephemeral port (see URL) and, if configured, the KV event
// publisher. The engine starts healthy.
func New(cfg Config) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	e := &Engine{cfg: cfg, cache: newPrefixCache(cfg.BlockSize, cfg.CacheBlocks), serveErr: make(chan error, 1), started: time.Now()}
	e.healthy.Store(true)
	e.ctx, e.cancel = context.WithCancel(context.Background())
	if cfg.KVEvents != nil {
		p, err := newPublisher(cfg.KVEvents, cfg.HashBytes)
		if err != nil {
			e.cancel()
			return nil, err
		}
		e.pub = p
	}
	addr := cfg.Addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		e.cancel()
		if e.pub != nil {
			e.pub.close()
		}
		return nil, fmt.Errorf("fakeengine: listen: %w", err)
	}
	e.url = "http://" + ln.Addr().String()
	e.srv = &http.Server{
		Handler:           e.routes(),
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return e.ctx },
	}
	go func() { e.serveErr <- e.srv.Serve(ln) }()
	return e, nil
}

// URL returns the server's base URL, "http://127.0.0.1:port" by default
// (the OpenAI base URL is URL()+"/v1").
func (e *Engine) URL() string { return e.url }

// ModelName returns the served model name.
func (e *Engine) ModelName() string { return e.cfg.ModelName }

// Close stops the server, ending requests in flight, waits for its
// handlers and closes the KV event sockets. It may be called more than
// once.
func (e *Engine) Close() error {
	var err error
	e.closed.Do(func() {
		e.cancel()
		err = e.srv.Close()
		if serr := <-e.serveErr; !errors.Is(serr, http.ErrServerClosed) && err == nil {
			err = serr
		}
		e.handlers.Wait()
		if e.pub != nil {
			e.pub.close()
		}
	})
	return err
}

// SetHealthy makes the engine healthy or dead: a dead engine answers
// /health with 503 and completion requests with vLLM's 500 for a dead
// engine core (EngineDeadError); /tokenize and /v1/models still work, as
// they do not reach the engine core.
func (e *Engine) SetHealthy(ok bool) { e.healthy.Store(ok) }

// Requests returns the requests received so far, oldest first (the last
// Config.MaxRecorded of them).
func (e *Engine) Requests() []Received {
	out, _ := e.RequestsSince(0)
	return out
}

// RequestsSince returns the requests received since the n-th (from 0),
// oldest first, of those still kept, and the number to ask from next time.
func (e *Engine) RequestsSince(n int) ([]Received, int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	from := min(max(n-e.first, 0), len(e.requests))
	out := make([]Received, 0, len(e.requests)-from)
	for _, r := range e.requests[from:] {
		r.Header = r.Header.Clone()
		r.PromptTokens = slices.Clone(r.PromptTokens)
		out = append(out, r)
	}
	return out, e.first + len(e.requests)
}

// CachedBlocks returns the number of blocks in the cache.
func (e *Engine) CachedBlocks() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cache.len()
}

// CachedPrefix returns how many leading tokens of tokens the cache holds
// in full blocks, without touching them.
func (e *Engine) CachedPrefix(tokens []uint32) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cache.lookup(tokens) * e.cfg.BlockSize
}

// Reset empties the cache and publishes AllBlocksCleared, as vLLM's
// reset_prefix_cache (also served at POST /reset_prefix_cache).
func (e *Engine) Reset() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.cache.reset()
	if e.pub == nil {
		return nil
	}
	return e.pub.send([]kvEvent{{tag: tagAllBlocksCleared}})
}

// SkipSeq advances the KV event sequence by n without publishing, so that
// subscribers see a gap of n batches (a test knob). Without KV events it
// does nothing.
func (e *Engine) SkipSeq(n uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.pub != nil {
		e.pub.seq += n
	}
}

// DropNext makes the next n KV event batches be numbered and kept for
// replay but not sent, as when vLLM's PUB socket drops batches for a slow
// subscriber past its high-water mark: a subscriber sees a gap that replay
// can fill (a test knob). Without KV events it does nothing.
func (e *Engine) DropNext(n int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.pub != nil {
		e.pub.drop += n
	}
}

// LoseNext makes the next n KV event batches vanish: not numbered, kept
// for replay nor sent, so that the blocks they stored are announced by no
// event and no gap shows it (an engine whose event stream is wrong; a test
// knob). Without KV events it does nothing.
func (e *Engine) LoseNext(n int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.pub != nil {
		e.pub.lose += n
	}
}

// NextSeq returns the sequence number of the next KV event batch.
func (e *Engine) NextSeq() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.pub == nil {
		return 0
	}
	return e.pub.seq
}

// KVEventsAddr returns the KV event PUB socket's address,
// "tcp://127.0.0.1:port" once bound (the endpoint for ipc, or when it
// connects); "" without KV events.
func (e *Engine) KVEventsAddr() string {
	if e.pub == nil {
		return ""
	}
	return e.pub.addr
}

// ReplayAddr returns the replay ROUTER socket's address, "" without one.
func (e *Engine) ReplayAddr() string {
	if e.pub == nil {
		return ""
	}
	return e.pub.raddr
}

// WaitSubscribed waits until a subscription matching the topic has reached
// the KV event PUB socket, after which no batch is dropped for that
// subscriber (a PUB drops what it sends before: ZeroMQ's slow joiner).
func (e *Engine) WaitSubscribed(ctx context.Context) error {
	if e.pub == nil {
		return fmt.Errorf("fakeengine: no KV events configured")
	}
	for !e.pub.subscribed() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("fakeengine: waiting for a KV event subscriber: %w", ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// handleMetrics answers GET /metrics, as vLLM serves its own, in the
// Prometheus text format: the HTTP requests received and the blocks its
// prefix cache holds; enough for a scrape (docker-compose.engine.yml's
// Prometheus job "engine") to succeed. process_start_time_seconds is when
// New started the Engine, as vLLM's (prometheus_client's process
// collector) is its process's start: an Engine made again at the same
// address is a restarted engine, and kvbus tells it by this series.
func (e *Engine) handleMetrics(w http.ResponseWriter, _ *http.Request) {
	e.mu.Lock()
	received := e.first + len(e.requests)
	e.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = fmt.Fprintf(w, "# HELP fakeengine_http_requests_total HTTP requests received.\n# TYPE fakeengine_http_requests_total counter\nfakeengine_http_requests_total %d\n"+
		"# HELP fakeengine_cached_blocks Blocks the prefix cache holds.\n# TYPE fakeengine_cached_blocks gauge\nfakeengine_cached_blocks %d\n",
		received, e.CachedBlocks())
	_, _ = fmt.Fprintf(w, "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds %s\n",
		strconv.FormatFloat(float64(e.started.UnixMicro())/1e6, 'f', -1, 64))
}

// StartedAt returns when New started the Engine (its /metrics
// process_start_time_seconds).
func (e *Engine) StartedAt() time.Time { return e.started }

// routes returns the Engine's HTTP handler.
func (e *Engine) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", e.handleChat)
	mux.HandleFunc("POST /v1/completions", e.handleCompletions)
	mux.HandleFunc("POST /tokenize", e.handleTokenize)
	mux.HandleFunc("GET /health", e.handleHealth)
	mux.HandleFunc("GET /v1/models", e.handleModels)
	mux.HandleFunc("POST /reset_prefix_cache", e.handleReset)
	mux.HandleFunc("GET /metrics", e.handleMetrics)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		// FastAPI's answer to an unknown path.
		writeJSON(w, http.StatusNotFound, map[string]string{"detail": "Not Found"})
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.handlers.Add(1)
		defer e.handlers.Done()
		idx, body := e.record(r)
		r = r.WithContext(context.WithValue(r.Context(), receivedKey{}, idx))
		r.Body = io.NopCloser(bytes.NewReader(body))
		sw := &statusWriter{ResponseWriter: w, set: func(code int) { e.setStatus(idx, code) }}
		// vLLM's AuthenticationMiddleware (vllm/entrypoints/openai/
		// server_utils.py): only paths under /v1, and its answer is not
		// the usual error shape.
		if e.cfg.APIKey != "" && r.Method != http.MethodOptions &&
			strings.HasPrefix(r.URL.Path, "/v1") && !e.authorized(r.Header) {
			writeJSON(sw, http.StatusUnauthorized, map[string]string{"error": "Unauthorized"})
			return
		}
		mux.ServeHTTP(sw, r)
	})
}

// authorized checks the bearer token as vLLM's verify_token: the scheme
// is case-insensitive, the token is everything after the first space.
func (e *Engine) authorized(h http.Header) bool {
	scheme, token, _ := strings.Cut(h.Get("Authorization"), " ")
	return strings.EqualFold(scheme, "bearer") && token == e.cfg.APIKey
}

// record appends a Received for r and returns its index and r's body.
func (e *Engine) record(r *http.Request) (int, []byte) {
	body, _ := io.ReadAll(io.LimitReader(r.Body, maxBodyBytes))
	rec := Received{Time: time.Now(), Method: r.Method, Path: r.URL.Path, Header: r.Header.Clone(), RawBody: body}
	if len(body) > 0 && json.Unmarshal(body, &rec.Body) == nil {
		rec.Model, _ = rec.Body["model"].(string)
		rec.Stream, _ = rec.Body["stream"].(bool)
		rec.VLLMXArgs, _ = rec.Body["vllm_xargs"].(map[string]any)
		rec.KVTransferParams, _ = rec.Body["kv_transfer_params"].(map[string]any)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.requests) >= e.cfg.MaxRecorded { // forget the older half: amortized O(1)
		drop := len(e.requests) - e.cfg.MaxRecorded/2
		e.requests = append(e.requests[:0:0], e.requests[drop:]...)
		e.first += drop
	}
	e.requests = append(e.requests, rec)
	return e.first + len(e.requests) - 1, body
}

func (e *Engine) setStatus(idx, code int) {
	e.mu.Lock()
	if i := idx - e.first; i >= 0 { // else forgotten already
		e.requests[i].Status = code
	}
	e.mu.Unlock()
}

// statusWriter reports the status written, once.
type statusWriter struct {
	http.ResponseWriter
	set  func(int)
	done bool
}

func (w *statusWriter) WriteHeader(code int) {
	if !w.done {
		w.done = true
		w.set(code)
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if !w.done {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// sleep waits d, or until the request or the Engine ends (false).
func (e *Engine) sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		code = http.StatusInternalServerError
		b = []byte(`{"error":{"message":"fakeengine: cannot encode the response","type":"InternalServerError","param":null,"code":500}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(b)
}
