// Package testenv runs kvbus for tests: an embedded nats-server with
// JetStream in a temporary directory, and an in-process cluster (frontend,
// scheduler, G groups × R ranks) over real NATS and real HTTP on loopback.
// Everything started is stopped by t.Cleanup.
package testenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/workers"
)

// StartNATS starts an embedded nats-server with JetStream on a free loopback
// port.
func StartNATS(t testing.TB) *bus.Server {
	t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir()})
	if err != nil {
		t.Fatalf("start nats: %v", err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

// Connect opens a NATS connection to srv, closed at cleanup.
func Connect(t testing.TB, srv *bus.Server) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(srv.ClientURL(), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatalf("connect nats: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// Eventually polls cond every 10 ms until it holds or timeout passes.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// LogBuffer is a concurrency-safe buffer of log output.
type LogBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write implements io.Writer.
func (b *LogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// Lines returns the log lines that contain every one of substrs.
func (b *LogBuffer) Lines(substrs ...string) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for _, l := range strings.Split(b.buf.String(), "\n") {
		ok := l != ""
		for _, s := range substrs {
			ok = ok && strings.Contains(l, s)
		}
		if ok {
			out = append(out, l)
		}
	}
	return out
}

// ClusterConfig configures an in-process cluster.
type ClusterConfig struct {
	Groups int    // default 1
	Ranks  int    // ranks per group, default 4
	Policy string // default "kv"
	// Schedulers is the number of scheduler replicas (default 1).
	Schedulers int
	Model      string // default "kvbus-sim"
	// TimeScale of the sim engine: 0 is instant.
	TimeScale float64
	// ModelProfile names the KV shape (default "tiny").
	ModelProfile string
	// KVCapacity per rank in bytes (default 64 MiB); Payload and Evict as
	// the workers' --kv-payload and --evict.
	KVCapacity     int64
	Payload        string
	Evict          string
	SessionTTL     time.Duration
	SessionHeaders []string
	MaxModelLen    int
	RequestTimeout time.Duration
	// LogLevel defaults to info.
	LogLevel slog.Level
	// LogTo also receives the logs (for example os.Stderr when debugging).
	LogTo io.Writer
}

// Cluster is a running in-process kvbus.
type Cluster struct {
	NATS      *bus.Server
	URL       string // the frontend's base URL, http://127.0.0.1:port
	Frontend  *frontend.Server
	Scheduler *scheduler.Scheduler // the first replica
	// Schedulers are all replicas.
	Schedulers []*scheduler.Scheduler
	Ranks      []*workers.Rank
	Logs       *LogBuffer
	Subjects   messages.Subjects
	Model      string
	// Registry holds the frontend's and the ranks' metrics;
	// SchedulerRegistries each scheduler replica's.
	Registry            *prometheus.Registry
	SchedulerRegistries []*prometheus.Registry

	mu        sync.Mutex
	rankStops map[rankKey]func()
	engines   map[string]workers.Engine
	restart   func(group string, tpRank int)
}

type rankKey struct {
	group string
	rank  int
}

// RestartRank stops one rank and starts a new one with the same identity
// and an empty block store, as a process restart would.
func (c *Cluster) RestartRank(group string, tpRank int) { c.restart(group, tpRank) }

// StartCluster starts NATS, ranks, a scheduler and a frontend, waits until
// every group is ready and HTTP is served, and stops everything at cleanup
// (ranks last, so in-flight requests finish).
func StartCluster(t testing.TB, cfg ClusterConfig) *Cluster {
	t.Helper()
	if cfg.Groups == 0 {
		cfg.Groups = 1
	}
	if cfg.Ranks == 0 {
		cfg.Ranks = 4
	}
	if cfg.Policy == "" {
		cfg.Policy = scheduler.PolicyKV
	}
	if cfg.Schedulers == 0 {
		cfg.Schedulers = 1
	}
	if cfg.KVCapacity == 0 {
		cfg.KVCapacity = 64 << 20
	}
	if cfg.Model == "" {
		cfg.Model = "kvbus-sim"
	}
	if cfg.ModelProfile == "" {
		cfg.ModelProfile = "tiny"
	}
	logs := &LogBuffer{}
	var w io.Writer = logs
	if cfg.LogTo != nil {
		w = io.MultiWriter(logs, cfg.LogTo)
	}
	log := slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: cfg.LogLevel}))
	srv := StartNATS(t)
	c := &Cluster{NATS: srv, Logs: logs, Model: cfg.Model, Registry: prometheus.NewRegistry(),
		rankStops: map[rankKey]func(){}, engines: map[string]workers.Engine{}}
	rankMetrics, handlerMetrics := workers.NewMetrics(c.Registry), bus.NewHandlerMetrics(c.Registry)

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	run := func(ctx context.Context, name string, f func(context.Context) error) {
		wg.Go(func() {
			if err := f(ctx); err != nil && !errors.Is(err, context.Canceled) {
				errs <- fmt.Errorf("%s: %w", name, err)
			}
		})
	}
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("cluster role failed: %v", err)
		}
	})

	profile, err := workers.LookupModelProfile(cfg.ModelProfile)
	if err != nil {
		t.Fatal(err)
	}
	startRank := func(group string, r int, engine workers.Engine) {
		rank, err := workers.NewRank(workers.RankConfig{
			Conn: Connect(t, srv), Group: group, TPRank: r, TPSize: cfg.Ranks, EPRank: r, EPSize: cfg.Ranks,
			Model: cfg.Model, Profile: profile, CapacityBytes: cfg.KVCapacity, Payload: cfg.Payload, Evict: cfg.Evict, Engine: engine,
			HeartbeatInterval: 100 * time.Millisecond, Logger: log, Metrics: rankMetrics, HandlerMetrics: handlerMetrics,
		})
		if err != nil {
			t.Fatal(err)
		}
		rctx, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		c.mu.Lock()
		c.Ranks = append(c.Ranks, rank)
		c.rankStops[rankKey{group, r}] = func() { stop(); <-done }
		c.mu.Unlock()
		run(rctx, fmt.Sprintf("rank %s/%d", group, r), func(ctx context.Context) error {
			defer close(done)
			return rank.Run(ctx)
		})
	}
	c.restart = func(group string, r int) {
		c.mu.Lock()
		stop := c.rankStops[rankKey{group, r}]
		engine := c.engines[group]
		c.mu.Unlock()
		if stop == nil {
			t.Fatalf("no rank %s/%d", group, r)
		}
		stop()
		startRank(group, r, engine)
	}
	for g := range cfg.Groups {
		group := fmt.Sprintf("g%d", g)
		engine, err := workers.NewSimEngine(workers.SimConfig{Profile: workers.DefaultSimProfile, TimeScale: cfg.TimeScale})
		if err != nil {
			t.Fatal(err)
		}
		c.engines[group] = engine
		for r := range cfg.Ranks {
			startRank(group, r, engine)
		}
	}
	for i := range cfg.Schedulers {
		policy, err := scheduler.NewPolicy(cfg.Policy, 0.25)
		if err != nil {
			t.Fatal(err)
		}
		reg := prometheus.NewRegistry()
		s, err := scheduler.New(scheduler.Config{
			Conn: Connect(t, srv), Policy: policy, HeartbeatTimeout: time.Second,
			RequestTimeout: cfg.RequestTimeout, SessionTTL: cfg.SessionTTL, Logger: log, Registerer: reg,
		})
		if err != nil {
			t.Fatal(err)
		}
		c.Schedulers = append(c.Schedulers, s)
		c.SchedulerRegistries = append(c.SchedulerRegistries, reg)
		run(ctx, fmt.Sprintf("scheduler %d", i), s.Run)
	}
	c.Scheduler = c.Schedulers[0]
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c.Frontend, err = frontend.New(frontend.Config{
		Conn: Connect(t, srv), Listener: ln, Models: []string{cfg.Model}, SessionHeaders: cfg.SessionHeaders,
		MaxModelLen: cfg.MaxModelLen, RequestTimeout: cfg.RequestTimeout, Logger: log, Registry: c.Registry,
	})
	if err != nil {
		t.Fatal(err)
	}
	run(ctx, "frontend", c.Frontend.Run)
	select {
	case <-c.Frontend.Ready():
	case err := <-errs:
		t.Fatalf("cluster failed to start: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("frontend not ready after 30s")
	}
	c.URL = "http://" + ln.Addr().String()
	Eventually(t, 10*time.Second, "all worker groups ready", func() bool {
		for _, s := range c.Schedulers {
			if s.ReadyGroups() != cfg.Groups {
				return false
			}
		}
		return true
	})
	return c
}

// Observe subscribes to subject and records every message until cleanup.
func (c *Cluster) Observe(t testing.TB, subject string) *Observer {
	t.Helper()
	nc := Connect(t, c.NATS)
	o := &Observer{}
	if _, err := nc.Subscribe(subject, func(m *nats.Msg) {
		o.mu.Lock()
		o.msgs = append(o.msgs, m)
		o.mu.Unlock()
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return o
}

// Observer records bus messages.
type Observer struct {
	mu   sync.Mutex
	msgs []*nats.Msg
}

// Messages returns the messages recorded so far.
func (o *Observer) Messages() []*nats.Msg {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]*nats.Msg(nil), o.msgs...)
}
