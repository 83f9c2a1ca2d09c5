package bus_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/testenv"
)

// TestReconnectRefusedByTLSIsSaid: a role connected over TLS whose NATS
// server comes back with a certificate its --nats-tls-ca does not verify
// (a new CA), or that refuses its client certificate (mutual TLS with
// another CA), keeps reconnecting, and now says why, once, with what to
// do, also while another of its servers is down. Before, it logged "nats disconnected" and nothing more while every
// reconnect failed, for as long as it ran.
func TestReconnectRefusedByTLSIsSaid(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	_, _, srvCert, srvKey := writeCert(t, dir, "server", false, ca, caKey)
	_, _, cliCert, cliKey := writeCert(t, dir, "client", false, ca, caKey)
	newCA, newKey, newCAPath, _ := writeCert(t, dir, "new-ca", true, nil, nil)
	_, _, newSrvCert, newSrvKey := writeCert(t, dir, "new-server", false, newCA, newKey)

	for _, tc := range []struct {
		name    string
		restart bus.ServerConfig
		want    string
	}{
		{"server certificate of another CA", bus.ServerConfig{TLSCert: newSrvCert, TLSKey: newSrvKey}, "the server's TLS certificate did not verify"},
		{"client certificate refused", bus.ServerConfig{TLSCert: srvCert, TLSKey: srvKey, TLSCA: newCAPath}, "the server refused this client's certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), TLSCert: srvCert, TLSKey: srvKey, TLSCA: caPath})
			if err != nil {
				t.Fatal(err)
			}
			addr := srv.Addr().String()
			log, logs := captureLogger(slog.LevelInfo)
			// A second server that is down: its attempts clear the first
			// one's error at once.
			down := testenv.FreeAddrs(t, 1)[0]
			nc, err := bus.Connect(t.Context(), bus.Config{URL: "tls://" + addr + ",tls://" + down, Name: "kvbus-worker", TLSCA: caPath, TLSCert: cliCert, TLSKey: cliKey, Logger: log})
			if err != nil {
				srv.Shutdown()
				t.Fatal(err)
			}
			defer nc.Close()
			srv.Shutdown()
			cfg := tc.restart
			cfg.Addr, cfg.DataDir = addr, t.TempDir()
			srv2, err := bus.StartServer(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer srv2.Shutdown()
			waitFor(t, 15*time.Second, "the role to say why it cannot reconnect", func() bool {
				return strings.Contains(logs.String(), tc.want)
			})
			time.Sleep(time.Second) // more refusals, said once
			if n := strings.Count(logs.String(), tc.want); n != 1 {
				t.Errorf("said %d times, want once:\n%s", n, logs)
			}
			if !nc.IsReconnecting() {
				t.Errorf("the connection stopped reconnecting (status %v)", nc.Status())
			}
		})
	}
}

// TestEnsureRequestStreamStoppedSaysNoServerTrouble: a role that stops
// while it makes the request log (its context cancelled) gets an error
// wrapping context.Canceled that blames no server. Before, a scheduler
// stopping during a NATS restart logged "create stream KVBUS_REQUESTS:
// context canceled (is JetStream enabled on the server?)".
func TestEnsureRequestStreamStoppedSaysNoServerTrouble(t *testing.T) {
	srv := startServer(t, "")
	nc := connectTo(t, srv.ClientURL())
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err = bus.EnsureRequestStream(ctx, js, bus.StreamConfig{})
	if !errors.Is(err, context.Canceled) || strings.Contains(err.Error(), "JetStream enabled") {
		t.Errorf("a stopped EnsureRequestStream: %v, want context.Canceled blaming no server", err)
	}
}
