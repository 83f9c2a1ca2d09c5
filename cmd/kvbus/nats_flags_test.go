package main

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestEmptyNATSFileSettingsAreUnset: an empty KVBUS_NATS_NKEY= or
// KVBUS_NATS_TLS_CA= (or --nats-tls-cert=) is no setting: kong's
// type:"path" made it the current directory, which then failed as a seed
// or a CA, or counted as a second credential.
func TestEmptyNATSFileSettingsAreUnset(t *testing.T) {
	t.Setenv("KVBUS_NATS_NKEY", "")
	t.Setenv("KVBUS_NATS_TLS_CA", "")
	c := parseCLI(t, "frontend", "--nats-tls-cert=", "--nats-tls-key=", "--nats-token", "t")
	cfg := c.Frontend.config("kvbus-frontend", "", nil)
	if cfg.NKeySeedFile != "" || cfg.TLSCA != "" || cfg.TLSCert != "" || cfg.TLSKey != "" {
		t.Errorf("empty settings became files: nkey %q, ca %q, cert %q, key %q", cfg.NKeySeedFile, cfg.TLSCA, cfg.TLSCert, cfg.TLSKey)
	}
	if err := cfg.Validate(); err != nil {
		t.Errorf("a token alone, with empty file settings: %v", err)
	}
	// A relative path is still made absolute, as before.
	c = parseCLI(t, "frontend", "--nats-nkey", "keys/frontend.nk")
	if cfg := c.Frontend.config("kvbus-frontend", "", nil); !filepath.IsAbs(cfg.NKeySeedFile) || !strings.HasSuffix(cfg.NKeySeedFile, "keys/frontend.nk") {
		t.Errorf("--nats-nkey keys/frontend.nk = %q, want it absolute", cfg.NKeySeedFile)
	}
}

// TestAuthInitRewritesAnOlderConfig: `kvbus auth init DIR` on a directory
// an older kvbus wrote (every role reading _INBOX.>) keeps the keys and
// rewrites nats-auth.conf with each role's own inbox; on a current one it
// still says every key is there.
func TestAuthInitRewritesAnOlderConfig(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, auth.ConfigFile)
	data, _ := os.ReadFile(conf)
	older := regexp.MustCompile(`"_INBOX_[^"]*"(, "_INBOX_[^"]*")*`).ReplaceAll(data, []byte(`"_INBOX.>"`))
	if err := os.WriteFile(conf, older, 0o644); err != nil {
		t.Fatal(err)
	}
	seed, _ := os.ReadFile(filepath.Join(dir, "worker.nk"))
	if err := (&authInitCmd{Dir: dir}).Run(); err != nil {
		t.Fatalf("auth init on an older directory: %v", err)
	}
	if now, _ := os.ReadFile(conf); strings.Contains(string(now), `"_INBOX.>"`) || !strings.Contains(string(now), `"_INBOX_worker.>"`) {
		t.Errorf("nats-auth.conf not rewritten with each role's own inbox:\n%s", now)
	}
	if now, _ := os.ReadFile(filepath.Join(dir, "worker.nk")); string(now) != string(seed) {
		t.Error("worker.nk changed")
	}
	if err := (&authInitCmd{Dir: dir}).Run(); !errors.Is(err, auth.ErrExists) {
		t.Errorf("auth init on a current directory: %v, want ErrExists", err)
	}
}

// TestRoleEndsWhenItsKeyIsRefusedAtReconnect: after `kvbus auth init
// --rotate` and a NATS restart the server refuses a running role's old
// key, and nats.go closes its connection for good: the role ends with an
// error saying what to do (the process exits non-zero), where it ran on
// for ever with a closed connection.
func TestRoleEndsWhenItsKeyIsRefusedAtReconnect(t *testing.T) {
	for _, tc := range []struct {
		role string
		args []string
	}{
		{"worker", []string{"worker", "--group", "g0", "--tp-rank", "0", "--tp-size", "1", "--time-scale", "0", "--kv-capacity", "64MiB", "--metrics-addr", ""}},
		{"scheduler", []string{"scheduler", "--metrics-addr", ""}},
		{"frontend", []string{"frontend", "--http-addr", "127.0.0.1:0"}},
	} {
		t.Run(tc.role, func(t *testing.T) {
			srv, dir := testenv.StartKeyedNATS(t, "g0")
			addr := srv.Addr().String()
			c := parseCLI(t, append(tc.args, "--nats-url", srv.ClientURL(), "--nats-nkey", filepath.Join(dir, tc.role+".nk"), "--log-level", "error")...)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			errc := make(chan error, 1)
			go func() {
				switch tc.role {
				case "worker":
					errc <- c.Worker.Run(ctx)
				case "scheduler":
					errc <- c.Scheduler.Run(ctx)
				default:
					errc <- c.Frontend.Run(ctx)
				}
			}()
			testenv.Eventually(t, 10*time.Second, "the role connected", func() bool {
				cz, err := srv.Connz(nil)
				return err == nil && cz.NumConns > 0
			})
			time.Sleep(300 * time.Millisecond) // past its start-up checks
			if err := auth.Rotate(dir, messages.Subjects{}, tc.role); err != nil {
				t.Fatal(err)
			}
			srv.Shutdown()
			srv2, err := bus.StartServer(bus.ServerConfig{Addr: addr, DataDir: t.TempDir(), AuthConfig: filepath.Join(dir, auth.ConfigFile)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(srv2.Shutdown)
			select {
			case err := <-errc:
				if !errors.Is(err, bus.ErrClosed) || !strings.Contains(err.Error(), "rotated key? restart the role with its new seed") {
					t.Errorf("Run = %v, want the refusal and its advice", err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("the role still runs 30 s after the server refused its key")
			}
		})
	}
}

// TestStrayKeyWarningNamesEveryKey: the warning about a seed file that is no
// kvbus key lists the key names there are, the observer's too (it listed
// frontend, scheduler, worker, worker-<group> and admin only).
func TestStrayKeyWarningNamesEveryKey(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	seed, _ := os.ReadFile(filepath.Join(dir, "observer.nk"))
	if err := os.WriteFile(filepath.Join(dir, "observer-old.nk"), seed, 0o600); err != nil {
		t.Fatal(err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := os.Stderr
	os.Stderr = w
	warnStrayKeys(dir)
	os.Stderr = stderr
	w.Close()
	out, _ := io.ReadAll(r)
	if !strings.Contains(string(out), "observer-old.nk") {
		t.Fatalf("no warning about observer-old.nk: %q", out)
	}
	for _, id := range auth.Identities(nil) {
		if !strings.Contains(string(out), id.Name()+",") && !strings.Contains(string(out), id.Name()+")") {
			t.Errorf("the warning does not name the key %s: %q", id.Name(), out)
		}
	}
}

// TestAuthShowSaysWhenTheConfigIsNotWhatItLists: `kvbus auth show DIR`
// lists what this kvbus gives the keys of DIR, but NATS enforces DIR's
// nats-auth.conf; when that file says otherwise (an older init, an edit, a
// key file removed since), show says so and what to run. A review removed
// kvbus.drain.g1 from the conf and worker-g2.nk from DIR: show still
// listed kvbus.drain.g1 for worker-g1, and nothing about the worker-g2 key
// the server still let in, exit 0 and silent.
func TestAuthShowSaysWhenTheConfigIsNotWhatItLists(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g1", "g2"}, false); err != nil {
		t.Fatal(err)
	}
	show := func() string {
		t.Helper()
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		stderr := os.Stderr
		os.Stderr = w
		err = (&authShowCmd{Dir: dir}).Run()
		os.Stderr = stderr
		w.Close()
		out, _ := io.ReadAll(r)
		if err != nil {
			t.Fatalf("auth show: %v", err)
		}
		return string(out)
	}
	if out := show(); out != "" {
		t.Fatalf("auth show of a current directory warned: %q", out)
	}
	conf := filepath.Join(dir, auth.ConfigFile)
	data, _ := os.ReadFile(conf)
	edited := strings.ReplaceAll(string(data), `, "kvbus.drain.g1"`, "")
	if edited == string(data) {
		t.Fatal("kvbus.drain.g1 is not in the config")
	}
	if err := os.WriteFile(conf, []byte(edited), 0o644); err != nil {
		t.Fatal(err)
	}
	if out := show(); !strings.Contains(out, conf+" does not give these keys the permissions above") ||
		!strings.Contains(out, "kvbus auth init "+dir) {
		t.Errorf("auth show of an edited config: %q, want it named and `kvbus auth init %s` advised", out, dir)
	}
	if err := (&authInitCmd{Dir: dir}).Run(); err != nil {
		t.Fatal(err)
	}
	if out := show(); out != "" {
		t.Errorf("auth show after auth init rewrote the config: %q, want silence", out)
	}
	if err := os.Remove(filepath.Join(dir, "worker-g2.nk")); err != nil {
		t.Fatal(err)
	}
	if out := show(); !strings.Contains(out, "does not give these keys") {
		t.Errorf("auth show with a key file removed (its user still in the config): %q, want the warning", out)
	}
	if err := os.Remove(conf); err != nil {
		t.Fatal(err)
	}
	if out := show(); !strings.Contains(out, conf+" is missing") {
		t.Errorf("auth show without a config: %q, want it said missing", out)
	}
}
