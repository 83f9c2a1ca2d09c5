// Package testenv runs kvbus for tests: an embedded nats-server with
// JetStream in a temporary directory, and an in-process cluster (package
// cluster: frontend, schedulers, G groups × R ranks) over real NATS and real
// HTTP on loopback. Everything started is stopped by t.Cleanup.
package testenv

import (
	"cmp"
	"context"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/cluster"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/internal/logbuf"
	"github.com/kvbus/kvbus/internal/logsink"
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
type LogBuffer = logbuf.Buffer

// writerFunc is an io.Writer that is a function.
type writerFunc func(p []byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// ClusterConfig configures an in-process cluster for a test.
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
	MaxSessions    int // the schedulers' --max-sessions (0: the default)
	SessionHeaders []string
	MaxModelLen    int
	MaxBodyBytes   int64 // the frontend's --max-body-bytes (0: its default)
	MaxInflight    int
	APIKey         string
	RequestTimeout time.Duration
	// StoreDelays slows the store thread of the ranks with these tp_ranks
	// in every group (a rank that saves late).
	StoreDelays map[int]time.Duration
	// SaveWait is the ranks' --save-wait (0: its default).
	SaveWait time.Duration
	// DropReqMetas makes the ranks with these tp_ranks (in every group)
	// ignore their first N ReqMetas.
	DropReqMetas map[int]int
	// DelayFirstReqMeta makes the ranks with these tp_ranks (in every
	// group) handle their first ReqMeta this late.
	DelayFirstReqMeta map[int]time.Duration
	// MaxPayload of the embedded NATS server (default 8 MiB).
	MaxPayload  int32
	NoGroupWait time.Duration
	ResendAfter time.Duration
	Pool        string // the schedulers' --pool (default global)
	// IndexGroups caps the groups the schedulers' KV index tracks (0: the
	// maximum, scheduler.MaxIndexedGroups).
	IndexGroups int
	// DrainHandoff is the ranks' --drain-handoff in bytes (0: off).
	DrainHandoff int64
	// StreamReplay is the drivers' --stream-replay in bytes (0: the
	// default, negative: off).
	StreamReplay int64
	// Engines puts a model server (a fakeengine, say) behind each group
	// instead of the sim: one group of one rank per engine, the frontend
	// forwarding client bodies (--engine openai).
	Engines []cluster.EngineBackend
	// Tokenizer is the frontend's (default: the embedded o200k).
	Tokenizer frontend.Tokenizer
	// AuthDir holds keys from auth.Init: NATS loads their authorization
	// block and every role connects with its own key.
	AuthDir string
	// LogLevel defaults to info.
	LogLevel slog.Level
	// LogTo also receives the logs (for example os.Stderr when debugging).
	LogTo io.Writer
}

// Cluster is a running in-process kvbus with its frontend on loopback.
type Cluster struct {
	*cluster.Cluster
	NATS      *bus.Server
	URL       string               // the frontend's base URL, http://127.0.0.1:port
	Scheduler *scheduler.Scheduler // the first replica
	Logs      *LogBuffer
	Model     string
	// Registry holds the frontend's, the ranks' and the first scheduler's
	// metrics; SchedulerRegistries has every replica's.
	Registry *prometheus.Registry
}

// StartCluster starts NATS, ranks, schedulers and a frontend, waits until
// every group is ready and HTTP is served, and stops everything at cleanup.
func StartCluster(t testing.TB, cfg ClusterConfig) *Cluster {
	t.Helper()
	if cfg.KVCapacity == 0 {
		cfg.KVCapacity = 64 << 20
	}
	if cfg.ModelProfile == "" {
		cfg.ModelProfile = "tiny"
	}
	logs := &LogBuffer{}
	var w io.Writer = logs
	if cfg.LogTo != nil {
		// One line at a time: the handler writes from many goroutines.
		var mu sync.Mutex // LogTo need not be safe for concurrent use
		w = writerFunc(func(p []byte) (int, error) {
			mu.Lock()
			defer mu.Unlock()
			_, _ = logs.Write(p)
			return cfg.LogTo.Write(p)
		})
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	cc, err := cluster.Start(context.Background(), cluster.Config{
		DataDir: t.TempDir(), Groups: cfg.Groups, Ranks: cfg.Ranks, Model: cfg.Model, ModelProfile: cfg.ModelProfile,
		KVCapacity: cfg.KVCapacity, Payload: cfg.Payload, Evict: cfg.Evict,
		Sim:               workers.SimConfig{Profile: workers.DefaultSimProfile(), TimeScale: cfg.TimeScale},
		HeartbeatInterval: 100 * time.Millisecond, HeartbeatTimeout: 2 * time.Second, ShutdownTimeout: 2 * time.Second,
		Schedulers: cfg.Schedulers, Policy: cfg.Policy, RequestTimeout: cfg.RequestTimeout, SessionTTL: cfg.SessionTTL, MaxSessions: cfg.MaxSessions,
		StoreDelays: cfg.StoreDelays, SaveWait: cfg.SaveWait, DropReqMetas: cfg.DropReqMetas, DelayFirstReqMeta: cfg.DelayFirstReqMeta, MaxPayload: cfg.MaxPayload, NoGroupWait: cfg.NoGroupWait, ResendAfter: cfg.ResendAfter, Pool: cfg.Pool,
		IndexGroups: cfg.IndexGroups, DrainHandoff: cfg.DrainHandoff, StreamReplay: cfg.StreamReplay, Engines: cfg.Engines, AuthDir: cfg.AuthDir,
		Frontend: &frontend.Config{Listener: ln, SessionHeaders: cfg.SessionHeaders, MaxModelLen: cfg.MaxModelLen, MaxBodyBytes: cfg.MaxBodyBytes,
			MaxInflight: cfg.MaxInflight, APIKey: cfg.APIKey, Tokenizer: cfg.Tokenizer,
			StopGrace: 100 * time.Millisecond}, // what a test's clients need; kvbus's default is 500 ms
		Logger:   slog.New(logsink.NewTextHandler(w, &slog.HandlerOptions{Level: cfg.LogLevel})), // as kvbus logs
		Registry: reg,
	})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	t.Cleanup(func() {
		cc.Stop()
		if err := cc.Wait(); err != nil {
			t.Errorf("cluster role failed: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cc.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	return &Cluster{
		Cluster: cc, NATS: cc.NATS, URL: "http://" + ln.Addr().String(), Scheduler: cc.Schedulers[0],
		Logs: logs, Model: cmp.Or(cfg.Model, "kvbus-sim"), Registry: reg,
	}
}

// KillRank crashes one rank (see cluster.Cluster.KillRank).
func (c *Cluster) KillRank(t testing.TB, group string, rank int) {
	t.Helper()
	if err := c.Cluster.KillRank(group, rank); err != nil {
		t.Fatal(err)
	}
}

// CrashRestartRank crashes one rank and starts a new process of it at once
// (see cluster.Cluster.CrashRestartRank).
func (c *Cluster) CrashRestartRank(t testing.TB, group string, rank int) {
	t.Helper()
	if err := c.Cluster.CrashRestartRank(group, rank); err != nil {
		t.Fatal(err)
	}
}

// RestartRank restarts one rank (see cluster.Cluster.RestartRank) and waits
// until the cluster is ready again, as a client retrying a 503 would.
func (c *Cluster) RestartRank(t testing.TB, group string, rank int) {
	t.Helper()
	if err := c.Cluster.RestartRank(group, rank); err != nil {
		t.Fatal(err)
	}
	c.WaitReady(t)
}

// WaitReady waits (30 s at most) until every scheduler is ready with every
// group synced and the frontend is healthy.
func (c *Cluster) WaitReady(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.Cluster.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
}

// Observe subscribes to subject and records every message until cleanup.
func (c *Cluster) Observe(t testing.TB, subject string) *Observer {
	t.Helper()
	return ObserveBus(t, c.NATS, subject)
}

// ObserveBus is Observe on srv, for a cluster not built by StartCluster.
func ObserveBus(t testing.TB, srv *bus.Server, subject string) *Observer {
	t.Helper()
	nc := Connect(t, srv)
	o := &Observer{nc: nc}
	sub, err := nc.Subscribe(subject, func(m *nats.Msg) {
		o.mu.Lock()
		o.msgs = append(o.msgs, m)
		o.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	o.sub = sub
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return o
}

// Observer records bus messages.
type Observer struct {
	nc   *nats.Conn
	sub  *nats.Subscription
	mu   sync.Mutex
	msgs []*nats.Msg
}

// Messages returns the messages recorded so far, among them every message
// the server had sent the observer before the call: that a role has
// received a message does not say that the observer, on its own
// connection, has recorded it yet (it is in flight, or queued for the
// subscription's handler). It waits up to a second for the server's
// answer to a flush and up to a second more for the handler, and not at
// all while the observer is disconnected or when the flush fails.
func (o *Observer) Messages() []*nats.Msg {
	if o.nc.IsConnected() && o.nc.FlushTimeout(time.Second) == nil {
		for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Microsecond) {
			if o.recordedAll() {
				break
			}
		}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]*nats.Msg(nil), o.msgs...)
}

// recordedAll reports whether the subscription's handler has recorded
// every message the connection has taken in for it.
func (o *Observer) recordedAll() bool {
	pending, _, err := o.sub.Pending()
	delivered, err2 := o.sub.Delivered()
	if err != nil || err2 != nil || pending != 0 {
		return false
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return int64(len(o.msgs)) == delivered
}

// Connected reports whether a client connection with this name is
// connected to the cluster's NATS server (how a test sees that a killed
// process is really gone).
func (c *Cluster) Connected(t testing.TB, name string) bool {
	t.Helper()
	cz, err := c.Cluster.NATS.Connz(&server.ConnzOptions{Limit: 10000})
	if err != nil {
		t.Fatal(err)
	}
	for _, ci := range cz.Conns {
		if ci.Name == name {
			return true
		}
	}
	return false
}

// StartKeyedNATS starts an embedded NATS server that admits only the keys
// `kvbus auth init` writes into the returned directory (one per role, and
// one worker key per group of groups, for the default prefix), as a bus
// with keys does.
func StartKeyedNATS(t testing.TB, groups ...string) (*bus.Server, string) {
	t.Helper()
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, groups, false); err != nil {
		t.Fatal(err)
	}
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), AuthConfig: filepath.Join(dir, auth.ConfigFile)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv, dir
}
