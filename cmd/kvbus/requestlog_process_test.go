package main

import (
	"bytes"
	"fmt"
	"net/http"
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
	send := smallLogCluster(t)
	// Trims every 5 s may keep it from filling.
	fillLog(t, send)
	// Every request was answered: the history is the scheduler's to trim.
	testenv.Eventually(t, 20*time.Second, "a request answered once the history is trimmed", func() bool {
		status, _ := send(-1)
		return status == http.StatusOK
	})
}

// TestProcessRequestLogHistoryIsHalfItsOwnCap: the frontend creates the
// request log with 64 KiB and the scheduler runs with 120 KiB and no
// --request-log-history-bytes, whose default is half the max. That half
// (60 KiB) was taken of the scheduler's flag, not of the log: it is below
// the log's cap, so it was kept, and the log had 4 KiB for requests
// between trims: after it filled, a burst of a few dozen requests got 503
// request_log_full with nothing waiting. The default is half the log's
// own cap.
func TestProcessRequestLogHistoryIsHalfItsOwnCap(t *testing.T) {
	send := smallLogCluster(t, "--request-log-max-bytes", fmt.Sprint(120<<10))
	if !fillLog(t, send) {
		t.Fatal("the log never filled")
	}
	testenv.Eventually(t, 20*time.Second, "a request answered once the history is trimmed", func() bool {
		status, _ := send(-1)
		return status == http.StatusOK
	})
	// A trim leaves half the log for new requests: 40 of a few hundred
	// bytes fit.
	refused := 0
	for i := range 40 {
		if status, body := send(1000 + i); status != http.StatusOK {
			refused++
			t.Logf("request %d after a trim: %d %s", i, status, body)
		}
	}
	if refused > 0 {
		t.Errorf("%d of 40 requests refused after a trim; want the history trimmed to half the log's 64 KiB, leaving room", refused)
	}
}

// smallLogLimit is the request log's --request-log-max-bytes in these tests.
const smallLogLimit = 64 << 10

// smallLogCluster starts NATS, a frontend that creates the request log of
// smallLogLimit bytes, then a scheduler (with schedulerArgs) and a worker,
// each its own process, and returns a function sending the i-th request.
func smallLogCluster(t *testing.T, schedulerArgs ...string) func(i int) (int, []byte) {
	bin, dir, natsAddr, _ := startNATSProc(t)
	httpAddr := freeAddr(t)
	bus := []string{"--nats-url", "nats://" + natsAddr}
	startProc(t, bin, dir, "frontend", append([]string{"frontend", "--http-addr", httpAddr,
		"--request-log-max-bytes", fmt.Sprint(smallLogLimit), "--max-body-bytes", fmt.Sprint(smallLogLimit / 4)}, bus...)...)
	base := "http://" + httpAddr
	// The frontend creates the log before it serves.
	testenv.Eventually(t, 60*time.Second, "the frontend serving", func() bool { return healthz(base+"/livez") == http.StatusOK })
	startProc(t, bin, dir, "scheduler", append(append([]string{"scheduler", "--metrics-addr", freeAddr(t)}, schedulerArgs...), bus...)...)
	startProc(t, bin, dir, "worker", append([]string{"worker", "--group", "g0", "--tp-rank", "0", "--tp-size", "1",
		"--time-scale", "0", "--kv-capacity", "64MiB", "--metrics-addr", freeAddr(t)}, bus...)...)
	testenv.Eventually(t, 60*time.Second, "/healthz 200", func() bool { return healthz(base+"/healthz") == http.StatusOK })
	return func(i int) (int, []byte) {
		status, _, body := testenv.Send(t, http.MethodPost, base+"/v1/chat/completions",
			fmt.Sprintf(`{"messages":[{"role":"user","content":"request %d of many"}],"max_tokens":2}`, i), nil)
		return status, body
	}
}

// fillLog sends up to four times the log's size of requests (a few
// hundred bytes each) until one is refused request_log_full, and says
// whether one was. Any other refusal fails the test.
func fillLog(t *testing.T, send func(int) (int, []byte)) (full bool) {
	t.Helper()
	for i := 0; i < 4*smallLogLimit/300; i++ {
		status, body := send(i)
		if status == http.StatusServiceUnavailable && bytes.Contains(body, []byte("request_log_full")) {
			return true
		}
		if status != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, status, body)
		}
	}
	return false
}
