package bus_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
)

// TestReloadTakesNewUsersAndCertificates: Reload (kvbus nats on SIGHUP)
// applies a rewritten authorization file and renewed certificate files to
// the running server: a user added after the start connects, a removed one
// is refused (and its connection closed), clients that stay keep their
// connection, and a new client verifies the new certificate. A broken file
// changes nothing. Before, every key change and certificate renewal needed
// a restart of the server, and every client reconnected.
func TestReloadTakesNewUsersAndCertificates(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	_, _, certPath, keyPath := writeCert(t, dir, "srv", false, ca, caKey)
	authPath := filepath.Join(dir, "nats-auth.conf")
	writeUsers := func(users ...string) {
		t.Helper()
		var b strings.Builder
		b.WriteString("authorization {\n  users = [\n")
		for _, u := range users {
			b.WriteString("    { user: " + u + ", password: secret }\n")
		}
		b.WriteString("  ]\n}\n")
		if err := os.WriteFile(authPath, []byte(b.String()), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeUsers("stays", "leaves")
	srv := startCfg(t, bus.ServerConfig{AuthConfig: authPath, TLSCert: certPath, TLSKey: keyPath})
	connect := func(user, ca string) (*nats.Conn, error) {
		return nats.Connect(srv.ClientURL(), nats.UserInfo(user, "secret"), nats.RootCAs(ca), nats.MaxReconnects(0))
	}
	stays, err := connect("stays", caPath)
	if err != nil {
		t.Fatal(err)
	}
	defer stays.Close()
	leaves, err := connect("leaves", caPath)
	if err != nil {
		t.Fatal(err)
	}
	defer leaves.Close()
	if _, err := connect("joins", caPath); err == nil {
		t.Fatal("a user not in the file connected")
	}

	// A renewed certificate from another CA, and the users rewritten.
	ca2, ca2Key, ca2Path, _ := writeCert(t, t.TempDir(), "ca2", true, nil, nil)
	_, _, cert2, key2 := writeCert(t, t.TempDir(), "srv2", false, ca2, ca2Key)
	for from, to := range map[string]string{cert2: certPath, key2: keyPath} {
		data, err := os.ReadFile(from)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(to, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeUsers("stays", "joins")
	if err := srv.Reload(); err != nil {
		t.Fatal(err)
	}
	joins, err := connect("joins", ca2Path)
	if err != nil {
		t.Fatalf("a user added to the file, with the renewed certificate's CA: %v", err)
	}
	joins.Close()
	if _, err := connect("stays", caPath); err == nil {
		t.Error("a new client verified the old certificate after the reload")
	}
	waitFor(t, 5*time.Second, "the removed user's connection closed", leaves.IsClosed)
	if !stays.IsConnected() || stays.Stats().Reconnects != 0 {
		t.Errorf("a user kept by the file: connected %v, reconnects %d; want its connection kept", stays.IsConnected(), stays.Stats().Reconnects)
	}

	// A broken file: refused, nothing changes.
	if err := os.WriteFile(authPath, []byte("authorization { users = [ \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := srv.Reload(); !errors.Is(err, bus.ErrServer) || !strings.Contains(err.Error(), authPath) {
		t.Errorf("reload of a broken file: %v, want bus.ErrServer naming it", err)
	}
	if nc, err := connect("joins", ca2Path); err != nil {
		t.Errorf("after a refused reload: %v, want the users of the last good file", err)
	} else {
		nc.Close()
	}
}
