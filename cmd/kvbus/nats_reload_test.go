package main

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/messages"
)

// TestNATSReloadsKeysOnSIGHUP: `kvbus auth init DIR` adds a key to a running
// deployment (here the observer key of a directory made before it existed)
// and `kill -HUP` makes the running `kvbus nats` take it, the connected
// clients untouched; before, it took a restart of the server, and every
// role reconnected. A broken file sent with SIGHUP is refused and logged,
// and the server runs on.
func TestNATSReloadsKeysOnSIGHUP(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	dir := t.TempDir()
	bin := buildBinary(t, dir)
	keys := filepath.Join(dir, "keys")
	if _, err := auth.Init(keys, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	// A directory as an older kvbus wrote it: no observer key.
	if err := os.Remove(filepath.Join(keys, "observer.nk")); err != nil {
		t.Fatal(err)
	}
	if _, err := auth.RewriteConfig(keys, messages.Subjects{}); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	p := startProc(t, bin, dir, "nats", "nats", "--addr", addr, "--data-dir", filepath.Join(dir, "js"), "--auth-config", filepath.Join(keys, auth.ConfigFile))
	p.logged(t, 30*time.Second, "nats server ready")
	connect := func(key string) (*nats.Conn, error) {
		o, err := nats.NkeyOptionFromSeed(filepath.Join(keys, key+".nk"))
		if err != nil {
			return nil, err
		}
		return nats.Connect("nats://"+addr, o, nats.MaxReconnects(0))
	}
	admin, err := connect("admin")
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()

	// The observer key is added to the running deployment.
	if _, err := auth.Init(keys, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	if nc, err := connect("observer"); err == nil {
		nc.Close()
		t.Fatal("the new key connected before the reload")
	}
	p.signal(t, syscall.SIGHUP)
	p.logged(t, 10*time.Second, "reloaded the authorization and TLS files")
	observer, err := connect("observer")
	if err != nil {
		t.Fatalf("the key added, after SIGHUP: %v", err)
	}
	observer.Close()
	if !admin.IsConnected() || admin.Stats().Reconnects != 0 {
		t.Errorf("a connected client: connected %v, reconnects %d; want it untouched", admin.IsConnected(), admin.Stats().Reconnects)
	}

	if err := os.WriteFile(filepath.Join(keys, auth.ConfigFile), []byte("authorization {"), 0o600); err != nil {
		t.Fatal(err)
	}
	p.signal(t, syscall.SIGHUP)
	p.logged(t, 10*time.Second, "the configuration was not reloaded")
	if nc, err := connect("observer"); err != nil {
		t.Errorf("after a refused reload: %v, want the keys of the last good file", err)
	} else {
		nc.Close()
	}
	if err := p.stop(t); err != nil {
		t.Errorf("kvbus nats exited with %v on SIGTERM", err)
	}
}
