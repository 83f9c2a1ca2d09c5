package main

import (
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestLivezAcrossANATSRestart: while NATS is away a role is not ready
// (/healthz 503) but alive (/livez 200): a liveness probe that failed then
// (it did) would restart every worker on a NATS restart and empty its KV
// store. Only a connection closed for good fails /livez.
func TestLivezAcrossANATSRestart(t *testing.T) {
	srv := testenv.StartNATS(t)
	nc := testenv.Connect(t, srv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	base := "http://" + ln.Addr().String()
	m := newMetricsServer(slog.New(slog.NewTextHandler(io.Discard, nil)), ln)
	m.serve(newRegistry(), metricsProbe{nc: nc}, func(error) {})
	defer m.close()
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var v map[string]string
		_ = json.NewDecoder(resp.Body).Decode(&v)
		return resp.StatusCode, v["status"] + " " + v["detail"]
	}
	if code, _ := get("/livez"); code != http.StatusOK {
		t.Fatalf("/livez %d while connected", code)
	}
	srv.Shutdown()
	testenv.Eventually(t, 5*time.Second, "the connection to notice the server is gone", func() bool { return !nc.IsConnected() })
	if code, body := get("/livez"); code != http.StatusOK {
		t.Errorf("/livez while NATS is away: %d %q, want 200", code, body)
	}
	if code, body := get("/healthz"); code != http.StatusServiceUnavailable {
		t.Errorf("/healthz while NATS is away: %d %q, want 503", code, body)
	}
	nc.Close()
	if code, body := get("/livez"); code != http.StatusServiceUnavailable {
		t.Errorf("/livez with the connection closed for good: %d %q, want 503", code, body)
	}
}
