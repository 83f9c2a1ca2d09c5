package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// signal sends sig to the process.
func (p *proc) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("%s: %v", p.name, err)
	}
}

// exitWithin waits up to d for the process to exit and returns its exit
// code (-1: killed by a signal); ok is false when it is still running.
func (p *proc) exitWithin(d time.Duration) (code int, ok bool) {
	select {
	case err := <-p.done:
		p.done <- err // for the cleanup
		var ee *exec.ExitError
		switch {
		case err == nil:
			return 0, true
		case errors.As(err, &ee):
			return ee.ExitCode(), true
		}
		return -1, true
	case <-time.After(d):
		return 0, false
	}
}

// logged waits up to d for the process's log to contain s.
// stopsAtTheSecondSignal: p, with a request in flight, logs each of said
// at the first sig and goes on; at the second it logs so and exits within
// 5 s with code.
func (p *proc) stopsAtTheSecondSignal(t *testing.T, sig syscall.Signal, code int, said ...string) {
	t.Helper()
	p.signal(t, sig)
	wait := 10 * time.Second // the first line; the others follow it
	for _, s := range said {
		p.logged(t, wait, s)
		wait = time.Second
	}
	if got, ok := p.exitWithin(500 * time.Millisecond); ok {
		t.Fatalf("%s exited (%d) at the first %v with a request in flight", p.name, got, sig)
	}
	p.signal(t, sig)
	if got, ok := p.exitWithin(5 * time.Second); !ok || got != code {
		t.Fatalf("%s after a second %v: exited %v, code %d; want an exit within 5 s with %d", p.name, sig, ok, got, code)
	}
	p.logged(t, time.Second, fmt.Sprintf("%s again: stopping at once, without finishing", signalName(sig)))
}

func (p *proc) logged(t *testing.T, d time.Duration, s string) {
	t.Helper()
	testenv.Eventually(t, d, fmt.Sprintf("%s logging %q", p.name, s), func() bool {
		b, _ := os.ReadFile(p.log)
		return strings.Contains(string(b), s)
	})
}

// slowStream starts a streaming chat completion of max_tokens tokens and
// returns once its first chunk arrived; the request stays open until the
// test ends.
func slowStream(t *testing.T, base string, maxTokens int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	body := fmt.Sprintf(`{"messages":[{"role":"user","content":"tell me a long story"}],"max_tokens":%d,"ignore_eos":true,"stream":true}`, maxTokens)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); resp.Body.Close(); <-done })
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		close(done)
		t.Fatalf("streaming request: %d %s", resp.StatusCode, b)
	}
	first := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(resp.Body)
		sent := false
		for sc.Scan() {
			if !sent && strings.HasPrefix(sc.Text(), "data:") {
				close(first)
				sent = true
			}
		}
		if !sent {
			close(first)
		}
	}()
	select {
	case <-first:
	case <-time.After(30 * time.Second):
		t.Fatal("no first chunk within 30 s")
	}
}

// probe GETs url: its status (0: no answer) and JSON body.
func probe(url string) (int, map[string]string) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, nil
	}
	defer resp.Body.Close()
	var v map[string]string
	_ = json.NewDecoder(resp.Body).Decode(&v)
	return resp.StatusCode, v
}

// drainingProbes: a role that is stopping (name) answers on base /healthz
// 503 draining, /livez and /metrics 200.
func drainingProbes(t *testing.T, name, base string) {
	t.Helper()
	if code, v := probe(base + "/healthz"); code != http.StatusServiceUnavailable || v["status"] != "draining" {
		t.Errorf("%s's /healthz: %d %v, want 503 draining", name, code, v)
	}
	if code, _ := probe(base + "/livez"); code != http.StatusOK {
		t.Errorf("%s's /livez: %d, want 200", name, code)
	}
	if code, _ := probe(base + "/metrics"); code != http.StatusOK {
		t.Errorf("%s's /metrics: %d, want 200", name, code)
	}
}

// TestProcessStopSignals runs NATS, a scheduler, a worker and a frontend
// as processes of the real binary, with a slow streaming request in
// flight, and stops them as an operator (or Kubernetes) does.
//
// The frontend: the first SIGTERM logs that it stops, the request it
// finishes and how long it may take; a second SIGTERM ends it at once with
// 143 (it was silently ignored: signal.NotifyContext kept catching).
//
// The scheduler, watching the request it placed until it ends: while it
// stops, /healthz answers 503 "draining" and /livez 200 (they closed the
// moment SIGTERM came: "connection refused"); it exits 0 once the request
// is over.
//
// The worker, still running the request: while it drains, /healthz 503
// "draining", /livez 200, and /metrics is scraped; a second SIGTERM ends
// it with 143.
func TestProcessStopSignals(t *testing.T) {
	bin, dir, natsAddr, natsProc := startNATSProc(t)
	httpAddr, schedMetrics, workerMetrics := freeAddr(t), freeAddr(t), freeAddr(t)
	bus := []string{"--nats-url", "nats://" + natsAddr}
	sched := startProc(t, bin, dir, "scheduler", append([]string{"scheduler", "--metrics-addr", schedMetrics, "--heartbeat-timeout", "1s"}, bus...)...)
	worker := startProc(t, bin, dir, "worker", append([]string{"worker", "--group", "g0", "--tp-rank", "0", "--ep-rank", "0", "--tp-size", "1",
		"--kv-capacity", "64MiB", "--heartbeat-interval", "200ms", "--decode-per-token", "50ms", "--shutdown-timeout", "60s",
		"--metrics-addr", workerMetrics}, bus...)...)
	fe := startProc(t, bin, dir, "frontend", append([]string{"frontend", "--http-addr", httpAddr, "--request-timeout", "120s"}, bus...)...)
	base := "http://" + httpAddr
	testenv.Eventually(t, 60*time.Second, "the frontend's /healthz 200", func() bool { return healthz(base+"/healthz") == http.StatusOK })
	slowStream(t, base, 2000) // 100 s of decoding

	// The frontend.
	fe.stopsAtTheSecondSignal(t, syscall.SIGTERM, 143, "SIGTERM: stopping: finishing 1 request in flight",
		"up to 4m6s (2 × --request-timeout + 1s + 5s NATS drain); send the signal again to stop at once")

	// The scheduler watches the request it placed, which the worker still
	// runs.
	sched.signal(t, syscall.SIGTERM)
	sched.logged(t, 10*time.Second, "SIGTERM: stopping: taking no new requests, watching the 1 request in flight it placed until they end")
	drainingProbes(t, "the stopping scheduler", "http://"+schedMetrics)

	// The worker.
	worker.signal(t, syscall.SIGTERM)
	worker.logged(t, 10*time.Second, "SIGTERM: stopping: finishing 1 request in flight (its group takes no new ones) within --shutdown-timeout")
	wbase := "http://" + workerMetrics
	drainingProbes(t, "the draining worker", wbase)
	resp, err := http.Get(wbase + "/metrics")
	if err != nil {
		t.Errorf("the draining worker's /metrics: %v", err)
	} else {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), "kvbus_worker_queue_depth") {
			t.Errorf("the draining worker's /metrics: %d, %d bytes without kvbus_worker_queue_depth", resp.StatusCode, len(b))
		}
	}
	if code, ok := worker.exitWithin(0); ok {
		t.Fatalf("the worker exited (%d) with a request in flight and --shutdown-timeout 60s", code)
	}
	worker.signal(t, syscall.SIGTERM)
	if code, ok := worker.exitWithin(5 * time.Second); !ok || code != 143 {
		t.Fatalf("the worker after a second SIGTERM: exited %v, code %d; want an exit within 5 s with 143", ok, code)
	}
	worker.logged(t, time.Second, "SIGTERM again: stopping at once, without finishing")

	// The scheduler's request is over (its group is gone): it exits 0 of
	// itself, and NATS on SIGTERM.
	if code, ok := sched.exitWithin(40 * time.Second); !ok || code != 0 {
		t.Errorf("the scheduler after one SIGTERM: exited %v, code %d; want 0", ok, code)
	}
	if err := natsProc.stop(t); err != nil {
		t.Errorf("nats: %v", err)
	}
}

// TestProcessServeSIGINTTwice: Ctrl-C on `kvbus serve` with a slow request
// in flight says what it finishes and how to stop at once; a second Ctrl-C
// ends it at once with 130 (it was ignored until the request ended).
func TestProcessServeSIGINTTwice(t *testing.T) {
	p, base := startServe(t, "--decode-per-token", "50ms")
	slowStream(t, base, 2000) // 100 s of decoding
	p.stopsAtTheSecondSignal(t, syscall.SIGINT, 130,
		"SIGINT: stopping: finishing 1 request in flight (new ones get 503 shutting_down), then stopping the schedulers and the ranks",
		"send the signal again to stop at once")
}

// TestProcessServeStopTimeout: `kvbus serve --stop-timeout 2s` stopped with
// a 100 s stream and a 100 s non-streamed request in flight ends both with
// a retryable 503 shutting_down (an error event then [DONE] in the stream)
// within the bound, and exits 0. Without the bound the stop waited up to
// --request-timeout for them, and an orchestrator's SIGKILL at the end of
// its grace period cut them with a connection reset.
func TestProcessServeStopTimeout(t *testing.T) {
	p, base := startServe(t, "--decode-per-token", "50ms", "--stop-timeout", "2s", "--request-timeout", "5m")
	type answer struct {
		status int
		body   string
	}
	send := func(stream bool) <-chan answer {
		out := make(chan answer, 1)
		body := fmt.Sprintf(`{"messages":[{"role":"user","content":"a long story"}],"max_tokens":2000,"ignore_eos":true,"stream":%v}`, stream)
		go func() {
			resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
			if err != nil {
				out <- answer{0, err.Error()}
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			out <- answer{resp.StatusCode, string(b)}
		}()
		return out
	}
	streamed, whole := send(true), send(false)
	testenv.Eventually(t, 10*time.Second, "both requests generating", func() bool {
		b, _ := os.ReadFile(p.log)
		return strings.Count(string(b), `"msg":"store thread"`) >= 2
	})
	stopped := time.Now()
	p.signal(t, syscall.SIGTERM)
	for name, ch := range map[string]<-chan answer{"the stream": streamed, "the non-streamed request": whole} {
		select {
		case a := <-ch:
			took := time.Since(stopped)
			if !strings.Contains(a.body, `"code":"shutting_down"`) || took > 5*time.Second {
				t.Errorf("%s ended %v after SIGTERM with %d %.300s; want shutting_down within the 2 s bound", name, took, a.status, a.body)
			}
			if name == "the stream" && (a.status != http.StatusOK || !strings.HasSuffix(strings.TrimSpace(a.body), "data: [DONE]")) {
				t.Errorf("the stream: status %d, ends %q; want 200 with an error event then [DONE]", a.status, a.body[max(0, len(a.body)-120):])
			}
			if name == "the non-streamed request" && a.status != http.StatusServiceUnavailable {
				t.Errorf("the non-streamed request: status %d, want 503", a.status)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s still running 30 s after SIGTERM with --stop-timeout 2s", name)
		}
	}
	if code, ok := p.exitWithin(30 * time.Second); !ok || code != 0 {
		t.Errorf("serve after SIGTERM: exited %v, code %d; want 0", ok, code)
	}
}

// TestProcessServeSIGHUPStopsGracefully: SIGHUP (the terminal of `kvbus
// serve` closed, an ssh session ended) stops serve as SIGTERM does: it
// says so, finishes what it accepted, flushes its log and removes its
// temporary store, and exits 0. Go's default killed it on the spot: the
// requests in flight were cut, the last log lines lost, and nothing said
// why it was gone. (`kvbus nats` reloads on SIGHUP instead.)
func TestProcessServeSIGHUPStopsGracefully(t *testing.T) {
	p, _ := startServe(t)
	p.signal(t, syscall.SIGHUP)
	code, ok := p.exitWithin(30 * time.Second)
	if !ok || code != 0 {
		t.Fatalf("after SIGHUP: exited %v, code %d; want a graceful stop, exit 0", ok, code)
	}
	p.logged(t, time.Second, "SIGHUP: stopping")
}

// startServe runs `kvbus serve` (one group of one rank, 64 MiB of KV, on
// ports of its own, with args besides) and waits for its /health.
func startServe(t *testing.T, args ...string) (p *proc, base string) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	dir := t.TempDir()
	bin := buildBinary(t, dir)
	httpAddr := freeAddr(t)
	p = startProc(t, bin, dir, "serve", append([]string{"serve", "--nats-addr", freeAddr(t), "--http-addr", httpAddr, "--groups", "1", "--ranks", "1",
		"--kv-capacity", "64MiB"}, args...)...)
	base = "http://" + httpAddr
	testenv.Eventually(t, 60*time.Second, "/health 200", func() bool { return healthz(base+"/health") == http.StatusOK })
	return p, base
}

// TestProcessStoppedWhileWaitingForNATS: a role stopped by SIGTERM while it
// still waits for NATS (started before it, or NATS restarting) stops as a
// role stopped at any other time does, with exit 0, and without advice to
// start a NATS server. It exited 1 saying "cannot connect to NATS …:
// context canceled … (start one with `kvbus nats` …)".
func TestProcessStoppedWhileWaitingForNATS(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	dir := t.TempDir()
	bin := buildBinary(t, dir)
	dead := "nats://" + freeAddr(t) // nothing listens there
	bus := []string{"--nats-url", dead}
	trace := oneRequestTrace(t, dir)
	for _, role := range [][]string{
		{"frontend", "--http-addr", freeAddr(t)},
		{"scheduler", "--metrics-addr", freeAddr(t)},
		{"replay", trace, "--target", dead}, // it exited 1, advising to start NATS
	} {
		p := startProc(t, bin, dir, role[0], append(role, bus...)...)
		p.logged(t, 30*time.Second, "cannot reach NATS yet; retrying")
		p.signal(t, syscall.SIGTERM)
		code, ok := p.exitWithin(5 * time.Second)
		if !ok || code != 0 {
			t.Errorf("%s stopped by SIGTERM while waiting for NATS: exited %v, code %d; want 0", role[0], ok, code)
		}
		if b, _ := os.ReadFile(p.log); strings.Contains(string(b), "start one with") {
			t.Errorf("%s stopped by SIGTERM is advised to start NATS:\n%s", role[0], b)
		}
	}
}
