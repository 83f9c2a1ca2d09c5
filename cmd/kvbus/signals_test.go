package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// syncBuffer is a bytes.Buffer safe for concurrent use.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestSignalTwiceStopsAtOnce: the first signal cancels the context and
// logs what the role does now, naming the signal; the second exits at once
// with 128 + the signal's number after saying it does not finish.
func TestSignalTwiceStopsAtOnce(t *testing.T) {
	for _, tc := range []struct {
		sig  syscall.Signal
		name string
		code int
	}{{syscall.SIGTERM, "SIGTERM", 143}, {syscall.SIGINT, "SIGINT", 130}} {
		t.Run(tc.name, func(t *testing.T) {
			var logs syncBuffer
			n := &stopNotice{}
			ctx, cancel := context.WithCancel(withStopNotice(context.Background(), n))
			defer cancel()
			onStop(ctx, slog.New(slog.NewTextHandler(&logs, nil)), func() stopPlan {
				return stopPlan{doing: "finishing " + requests(3) + " in flight", inFlight: 3, upTo: 126 * time.Second, bound: "2 × --request-timeout + 6s"}
			})
			sigs := make(chan os.Signal, 2)
			exited := make(chan int, 1)
			go watchSignals(sigs, n, cancel, func(code int) { exited <- code })

			sigs <- tc.sig
			select {
			case <-ctx.Done():
			case <-time.After(5 * time.Second):
				t.Fatal("the first signal did not end the context")
			}
			first := tc.name + ": stopping: finishing 3 requests in flight, up to 2m6s (2 × --request-timeout + 6s); send the signal again to stop at once"
			if !strings.Contains(logs.String(), first) || !strings.Contains(logs.String(), "in_flight=3") {
				t.Errorf("after the first signal the log is\n%s\nwant a line with %q and in_flight=3", logs.String(), first)
			}
			select {
			case code := <-exited:
				t.Fatalf("exit(%d) after the first signal", code)
			case <-time.After(50 * time.Millisecond):
			}

			sigs <- tc.sig
			select {
			case code := <-exited:
				if code != tc.code {
					t.Errorf("exit code %d, want %d", code, tc.code)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the second signal did not exit")
			}
			if want := tc.name + " again: stopping at once, without finishing"; !strings.Contains(logs.String(), want) {
				t.Errorf("after the second signal the log is\n%s\nwant %q", logs.String(), want)
			}
		})
	}
}

// TestSignalTwiceWithoutARole: a command that registered nothing (capture,
// replay, …) logs nothing at the first signal, and still stops at once at
// the second, saying so on its output.
func TestSignalTwiceWithoutARole(t *testing.T) {
	var out syncBuffer
	n := &stopNotice{out: &out}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sigs := make(chan os.Signal, 2)
	exited := make(chan int, 1)
	go watchSignals(sigs, n, cancel, func(code int) { exited <- code })
	sigs <- syscall.SIGINT
	<-ctx.Done()
	if out.String() != "" {
		t.Errorf("logged %q at the first signal without a role", out.String())
	}
	sigs <- syscall.SIGINT
	if code := <-exited; code != 130 {
		t.Errorf("exit code %d, want 130", code)
	}
	if !strings.Contains(out.String(), "SIGINT again: stopping at once") {
		t.Errorf("output %q", out.String())
	}
}

// TestMetricsWhileStopping: the endpoints of a scheduler or worker outlive
// the role's context: once it ends, /healthz answers 503 "draining" and
// /livez 200, /metrics is still scraped, and only close stops them.
func TestMetricsWhileStopping(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	base := "http://" + ln.Addr().String()
	reg := newRegistry()
	m := newMetricsServer(slog.New(slog.NewTextHandler(io.Discard, nil)), ln)
	stopping := make(chan struct{})
	failed := make(chan error, 1)
	m.serve(reg, metricsProbe{stopping: stopping, drainReason: "worker stopping"}, func(err error) { failed <- err })
	defer m.close()
	get := func(path string) (int, map[string]string) {
		t.Helper()
		resp, err := http.Get(base + path)
		if err != nil {
			return 0, nil
		}
		defer resp.Body.Close()
		var v map[string]string
		if path != "/metrics" {
			_ = json.NewDecoder(resp.Body).Decode(&v)
		}
		return resp.StatusCode, v
	}
	if code, _ := get("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz %d before the stop, want 200", code)
	}
	close(stopping)
	if code, v := get("/healthz"); code != http.StatusServiceUnavailable || v["status"] != "draining" || v["reason"] != "worker stopping" {
		t.Errorf("/healthz while stopping: %d %v, want 503 draining", code, v)
	}
	if code, _ := get("/livez"); code != http.StatusOK {
		t.Errorf("/livez while stopping: %d, want 200", code)
	}
	if code, _ := get("/metrics"); code != http.StatusOK {
		t.Errorf("/metrics while stopping: %d, want 200", code)
	}
	m.close()
	if code, _ := get("/livez"); code != 0 {
		t.Errorf("/livez answered %d after close", code)
	}
	select {
	case err := <-failed:
		t.Errorf("serving failed: %v", err)
	default:
	}
}
