package bus_test

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/testenv"
)

// syncBuffer is a bytes.Buffer safe for a logger and a test to share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// captureLogger logs at level into a buffer.
func captureLogger(level slog.Level) (*slog.Logger, *syncBuffer) {
	buf := &syncBuffer{}
	return slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: level})), buf
}

// writeAuthConfig writes a nats-server authorization block with one user,
// app/secret, allowed everything.
func writeAuthConfig(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "nats-auth.conf")
	conf := "authorization {\n  users = [ { user: app, password: secret } ]\n}\n"
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func startCfg(t *testing.T, cfg bus.ServerConfig) *bus.Server {
	t.Helper()
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	if cfg.DataDir == "" {
		cfg.DataDir = t.TempDir()
	}
	if cfg.Logger == nil {
		cfg.Logger, _ = captureLogger(slog.LevelError)
	}
	srv, err := bus.StartServer(cfg)
	if err != nil {
		t.Fatalf("start %s: %v", cfg.ServerName, err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

func routeURL(srv *bus.Server) string { return "nats://" + srv.ClusterAddr().String() }

func waitFor(t *testing.T, d time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func connectTo(t *testing.T, url string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, append(opts, nats.MaxReconnects(0))...)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// TestRoutesRequireClusterAuth: on a cluster whose clients need keys
// (--auth-config), a server without the cluster password cannot route in,
// so its anonymous client neither reads the cluster's subjects nor
// publishes into it; a server with it joins. Without route authentication
// such a cluster is refused at start, naming the flag to add. Before, the
// route port took any server, and the rogue's client got everything.
func TestRoutesRequireClusterAuth(t *testing.T) {
	conf := writeAuthConfig(t)
	const pw = "route-secret-1"
	if _, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), AuthConfig: conf, Cluster: "127.0.0.1:0"}); err == nil ||
		!strings.Contains(err.Error(), "--cluster-password") {
		t.Fatalf("--auth-config with --cluster-addr and no route authentication: %v, want a refusal naming --cluster-password", err)
	}
	if _, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), Token: "tok", Cluster: "127.0.0.1:0"}); err == nil ||
		!strings.Contains(err.Error(), "--cluster-password") {
		t.Fatalf("--token with --cluster-addr and no route authentication: %v, want a refusal", err)
	}
	log1, logs1 := captureLogger(slog.LevelInfo)
	cl := testenv.FreeAddrs(t, 3)
	n1 := startCfg(t, bus.ServerConfig{ServerName: "n1", AuthConfig: conf, Cluster: cl[0], ClusterName: "kvbus", ClusterPassword: pw, Logger: log1,
		Routes: []string{"nats://" + cl[1]}})
	n2 := startCfg(t, bus.ServerConfig{ServerName: "n2", AuthConfig: conf, Cluster: cl[1], ClusterName: "kvbus", ClusterPassword: pw,
		Routes: []string{routeURL(n1)}})
	rogue := startCfg(t, bus.ServerConfig{ServerName: "rogue", Cluster: cl[2], ClusterName: "kvbus", Routes: []string{routeURL(n1)}})
	waitFor(t, 10*time.Second, "n2 to route to n1", func() bool { return n1.NumRoutes() > 0 && n2.NumRoutes() > 0 })
	// The rogue has tried (and been refused) by the time n1 logged it.
	waitFor(t, 10*time.Second, "n1 to log the rogue's refused route", func() bool { return strings.Contains(logs1.String(), "authentication error") })
	if strings.Contains(logs1.String(), pw) {
		t.Errorf("the cluster password is in the log:\n%s", logs1)
	}

	app := nats.UserInfo("app", "secret")
	pub := connectTo(t, n1.ClientURL(), app)
	member := connectTo(t, n2.ClientURL(), app)
	anon := connectTo(t, rogue.ClientURL())
	memberMsgs, err := member.SubscribeSync("kvbus.>")
	if err != nil {
		t.Fatal(err)
	}
	rogueMsgs, err := anon.SubscribeSync("kvbus.meta.>")
	if err != nil {
		t.Fatal(err)
	}
	n1Msgs, err := pub.SubscribeSync("kvbus.req.>")
	if err != nil {
		t.Fatal(err)
	}
	for _, nc := range []*nats.Conn{pub, member, anon} {
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	// The member's interest reaches n1 over the route: publish until it
	// gets one.
	waitFor(t, 10*time.Second, "a message published on n1 to reach n2's client", func() bool {
		if err := pub.Publish("kvbus.meta.g0.x", []byte("prompt")); err != nil {
			t.Fatal(err)
		}
		_, err := memberMsgs.NextMsg(50 * time.Millisecond)
		return err == nil
	})
	if err := anon.Publish("kvbus.req.forged", []byte("forged")); err != nil {
		t.Fatal(err)
	}
	_ = anon.Flush()
	if m, err := rogueMsgs.NextMsg(500 * time.Millisecond); err == nil {
		t.Errorf("the rogue server's anonymous client read %s from the cluster", m.Subject)
	}
	if m, err := n1Msgs.NextMsg(200 * time.Millisecond); err == nil {
		t.Errorf("the rogue server's anonymous client published %s into the cluster", m.Subject)
	}
	if rogue.NumRoutes() != 0 {
		t.Errorf("the rogue server has %d routes", rogue.NumRoutes())
	}
}

// TestRoutesUseTLS: with --tls-cert/--tls-key/--tls-ca and a cluster, the
// routes are TLS and verify the peer against the CA: two such servers
// route, one with the password but plaintext routes cannot, nor can one
// whose certificate another CA signed. Before, --tls-* applied to clients
// only and routes were plaintext.
func TestRoutesUseTLS(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	_, _, cert1, key1 := writeCert(t, dir, "n1", false, ca, caKey)
	_, _, cert2, key2 := writeCert(t, dir, "n2", false, ca, caKey)
	otherCA, otherKey, otherCAPath, _ := writeCert(t, dir, "other-ca", true, nil, nil)
	_, _, cert3, key3 := writeCert(t, dir, "n3", false, otherCA, otherKey)
	const pw = "route-secret-2"
	cl := testenv.FreeAddrs(t, 4)
	n1 := startCfg(t, bus.ServerConfig{ServerName: "n1", Cluster: cl[0], ClusterName: "kvbus", ClusterPassword: pw,
		TLSCert: cert1, TLSKey: key1, TLSCA: caPath, Routes: []string{"nats://" + cl[1]}})
	if v, err := n1.Varz(nil); err != nil || !v.Cluster.TLSRequired || !v.Cluster.TLSVerify {
		t.Fatalf("n1's routes: TLS required %v, verify %v (%v)", v.Cluster.TLSRequired, v.Cluster.TLSVerify, err)
	}
	plain := startCfg(t, bus.ServerConfig{ServerName: "plain", Cluster: cl[2], ClusterName: "kvbus", ClusterPassword: pw, Routes: []string{routeURL(n1)}})
	foreign := startCfg(t, bus.ServerConfig{ServerName: "foreign", Cluster: cl[3], ClusterName: "kvbus", ClusterPassword: pw,
		TLSCert: cert3, TLSKey: key3, TLSCA: otherCAPath, Routes: []string{routeURL(n1)}})
	n2 := startCfg(t, bus.ServerConfig{ServerName: "n2", Cluster: cl[1], ClusterName: "kvbus", ClusterPassword: pw,
		TLSCert: cert2, TLSKey: key2, TLSCA: caPath, Routes: []string{routeURL(n1)}})
	waitFor(t, 10*time.Second, "n2 to route to n1 over TLS", func() bool { return n1.NumRoutes() > 0 && n2.NumRoutes() > 0 })
	time.Sleep(500 * time.Millisecond) // the others have had their tries
	if plain.NumRoutes() != 0 || foreign.NumRoutes() != 0 {
		t.Errorf("routes of a plaintext server %d, of one with another CA's certificate %d: want 0", plain.NumRoutes(), foreign.NumRoutes())
	}
	rz, err := n1.Routez(nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rz.Routes {
		if r.RemoteName != "n2" {
			t.Errorf("n1 has a route to %s", r.RemoteName)
		}
	}
}
