package bus_test

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/testenv"
)

// TestServerBadTLSFiles: each bad or missing TLS file of kvbus nats fails
// at start naming its flag (and the file), never nats-server's own option
// names. Before, --tls-cert alone said "missing 'key_file' in TLS
// configuration", a --tls-ca holding no certificate "failed to parse root
// ca certificate" (no file, no flag), a missing one or a key that is not
// the certificate's named no flag.
func TestServerBadTLSFiles(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	_, _, cert, key := writeCert(t, dir, "server", false, ca, caKey)
	_, _, _, otherKey := writeCert(t, dir, "other", false, ca, caKey)
	garbage := filepath.Join(dir, "garbage.pem")
	if err := os.WriteFile(garbage, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.pem")
	for _, tc := range []struct {
		name          string
		cert, key, ca string
		want          []string
	}{
		{"cert without key", cert, "", "", []string{"--tls-cert", "--tls-key"}},
		{"key without cert", "", key, "", []string{"--tls-key", "--tls-cert"}},
		{"key of another certificate", cert, otherKey, "", []string{"--tls-cert", "--tls-key", otherKey}},
		{"missing key", cert, missing, "", []string{"--tls-key", missing}},
		{"garbage key", cert, garbage, "", []string{"--tls-key", garbage}},
		{"missing CA", cert, key, missing, []string{"--tls-ca", missing}},
		{"CA without a certificate", cert, key, garbage, []string{"--tls-ca", garbage}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), TLSCert: tc.cert, TLSKey: tc.key, TLSCA: tc.ca})
			if err == nil {
				srv.Shutdown()
				t.Fatal("started")
			}
			if !errors.Is(err, bus.ErrServer) {
				t.Errorf("%v does not wrap bus.ErrServer", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%v: does not say %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "key_file") || strings.Contains(err.Error(), "cert_file") {
				t.Errorf("%v: names nats-server's option, not the flag", err)
			}
		})
	}
	_ = caPath
}

// TestRoutesWithoutClusterAddr: --routes without --cluster-addr, and
// --cluster-addr without --routes, are refused at start naming the flag to
// add. Before, the routes were ignored and the
// server ran alone, saying nothing: three servers started that way never
// formed a cluster.
func TestRoutesWithoutClusterAddr(t *testing.T) {
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), Routes: []string{"nats://127.0.0.1:6222"}})
	if err == nil {
		srv.Shutdown()
		t.Fatal("--routes without --cluster-addr started a server that runs alone")
	}
	if !errors.Is(err, bus.ErrServer) || !strings.Contains(err.Error(), "--cluster-addr") {
		t.Errorf("--routes without --cluster-addr: %v, want a refusal naming --cluster-addr", err)
	}
	// The reverse, a clustered JetStream with no routes, never became
	// ready: the error came after 30 s asking whether the port was in use.
	start := time.Now()
	srv, err = bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), ServerName: "n1", Cluster: "127.0.0.1:0"})
	if err == nil {
		srv.Shutdown()
		t.Fatal("--cluster-addr without --routes started")
	}
	if !errors.Is(err, bus.ErrServer) || !strings.Contains(err.Error(), "--routes") || time.Since(start) > 5*time.Second {
		t.Errorf("--cluster-addr without --routes: %v after %s, want a refusal at once naming --routes", err, time.Since(start).Round(time.Millisecond))
	}
	// A cluster password alone is said, not refused: the server runs alone
	// as asked.
	log, logs := captureLogger(slog.LevelInfo)
	srv, err = bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), ClusterPassword: "route-secret-3", Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	srv.Shutdown()
	if !strings.Contains(logs.String(), "--cluster-addr") || strings.Contains(logs.String(), "route-secret-3") {
		t.Errorf("a cluster password without --cluster-addr: want a warning naming --cluster-addr (and not the password):\n%s", logs)
	}
}

// TestRouteCertMustVerifyAgainstTheCA: with --cluster-addr and TLS, the
// routes verify each other's certificates against --tls-ca (the system's
// roots without it), so a server certificate that does not verify there is
// refused at start, naming --tls-ca. Before, such a server started, and
// its cluster never formed: every route logged "certificate signed by
// unknown authority" while clients connected fine.
func TestRouteCertMustVerifyAgainstTheCA(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	_, _, cert, key := writeCert(t, dir, "n1", false, ca, caKey)
	_, _, clientCAPath, _ := writeCert(t, dir, "client-ca", true, nil, nil)
	cl := testenv.FreeAddrs(t, 2)
	routes := []string{"nats://" + cl[1]}
	for _, tc := range []struct {
		name, ca string
		want     []string
	}{
		{"no --tls-ca: the system's roots", "", []string{"--tls-ca", "system"}},
		{"--tls-ca of another CA", clientCAPath, []string{"--tls-ca", clientCAPath, cert}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), ServerName: "n1", Cluster: cl[0], ClusterName: "kvbus",
				ClusterPassword: "route-secret-4", TLSCert: cert, TLSKey: key, TLSCA: tc.ca, Routes: routes})
			if err == nil {
				srv.Shutdown()
				t.Fatal("started a clustered server whose routes no peer can verify")
			}
			for _, w := range tc.want {
				if !errors.Is(err, bus.ErrServer) || !strings.Contains(err.Error(), w) {
					t.Errorf("%v: want bus.ErrServer saying %q", err, w)
				}
			}
		})
	}
	// A --tls-ca holding both CAs verifies clients and routes.
	both := filepath.Join(dir, "both.pem")
	a, _ := os.ReadFile(caPath)
	b, _ := os.ReadFile(clientCAPath)
	if err := os.WriteFile(both, append(a, b...), 0o600); err != nil {
		t.Fatal(err)
	}
	startCfg(t, bus.ServerConfig{ServerName: "n1", Cluster: cl[0], ClusterName: "kvbus", ClusterPassword: "route-secret-4", TLSCert: cert, TLSKey: key, TLSCA: both,
		Routes: routes})
	// Not clustered, a --tls-ca of the clients' CA alone is right.
	startCfg(t, bus.ServerConfig{TLSCert: cert, TLSKey: key, TLSCA: clientCAPath})
}

// TestServerLogSaysWhyRoutesFail: a clustered server without --server-name
// is warned about at start (every kvbus nats on the same port has the same
// default name), and the server's log lines about a duplicate server name
// and a refused cluster password say which flag to fix (and that SIGHUP
// reads a rotated password file again). Before, two servers
// on different hosts with the default name refused each other's routes and
// the log said only "Remote server has a duplicate name", and a rotated
// password only "authentication error".
func TestServerLogSaysWhyRoutesFail(t *testing.T) {
	cl := testenv.FreeAddrs(t, 3)
	log1, logs1 := captureLogger(slog.LevelInfo)
	n1 := startCfg(t, bus.ServerConfig{Cluster: cl[0], ClusterName: "kvbus", ClusterPassword: "route-secret-5", Logger: log1,
		Routes: []string{"nats://" + cl[1]}})
	if !strings.Contains(logs1.String(), "--server-name") {
		t.Errorf("no warning about a clustered server without --server-name:\n%s", logs1)
	}
	// Same name as n1's default.
	startCfg(t, bus.ServerConfig{ServerName: n1.Name(), Cluster: cl[1], ClusterName: "kvbus", ClusterPassword: "route-secret-5", Routes: []string{routeURL(n1)}})
	waitFor(t, 10*time.Second, "n1 to say what to do about a duplicate server name", func() bool {
		return strings.Contains(logs1.String(), "duplicate name") && strings.Contains(logs1.String(), "hint=") &&
			strings.Contains(logs1.String(), "its own --server-name")
	})
	// Another cluster password.
	startCfg(t, bus.ServerConfig{ServerName: "n3", Cluster: cl[2], ClusterName: "kvbus", ClusterPassword: "route-secret-6", Routes: []string{routeURL(n1)}})
	waitFor(t, 10*time.Second, "n1 to say what to do about a route with another password", func() bool {
		return strings.Contains(logs1.String(), "authentication error") && strings.Contains(logs1.String(), "--cluster-password-file")
	})
	// A rotated password is read again on SIGHUP (Reload): no server needs a
	// restart, which would make every role reconnect.
	if !strings.Contains(logs1.String(), "SIGHUP") || strings.Contains(logs1.String(), "restart every kvbus nats") {
		t.Errorf("the hint about another cluster password should say to send SIGHUP, not to restart the servers:\n%s", logs1)
	}
	if strings.Contains(logs1.String(), "route-secret") {
		t.Errorf("a cluster password is in the log:\n%s", logs1)
	}
}

// TestRoutesWithAClusterCA: servers whose certificates come from a private
// CA route over TLS with --cluster-tls-ca while clients connect with TLS
// and no certificate of their own (no --tls-ca); a server of another CA does
// not route in. Before, the routes' CA was --tls-ca, which also demands a
// certificate of every client: TLS routes of a private CA meant mutual TLS
// for every role. --cluster-tls-ca without routes, or without the server's
// own certificate, is refused naming the flag.
func TestRoutesWithAClusterCA(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	_, _, cert1, key1 := writeCert(t, dir, "n1", false, ca, caKey)
	_, _, cert2, key2 := writeCert(t, dir, "n2", false, ca, caKey)
	other, otherKey, _, _ := writeCert(t, dir, "other-ca", true, nil, nil)
	_, _, cert3, key3 := writeCert(t, dir, "n3", false, other, otherKey)
	const pw = "route-secret-7"
	cl := testenv.FreeAddrs(t, 3)
	n1 := startCfg(t, bus.ServerConfig{ServerName: "n1", Cluster: cl[0], ClusterName: "kvbus", ClusterPassword: pw,
		TLSCert: cert1, TLSKey: key1, ClusterTLSCA: caPath, Routes: []string{"nats://" + cl[1]}})
	n2 := startCfg(t, bus.ServerConfig{ServerName: "n2", Cluster: cl[1], ClusterName: "kvbus", ClusterPassword: pw,
		TLSCert: cert2, TLSKey: key2, ClusterTLSCA: caPath, Routes: []string{routeURL(n1)}})
	foreign, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), ServerName: "n3", Cluster: cl[2], ClusterName: "kvbus",
		ClusterPassword: pw, TLSCert: cert3, TLSKey: key3, ClusterTLSCA: caPath, Routes: []string{routeURL(n1)}})
	if err == nil {
		foreign.Shutdown()
		t.Error("a server whose certificate is not of --cluster-tls-ca started")
	} else if !strings.Contains(err.Error(), "--cluster-tls-ca") {
		t.Errorf("a server of another CA: %v, want an error naming --cluster-tls-ca", err)
	}
	waitFor(t, 10*time.Second, "n1 and n2 to route over TLS", func() bool { return n1.NumRoutes() > 0 && n2.NumRoutes() > 0 })
	if v, err := n1.Varz(nil); err != nil || !v.Cluster.TLSRequired || !v.Cluster.TLSVerify || v.TLSVerify {
		t.Errorf("n1: routes TLS %v verified %v, clients verified %v (%v); want TLS routes verified, clients not asked for a certificate",
			v.Cluster.TLSRequired, v.Cluster.TLSVerify, v.TLSVerify, err)
	}
	// A client with the CA to verify the server, and no certificate.
	connectTo(t, n2.ClientURL(), nats.RootCAs(caPath))

	for _, tc := range []struct {
		name string
		cfg  bus.ServerConfig
	}{
		{"no routes", bus.ServerConfig{TLSCert: cert1, TLSKey: key1, ClusterTLSCA: caPath}},
		{"no certificate", bus.ServerConfig{ServerName: "n4", Cluster: "127.0.0.1:0", Routes: []string{routeURL(n1)}, ClusterPassword: pw, ClusterTLSCA: caPath}},
	} {
		tc.cfg.Addr, tc.cfg.DataDir = "127.0.0.1:0", t.TempDir()
		if srv, err := bus.StartServer(tc.cfg); err == nil {
			srv.Shutdown()
			t.Errorf("%s: --cluster-tls-ca accepted", tc.name)
		} else if !strings.Contains(err.Error(), "--cluster-tls-ca") {
			t.Errorf("%s: %v, want an error naming --cluster-tls-ca", tc.name, err)
		}
	}
}

// TestClusterPasswordRotatedOnReload: with ClusterPasswordFile, Reload
// (SIGHUP) reads the password again: a server routing in with the rotated
// password is refused before and joins after, without a restart; a file
// left empty is refused and changes nothing; neither password is logged.
// Before, the password was read at start only and a rotation meant
// restarting every server.
func TestClusterPasswordRotatedOnReload(t *testing.T) {
	cl := testenv.FreeAddrs(t, 2)
	pwFile := filepath.Join(t.TempDir(), "cluster-password")
	if err := os.WriteFile(pwFile, []byte("route-secret-old\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	log1, logs1 := captureLogger(slog.LevelInfo)
	n1 := startCfg(t, bus.ServerConfig{ServerName: "n1", Cluster: cl[0], ClusterName: "kvbus", ClusterPasswordFile: pwFile, Logger: log1,
		Routes: []string{"nats://" + cl[1]}})
	n2 := startCfg(t, bus.ServerConfig{ServerName: "n2", Cluster: cl[1], ClusterName: "kvbus", ClusterPassword: "route-secret-new", Routes: []string{routeURL(n1)}})
	// Routed: a message published on n1 reaches a subscriber on n2.
	nc1, nc2 := connectTo(t, n1.ClientURL()), connectTo(t, n2.ClientURL())
	sub, err := nc2.SubscribeSync("routed")
	if err != nil {
		t.Fatal(err)
	}
	if err := nc2.Flush(); err != nil {
		t.Fatal(err)
	}
	routed := func() bool {
		if err := nc1.Publish("routed", nil); err != nil {
			t.Fatal(err)
		}
		_, err := sub.NextMsg(100 * time.Millisecond)
		return err == nil
	}
	waitFor(t, 10*time.Second, "n1 to refuse the route with the rotated password", func() bool {
		return strings.Contains(logs1.String(), "authentication error")
	})
	if routed() {
		t.Fatal("a message crossed from n1 to n2 before the rotation")
	}
	if err := os.WriteFile(pwFile, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := n1.Reload(); err == nil || !strings.Contains(err.Error(), "empty") {
		t.Errorf("Reload with an empty password file: %v; want it refused", err)
	}
	if err := os.WriteFile(pwFile, []byte("route-secret-new\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := n1.Reload(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 15*time.Second, "a message routed from n1 to n2 with the rotated password", routed)
	if strings.Contains(logs1.String(), "route-secret") {
		t.Errorf("a cluster password is in the log:\n%s", logs1)
	}
}
