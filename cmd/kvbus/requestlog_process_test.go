package main

import (
	"bytes"
	"fmt"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestProcessRequestLogOfAnotherSizeIsTrimmed: the frontend creates the
// request log with a small --request-log-max-bytes and the scheduler runs
// with the default (1 GiB), as when the flag is set on one role only. The
// scheduler kept half of its own limit (512 MiB) of dispatched history, so
// once the small log was full of answered requests every new one got 503
// request_log_full for a day (--request-log-max-age), with nothing waiting.
// The scheduler now trims to half the log's own limit: a request is
// answered again within a trim or two.
func TestProcessRequestLogOfAnotherSizeIsTrimmed(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	dir := t.TempDir()
	bin := buildBinary(t, dir)
	natsAddr, httpAddr := freeAddr(t), freeAddr(t)
	bus := []string{"--nats-url", "nats://" + natsAddr}
	startProc(t, bin, dir, "nats", "nats", "--addr", natsAddr, "--data-dir", filepath.Join(dir, "js"))
	const logBytes = 64 << 10
	startProc(t, bin, dir, "frontend", append([]string{"frontend", "--http-addr", httpAddr,
		"--request-log-max-bytes", fmt.Sprint(logBytes)}, bus...)...)
	base := "http://" + httpAddr
	// The frontend creates the log before it serves.
	testenv.Eventually(t, 60*time.Second, "the frontend serving", func() bool { return healthz(base+"/livez") == http.StatusOK })
	startProc(t, bin, dir, "scheduler", append([]string{"scheduler", "--metrics-addr", freeAddr(t)}, bus...)...)
	startProc(t, bin, dir, "worker", append([]string{"worker", "--group", "g0", "--tp-rank", "0", "--tp-size", "1",
		"--time-scale", "0", "--kv-capacity", "64MiB", "--metrics-addr", freeAddr(t)}, bus...)...)
	testenv.Eventually(t, 60*time.Second, "/healthz 200", func() bool { return healthz(base+"/healthz") == http.StatusOK })

	send := func(i int) (int, []byte) {
		status, _, body := testenv.Send(t, http.MethodPost, base+"/v1/chat/completions",
			fmt.Sprintf(`{"messages":[{"role":"user","content":"request %d of many"}],"max_tokens":2}`, i), nil)
		return status, body
	}
	// Send several times the log's size of requests (a few hundred bytes
	// each), until it is full: trims every 5 s may keep it from filling.
	for i := 0; i < 4*logBytes/300; i++ {
		status, body := send(i)
		if status == http.StatusServiceUnavailable && bytes.Contains(body, []byte("request_log_full")) {
			break
		}
		if status != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, status, body)
		}
	}
	// Every request was answered: the history is the scheduler's to trim.
	testenv.Eventually(t, 20*time.Second, "a request answered once the history is trimmed", func() bool {
		status, _ := send(-1)
		return status == http.StatusOK
	})
}
