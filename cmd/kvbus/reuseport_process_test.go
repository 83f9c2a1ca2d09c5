//go:build linux

package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestFrontendReplacedOnItsPort: an operator replaces the only frontend of
// a cluster (each role its own process of the real binary) while eight
// clients, half of them streaming, send each next request the moment the
// last answer came, on kept-alive connections. With --reuse-port the new frontend listens on the
// same address before the old one gets SIGTERM; the old one's listener
// closes at once, the requests still sent on its connections are served
// with Connection: close, and it exits. No request fails, and both
// processes answered some (the fault took effect: the old one is gone,
// the new one answers alone after), and after SIGTERM the old one answers
// at most three requests per client. (A streamed answer's Connection:
// keep-alive overrode the stopping frontend's close: its streaming clients
// stayed on it, hundreds of requests, until their connections were closed
// under them.) Without --reuse-port the new process
// cannot listen until the old one has stopped: measured on the same
// cluster, 16 clients met 128 errors (503 shutting_down, then refused
// connections) in one replacement.
func TestFrontendReplacedOnItsPort(t *testing.T) {
	bin, dir, natsAddr, _ := startNATSProc(t)
	bus := []string{"--nats-url", "nats://" + natsAddr}
	startProc(t, bin, dir, "scheduler", append([]string{"scheduler", "--metrics-addr", freeAddr(t)}, bus...)...)
	for r := range 4 {
		startProc(t, bin, dir, fmt.Sprint("worker-", r), append([]string{"worker", "--group", "g0", "--tp-rank", fmt.Sprint(r),
			"--tp-size", "4", "--time-scale", "0", "--kv-capacity", "64MiB", "--metrics-addr", freeAddr(t)}, bus...)...)
	}
	httpAddr := freeAddr(t)
	base := "http://" + httpAddr
	frontend := func(name string) *proc {
		return startProc(t, bin, dir, name, append([]string{"frontend", "--http-addr", httpAddr, "--reuse-port"}, bus...)...)
	}
	old := frontend("frontend-old")
	testenv.Eventually(t, 60*time.Second, "/healthz 200", func() bool { return healthz(base+"/healthz") == http.StatusOK })

	var (
		ok, afterExit atomic.Int64
		oldGone       atomic.Bool
		mu            sync.Mutex
		failures      []string
		wg            sync.WaitGroup
	)
	stop := make(chan struct{})
	for c := range 8 {
		stream := c%2 == 0 // half the clients stream
		body := fmt.Sprintf(`{"model":"kvbus-sim","messages":[{"role":"user","content":"replace me"}],"max_tokens":4,"ignore_eos":true,"stream":%v}`, stream)
		wg.Go(func() {
			client := &http.Client{Timeout: 30 * time.Second}
			defer client.CloseIdleConnections()
			for {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := client.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
				var b []byte
				if err == nil {
					b, _ = io.ReadAll(resp.Body)
					resp.Body.Close()
				}
				if err != nil || resp.StatusCode != http.StatusOK || stream && (!bytes.Contains(b, []byte("data: [DONE]")) || bytes.Contains(b, []byte(`"error"`))) {
					mu.Lock()
					failures = append(failures, fmt.Sprintf("%v %s", err, b))
					mu.Unlock()
					continue
				}
				ok.Add(1)
				if oldGone.Load() {
					afterExit.Add(1)
				}
			}
		})
	}
	time.Sleep(time.Second)
	replacement := frontend("frontend-new")
	testenv.Eventually(t, 60*time.Second, "the new frontend listening", func() bool {
		b, _ := os.ReadFile(replacement.log)
		return bytes.Contains(b, []byte(`"frontend listening"`))
	})
	time.Sleep(500 * time.Millisecond)
	began := time.Now()
	if err := old.stop(t); err != nil {
		t.Errorf("the old frontend's exit: %v", err)
	}
	oldGone.Store(true)
	took := time.Since(began)
	time.Sleep(time.Second)
	close(stop)
	wg.Wait()

	served := func(p *proc) int {
		b, _ := os.ReadFile(p.log)
		return bytes.Count(b, []byte(`"request completed"`))
	}
	t.Logf("%d requests answered, %d after the old frontend exited (%s after SIGTERM); old answered %d (%d after SIGTERM), new %d; %d failed",
		ok.Load(), afterExit.Load(), took.Round(time.Millisecond), served(old), servedSince(t, old, began), served(replacement), len(failures))
	if len(failures) > 0 {
		t.Errorf("%d requests failed across the replacement, want none; the first: %s", len(failures), failures[0])
	}
	// After SIGTERM a client's connection to the old frontend carries the
	// request in flight and at most one more, answered with Connection:
	// close (and one that ended as the signal was on its way: 3 per client
	// at most; 11-12 of 8 clients under -race).
	if n := servedSince(t, old, began); n > 3*8 {
		t.Errorf("the old frontend answered %d requests after SIGTERM, more than 3 per client: its clients did not move to the new one", n)
	}
	if served(old) == 0 || served(replacement) == 0 || afterExit.Load() < 10 {
		t.Errorf("old answered %d, new %d, %d after the old one's exit: the replacement did not happen under load", served(old), served(replacement), afterExit.Load())
	}
}

// servedSince counts the requests p's log says it answered after since.
func servedSince(t *testing.T, p *proc, since time.Time) int {
	t.Helper()
	b, err := os.ReadFile(p.log)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range bytes.Split(b, []byte("\n")) {
		var line struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal(l, &line) == nil && line.Msg == "request completed" && line.Time.After(since) {
			n++
		}
	}
	return n
}
