package bus_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
)

// TestServerLogsRefusedClients: without --debug, the server logs a client
// refused its credentials ("authentication error") and a failed TLS
// handshake, with the remote address; a client retrying the same bad
// password is logged once, and its repeats as one count. Before, nothing
// was logged unless --debug.
func TestServerLogsRefusedClients(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	_, _, srvCert, srvKey := writeCert(t, dir, "server", false, ca, caKey)
	log, logs := captureLogger(slog.LevelInfo)
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), AuthConfig: writeAuthConfig(t), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	const tries = 8
	for range tries {
		if nc, err := nats.Connect(srv.ClientURL(), nats.UserInfo("app", "wrong"), nats.MaxReconnects(0)); err == nil {
			nc.Close()
			t.Fatal("a wrong password connected")
		}
	}
	waitFor(t, 5*time.Second, "the refused password in the log", func() bool { return strings.Contains(logs.String(), "authentication error") })
	srv.Shutdown()
	var full, counted []string
	for _, line := range strings.Split(logs.String(), "\n") {
		if !strings.Contains(line, "authentication error") {
			continue
		}
		if strings.Contains(line, "repeated=") {
			counted = append(counted, line)
		} else {
			full = append(full, line)
		}
	}
	if len(full) != 1 || !strings.Contains(full[0], "level=ERROR") || !strings.Contains(full[0], "remote=127.0.0.1:") {
		t.Errorf("%d refused connections logged as %q: want one error line with the remote address", tries, full)
	}
	if len(counted) != 1 || !strings.Contains(counted[0], "repeated=7") {
		t.Errorf("the repeats: %q, want one line with repeated=7", counted)
	}
	if strings.Contains(logs.String(), "Starting nats-server") {
		t.Errorf("the start-up banner is logged at info:\n%s", logs)
	}

	// TLS: a client without the client certificate --tls-ca requires.
	log, logs = captureLogger(slog.LevelInfo)
	tlsSrv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), TLSCert: srvCert, TLSKey: srvKey, TLSCA: caPath, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer tlsSrv.Shutdown()
	if nc, err := nats.Connect("tls://"+tlsSrv.Addr().String(), nats.RootCAs(caPath), nats.MaxReconnects(0), nats.Timeout(time.Second)); err == nil {
		nc.Close()
		t.Fatal("a client without a certificate connected")
	}
	waitFor(t, 5*time.Second, "the failed handshake in the log", func() bool { return strings.Contains(logs.String(), "TLS handshake error") })
	if !strings.Contains(logs.String(), "remote=127.0.0.1:") {
		t.Errorf("the handshake error does not name the client:\n%s", logs)
	}
}

// TestServerDebugLog: --debug adds the server's debug output.
func TestServerDebugLog(t *testing.T) {
	log, logs := captureLogger(slog.LevelDebug)
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), Debug: true, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	nc.Close()
	srv.Shutdown()
	if !strings.Contains(logs.String(), "level=DEBUG") || !strings.Contains(logs.String(), "Client connection created") {
		t.Errorf("no debug output with Debug:\n%s", logs)
	}
}
