// Command kvbus runs the roles of kvbus, an LLM-serving request pipeline over
// NATS: serve (everything in one process), nats, frontend, scheduler and
// worker. Every flag has a KVBUS_* environment twin.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/alecthomas/kong"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/workers"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

type cli struct {
	Serve     serveCmd       `cmd:"" help:"Run everything in one process: embedded NATS, frontend, one scheduler, --groups groups of --ranks ranks."`
	NATS      natsCmd        `cmd:"" name:"nats" help:"Run the embedded nats-server alone, with JetStream."`
	Frontend  frontendCmd    `cmd:"" help:"Run the OpenAI-compatible HTTP frontend."`
	Scheduler schedulerCmd   `cmd:"" help:"Run a scheduler replica."`
	Worker    workerCmd      `cmd:"" help:"Run one rank of a worker group."`
	Capture   captureCmd     `cmd:"" help:"Copy requests from the bus into a capture file, or summarise one."`
	Replay    replayCmd      `cmd:"" help:"Replay a capture file or a trace (Mooncake, TraceLab, Azure) onto the bus or a frontend and report."`
	Tap       tapCmd         `cmd:"" help:"Print bus messages live, decoded to JSON, one per line (with kvbus auth keys: the observer key)."`
	Bench     benchCmd       `cmd:"" help:"Replay one trace on an embedded cluster per placement policy and compare them side by side."`
	Health    healthcheckCmd `cmd:"" name:"healthcheck" help:"Exit 0 when a role's /healthz answers 200 (for container health checks)."`
	Auth      authCmd        `cmd:"" help:"Give every role its own NATS key and only the subjects it needs (init, show, probe)."`
	Report    reportCmd      `cmd:"" help:"Redraw the HTML plots of a JSON report (kvbus report --html out.html report.json)."`
	Loadgen   loadgenCmd     `cmd:"" help:"Drive an OpenAI-compatible server over HTTP with concurrent clients and print req/s and latency percentiles."`
	Top       topCmd         `cmd:"" help:"Watch the cluster live from the bus: groups, queues, cache hits, TTFT, busiest sessions (with kvbus auth keys: the observer key)."`
}

func main() {
	// The first SIGINT/SIGTERM stops the command gracefully, the second at
	// once (see watchSignals).
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	// Every role logs through one sink: a line costs its formatting, and
	// one goroutine writes them out in batches.
	sink, err := logsink.New(logsink.Config{Out: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvbus:", err)
		os.Exit(1)
	}
	notice := &stopNotice{out: sink}
	ctx, cancel := context.WithCancel(withStopNotice(context.Background(), notice))
	defer cancel()
	go watchSignals(sigs, notice, cancel, func(code int) {
		// What is logged is written out first, within a second.
		flushed := make(chan struct{})
		go func() { _ = sink.Close(); close(flushed) }()
		select {
		case <-flushed:
		case <-time.After(time.Second):
		}
		os.Exit(code)
	})
	var c cli
	kctx := kong.Parse(&c,
		kong.Bind(sink),
		kong.BindTo(ctx, (*context.Context)(nil)),
		kong.Name("kvbus"),
		kong.Description("kvbus: an LLM-serving request pipeline over NATS that carries a conversation's session id from the OpenAI API to every KV store rank."),
		kong.DefaultEnvars("KVBUS"),
		kong.ShortUsageOnError(), // the full usage buried a one-line error under 80 lines
	)
	err = kctx.Run()
	_ = sink.Close()
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvbus:", err)
		os.Exit(1)
	}
}

// roles runs functions concurrently until all return; the first error
// cancels the others.
type roles struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex // guards err: fail may be called from outside run
	err    error
}

func newRoles(ctx context.Context) *roles {
	r := &roles{}
	r.ctx, r.cancel = context.WithCancel(ctx)
	return r
}

func (r *roles) run(name string, f func(context.Context) error) {
	r.wg.Go(func() { r.fail(name, f(r.ctx)) })
}

// fail records a role's error, the first one only, and cancels the
// others; a nil error or a cancellation is not a failure.
func (r *roles) fail(name string, err error) {
	if err != nil && !errors.Is(err, context.Canceled) {
		r.mu.Lock()
		if r.err == nil {
			r.err = fmt.Errorf("%s: %w", name, err)
		}
		r.mu.Unlock()
		r.cancel()
	}
}

func (r *roles) wait() error {
	r.wg.Wait()
	r.cancel()
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// newRegistry returns a registry with the Go and process collectors.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// listenMetrics binds --metrics-addr, or returns nil when it is empty. A
// role binds it before it connects: a port in use stops the process before
// it acts as a scheduler or joins a rank (a second worker given a running
// rank's identity took its group out until it exited).
func listenMetrics(addr string) (net.Listener, error) {
	if addr == "" {
		return nil, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics listen on %s: %w (is this role already running? stop it, or choose another --metrics-addr, or empty to disable)", addr, err)
	}
	return ln, nil
}

// metricsServer serves /metrics, /livez (the process is up and its NATS
// connection not closed for good: a NATS restart is not a reason to kill
// the process, and its store with it) and /healthz (readiness: connected
// to NATS, and ready() if given) on
// --metrics-addr. It outlives the role it reports on: the role closes it
// last, once it has stopped and drained its connection, so that while it
// stops probes get /healthz 503 "draining" and /livez 200 rather than
// "connection refused", and the drain's and the hand-off's counters can
// still be scraped. (It closed with the role's context before: the moment
// SIGTERM came.)
type metricsServer struct {
	log *slog.Logger
	ln  net.Listener // nil: --metrics-addr is empty, nothing is served

	mu     sync.Mutex
	srv    *http.Server
	served chan struct{} // closed when Serve returned
}

// metricsProbe is what the endpoints report on.
type metricsProbe struct {
	nc    *nats.Conn
	ready func() (bool, string) // nil: ready while live
	// stopping is closed when the role begins to stop: /healthz answers
	// 503 draining, with drainReason, and /livez 200 whatever NATS does
	// (a liveness failure would get the process killed mid-drain).
	stopping    <-chan struct{}
	drainReason string
}

func newMetricsServer(log *slog.Logger, ln net.Listener) *metricsServer {
	return &metricsServer{log: log, ln: ln}
}

// serve starts serving on the listener; fail gets an error that ends the
// serving before close.
func (m *metricsServer) serve(reg *prometheus.Registry, p metricsProbe, fail func(error)) {
	if m.ln == nil {
		return
	}
	srv := &http.Server{Handler: metricsHandler(reg, p), ReadHeaderTimeout: 5 * time.Second}
	served := make(chan struct{})
	m.mu.Lock()
	m.srv, m.served = srv, served
	m.mu.Unlock()
	m.log.Info("metrics listening", "addr", m.ln.Addr().String())
	go func() {
		defer close(served)
		if err := srv.Serve(m.ln); !errors.Is(err, http.ErrServerClosed) {
			fail(err)
		}
	}()
}

// close stops serving and waits for Serve to return.
func (m *metricsServer) close() {
	m.mu.Lock()
	srv, served := m.srv, m.served
	m.mu.Unlock()
	if srv == nil {
		return
	}
	_ = srv.Close()
	<-served
}

func metricsHandler(reg *prometheus.Registry, p metricsProbe) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	status := func(w http.ResponseWriter, code int, v map[string]string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(v)
	}
	stopping := func() bool {
		select {
		case <-p.stopping:
			return true
		default:
			return false
		}
	}
	connected := func(w http.ResponseWriter) bool {
		if p.nc != nil && !p.nc.IsConnected() {
			status(w, http.StatusServiceUnavailable, map[string]string{"status": "nats disconnected"})
			return false
		}
		return true
	}
	mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) {
		switch {
		case stopping():
			status(w, http.StatusOK, map[string]string{"status": "alive", "detail": "stopping"})
		case p.nc != nil && p.nc.IsClosed():
			// Closed for good (the server refused its credentials twice):
			// only a restart helps.
			status(w, http.StatusServiceUnavailable, map[string]string{"status": "nats connection closed"})
		case p.nc != nil && !p.nc.IsConnected():
			// A NATS restart: the connection comes back by itself, and a
			// liveness probe that failed now would restart the process and
			// empty its KV store.
			status(w, http.StatusOK, map[string]string{"status": "alive", "detail": "nats reconnecting"})
		default:
			status(w, http.StatusOK, map[string]string{"status": "alive"})
		}
	})
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if stopping() {
			status(w, http.StatusServiceUnavailable, map[string]string{"status": "draining", "reason": p.drainReason})
			return
		}
		if !connected(w) {
			return
		}
		if p.ready != nil {
			if ok, why := p.ready(); !ok {
				status(w, http.StatusServiceUnavailable, map[string]string{"status": "not ready", "reason": why})
				return
			}
		}
		status(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	return mux
}

// connect opens a role's NATS connection; inbox is its reply inbox prefix
// (bus.InboxPrefix: with the keys of `kvbus auth init` each role may read
// only its own). See connectRole for the context it returns.
func connect(ctx context.Context, f natsFlags, name, inbox string, log *slog.Logger) (context.Context, *nats.Conn, error) {
	return connectRole(ctx, f.config(name, inbox, log))
}

// connectRole connects with cfg and returns, with the connection, the
// context the role runs in: ctx, ended when the server closes the
// connection for good (it refused the role's credentials at a reconnect:
// a rotated key after a NATS restart), with that error as its cause. The
// role then stops as at a signal, and roleErr makes Run return the error,
// so that the process exits non-zero instead of running on a closed
// connection. A close by the role itself (its drain) is no such error.
func connectRole(ctx context.Context, cfg bus.Config) (context.Context, *nats.Conn, error) {
	ctx, lost := context.WithCancelCause(ctx)
	cfg.OnClosed = lost
	nc, err := bus.Connect(ctx, cfg)
	if err != nil {
		lost(nil)
		return ctx, nil, err
	}
	return ctx, nc, nil
}

// closeConn closes nc at once, as the role's own close (not reported as
// the server's, see connectRole).
func closeConn(nc *nats.Conn) {
	nc.SetClosedHandler(nil)
	nc.Close()
}

// roleErr is what a role's Run returns: err, unless its connection was
// closed for good (connectRole), which is the error then.
func roleErr(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); errors.Is(cause, bus.ErrClosed) {
		return cause
	}
	return err
}

// drainTimeout bounds a role's drain of its NATS connections.
const drainTimeout = 5 * time.Second

// drain drains connections with a deadline.
func drain(conns ...*nats.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), drainTimeout)
	defer cancel()
	for _, nc := range conns {
		bus.Drain(ctx, nc)
	}
}

type natsCmd struct {
	logFlags   `embed:""`
	pprofFlags `embed:""`
	Addr       string   `name:"addr" default:"127.0.0.1:4222" help:"Client listen address HOST:PORT."`
	DataDir    string   `name:"data-dir" help:"JetStream storage directory (default: a temporary directory)."`
	Token      string   `name:"token" help:"Require this token from clients."`
	Auth       string   `name:"auth-config" type:"path" help:"nats-server config file whose authorization block applies (kvbus auth init writes one): each role's key gets only its subjects."`
	TLSCert    string   `name:"tls-cert" type:"path" help:"Server certificate (PEM): clients connect with TLS."`
	TLSKey     string   `name:"tls-key" type:"path" help:"Server key (PEM)."`
	TLSCA      string   `name:"tls-ca" type:"path" help:"CA (PEM) to require and verify client certificates (and, without --cluster-tls-ca, the routes')."`
	ClusterCA  string   `name:"cluster-tls-ca" type:"path" help:"CA (PEM) the routes verify each other's certificates against (with --tls-cert and --cluster-addr): servers of a private CA route over TLS while clients need no certificate."`
	Debug      bool     `name:"debug" help:"Log the server's own debug output."`
	Monitor    string   `name:"monitor-addr" help:"Serve the server's monitoring endpoints (/healthz, /varz, /jsz) on HOST:PORT."`
	Name       string   `name:"server-name" help:"Server name (default kvbus-<port>; must differ in a cluster)."`
	Cluster    string   `name:"cluster-addr" help:"Route listen address HOST:PORT: join a cluster of kvbus nats servers."`
	CName      string   `name:"cluster-name" default:"kvbus" help:"Cluster name."`
	Routes     []string `name:"routes" help:"Route URLs of the other servers (nats://host:6222), comma-separated."`
	// Route authentication: never logged.
	ClusterUser     string        `name:"cluster-user" help:"User name of the route authentication (default kvbus; needs a cluster password)."`
	ClusterPassword string        `name:"cluster-password" help:"Password every server routing in must give, and this one gives on its routes: the same on every server. Required with --cluster-addr and --auth-config or --token. Prefer --cluster-password-file (a flag shows in ps)."`
	ClusterPassFile string        `name:"cluster-password-file" type:"path" help:"File holding the cluster password (kvbus auth init writes DIR/cluster-password)."`
	LameDuck        time.Duration `name:"lame-duck-duration" default:"30s" help:"How long lame duck mode takes (SIGUSR2, as nats-server's: a planned stop of one server of a cluster): the stream leaders move to the other servers at once, then the clients are closed one by one, so they reconnect spread out. SIGTERM stops at once."`
	LameDuckGrace   time.Duration `name:"lame-duck-grace-period" default:"5s" help:"In lame duck mode, how long the clients are told to go elsewhere before the first is closed (shorter than --lame-duck-duration)."`
}

func (c *natsCmd) Run(ctx context.Context) error {
	lf := c.logFlags
	if c.Debug { // the server's debug output is logged at debug level
		lf.LogLevel = "debug"
	}
	log := lf.logger()
	if c.LameDuck <= 0 || c.LameDuckGrace >= c.LameDuck {
		return fmt.Errorf("--lame-duck-grace-period (%s) must be shorter than --lame-duck-duration (%s), which must be above 0", c.LameDuckGrace, c.LameDuck)
	}
	onStop(ctx, log, func() stopPlan { return stopPlan{doing: "shutting the NATS server down", inFlight: -1} })
	stopPprof, err := c.startPprof(ctx, log)
	if err != nil {
		return err
	}
	defer stopPprof()
	// SIGHUP reads --auth-config and the TLS files again, as nats-server
	// does: new or rotated keys and renewed certificates without a restart.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	// SIGUSR2 enters lame duck mode, as nats-server's does. Both are
	// caught from before the server is ready: unhandled, SIGUSR2 would
	// kill the process.
	ldm := make(chan os.Signal, 1)
	signal.Notify(ldm, syscall.SIGUSR2)
	defer signal.Stop(ldm)
	srv, err := bus.StartServer(bus.ServerConfig{Addr: c.Addr, DataDir: c.DataDir, Token: c.Token, AuthConfig: c.Auth, Debug: c.Debug,
		TLSCert: c.TLSCert, TLSKey: c.TLSKey, TLSCA: c.TLSCA, ClusterTLSCA: c.ClusterCA, MonitorAddr: c.Monitor,
		ServerName: c.Name, Cluster: c.Cluster, ClusterName: c.CName, Routes: c.Routes,
		ClusterUser: c.ClusterUser, ClusterPassword: c.ClusterPassword, ClusterPasswordFile: c.ClusterPassFile, Logger: log,
		LameDuckDuration: c.LameDuck, LameDuckGracePeriod: c.LameDuckGrace})
	if err != nil {
		return err
	}
	log.Info("nats server ready", "url", srv.ClientURL(), "jetstream", true, "data_dir", srv.StoreDir(), "monitor_addr", fmt.Sprint(srv.MonitorAddr()))
	// The certificate is checked as at start every few hours: a warning
	// from 14 days before it ends, an error once it has.
	certCheck := time.NewTicker(certCheckEvery)
	defer certCheck.Stop()
	for {
		select {
		case now := <-certCheck.C:
			if err := srv.CheckCertificate(now); err != nil {
				log.Error("the NATS server's TLS certificate is not valid now: clients refuse new connections to it; renew it, then send the server SIGHUP (make reload-nats)", "err", err)
			}
		case <-hup:
			if err := srv.Reload(); err != nil {
				log.Error("SIGHUP: the configuration was not reloaded; the server runs on as it was: fix the files and send SIGHUP again", "err", err)
			} else {
				log.Info("SIGHUP: reloaded the authorization and TLS files and the cluster password file", "auth_config", c.Auth, "tls_cert", c.TLSCert,
					"cluster_password_file", c.ClusterPassFile)
			}
		case <-ldm:
			log.Info("SIGUSR2: entering lame duck mode: the stream leaders move to the other servers, the clients are told to go elsewhere and closed one by one",
				"lame_duck_duration", c.LameDuck, "lame_duck_grace_period", c.LameDuckGrace)
			done := make(chan struct{})
			go func() {
				defer close(done)
				srv.LameDuck()
			}()
			select {
			case <-done:
				log.Info("nats server stopped after lame duck mode")
			case <-ctx.Done(): // SIGTERM or SIGINT cuts it short
				log.Info("nats server stopping before lame duck mode ended")
				srv.Shutdown()
				<-done
			}
			return nil
		case <-ctx.Done():
			log.Info("nats server stopping")
			srv.Shutdown()
			return nil
		}
	}
}

// certCheckEvery is how often kvbus nats checks its TLS certificate's
// validity while it runs.
const certCheckEvery = 6 * time.Hour

type frontendCmd struct {
	busFlags        `embed:""`
	modelFlags      `embed:""`
	frontendFlags   `embed:""`
	tokenizerFlags  `embed:""`
	Engine          string `name:"engine" enum:"sim,openai" default:"sim" help:"What the workers run: sim, or openai (model servers): then each client's body goes to the engine as sent, fields the sim cannot honour (tools, response_format, logprobs, n) included, and the client gets the engine's answer as written."`
	requestLogFlags `embed:""`
	timeoutFlags    `embed:""`
	ID              string `name:"id" help:"Frontend id in subjects (default: a random fe-…)."`
}

func (c *frontendCmd) Run(ctx context.Context) error {
	log := c.logger()
	onStop(ctx, log, nil)
	stopPprof, err := c.startPprof(ctx, log)
	if err != nil {
		return err
	}
	defer stopPprof()
	if _, err := c.models(); err != nil {
		return err
	}
	tok, err := c.tokenizer()
	if err != nil {
		return err
	}
	ctx, nc, err := connect(ctx, c.natsFlags, "kvbus-frontend", bus.InboxPrefix(auth.RoleFrontend, ""), log)
	if err != nil {
		return err
	}
	defer drain(nc)
	reg := newRegistry()
	cfg := c.frontendConfig(nc, log, reg, c.ID)
	cfg.Tokenizer = tok
	cfg.Passthrough = c.Engine == workers.EngineOpenAI
	fe, err := frontend.New(cfg)
	if err != nil {
		return err
	}
	onStop(ctx, log, func() stopPlan { return c.stopPlan(reg) })
	return roleErr(ctx, fe.Run(ctx))
}

// stopPlan: the frontend answers new requests with 503 shutting_down and
// finishes those in flight, then drains NATS.
func (c *frontendCmd) stopPlan(reg *prometheus.Registry) stopPlan {
	n := gaugeSum(reg, "kvbus_frontend_inflight_requests")
	upTo, bound := frontendStopBound(c.RequestTimeout, c.StopGrace, c.StopTimeout)
	return stopPlan{
		doing:    fmt.Sprintf("finishing %s in flight (new ones get 503 shutting_down), then draining NATS", requests(n)),
		inFlight: n, upTo: upTo + drainTimeout, bound: bound + " + 5s NATS drain",
	}
}

func (c *frontendCmd) frontendConfig(nc *nats.Conn, log *slog.Logger, reg *prometheus.Registry, id string) frontend.Config {
	return newFrontendConfig(nc, c.subjects(), c.Replicas, log, reg, id, c.modelFlags, c.frontendFlags, c.requestLogFlags, c.timeoutFlags)
}

func newFrontendConfig(nc *nats.Conn, subj messages.Subjects, replicas int, log *slog.Logger, reg *prometheus.Registry, id string, m modelFlags, f frontendFlags, rl requestLogFlags, t timeoutFlags) frontend.Config {
	cfg := f.baseConfig(rl)
	cfg.Conn, cfg.Subjects, cfg.ID, cfg.StreamReplicas = nc, subj, id, replicas
	cfg.Models, _ = m.models() // checked in Run
	cfg.RequestTimeout, cfg.Logger, cfg.Registry = t.RequestTimeout, log, reg
	return cfg
}

type schedulerCmd struct {
	busFlags        `embed:""`
	schedulerFlags  `embed:""`
	requestLogFlags `embed:""`
	timeoutFlags    `embed:""`
	ID              string        `name:"id" help:"Scheduler id in subjects (default: a random sched-…)."`
	MetricsAddr     string        `name:"metrics-addr" default:":9090" help:"Address of /metrics and /healthz (empty: off)."`
	ShutdownTimeout time.Duration `name:"shutdown-timeout" positive:"" default:"20s" help:"On SIGTERM, how long the scheduler watches the requests it placed (their results, and moving them if their group fails) until they end."`
}

func (c *schedulerCmd) Run(ctx context.Context) error {
	log := c.logger()
	onStop(ctx, log, nil)
	stopPprof, err := c.startPprof(ctx, log)
	if err != nil {
		return err
	}
	defer stopPprof()
	ln, err := listenMetrics(c.MetricsAddr)
	if err != nil {
		return err
	}
	if ln != nil {
		defer ln.Close()
	}
	// Closed last, after the NATS drain below.
	metrics := newMetricsServer(log, ln)
	defer metrics.close()
	cfg := c.natsFlags.config("kvbus-scheduler", bus.InboxPrefix(auth.RoleScheduler, ""), log)
	cfg.NoEcho = true // a scheduler does not receive its own save plans
	ctx, nc, err := connectRole(ctx, cfg)
	if err != nil {
		return err
	}
	defer drain(nc)
	reg := newRegistry()
	s, err := newScheduler(nc, c, log, reg)
	if err != nil {
		return err
	}
	onStop(ctx, log, func() stopPlan {
		n := s.Trackers()
		return stopPlan{
			doing:    fmt.Sprintf("taking no new requests, watching the %s in flight it placed until they end, then draining NATS", requests(n)),
			inFlight: n, upTo: drainTimeout + c.ShutdownTimeout + drainTimeout,
			bound: fmt.Sprintf("5s request-log consumer drain + %s for its requests (--shutdown-timeout) + 5s NATS drain", c.ShutdownTimeout),
		}
	})
	r := newRoles(ctx)
	metrics.serve(reg, metricsProbe{nc: nc, ready: s.Ready, stopping: r.ctx.Done(),
		drainReason: "scheduler stopping: it takes no new requests"}, func(err error) { r.fail("metrics", err) })
	r.run("scheduler", s.Run)
	return roleErr(ctx, r.wait())
}

func newScheduler(nc *nats.Conn, c *schedulerCmd, log *slog.Logger, reg prometheus.Registerer) (*scheduler.Scheduler, error) {
	b, f, rl, t := c.busFlags, c.schedulerFlags, c.requestLogFlags, c.timeoutFlags
	policy, err := scheduler.NewPolicy(f.Policy, f.SessionEpsilon)
	if err != nil {
		return nil, err
	}
	return scheduler.New(scheduler.Config{
		Conn: nc, Subjects: b.subjects(), ID: c.ID, Policy: policy, BlockSize: f.BlockSize, StreamReplicas: b.Replicas,
		HeartbeatTimeout: f.HeartbeatTimeout, RequestTimeout: t.RequestTimeout, SessionTTL: f.SessionTTL, ShutdownTimeout: c.ShutdownTimeout,
		Logger: log, Registerer: reg,
		NoGroupWait: f.NoGroupWait, ResendAfter: f.ResendAfter, RequestLog: rl.streamConfig(), Pool: f.Pool,
	})
}

type workerCmd struct {
	busFlags           `embed:""`
	modelFlags         `embed:""`
	engineFlags        `embed:""`
	engineAdapterFlags `embed:""`
	BlockSize          int           `name:"block-size" positive:"" default:"16" help:"Tokens per KV block: the schedulers' --block-size, and the engine's with --engine openai."`
	Rank               string        `name:"rank" help:"'auto' claims the first free (group, rank) slot through the KVBUS_RANKS bucket (groups g0, g1, … filled in order, --tp-size ranks each; with --group, a rank of that group only); otherwise --group and --tp-rank say it."`
	SlotTTL            time.Duration `name:"slot-ttl" positive:"" default:"10s" help:"With --rank auto: a slot whose worker stopped refreshing it is free again after this."`
	Group              string        `name:"group" help:"Worker group: one engine instance (a DP replica); default g0. With --rank auto: claim a rank of this group only (for a key of one group, worker-<group>.nk)."`
	TPRank             int           `name:"tp-rank" default:"0" help:"Tensor-parallel rank; rank 0 is the driver and runs the engine."`
	TPSize             int           `name:"tp-size" positive:"" default:"4" help:"Tensor-parallel size: the group's world size."`
	EPRank             int           `name:"ep-rank" negative:"allowed" default:"-1" help:"Expert-parallel rank (default: the TP rank)."`
	EPSize             int           `name:"ep-size" default:"0" help:"Expert-parallel size (default: the TP size)."`
	MetricsAddr        string        `name:"metrics-addr" default:":9090" help:"Address of /metrics and /healthz (empty: off)."`
}

func (c *workerCmd) Run(ctx context.Context) error {
	log := c.logger()
	onStop(ctx, log, nil)
	stopPprof, err := c.startPprof(ctx, log)
	if err != nil {
		return err
	}
	defer stopPprof()
	if c.Rank != "" && c.Rank != "auto" {
		return fmt.Errorf("--rank %q: want auto, or give --group and --tp-rank", c.Rank)
	}
	model, err := c.one()
	if err != nil {
		return err
	}
	if c.Group != "" {
		if err := messages.ValidateGroup(c.Group); err != nil {
			return fmt.Errorf("--group: %w", err)
		}
	} else if c.Rank != "auto" {
		c.Group = "g0"
	}
	if err := c.checkSizes(c.TPSize, c.BlockSize, c.Engine == workers.EngineOpenAI); err != nil {
		return err
	}
	// An engine's configuration is checked before anything connects.
	var (
		engine   workers.Engine
		kvEvents *vllmevents.Config
	)
	switch c.Engine {
	case workers.EngineOpenAI:
		if c.TPSize != 1 {
			return fmt.Errorf("--engine openai: a group fronts one engine, which does its own tensor parallelism: give --tp-size 1 (got %d)", c.TPSize)
		}
		if len(c.EngineURL) != 1 {
			return errors.New("--engine openai needs one --engine-url http://HOST:PORT (the engine's base URL)")
		}
		oc, ev, err := c.openAI(0)
		if err != nil {
			return err
		}
		oc.Logger = log
		if engine, err = workers.NewOpenAIEngine(oc); err != nil {
			return err
		}
		if kvEvents = ev; ev == nil {
			log.Warn("no --kv-events: kvbus cannot see the engine's cache, so placement cannot follow it; give vLLM --kv-events-config and kvbus --kv-events")
		}
	default:
		if len(c.EngineURL)+len(c.KVEvents)+len(c.KVEventsBind) > 0 {
			return errors.New("--engine-url and --kv-events need --engine openai")
		}
		sim, err := c.engine()
		if err != nil {
			return err
		}
		engine = sim
	}
	ln, err := listenMetrics(c.MetricsAddr)
	if err != nil {
		return err
	}
	if ln != nil {
		defer ln.Close()
	}
	// Closed last, after the slot's release and the NATS drain below.
	metrics := newMetricsServer(log, ln)
	defer metrics.close()
	// A worker of one group reads the inbox of that group (which
	// worker-<group>.nk allows); one that claims a slot in any group may
	// serve any.
	inbox := bus.InboxPrefix(auth.RoleWorker, c.Group)
	ctx, nc, err := connect(ctx, c.natsFlags, "kvbus-worker", inbox, log)
	if err != nil {
		return err
	}
	defer drain(nc)
	var slot *workers.Slot
	if c.Rank == "auto" {
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		// The slot is claimed through JetStream, whose answers come to the
		// reply inbox: a key that may not read it (a key of one group
		// without --group, another role's) would wait for them for ever,
		// saying nothing. Say now which key or flag it needs.
		if err := checkRankAutoKey(ctx, nc, c.subjects(), c.Group); err != nil {
			return err
		}
		owner, _ := os.Hostname()
		names, err := bus.ResolveNames(ctx, js, c.subjects())
		if err != nil {
			return err
		}
		if slot, err = workers.ClaimSlot(ctx, js, workers.SlotConfig{Bucket: names.SlotBucket, Group: c.Group, Model: model, Size: c.TPSize, TTL: c.SlotTTL, Owner: owner, Replicas: c.Replicas, Logger: log}); err != nil {
			return err
		}
		c.Group, c.TPRank, c.EPRank = slot.Group, slot.Rank, slot.Rank
		defer func() {
			rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			if err := slot.Release(rctx); err != nil {
				log.Warn("cannot release the worker slot; it expires after --slot-ttl", "group", slot.Group, "tp_rank", slot.Rank, "err", err)
			}
		}()
	}
	if c.EPRank < 0 {
		c.EPRank = c.TPRank
	}
	if c.EPSize == 0 {
		c.EPSize = c.TPSize
	}
	reg := newRegistry()
	wm, hm := workers.NewMetrics(reg), bus.NewHandlerMetrics(reg)
	onStop(ctx, log, func() stopPlan { return c.stopPlan(reg, c.handoffOn(), slot != nil) })
	r := newRoles(ctx)
	metrics.serve(reg, metricsProbe{nc: nc, stopping: r.ctx.Done(),
		drainReason: "worker stopping: its group takes no new requests; it finishes those in flight"}, func(err error) { r.fail("metrics", err) })
	r.run("worker", func(ctx context.Context) error {
		for {
			rank, err := newRank(nc, c.busFlags, c.modelFlags, c.engineFlags, engine, c.Group, c.TPRank, c.TPSize, c.EPRank, c.EPSize, log,
				wm, hm, func(rc *workers.RankConfig) {
					rc.EngineCache, rc.KVEvents, rc.BlockSize = c.Engine == workers.EngineOpenAI, kvEvents, c.BlockSize
				})
			if err != nil {
				return err
			}
			ranks := newRoles(ctx)
			ranks.run("rank", rank.Run)
			if slot != nil {
				ranks.run("slot", slot.Hold) // losing the slot stops the worker
			}
			err = ranks.wait()
			if slot == nil || !errors.Is(err, workers.ErrRegrouped) || ctx.Err() != nil {
				return err
			}
			// The slot moved to make a whole group: the worker is that
			// rank now, with an empty store.
			c.Group, c.TPRank, c.EPRank = slot.Group, slot.Rank, slot.Rank
		}
	})
	return roleErr(ctx, r.wait())
}

// checkRankAutoKey checks, before a --rank auto worker claims a slot, that
// its key may read what the slot's group needs (every group's ReqMetas
// without --group) and its reply inbox. Without --group, a refusal also
// names --group: a key of one group (worker-<g>.nk) claims with --rank auto
// --group <g>.
func checkRankAutoKey(ctx context.Context, nc *nats.Conn, subj messages.Subjects, group string) error {
	g := group
	if g == "" {
		g = "*"
	}
	err := bus.CheckPermissions(ctx, nc, bus.RoleCheck{Role: "worker", Group: group, Subscribe: []string{subj.MetaGroup(g)}})
	if err != nil && group == "" {
		return fmt.Errorf("%w. --rank auto without --group may claim a rank of any group, so it needs the key of any group; "+
			"with a key of one group (DIR/worker-<g>.nk) add --group <g>", err)
	}
	return err
}

// stopPlan: a rank finishes its requests within --shutdown-timeout, hands
// its blocks to other groups (--drain-handoff: one more
// --shutdown-timeout at most, after up to 5 heartbeat intervals to see
// who is draining), releases its --rank auto slot (2 s at most) and
// drains NATS.
func (c *workerCmd) stopPlan(reg *prometheus.Registry, handoff, autoSlot bool) stopPlan {
	n := gaugeSum(reg, "kvbus_worker_queue_depth")
	p := stopPlan{inFlight: n, upTo: c.ShutdownTimeout + drainTimeout, bound: "--shutdown-timeout + 5s NATS drain"}
	p.doing = fmt.Sprintf("finishing %s in flight (its group takes no new ones) within --shutdown-timeout", requests(n))
	if handoff {
		p.doing += ", handing its blocks to other groups (--drain-handoff)"
		p.upTo += c.ShutdownTimeout + 5*c.HeartbeatEvery
		p.bound = "2 × --shutdown-timeout + 5 × --heartbeat-interval + 5s NATS drain"
	}
	if autoSlot {
		p.doing += ", releasing its slot"
		p.upTo += 2 * time.Second
		p.bound += " + 2s slot release"
	}
	p.doing += ", then draining NATS"
	return p
}

func newRank(nc *nats.Conn, b busFlags, m modelFlags, e engineFlags, engine workers.Engine, group string, tp, tpSize, ep, epSize int,
	log *slog.Logger, wm *workers.Metrics, hm *bus.HandlerMetrics, with func(*workers.RankConfig)) (*workers.Rank, error) {
	profile, err := workers.LookupModelProfile(e.ModelProfile)
	if err != nil {
		return nil, err
	}
	capacity, err := workers.ParseCapacity(e.KVCapacity, profile.BytesPerTokenPerRank(tpSize))
	if err != nil {
		return nil, fmt.Errorf("--kv-capacity: %w", err)
	}
	handoff, err := e.drainHandoff(profile.BytesPerTokenPerRank(tpSize))
	if err != nil {
		return nil, err
	}
	replay, err := e.streamReplay()
	if err != nil {
		return nil, err
	}
	model, err := m.one()
	if err != nil {
		return nil, err
	}
	cfg := workers.RankConfig{
		Conn: nc, Subjects: b.subjects(), Group: group, TPRank: tp, TPSize: tpSize, EPRank: ep, EPSize: epSize,
		Model: model, Profile: profile, CapacityBytes: capacity, Payload: e.KVPayload, Evict: e.Evict, Engine: engine,
		HeartbeatInterval: e.HeartbeatEvery, ShutdownTimeout: e.ShutdownTimeout, SaveWait: e.SaveWait, DrainHandoff: handoff,
		ReplayBytes: replay, Logger: log, Metrics: wm, HandlerMetrics: hm,
	}
	if with != nil {
		with(&cfg)
	}
	return workers.NewRank(cfg)
}
