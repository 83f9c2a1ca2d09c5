package bus_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestConnectErrorRedactsPassword: a --nats-url with user:password
// (nats://user:pass@host, as nats.go takes it) is printed in the connect
// error every role shows at start-up: without its password.
func TestConnectErrorRedactsPassword(t *testing.T) {
	_, err := bus.Connect(t.Context(), bus.Config{URL: "nats://kvbus:hunter2@127.0.0.1:1,nats://tok3n@127.0.0.1:2", ConnectTimeout: 100 * time.Millisecond})
	if err == nil {
		t.Fatal("connected to port 1")
	}
	if strings.Contains(err.Error(), "hunter2") || strings.Contains(err.Error(), "tok3n") {
		t.Fatalf("the connect error shows a secret: %v", err)
	}
	if !strings.Contains(err.Error(), "nats://kvbus:xxxxx@127.0.0.1:1") || !strings.Contains(err.Error(), "start one with `kvbus nats`") {
		t.Errorf("the connect error should name the redacted URL and say to start a server: %v", err)
	}
	// A password net/url cannot parse: nats.go quotes the whole URL in its
	// error; it is redacted too, and said at once, with how to escape it.
	start := time.Now()
	_, err = bus.Connect(t.Context(), bus.Config{URL: "nats://kvbus:hun/ter2@127.0.0.1:1", ConnectTimeout: 5 * time.Second})
	if err == nil || strings.Contains(err.Error(), "ter2") || !strings.Contains(err.Error(), "escape") || time.Since(start) > 4*time.Second {
		t.Errorf("an unparsable URL with a password: %v after %s; want it redacted, at once, saying how to escape the password", err, time.Since(start))
	}
}

// TestConnectErrorRedactsPasswordAfterASpace: a --nats-url list written
// with a space after its comma ("nats://a:4222, nats://u:p@b:4222") is
// redacted too: nats.go quotes the URL it cannot parse without the space.
func TestConnectErrorRedactsPasswordAfterASpace(t *testing.T) {
	_, err := bus.Connect(t.Context(), bus.Config{URL: "nats://127.0.0.1:2, nats://kvbus:hun/ter2@127.0.0.1:1", ConnectTimeout: time.Second})
	if err == nil || strings.Contains(err.Error(), "ter2") || !strings.Contains(err.Error(), "escape") {
		t.Errorf("an unparsable URL with a password after a space: %v; want it redacted, saying how to escape the password", err)
	}
}

// TestConnectErrorShowsNoPieceOfThePassword: the reason net/url gives for a
// URL it cannot parse quotes the piece it stopped at, which may be part of
// the password ("hun" of hun/ter2 as `invalid port ":hun"`): the connect
// error leaves it out and keeps the advice on escaping.
func TestConnectErrorShowsNoPieceOfThePassword(t *testing.T) {
	for _, url := range []string{"nats://kvbus:hun/ter2@127.0.0.1:1", "nats://kvbus:se%zzret@127.0.0.1:1"} {
		_, err := bus.Connect(t.Context(), bus.Config{URL: url, ConnectTimeout: time.Second})
		if err == nil || strings.Contains(err.Error(), "hun") || strings.Contains(err.Error(), "zz") || !strings.Contains(err.Error(), "escape") {
			t.Errorf("an unparsable URL with a password: %v; want no piece of the password, saying how to escape it", err)
		}
	}
}

// TestConnectAuthErrorAdvice: a wrong credential is not "no server": the
// error says to check the credentials, at once, not after retrying for the
// whole ConnectTimeout and telling the operator to start a server.
func TestConnectAuthErrorAdvice(t *testing.T) {
	srv := startServer(t, "s3cret")
	start := time.Now()
	_, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), Token: "wrong", ConnectTimeout: 5 * time.Second})
	took := time.Since(start)
	if !errors.Is(err, bus.ErrConnect) {
		t.Fatalf("err %v", err)
	}
	if strings.Contains(err.Error(), "start one with `kvbus nats`") || !strings.Contains(err.Error(), "--nats-token") {
		t.Errorf("an authorization failure should point at the credentials: %v", err)
	}
	if took >= 4*time.Second {
		t.Errorf("an authorization failure was retried for the whole connect timeout (%s)", took)
	}
}

// TestServerTLSCAAlone: `kvbus nats --tls-ca ca.pem` ("CA to require and
// verify client certificates") without the server's own certificate would
// start a plaintext server that asks nobody for one: refused.
func TestServerTLSCAAlone(t *testing.T) {
	dir := t.TempDir()
	_, _, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), TLSCA: caPath})
	if err == nil {
		srv.Shutdown()
		t.Fatal("a server with --tls-ca and no --tls-cert started")
	}
	if !errors.Is(err, bus.ErrServer) || !strings.Contains(err.Error(), "--tls-cert") {
		t.Errorf("err = %v; want an ErrServer naming --tls-cert", err)
	}
}

// TestMonitorPortZero: port 0 asks for a free port for monitoring as it
// does for clients; nats-server alone reads it as "off".
func TestMonitorPortZero(t *testing.T) {
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), MonitorAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	if srv.MonitorAddr() == nil || srv.MonitorAddr().Port == 0 {
		t.Fatal("MonitorAddr 127.0.0.1:0 started no monitoring endpoint")
	}
}

// TestDrainWhileReconnecting: a role that stops while NATS restarts holds
// its last publishes (final outputs, rank results) in the reconnect
// buffer; Drain waits, within its context, for the server to come back and
// sends them, where it used to close the connection and drop them.
func TestDrainWhileReconnecting(t *testing.T) {
	dir := t.TempDir()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	addr := srv.Addr().String()
	admin, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	js, _ := jetstream.New(admin)
	if _, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: "OUT", Subjects: []string{"out"}, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	admin.Close()
	nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), Name: "worker"})
	if err != nil {
		t.Fatal(err)
	}
	srv.Shutdown() // NATS restarts
	for nc.IsConnected() {
		time.Sleep(10 * time.Millisecond)
	}
	if !nc.IsReconnecting() {
		t.Fatal("the connection is not reconnecting: the fault did not take effect")
	}
	if err := nc.Publish("out", []byte("final output")); err != nil { // buffered for the reconnect
		t.Fatal(err)
	}
	restarted := make(chan *bus.Server, 1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		s, err := bus.StartServer(bus.ServerConfig{Addr: addr, DataDir: dir})
		if err != nil {
			t.Error(err)
		}
		restarted <- s
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	bus.Drain(ctx, nc) // the role stops, with 10 s to drain
	srv2 := <-restarted
	if srv2 == nil {
		return
	}
	defer srv2.Shutdown()
	c2, err := nats.Connect(srv2.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	js2, _ := jetstream.New(c2)
	testenv.Eventually(t, 5*time.Second, "the publish buffered while NATS restarted to reach the stream after Drain", func() bool {
		st, err := js2.Stream(t.Context(), "OUT")
		if err != nil {
			return false
		}
		info, err := st.Info(t.Context())
		return err == nil && info.State.Msgs == 1
	})
}

// TestRequestLogPerPrefix: two deployments with their own --subject-prefix
// on one NATS keep their own request logs. Before, the stream's name was
// fixed: the second deployment found the first one's log, which holds
// none of its subjects, so every request it published was refused; and its
// schedulers attached to the first one's durable consumer and took (and
// acked) the first deployment's requests.
func TestRequestLogPerPrefix(t *testing.T) {
	js := newJS(t)
	ctx := t.Context()
	a, b := messages.Subjects{Prefix: "a"}, messages.Subjects{Prefix: "b"}
	stA, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{Subjects: a})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bus.EnsureSchedulerConsumer(ctx, stA, 0, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, a.Request("m"), []byte("a's request")); err != nil {
		t.Fatal(err)
	}
	stB, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{Subjects: b})
	if err != nil {
		t.Fatal(err)
	}
	if stA.CachedInfo().Config.Name == stB.CachedInfo().Config.Name {
		t.Fatalf("both prefixes log to stream %s", stA.CachedInfo().Config.Name)
	}
	if _, err := js.Publish(ctx, b.Request("m"), []byte("b's request"), jetstream.WithMsgID("r1")); err != nil {
		t.Fatalf("publishing a request on %s: %v", b.Request("m"), err)
	}
	consB, err := bus.EnsureSchedulerConsumer(ctx, stB, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	batch, err := consB.Fetch(2, jetstream.FetchMaxWait(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for m := range batch.Messages() {
		got = append(got, string(m.Data()))
	}
	if len(got) != 1 || got[0] != "b's request" {
		t.Errorf("prefix b's scheduler received %q, want only b's request", got)
	}
}

// TestRequestLogOfAnotherDeploymentIsRefused: a stream under this
// deployment's log name that logs other subjects (made by hand, or by
// another tool) is refused with what to do, not used to refuse every
// request later.
func TestRequestLogOfAnotherDeploymentIsRefused(t *testing.T) {
	js := newJS(t)
	if _, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: messages.Subjects{}.RequestStream(), Subjects: []string{"other.>"}}); err != nil {
		t.Fatal(err)
	}
	_, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{})
	if !errors.Is(err, bus.ErrRequestLog) || !strings.Contains(err.Error(), "--subject-prefix") {
		t.Errorf("err = %v; want ErrRequestLog saying to use another --subject-prefix", err)
	}
}

// TestRequestLogOfAnEarlierVersionIsKept: a deployment under its own
// prefix that an earlier kvbus started has its log in KVBUS_REQUESTS (the
// name was the same under every prefix). Upgraded, it goes on with that
// log and the old buckets, requests waiting in it included, instead of
// failing to create a second log for the same subjects.
func TestRequestLogOfAnEarlierVersionIsKept(t *testing.T) {
	js := newJS(t)
	ctx := t.Context()
	prod := messages.Subjects{Prefix: "prod"}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "KVBUS_REQUESTS", Subjects: []string{prod.RequestAll()}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, prod.Request("m"), []byte("waiting")); err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	st, err := bus.EnsureRequestStream(sctx, js, bus.StreamConfig{Subjects: prod})
	if err != nil {
		t.Fatal(err)
	}
	if name := st.CachedInfo().Config.Name; name != "KVBUS_REQUESTS" || st.CachedInfo().State.Msgs != 1 {
		t.Errorf("the log is %s with %d requests; want the earlier KVBUS_REQUESTS with its waiting request", name, st.CachedInfo().State.Msgs)
	}
	names, err := bus.ResolveNames(ctx, js, prod)
	if err != nil {
		t.Fatal(err)
	}
	if names != (bus.JetStreamNames{RequestStream: "KVBUS_REQUESTS", SessionBucket: "KVBUS_SESSIONS", SlotBucket: "KVBUS_RANKS"}) {
		t.Errorf("names %+v, want the earlier ones", names)
	}
	// A new deployment under another prefix on the same server gets its own.
	if names, err := bus.ResolveNames(ctx, js, messages.Subjects{Prefix: "dev"}); err != nil || names.RequestStream != "KVBUS_REQUESTS_dev" {
		t.Errorf("another prefix: %+v, %v; want KVBUS_REQUESTS_dev", names, err)
	}
}
