package frontend

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// ErrConfig is wrapped by configuration errors.
var ErrConfig = errors.New("frontend: bad configuration")

// Config configures a frontend.
type Config struct {
	// Conn is the frontend's NATS connection, owned by the caller.
	Conn     *nats.Conn
	Subjects messages.Subjects
	// ID names the frontend in subjects (kvbus.out.<id>); default "fe-…".
	ID string
	// Listener, if set, is served instead of listening on Addr.
	Listener net.Listener
	// Addr is the HTTP listen address (default ":8000").
	Addr string
	// Models are the served model names; the first is used when a request
	// names none.
	Models []string
	// SessionHeaders are read for a session id in order (default
	// X-Session-ID, X-Correlation-ID).
	SessionHeaders []string
	// MaxModelLen bounds prompt + completion tokens (default 8192).
	MaxModelLen int
	// MaxBodyBytes bounds a request body (default 4 MiB).
	MaxBodyBytes int64
	// Version is what /version answers (vLLM's route): the binary's
	// version; "" is "devel".
	Version string
	// MaxInflight bounds the generate requests served at once; more get a
	// 429 with Retry-After (0: no bound).
	MaxInflight int
	// APIKey, if set, is required on /v1/ routes as "Authorization: Bearer
	// <key>" (vLLM's --api-key); other requests get a 401. It is never
	// logged.
	APIKey string
	// AllowedOrigins are the origins browsers may call from (CORS), as
	// vLLM's --allowed-origins ("*": any); every method and requested header
	// is allowed, without credentials. None: no CORS headers.
	AllowedOrigins []string
	// RequestTimeout bounds a request end to end (default 60 s).
	RequestTimeout time.Duration
	// PublishTimeout bounds the wait for JetStream's ack (default 5 s).
	PublishTimeout time.Duration
	// StreamReplicas is the request log's replication factor (default 1).
	StreamReplicas int
	// RequestLogMaxBytes caps the request log (default 1 GiB); a full log
	// answers new requests with a 503 request_log_full instead of dropping
	// accepted ones. RequestLogMaxAge bounds how long requests are kept
	// (default 24 h) and RequestLogHistoryBytes how many bytes of dispatched
	// requests are kept for capture (default half the cap). They apply when
	// this frontend creates the log; an existing log keeps its limits.
	RequestLogMaxBytes     int64
	RequestLogMaxAge       time.Duration
	RequestLogHistoryBytes int64
	// ReadHeaderTimeout bounds reading a request's headers (default 10 s);
	// IdleTimeout closes a keep-alive connection idle that long (default
	// 120 s).
	ReadHeaderTimeout time.Duration
	IdleTimeout       time.Duration
	// StopGrace is how long, once Run's context ends and the requests it
	// had accepted are answered (within RequestTimeout), the frontend keeps
	// its listener open answering new requests with 503 shutting_down
	// (Connection: close) and /health with 503, so that clients on
	// keep-alive connections and load balancers learn of the stop, before
	// it closes the listener (default 500 ms; negative: none). Without it
	// a request sent on a kept-alive connection at that moment, such as
	// the next one of a client just answered, gets no answer at all.
	StopGrace time.Duration
	// ReusePort listens with SO_REUSEPORT (Linux), so that a replacement
	// frontend listens on the same address while this one still runs. Its
	// stop then differs: the listener closes at once (new connections go to
	// the other process) and the requests that still come on connections
	// already open are served, not refused, each answer with Connection:
	// close so that its client reconnects to the other; the stop waits for
	// them as for those accepted before it, and StopGrace after the last.
	// Replaced alone without it, a frontend's clients met 503s and then
	// refused connections for 2-3 s.
	ReusePort bool
	// StopTimeout, if positive, bounds the whole stop: the requests still
	// running when it has passed since Run's context ended get a 503
	// shutting_down (an error event for a stream already under way) and
	// the listener closes. 0: no bound but theirs (each within
	// RequestTimeout, so up to 2 × RequestTimeout + 1 s). An orchestrator
	// kills the process at the end of its grace period (Kubernetes: 30 s):
	// set it a few seconds below that, and clients get an error they retry
	// instead of a connection reset.
	StopTimeout time.Duration
	// ReadBodyTimeout bounds reading a generation request's body (default
	// 30 s): a client that stalls mid-body would otherwise hold its
	// connection and handler for as long as it keeps the connection open.
	// A body being read takes no MaxInflight slot.
	ReadBodyTimeout time.Duration
	// LostOutputWait: a request in flight when the frontend reconnects to
	// NATS that hears no output within it may have lost its answer on the
	// bus while the frontend was cut off: it is asked again, the first copy
	// to answer followed (or, once part of a stream was sent, it ends with
	// a 503 output_lost) (default 3 s).
	LostOutputWait time.Duration
	// SchedulerTimeout: the frontend is healthy, and takes requests, while
	// a ready scheduler announced itself within it (default 3 s).
	SchedulerTimeout time.Duration
	// Tokenizer; nil means the embedded o200k_base BPE tokenizer. A
	// RequestTokenizer (EngineTokenizer) tokenizes chat requests from their
	// body, tools and template arguments included.
	Tokenizer Tokenizer
	// Passthrough: the groups run real engines (--engine openai). Each
	// request's body goes to the engine as the client sent it, fields the
	// sim cannot honour included, and the client gets the engine's answer
	// as the engine wrote it.
	Passthrough bool
	Logger      *slog.Logger
	// Registry receives the frontend's metrics and is served on /metrics;
	// nil means a new registry.
	Registry *prometheus.Registry
}

// Validate checks the configuration's settings; New also needs Conn. It
// needs no connection, so a command line calls it before connecting (an
// empty ID passes: New picks one).
func (c *Config) Validate() error {
	switch {
	case len(c.Models) == 0 || c.Models[0] == "":
		return fmt.Errorf("%w: no served model (--model)", ErrConfig)
	case c.MaxModelLen < 2:
		return fmt.Errorf("%w: --max-model-len must be >= 2", ErrConfig)
	case c.MaxBodyBytes < 1:
		return fmt.Errorf("%w: --max-body-bytes must be positive", ErrConfig)
	case c.MaxInflight < 0:
		return fmt.Errorf("%w: --max-inflight must be >= 0", ErrConfig)
	case c.RequestLogMaxBytes < 0 || c.RequestLogMaxAge < 0 || c.RequestLogHistoryBytes < 0:
		return fmt.Errorf("%w: --request-log-max-bytes, --request-log-max-age and --request-log-history-bytes must be >= 0 (0: default)", ErrConfig)
	case c.RequestLogHistoryBytes > 0 && c.RequestLogHistoryBytes >= c.RequestLogMaxBytes && c.RequestLogMaxBytes > 0:
		return fmt.Errorf("%w: --request-log-history-bytes (%d) must be below --request-log-max-bytes (%d), or history alone fills the log",
			ErrConfig, c.RequestLogHistoryBytes, c.RequestLogMaxBytes)
	case c.ReadHeaderTimeout < 0 || c.IdleTimeout < 0 || c.ReadBodyTimeout < 0:
		return fmt.Errorf("%w: --read-header-timeout, --idle-timeout and the read-body timeout must be >= 0 (0: default)", ErrConfig)
	}
	if _, engineTok := c.Tokenizer.(RequestTokenizer); engineTok && c.Passthrough && len(c.Models) > 1 {
		// The engines' /tokenize and /v1/models are asked without a
		// model name, of whichever engine answers first: another model's
		// prompts would be tokenized by this one's engine, and a name only
		// the engines list would go on the bus under the first --model.
		return fmt.Errorf("%w: --model %q: a frontend with --engine openai and --tokenizer engine serves one --model: "+
			"its engines' /tokenize and /v1/models are asked without a model name, so one model's prompts would be tokenized "+
			"by another's engine and a name the engines list would go to the first model's groups; run one frontend per model, "+
			"each with --tokenizer-url of its own engines", ErrConfig, strings.Join(c.Models, ","))
	}
	for _, h := range c.SessionHeaders {
		if strings.TrimSpace(h) == "" || strings.ContainsAny(h, " :\t") {
			return fmt.Errorf("%w: --session-header %q is not a header name", ErrConfig, h)
		}
	}
	for _, o := range c.AllowedOrigins {
		if err := checkOrigin(o); err != nil {
			return fmt.Errorf("%w: --allowed-origins %q: %v", ErrConfig, o, err)
		}
	}
	if c.ID != "" {
		if err := messages.ValidateToken("frontend id", c.ID); err != nil {
			return fmt.Errorf("%w: --id: %v", ErrConfig, err)
		}
	}
	if c.Listener == nil && c.Addr != "" {
		if err := checkListenAddr(c.Addr); err != nil {
			return fmt.Errorf("%w: --http-addr %q: %v: give HOST:PORT, e.g. 0.0.0.0:8000 or :8000", ErrConfig, c.Addr, err)
		}
	}
	return c.Subjects.Validate()
}

// checkOrigin refuses an origin no browser sends, which matched no
// request (CORS silently off for it): a browser's Origin is
// scheme://host[:port], lower case, no path or trailing slash; "*" is
// any, "null" an opaque origin, "" none.
func checkOrigin(o string) error {
	if o == "" || o == "*" || o == "null" {
		return nil
	}
	u, err := url.Parse(o)
	if err != nil || u.Scheme == "" || u.Host == "" || u.Scheme+"://"+u.Host != o || strings.ToLower(o) != o {
		return errors.New("not an origin as browsers send it: give scheme://host[:port] in lower case with no path or trailing slash (https://app.example.com), * for any, or an empty value for none")
	}
	return nil
}

// checkListenAddr checks HOST:PORT without listening: net.Listen's own
// errors come only once a role has connected to NATS.
func checkListenAddr(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if _, err := net.LookupPort("tcp", port); err != nil {
		return fmt.Errorf("port %q: %w", port, err)
	}
	return nil
}

// RequestLog is the request log's configuration this frontend creates it
// with (zero fields take bus.EnsureRequestStream's defaults).
func (c *Config) RequestLog() bus.StreamConfig {
	return bus.StreamConfig{
		Subjects: c.Subjects, Replicas: c.StreamReplicas,
		MaxBytes: c.RequestLogMaxBytes, MaxAge: c.RequestLogMaxAge, HistoryBytes: c.RequestLogHistoryBytes,
	}
}

// DefaultRequestTimeout is Config.RequestTimeout's default.
const DefaultRequestTimeout = 60 * time.Second

// Server is an OpenAI-compatible HTTP frontend.
type Server struct {
	cfg     Config
	log     *slog.Logger
	tok     Tokenizer
	js      jetstream.JetStream
	m       *metrics
	vm      *vllmMetrics
	hm      *bus.HandlerMetrics
	mux     http.Handler
	created int64

	mu      sync.Mutex
	pending map[string]route // bus request id → where its outputs go

	ready    chan struct{}
	addr     net.Addr
	refusals refusalLog
	stopNow  chan struct{} // closed when StopTimeout has passed since the stop began
	active   atomic.Int64  // generate requests being served
	accepted atomic.Int64  // of those, the ones taken before the stop began
	draining atomic.Bool   // Run's context ended: new requests get a 503
	// reconnects is the connection's reconnect count watchReconnects last
	// saw, and reconnectedAt (unix ns) when it saw it change.
	reconnects    atomic.Uint64
	reconnectedAt atomic.Int64

	schedulers schedulerTable
	// engineModels: the engines' model list (--engine openai with
	// --tokenizer engine); nil otherwise.
	engineModels *engineModels
}

// route sends one bus request's outputs to the queue of its HTTP request.
type route struct {
	q      *outputQueue
	choice int
}

// New builds a frontend; Run serves it.
func New(cfg Config) (*Server, error) {
	if cfg.ID == "" {
		cfg.ID = "fe-" + nuid.Next()
	}
	if cfg.Addr == "" {
		cfg.Addr = ":8000"
	}
	if cfg.LostOutputWait <= 0 {
		cfg.LostOutputWait = 3 * time.Second
	}
	if cfg.SessionHeaders == nil {
		cfg.SessionHeaders = DefaultSessionHeaders()
	}
	if cfg.MaxModelLen == 0 {
		cfg.MaxModelLen = 8192
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = 4 << 20
	}
	if cfg.RequestTimeout <= 0 {
		cfg.RequestTimeout = DefaultRequestTimeout
	}
	if cfg.PublishTimeout <= 0 {
		cfg.PublishTimeout = 5 * time.Second
	}
	if cfg.ReadBodyTimeout == 0 {
		cfg.ReadBodyTimeout = 30 * time.Second
	}
	if cfg.Version == "" {
		cfg.Version = "devel"
	}
	if cfg.ReadHeaderTimeout == 0 {
		cfg.ReadHeaderTimeout = 10 * time.Second
	}
	if cfg.SchedulerTimeout <= 0 {
		cfg.SchedulerTimeout = 3 * time.Second
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = 120 * time.Second
	}
	if cfg.StopGrace == 0 {
		cfg.StopGrace = 500 * time.Millisecond
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	if cfg.Conn == nil {
		return nil, fmt.Errorf("%w: no NATS connection", ErrConfig)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tok := cfg.Tokenizer
	if tok == nil {
		var err error
		if tok, err = NewBPETokenizer(); err != nil {
			return nil, err
		}
	}
	js, err := jetstream.New(cfg.Conn)
	if err != nil {
		return nil, fmt.Errorf("frontend: jetstream: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	s := &Server{
		cfg: cfg, log: log.With("frontend_id", cfg.ID), tok: tok, js: js,
		hm:      bus.NewHandlerMetrics(cfg.Registry),
		created: time.Now().Unix(),
		pending: map[string]route{},
		ready:   make(chan struct{}),
		stopNow: make(chan struct{}),
	}
	s.schedulers.timeout = cfg.SchedulerTimeout
	if lister, ok := tok.(ModelLister); ok && cfg.Passthrough {
		s.engineModels = &engineModels{lister: lister, log: s.log}
	}
	s.refusals.log = s.log
	s.m = newMetrics(cfg.Registry, s.inflight)
	s.vm = newVLLMMetrics(cfg.Registry, vllmEngineIndex, cfg.Models)
	s.mux = s.routes()
	return s, nil
}

// ID returns the frontend's id.
func (s *Server) ID() string { return s.cfg.ID }

// Ready is closed once Run serves HTTP.
func (s *Server) Ready() <-chan struct{} { return s.ready }

// Addr is the address Run listens on; valid after Ready.
func (s *Server) Addr() net.Addr { return s.addr }

// Handler returns the HTTP handler (for tests and embedding).
func (s *Server) Handler() http.Handler { return s.mux }

func (s *Server) inflight() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return float64(len(s.pending))
}

// Run subscribes to the frontend's output subject, makes sure the request
// log exists, and serves HTTP until ctx ends; then it stops accepting
// connections and lets in-flight requests finish (bounded by their own
// timeouts).
func (s *Server) Run(ctx context.Context) error {
	ctx = bus.WithLogger(ctx, s.log)
	annSubject := s.cfg.Subjects.AnnounceRole(messages.RoleScheduler)
	// Another role's key is refused these subjects: say so now, naming the
	// key to give, rather than wait 30 s for JetStream or serve requests
	// that never find a scheduler.
	if err := bus.CheckPermissions(ctx, s.cfg.Conn, bus.RoleCheck{Role: "frontend",
		Subscribe: []string{s.cfg.Subjects.Out(s.cfg.ID), annSubject}}); err != nil {
		return err
	}
	setup, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	// The schedulers' consumer is theirs to make: it delivers the whole
	// log (DeliverAll), so a request logged before the first scheduler
	// started is not missed, and a frontend key may not touch it (auth).
	if _, err := bus.EnsureRequestStream(setup, s.js, s.cfg.RequestLog()); err != nil {
		return err
	}
	sub, err := bus.Subscribe(ctx, s.cfg.Conn, s.cfg.Subjects.Out(s.cfg.ID), bus.Wrap(s.onOutput, s.log, s.hm, "frontend_output"))
	if err != nil {
		return fmt.Errorf("frontend: subscribe: %w", err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	annSub, err := bus.Subscribe(ctx, s.cfg.Conn, annSubject, bus.Wrap(s.onAnnouncement, s.log, s.hm, "frontend_announcement"))
	if err != nil {
		return fmt.Errorf("frontend: subscribe %s: %w", annSubject, err)
	}
	defer func() { _ = annSub.Unsubscribe() }()
	s.schedulers.listen(time.Now())
	if err := s.cfg.Conn.Flush(); err != nil {
		s.log.Warn("flush after subscribe", "err", err)
	}

	ln := s.cfg.Listener
	if ln == nil {
		if ln, err = Listen(ctx, s.cfg.Addr, s.cfg.ReusePort); err != nil {
			return err
		}
	}
	s.addr = ln.Addr()
	srv := &http.Server{
		Handler:           s.leaveWhenDraining(s.mux),
		ReadHeaderTimeout: s.cfg.ReadHeaderTimeout,
		IdleTimeout:       s.cfg.IdleTimeout,
		// Go's own limit answers in plain text; kvbus checks MaxHeaderBytes
		// itself to answer in JSON, and leaves a margin here.
		MaxHeaderBytes: 4 * MaxHeaderBytes,
		ErrorLog:       httpErrorLog(s.log.Handler()),
	}
	// Until Run returns: requests are answered after ctx ends too.
	watchCtx, stopWatch := context.WithCancel(context.WithoutCancel(ctx))
	var watcher sync.WaitGroup
	watcher.Go(func() { s.watchReconnects(watchCtx) })
	defer func() { stopWatch(); watcher.Wait() }()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	s.log.Info("frontend listening", "addr", s.addr.String(), "models", s.cfg.Models, "tokenizer", s.tok.Name(),
		"session_headers", s.cfg.SessionHeaders)
	close(s.ready)
	select {
	case err := <-errc:
		return fmt.Errorf("frontend: serve: %w", err)
	case <-ctx.Done():
	}
	s.draining.Store(true)
	if s.cfg.ReusePort {
		// The other process takes the new connections; this one serves
		// the requests of those it has (see Config.ReusePort).
		_ = ln.Close()
		if err := <-errc; !errors.Is(err, net.ErrClosed) {
			return fmt.Errorf("frontend: serve: %w", err)
		}
		errc = nil
	}
	wait := s.cfg.RequestTimeout // for the requests in flight
	if s.cfg.StopTimeout > 0 {
		wait = min(wait, s.cfg.StopTimeout)
		stop := time.AfterFunc(s.cfg.StopTimeout, func() { close(s.stopNow) })
		defer stop.Stop()
	}
	if err := s.holdGrace(errc, wait); err != nil {
		return err
	}
	shutdown, cancel2 := context.WithTimeout(context.Background(), wait+time.Second)
	defer cancel2()
	if err := srv.Shutdown(shutdown); err != nil {
		s.log.Warn("http shutdown", "err", err)
		_ = srv.Close()
	}
	s.refusals.flush(true) // those counted since the last line
	s.log.Info("frontend stopped")
	return nil
}

// Listen listens on addr for the frontend's HTTP API; with reusePort, with
// SO_REUSEPORT set, so that another process of the same user listening so
// can share the address (the kernel spreads new connections over them): a
// replacement frontend starts before the one it replaces stops. Its errors
// name --http-addr.
func Listen(ctx context.Context, addr string, reusePort bool) (net.Listener, error) {
	lc, err := listenConfig(reusePort)
	if err != nil {
		return nil, err
	}
	ln, err := lc.Listen(ctx, "tcp", addr)
	switch {
	case errors.Is(err, syscall.EADDRINUSE) && reusePort:
		return nil, fmt.Errorf("frontend: listen on %s: %w (is another kvbus running? a frontend can share the address only if both were started with --reuse-port; or choose another --http-addr)", addr, err)
	case errors.Is(err, syscall.EADDRINUSE):
		return nil, fmt.Errorf("frontend: listen on %s: %w (is another kvbus running? stop it, or choose another --http-addr)", addr, err)
	case err != nil:
		return nil, fmt.Errorf("frontend: listen on %s: %w (--http-addr takes HOST:PORT, e.g. 0.0.0.0:8000)", addr, err)
	}
	return ln, nil
}

// leaveWhenDraining, with ReusePort, answers every request of a stopping
// frontend with Connection: close: its client reconnects, to the process
// that took over the listening address.
func (s *Server) leaveWhenDraining(h http.Handler) http.Handler {
	if !s.cfg.ReusePort {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.draining.Load() {
			w.Header().Set("Connection", "close")
		}
		h.ServeHTTP(w, r)
	})
}

// holdGrace keeps the listener open, new requests answered with 503, until
// the accepted requests are answered (within wait) and then for
// StopGrace: a client answered during the stop sends its next request on
// its kept-alive connection, and gets the 503 rather than a connection
// closed under it.
func (s *Server) holdGrace(errc <-chan error, wait time.Duration) error {
	if s.cfg.StopGrace <= 0 {
		return nil
	}
	deadline := time.Now().Add(wait)
	quiet := time.Now() // since when no accepted request is in flight
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for time.Since(quiet) < s.cfg.StopGrace && time.Now().Before(deadline) {
		select {
		case <-tick.C:
		case err := <-errc:
			return fmt.Errorf("frontend: serve: %w", err)
		}
		if s.accepted.Load() > 0 {
			quiet = time.Now()
		}
	}
	return nil
}

func (s *Server) onOutput(_ context.Context, m *nats.Msg) error {
	out, err := messages.DecodeOutput(m.Data)
	if err != nil {
		return err
	}
	s.mu.Lock()
	rt, ok := s.pending[out.ReqID]
	s.mu.Unlock()
	if ok {
		rt.q.push(rt.choice, out)
	}
	return nil
}

func (s *Server) register(busID string, q *outputQueue, choice int) {
	s.mu.Lock()
	s.pending[busID] = route{q: q, choice: choice}
	s.mu.Unlock()
}

func (s *Server) unregister(ids []string) {
	s.mu.Lock()
	for _, id := range ids {
		delete(s.pending, id)
	}
	s.mu.Unlock()
}

// MaxHeaderBytes bounds the headers of a request (431 above).
const MaxHeaderBytes = 64 << 10

func headerBytes(h http.Header) int {
	n := 0
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}

// routes builds the HTTP routes. Unknown paths and wrong methods get OpenAI
// error bodies.
func (s *Server) routes() http.Handler {
	type route struct {
		method string // GET routes answer HEAD too
		h      http.HandlerFunc
		also   string // a second method, or ""
	}
	table := map[string]route{
		"/v1/chat/completions": {method: http.MethodPost, h: func(w http.ResponseWriter, r *http.Request) { s.serveGenerate(w, r, messages.EndpointChat) }},
		"/v1/completions":      {method: http.MethodPost, h: func(w http.ResponseWriter, r *http.Request) { s.serveGenerate(w, r, messages.EndpointCompletions) }},
		"/v1/models":           {method: http.MethodGet, h: s.serveModels},
		"/tokenize":            {method: http.MethodPost, h: s.serveTokenize},
		"/detokenize":          {method: http.MethodPost, h: s.serveDetokenize},
		"/health":              {method: http.MethodGet, h: s.serveHealth},
		// vLLM's SageMaker probe: /health's answer, to GET and POST.
		"/ping":    {method: http.MethodGet, h: s.serveHealth, also: http.MethodPost},
		"/version": {method: http.MethodGet, h: s.serveVersion},
		"/healthz": {method: http.MethodGet, h: s.serveHealthz},
		"/livez":   {method: http.MethodGet, h: s.serveLivez},
		"/metrics": {method: http.MethodGet, h: promhttp.HandlerFor(s.cfg.Registry, promhttp.HandlerOpts{}).ServeHTTP},
	}
	cors := newCORS(s.cfg.AllowedOrigins)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if cors.handle(w, r) {
			return
		}
		// A generate route's refusal here carries X-Request-Id as its
		// other responses do (generate sets it on those).
		refuse := func(e *APIError) {
			if r.URL.Path == "/v1/chat/completions" || r.URL.Path == "/v1/completions" {
				id, err := requestID(r.Header)
				if err != nil || id == "" {
					id = nuid.Next()
				}
				w.Header().Set("X-Request-Id", id)
			}
			writeError(w, e)
		}
		if n := headerBytes(r.Header); n > MaxHeaderBytes {
			refuse(&APIError{Status: http.StatusRequestHeaderFieldsTooLarge, Type: typeInvalidRequest, Code: "headers_too_large",
				Message: fmt.Sprintf("request headers are %d bytes; at most %d are accepted", n, MaxHeaderBytes)})
			return
		}
		if s.cfg.APIKey != "" && strings.HasPrefix(r.URL.Path, "/v1/") && !s.authorized(r) {
			e := &APIError{Status: http.StatusUnauthorized, Type: typeAuthentication, Code: "invalid_api_key",
				Message: "missing or wrong API key: send Authorization: Bearer <key>"}
			refuse(e)
			// Counted and logged as every refusal is (never the header's
			// value): a client with a wrong key showed nowhere.
			s.refusals.note(time.Now(), &APIError{Status: e.Status, Type: e.Type, Code: e.Code,
				Message: fmt.Sprintf("%s %s: %s", r.Method, r.URL.Path, e.Message)})
			switch r.URL.Path {
			case "/v1/chat/completions":
				s.m.requests.WithLabelValues(messages.EndpointChat, "401", "").Inc()
			case "/v1/completions":
				s.m.requests.WithLabelValues(messages.EndpointCompletions, "401", "").Inc()
			}
			return
		}
		rt, ok := table[r.URL.Path]
		if !ok && strings.HasPrefix(r.URL.Path, "/v1/models/") {
			rt, ok = route{method: http.MethodGet, h: s.serveModel}, true
		}
		if !ok {
			writeError(w, &APIError{Status: http.StatusNotFound, Type: typeNotFound, Code: "not_found",
				Message: fmt.Sprintf("no route %s %s; see /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize", r.Method, r.URL.Path)})
			return
		}
		if r.Method != rt.method && r.Method != rt.also && !(rt.method == http.MethodGet && r.Method == http.MethodHead) {
			w.Header().Set("Allow", strings.TrimSuffix(rt.method+", "+rt.also, ", "))
			refuse(&APIError{Status: http.StatusMethodNotAllowed, Type: typeInvalidRequest, Code: "method_not_allowed",
				Message: fmt.Sprintf("%s does not allow %s; use %s", r.URL.Path, r.Method, rt.method)})
			return
		}
		rt.h(w, r)
	})
}

// authorized checks the Bearer token in constant time.
func (s *Server) authorized(r *http.Request) bool {
	token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(strings.TrimSpace(token)), []byte(s.cfg.APIKey)) == 1
}

// servedModels is what GET /v1/models lists: with engines behind the
// frontend, the engines' own entries (their ids, their max_model_len), then
// kvbus's --model names they do not list (the workers' --engine-model maps
// those); without, the --model names.
func (s *Server) servedModels(ctx context.Context) []any {
	type model struct {
		ID          string `json:"id"`
		Object      string `json:"object"`
		Created     int64  `json:"created"`
		OwnedBy     string `json:"owned_by"`
		Root        string `json:"root"`
		MaxModelLen int    `json:"max_model_len"`
	}
	engine, ids := s.engineModels.list(ctx, engineModelsTTL)
	var data []any
	for _, raw := range engine {
		data = append(data, raw)
	}
	for _, m := range s.cfg.Models {
		if !ids[m] {
			data = append(data, model{ID: m, Object: "model", Created: s.created, OwnedBy: "kvbus", Root: m, MaxModelLen: s.cfg.MaxModelLen})
		}
	}
	return data
}

func (s *Server) serveModels(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, struct {
		Object string `json:"object"`
		Data   []any  `json:"data"`
	}{"list", s.servedModels(r.Context())})
}

// serveModel answers GET /v1/models/{model} (OpenAI's retrieve, which the
// SDKs' Models.Get calls; vLLM has no such route): the entry the list
// has for that id, whose slashes are part of it
// (/v1/models/meta-llama/Llama-3.1-8B), or 404 model_not_found.
func (s *Server) serveModel(w http.ResponseWriter, r *http.Request) {
	id := strings.TrimPrefix(r.URL.Path, "/v1/models/")
	var ids []string
	for _, m := range s.servedModels(r.Context()) {
		entry, _ := json.Marshal(m) // an engine's entry is JSON already
		var named struct {
			ID string `json:"id"`
		}
		if json.Unmarshal(entry, &named) != nil {
			continue
		}
		if named.ID == id {
			writeJSON(w, http.StatusOK, json.RawMessage(entry))
			return
		}
		ids = append(ids, named.ID)
	}
	writeError(w, &APIError{Status: http.StatusNotFound, Type: typeNotFound, Param: "model", Code: "model_not_found",
		Message: fmt.Sprintf("The model `%s` does not exist. Served models: %s.", id, strings.Join(ids, ", "))})
}

// writeJSON writes v as JSON, its <, > and & as they are (as vLLM's
// FastAPI answers write them: a chat marker such as <|im_start|> reads as
// itself, not \u003c|im_start|\u003e).
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
}
