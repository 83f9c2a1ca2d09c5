package main

import (
	"bytes"
	"io"
	"net/http"
	"path/filepath"
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
