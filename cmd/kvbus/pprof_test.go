package main

import (
	"bytes"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestPprofAddr: `--pprof-addr` serves Go's profiler on the real binary,
// a heap profile and a CPU profile included, and the role stops cleanly.
func TestPprofAddr(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	dir := t.TempDir()
	bin := buildBinary(t, dir)
	pprofAddr, natsAddr := freeAddr(t), freeAddr(t)
	p := startProc(t, bin, dir, "nats", "nats", "--addr", natsAddr, "--data-dir", filepath.Join(dir, "js"), "--pprof-addr", pprofAddr)
	get := func(path string) (int, []byte) {
		resp, err := http.Get("http://" + pprofAddr + path)
		if err != nil {
			return 0, nil
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	testenv.Eventually(t, 30*time.Second, "the profiler answering", func() bool { code, _ := get("/debug/pprof/"); return code == http.StatusOK })
	if code, body := get("/debug/pprof/heap?debug=1"); code != http.StatusOK || !bytes.Contains(body, []byte("heap profile")) {
		t.Errorf("heap profile: %d %.100s", code, body)
	}
	if code, body := get("/debug/pprof/profile?seconds=1"); code != http.StatusOK || len(body) < 2 || body[0] != 0x1f || body[1] != 0x8b {
		t.Errorf("CPU profile: %d, %d bytes (want a gzipped profile)", code, len(body))
	}
	if err := p.stop(t); err != nil {
		t.Errorf("exit after SIGTERM: %v", err)
	}
}

// TestPprofCmdlineHidesSecrets: pprof's /debug/pprof/cmdline served
// --api-key and the NATS password to anyone reaching --pprof-addr.
func TestPprofCmdlineHidesSecrets(t *testing.T) {
	got := strings.Join(redactArgs([]string{"kvbus", "frontend", "--api-key", "sk-1", "--nats-password=pw2",
		"--nats-url", "nats://u:pw3@h:4222", "--nats-token", "tok4", "--engine-api-key=sk-5", "--model", "m"}), " ")
	for _, secret := range []string{"sk-1", "pw2", "pw3", "tok4", "sk-5"} {
		if strings.Contains(got, secret) {
			t.Errorf("cmdline %q shows %q", got, secret)
		}
	}
	if want := "kvbus frontend --api-key xxxxx --nats-password=xxxxx --nats-url nats://u:xxxxx@h:4222 --nats-token xxxxx --engine-api-key=xxxxx --model m"; got != want {
		t.Errorf("cmdline %q, want %q", got, want)
	}
}

// TestPprofAddrSaysWhatToGive: a --pprof-addr that cannot be listened on
// (no HOST:PORT, a port out of range, a port in use) fails naming the flag
// and what to give; it named the flag and net's error alone.
func TestPprofAddrSaysWhatToGive(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	for _, addr := range []string{"banana", "127.0.0.1:99999", taken.Addr().String()} {
		stop, err := pprofFlags{PprofAddr: addr}.startPprof(t.Context(), slog.New(slog.DiscardHandler))
		if err == nil {
			stop()
		}
		if err == nil || !strings.Contains(err.Error(), "--pprof-addr") || !strings.Contains(err.Error(), "leave") {
			t.Errorf("--pprof-addr %s: %v; want an error naming the flag and what to give", addr, err)
		}
	}
}
