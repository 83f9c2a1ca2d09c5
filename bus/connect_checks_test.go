package bus_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestConnectClientCertRefused: a server that refuses the client's
// certificate (mutual TLS: none given, one from another CA, an expired one)
// fails the connection at once, saying so, not after 10 s of retries
// advising to start a server; an expired certificate is warned about
// before connecting.
func TestConnectClientCertRefused(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	_, _, srvCert, srvKey := writeCert(t, dir, "server", false, ca, caKey)
	other, otherKey, _, _ := writeCert(t, dir, "other-ca", true, nil, nil)
	_, _, strangerCert, strangerKey := writeCert(t, dir, "stranger", false, other, otherKey)
	_, _, expiredCert, expiredKey := writeCertValid(t, dir, "expired", false, ca, caKey, time.Now().Add(-48*time.Hour), time.Now().Add(-24*time.Hour))
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), TLSCert: srvCert, TLSKey: srvKey, TLSCA: caPath})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	url := "tls://" + srv.Addr().String()
	for _, tc := range []struct {
		name      string
		cert, key string
		warns     string
	}{
		{"no client certificate", "", "", ""},
		{"a certificate of another CA", strangerCert, strangerKey, ""},
		{"an expired certificate", expiredCert, expiredKey, "the client certificate has expired"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log, logs := captureLogger(slog.LevelInfo)
			start := time.Now()
			_, err := bus.Connect(t.Context(), bus.Config{URL: url, TLSCA: caPath, TLSCert: tc.cert, TLSKey: tc.key, Logger: log})
			took := time.Since(start)
			if !errors.Is(err, bus.ErrConnect) {
				t.Fatalf("Connect = %v, want ErrConnect", err)
			}
			if took > 3*time.Second {
				t.Errorf("took %s: a refused certificate was retried as if NATS were down", took)
			}
			if !strings.Contains(err.Error(), "the server refused this client's certificate (mutual TLS)") ||
				!strings.Contains(err.Error(), "--nats-tls-cert/--nats-tls-key signed by the CA of the server's --tls-ca, not expired") ||
				strings.Contains(err.Error(), "kvbus nats") {
				t.Errorf("the error does not say the certificate was refused: %v", err)
			}
			if tc.warns != "" && !strings.Contains(logs.String(), tc.warns) {
				t.Errorf("no warning %q in:\n%s", tc.warns, logs)
			}
		})
	}
}

// TestConnectBadTLSFiles: a CA file that holds no certificate, a
// certificate that is no PEM and a key that is not the certificate's fail
// at once naming the flag, before anything connects (they were retried for
// 10 s as if NATS were down).
func TestConnectBadTLSFiles(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	_, _, cliCert, _ := writeCert(t, dir, "client", false, ca, caKey)
	_, _, _, otherKey := writeCert(t, dir, "other", false, ca, caKey)
	garbage := filepath.Join(dir, "garbage.pem")
	if err := os.WriteFile(garbage, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// No server: a check that connects would wait for one.
	url := "tls://127.0.0.1:1"
	for _, tc := range []struct {
		name string
		cfg  bus.Config
		says string
	}{
		{"a CA file with garbage", bus.Config{TLSCA: garbage}, "--nats-tls-ca " + garbage + " holds no PEM certificate"},
		{"a missing CA file", bus.Config{TLSCA: filepath.Join(dir, "none.pem")}, "--nats-tls-ca"},
		{"a certificate and another key", bus.Config{TLSCA: caPath, TLSCert: cliCert, TLSKey: otherKey}, "--nats-tls-cert " + cliCert},
		{"a garbage certificate", bus.Config{TLSCA: caPath, TLSCert: garbage, TLSKey: otherKey}, "--nats-tls-cert " + garbage},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.URL, cfg.ConnectTimeout, cfg.Logger = url, 10*time.Second, slog.New(slog.DiscardHandler)
			start := time.Now()
			_, err := bus.Connect(t.Context(), cfg)
			if took := time.Since(start); took > time.Second {
				t.Errorf("took %s: a bad local file was retried", took)
			}
			if !errors.Is(err, bus.ErrConnect) || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("Connect = %v, want ErrConnect saying %q", err, tc.says)
			}
			if err != nil && strings.Contains(err.Error(), "start one with") {
				t.Errorf("a bad local file is advised to start a server: %v", err)
			}
		})
	}
}

// TestConnectCancelledSaysTheLastError: a Connect whose context ends while
// it retries says why it could not connect, not only "context deadline
// exceeded" (what `kvbus auth probe` printed); and its error wraps the
// context's, so that a caller tells a stop from a failure (it wrapped only
// ErrConnect: a role stopped by SIGTERM while it waited for NATS exited 1).
func TestConnectCancelledSaysTheLastError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	ctx, cancel := context.WithTimeout(t.Context(), 600*time.Millisecond)
	defer cancel()
	_, err = bus.Connect(ctx, bus.Config{URL: "nats://" + addr, ConnectTimeout: 10 * time.Second, Logger: slog.New(slog.DiscardHandler)})
	if !errors.Is(err, bus.ErrConnect) || !strings.Contains(err.Error(), "context deadline exceeded") ||
		!strings.Contains(err.Error(), "no servers available") || !strings.Contains(err.Error(), "kvbus nats") {
		t.Errorf("Connect = %v, want the deadline, the last error (no servers available) and the advice", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Connect = %v, which does not wrap the context's error", err)
	}
}

// TestConfigValidateSaysWhatItSaw: conflicting credentials name the
// settings seen (one may come from the environment); a password without a
// user is refused rather than ignored.
func TestConfigValidateSaysWhatItSaw(t *testing.T) {
	err := bus.Config{NKeySeedFile: "w.nk", Token: "t"}.Validate()
	for _, want := range []string{"--nats-nkey (KVBUS_NATS_NKEY)", "--nats-token (KVBUS_NATS_TOKEN)", "KVBUS_* environment variable"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate = %v, want it to say %q", err, want)
		}
	}
	if err != nil && strings.Contains(err.Error(), "--nats-creds") {
		t.Errorf("Validate names a setting not given: %v", err)
	}
	if err := (bus.Config{Password: "secret"}).Validate(); err == nil || !strings.Contains(err.Error(), "--nats-password needs --nats-user") {
		t.Errorf("a password without a user: Validate = %v", err)
	}
	if err := (bus.Config{User: "u", Password: "secret"}).Validate(); err != nil {
		t.Errorf("user and password: %v", err)
	}
}

// TestConnectWarnsAboutReadableSeeds: a seed file others may read is
// accepted, with a warning naming it and chmod 600; a 0600 one is not
// warned about.
func TestConnectWarnsAboutReadableSeeds(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t)
	seed := filepath.Join(dir, "worker.nk")
	for _, mode := range []os.FileMode{0o600, 0o644} {
		if err := os.Chmod(seed, mode); err != nil {
			t.Fatal(err)
		}
		log, logs := captureLogger(slog.LevelInfo)
		nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), NKeySeedFile: seed, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		nc.Close()
		warned := strings.Contains(logs.String(), "chmod 600 "+seed) && strings.Contains(logs.String(), "readable by other users")
		if warned != (mode != 0o600) {
			t.Errorf("mode %04o: warned %v; logs:\n%s", mode, warned, logs)
		}
		if n := strings.Count(logs.String(), "readable by other users"); n > 1 {
			t.Errorf("mode %04o: warned %d times", mode, n)
		}
	}
}

// TestConnectClosedAfterAServerError: a message the server answers with an
// error that nats.go never reconnects after (here a subject over the
// server's 4096-byte control line) closes the connection for good: OnClosed
// says so, so that the role ends instead of answering every request 503
// "not connected to NATS" for as long as it runs. Before, only a refusal
// of the credentials was reported, and a frontend served nothing more.
func TestConnectClosedAfterAServerError(t *testing.T) {
	srv := testenv.StartNATS(t)
	log, logs := captureLogger(slog.LevelInfo)
	closed := make(chan error, 2)
	nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), Name: "frontend", Logger: log,
		OnClosed: func(err error) { closed <- err }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if err := nc.Publish("kvbus.req."+strings.Repeat("x", 5000), []byte("x")); err != nil {
		t.Fatal(err)
	}
	_ = nc.Flush()
	select {
	case err := <-closed:
		if !errors.Is(err, bus.ErrClosed) || !strings.Contains(err.Error(), "maximum control line") {
			t.Errorf("OnClosed(%v), want ErrClosed naming the server's error", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("OnClosed not called within 10 s of the server's error (connection closed: %v); logs:\n%s", nc.IsClosed(), logs)
	}
	if !strings.Contains(logs.String(), "nats connection closed") {
		t.Errorf("the close was not logged:\n%s", logs)
	}
}

// TestConnectClosedAfterItsKeyIsRefused: when the server refuses a role's
// key at a reconnect (rotated, NATS restarted), nats.go closes the
// connection despite reconnecting forever: OnClosed says so, with advice,
// so that the role ends instead of running on a closed connection. A close
// by the role itself (Close, Drain) is not reported.
func TestConnectClosedAfterItsKeyIsRefused(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t)
	addr := srv.Addr().String()
	log, logs := captureLogger(slog.LevelInfo)
	closed := make(chan error, 3)
	connect := func(key string) *nats.Conn {
		nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), Name: key, NKeySeedFile: filepath.Join(dir, key+".nk"),
			InboxPrefix: bus.InboxPrefix(key, ""), Logger: log, OnClosed: func(err error) { closed <- err }})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc
	}
	worker, frontend, scheduler := connect("worker"), connect("frontend"), connect("scheduler")
	frontend.Close()
	bus.Drain(t.Context(), scheduler)
	if err := auth.Rotate(dir, messages.Subjects{}, "worker"); err != nil {
		t.Fatal(err)
	}
	srv.Shutdown()
	srv2, err := bus.StartServer(bus.ServerConfig{Addr: addr, DataDir: t.TempDir(), AuthConfig: filepath.Join(dir, auth.ConfigFile)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv2.Shutdown)
	select {
	case err := <-closed:
		if !errors.Is(err, bus.ErrClosed) || !strings.Contains(err.Error(), "the server refused this role's credentials after a reconnect "+
			"(rotated key? restart the role with its new seed)") {
			t.Errorf("OnClosed(%v), want ErrClosed with the advice", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("OnClosed not called within 15 s of the key's refusal")
	}
	if !worker.IsClosed() {
		t.Error("the worker's connection is not closed")
	}
	if !strings.Contains(logs.String(), "rotated key? restart the role with its new seed") {
		t.Errorf("the refusal was not logged with the advice:\n%s", logs)
	}
	select {
	case err := <-closed:
		t.Errorf("a second OnClosed (a deliberate close reported?): %v", err)
	case <-time.After(200 * time.Millisecond):
	}
}

// TestConnectRefusesURLsNoAttemptCanReach: a --nats-url with a scheme
// nats.go does not speak (the frontend's http:// address by mistake) or a
// port out of range fails at once, naming the flag and what to give; both
// were retried for 10 s as a server down, then the role advised starting
// one. URLs nats.go takes (host:port without a scheme, tls://, ws://) are
// still tried.
func TestConnectRefusesURLsNoAttemptCanReach(t *testing.T) {
	for _, url := range []string{"http://127.0.0.1:8000", "nats://127.0.0.1:4222, https://u:hunter2@x:443",
		"nats://127.0.0.1:99999", "nats://127.0.0.1:0"} {
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		start := time.Now()
		_, err := bus.Connect(ctx, bus.Config{URL: url, ConnectTimeout: 2 * time.Second, Logger: slog.New(slog.DiscardHandler)})
		cancel()
		if !errors.Is(err, bus.ErrConnect) || !strings.Contains(err.Error(), "--nats-url") || strings.Contains(err.Error(), "start one") ||
			strings.Contains(err.Error(), "hunter2") || time.Since(start) > time.Second {
			t.Errorf("%s: %v after %v; want an error at once naming --nats-url and what to give, without the password", url, err, time.Since(start).Round(time.Millisecond))
		}
	}
	srv := testenv.StartNATS(t)
	for _, url := range []string{srv.Addr().String(), srv.ClientURL()} {
		nc, err := bus.Connect(t.Context(), bus.Config{URL: url, ConnectTimeout: 2 * time.Second, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Errorf("%s: %v; nats.go takes it", url, err)
			continue
		}
		nc.Close()
	}
}

// TestConnectNamesTheNKeyFlag: an nkey seed file that cannot be read (a
// wrong path, a file that holds no seed) is refused naming --nats-nkey and
// what to give; the error named neither the flag nor what it wants.
func TestConnectNamesTheNKeyFlag(t *testing.T) {
	notSeed := filepath.Join(t.TempDir(), "notseed.nk")
	if err := os.WriteFile(notSeed, []byte("hello\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{filepath.Join(t.TempDir(), "missing.nk"), notSeed} {
		_, err := bus.Connect(t.Context(), bus.Config{URL: "nats://127.0.0.1:1", NKeySeedFile: path, ConnectTimeout: time.Second,
			Logger: slog.New(slog.DiscardHandler)})
		if !errors.Is(err, bus.ErrConnect) || !strings.Contains(err.Error(), "--nats-nkey") || !strings.Contains(err.Error(), "kvbus auth init") {
			t.Errorf("seed %s: %v; want an error naming --nats-nkey and where seeds come from", path, err)
		}
	}
}

// TestConnectChecksTheCredsFileFirst: a --nats-creds file that holds no
// nkey seed fails at once, naming the flag and what to give; each attempt
// failed signing the server's nonce and was retried for the whole connect
// timeout, then the role advised starting a NATS server.
func TestConnectChecksTheCredsFileFirst(t *testing.T) {
	srv := testenv.StartNATS(t)
	notCreds := filepath.Join(t.TempDir(), "user.creds")
	if err := os.WriteFile(notCreds, []byte("hello\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), CredsFile: notCreds, ConnectTimeout: 3 * time.Second,
		Logger: slog.New(slog.DiscardHandler)})
	if !errors.Is(err, bus.ErrConnect) || !strings.Contains(err.Error(), "--nats-creds") || strings.Contains(err.Error(), "start one") ||
		time.Since(start) > time.Second {
		t.Errorf("a creds file with no seed: %v after %v; want an error at once naming --nats-creds", err, time.Since(start).Round(time.Millisecond))
	}
}
