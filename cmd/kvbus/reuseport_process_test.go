//go:build linux

package main

import (
	"bytes"
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
// clients send each next request the moment the last answer came, on
// kept-alive connections. With --reuse-port the new frontend listens on the
// same address before the old one gets SIGTERM; the old one's listener
// closes at once, the requests still sent on its connections are served
// with Connection: close, and it exits. No request fails, and both
// processes answered some (the fault took effect: the old one is gone,
// the new one answers alone after). Without --reuse-port the new process
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
	body := `{"model":"kvbus-sim","messages":[{"role":"user","content":"replace me"}],"max_tokens":4,"ignore_eos":true}`
	for range 8 {
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
				if err != nil || resp.StatusCode != http.StatusOK {
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
	t.Logf("%d requests answered, %d after the old frontend exited (%s after SIGTERM); old answered %d, new %d; %d failed",
		ok.Load(), afterExit.Load(), took.Round(time.Millisecond), served(old), served(replacement), len(failures))
	if len(failures) > 0 {
		t.Errorf("%d requests failed across the replacement, want none; the first: %s", len(failures), failures[0])
	}
	if served(old) == 0 || served(replacement) == 0 || afterExit.Load() < 10 {
		t.Errorf("old answered %d, new %d, %d after the old one's exit: the replacement did not happen under load", served(old), served(replacement), afterExit.Load())
	}
}
