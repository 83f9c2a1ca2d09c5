package bus_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  bus.Config
		ok   bool
	}{
		{"empty", bus.Config{}, true},
		{"token", bus.Config{Token: "s3cret"}, true},
		{"cert without key", bus.Config{TLSCert: "c.pem"}, false},
		{"cert and key", bus.Config{TLSCert: "c.pem", TLSKey: "k.pem"}, true},
		{"token and creds", bus.Config{Token: "t", CredsFile: "x.creds"}, false},
		{"user and nkey", bus.Config{User: "u", NKeySeedFile: "seed"}, false},
	} {
		if err := tc.cfg.Validate(); (err == nil) != tc.ok {
			t.Errorf("%s: Validate() = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

func startServer(t testing.TB, token string) *bus.Server {
	t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), Token: token})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

func TestConnectTokenAndDrain(t *testing.T) {
	srv := startServer(t, "s3cret")
	ctx := t.Context()
	if _, err := bus.Connect(ctx, bus.Config{URL: srv.ClientURL(), ConnectTimeout: 300 * time.Millisecond}); !errors.Is(err, bus.ErrConnect) {
		t.Fatalf("connect without the token: %v, want ErrConnect", err)
	}
	nc, err := bus.Connect(ctx, bus.Config{URL: srv.ClientURL(), Token: "s3cret", Name: "test"})
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	if _, err := nc.Subscribe("x", func(m *nats.Msg) { got <- string(m.Data) }); err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish("x", []byte("hello")); err != nil {
		t.Fatal(err)
	}
	bus.Drain(ctx, nc) // delivers what was published, then closes
	if !nc.IsClosed() {
		t.Fatal("connection not closed after Drain")
	}
	select {
	case s := <-got:
		if s != "hello" {
			t.Fatalf("got %q", s)
		}
	default:
		t.Fatal("message published before Drain was not delivered")
	}
}

func TestConnectErrorSaysWhatToDo(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	_, err := bus.Connect(ctx, bus.Config{URL: "nats://127.0.0.1:1", ConnectTimeout: 200 * time.Millisecond})
	if !errors.Is(err, bus.ErrConnect) || !strings.Contains(err.Error(), "--nats-url") {
		t.Fatalf("err = %v; want ErrConnect mentioning --nats-url", err)
	}
}

// TestStartServerPortInUse: a server whose client, monitoring or cluster
// port is taken fails at once (not after ReadyForConnections' 30 s), names
// the address and says what to do.
// TestStartServerUnusableDataDir: a --data-dir that cannot hold JetStream's
// files is named at once. nats-server logged the cause only with --debug,
// and the error came 30 s later asking whether the port was in use.
func TestStartServerUnusableDataDir(t *testing.T) {
	file := filepath.Join(t.TempDir(), "afile")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: filepath.Join(file, "x")})
	if err == nil {
		srv.Shutdown()
		t.Fatal("a server started on a data dir under a file")
	}
	if !errors.Is(err, bus.ErrServer) || !strings.Contains(err.Error(), "--data-dir") || !strings.Contains(err.Error(), file) {
		t.Errorf("err = %v; want ErrServer naming the directory and --data-dir", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the error took %s; want it at once", took)
	}
}

func TestStartServerPortInUse(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	taken := l.Addr().String()
	for _, tc := range []struct {
		what string
		cfg  bus.ServerConfig
	}{
		{"client", bus.ServerConfig{Addr: taken}},
		{"monitoring", bus.ServerConfig{Addr: "127.0.0.1:0", MonitorAddr: taken}},
		// With routes: a cluster address without them is refused by
		// Validate before any port is tried.
		{"cluster", bus.ServerConfig{Addr: "127.0.0.1:0", Cluster: taken, ClusterName: "c", Routes: []string{"nats://127.0.0.1:1"}}},
	} {
		tc.cfg.DataDir = t.TempDir()
		start := time.Now()
		srv, err := bus.StartServer(tc.cfg)
		if err == nil {
			srv.Shutdown()
			t.Errorf("%s: a server started on a port in use", tc.what)
			continue
		}
		if !errors.Is(err, bus.ErrServer) || !strings.Contains(err.Error(), "another address") ||
			!strings.Contains(err.Error(), taken) || !strings.Contains(err.Error(), tc.what) {
			t.Errorf("%s: err = %v; want ErrServer naming %s, the %s address, and saying to pick another", tc.what, err, taken, tc.what)
		}
		if took := time.Since(start); took > 5*time.Second {
			t.Errorf("%s: the error took %s; want it at once", tc.what, took)
		}
	}
}

func TestEnsureStreamAndConsumerIdempotent(t *testing.T) {
	srv := startServer(t, "")
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 { // a second process starting must not fail
		st, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{})
		if err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		info, err := st.Info(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if info.Config.Name != messages.RequestStream || info.Config.Storage != jetstream.FileStorage || info.Config.Subjects[0] != "kvbus.req.>" {
			t.Fatalf("stream config %+v", info.Config)
		}
		c, err := bus.EnsureSchedulerConsumer(t.Context(), st, 0, 1)
		if err != nil {
			t.Fatalf("round %d: consumer: %v", i, err)
		}
		if ci, err := c.Info(t.Context()); err != nil || ci.Config.AckPolicy != jetstream.AckExplicitPolicy {
			t.Fatalf("consumer info %+v, %v", ci, err)
		}
	}
	// Nats-Msg-Id dedupes a second publish of the same request id.
	for range 2 {
		if _, err := js.Publish(t.Context(), "kvbus.req.m", []byte("x"), jetstream.WithMsgID("r1")); err != nil {
			t.Fatal(err)
		}
	}
	st, _ := js.Stream(t.Context(), messages.RequestStream)
	info, _ := st.Info(t.Context())
	if info.State.Msgs != 1 {
		t.Fatalf("%d messages in the log after a duplicate publish, want 1", info.State.Msgs)
	}
}

func TestMiddleware(t *testing.T) {
	reg := prometheus.NewRegistry()
	hm := bus.NewHandlerMetrics(reg)
	_ = bus.NewHandlerMetrics(reg) // a second role in the same process shares the series
	var order []string
	mw := func(name string) bus.Middleware[string] {
		return func(next bus.Handler[string]) bus.Handler[string] {
			return func(ctx context.Context, m string) error {
				order = append(order, name)
				return next(ctx, m)
			}
		}
	}
	h := bus.Chain(func(context.Context, string) error { order = append(order, "h"); return nil }, mw("a"), mw("b"))
	if err := h(t.Context(), "x"); err != nil || strings.Join(order, ",") != "a,b,h" {
		t.Fatalf("order %v, err %v", order, err)
	}

	log := slog.New(slog.DiscardHandler)
	panicky := bus.Wrap(func(context.Context, string) error { panic("boom") }, log, hm, "panicky")
	if err := panicky(t.Context(), "x"); !errors.Is(err, bus.ErrPanic) || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("panic became %v", err)
	}
	malformed := bus.Wrap(func(context.Context, string) error { return fmt.Errorf("x: %w", messages.ErrMalformed) }, log, hm, "malformed")
	_ = malformed(t.Context(), "x")
	timed := bus.Chain(func(ctx context.Context, _ string) error {
		if _, ok := ctx.Deadline(); !ok {
			return errors.New("no deadline")
		}
		return nil
	}, bus.Timeout[string](time.Second))
	if err := timed(t.Context(), "x"); err != nil {
		t.Fatal(err)
	}

	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "kvbus_bus_messages_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			key := ""
			for _, l := range m.GetLabel() {
				key += l.GetValue() + "/"
			}
			counts[key] = m.GetCounter().GetValue()
		}
	}
	if counts["panicky/error/"] != 1 || counts["malformed/malformed/"] != 1 {
		t.Fatalf("counts %v", counts)
	}
}

// TestEnsureRequestStreamRefusesBadLimits: a negative limit is refused at
// once, naming the flags; a configuration the server refuses is not
// retried until the caller's deadline (a scheduler given
// --request-log-max-age=-1s hung for ever, retrying every 200 ms, and
// asked whether JetStream was enabled).
func TestEnsureRequestStreamRefusesBadLimits(t *testing.T) {
	srv := startServer(t, "")
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	_, err = bus.EnsureRequestStream(ctx, js, bus.StreamConfig{MaxAge: -time.Second})
	if !errors.Is(err, bus.ErrStreamConfig) || !strings.Contains(err.Error(), "--request-log-max-age") {
		t.Errorf("negative max age: %v; want ErrStreamConfig naming the flag", err)
	}
	_, err = bus.Retry(ctx, func(ctx context.Context) (jetstream.Stream, error) {
		return js.CreateStream(ctx, jetstream.StreamConfig{Name: "BAD", Subjects: []string{"bad.>"}, MaxAge: -time.Second})
	})
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || ctx.Err() != nil {
		t.Errorf("Retry of a configuration the server refuses: %v (deadline passed: %v); want the server's answer at once", err, ctx.Err())
	}
}

// TestReplicasOnOneServerFailAtOnce: --stream-replicas above 1 against a
// NATS server that is not clustered fails the request log, its consumer
// and the plan stream at once with the server's answer. Before, each was
// retried every 200 ms until the role's 30 s setup deadline passed, and
// the role said nothing meanwhile.
func TestReplicasOnOneServerFailAtOnce(t *testing.T) {
	js := newJS(t)
	st, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for what, ensure := range map[string]func(ctx context.Context) error{
		"request log": func(ctx context.Context) error {
			_, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{Subjects: messages.Subjects{Prefix: "r3"}, Replicas: 3})
			return err
		},
		"consumer": func(ctx context.Context) error {
			_, err := bus.EnsureSchedulerConsumer(ctx, st, 0, 3)
			return err
		},
		"plan stream": func(ctx context.Context) error {
			_, err := bus.EnsurePlanStream(ctx, js, messages.Subjects{}, 3, time.Minute)
			return err
		},
	} {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		start := time.Now()
		err := ensure(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "replicas") || time.Since(start) > 3*time.Second {
			t.Errorf("%s with 3 replicas on one server: %v after %s; want the server's refusal at once", what, err, time.Since(start).Round(time.Millisecond))
		}
	}
}
