package frontend

import (
	"errors"
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/internal/logbuf"
)

// tempErr is a temporary accept error, as EMFILE is to net/http.
type tempErr struct{}

func (tempErr) Error() string   { return "accept tcp 127.0.0.1:8000: accept4: too many open files" }
func (tempErr) Timeout() bool   { return false }
func (tempErr) Temporary() bool { return true }

// flakyListener fails every other Accept with tempErr, n times, then
// waits to be closed; the accepts in between succeed (a pipe), so that
// net/http retries within 5 ms each time, as at the file descriptor limit.
type flakyListener struct {
	n      atomic.Int32
	closed chan struct{}
	once   sync.Once
}

func (l *flakyListener) Accept() (net.Conn, error) {
	n := l.n.Add(1)
	switch {
	case n > 200:
		<-l.closed
		return nil, net.ErrClosed
	case n%2 == 1:
		return nil, tempErr{}
	}
	c, other := net.Pipe()
	other.Close()
	return c, nil
}
func (l *flakyListener) Close() error   { l.once.Do(func() { close(l.closed) }); return nil }
func (l *flakyListener) Addr() net.Addr { return &net.TCPAddr{} }

// TestAcceptErrorsLoggedOncePerWindow: net/http logs every failed accept,
// ~90 lines a second at the file descriptor limit (a review's `ulimit -n
// 256` run); the frontend's HTTP server logs the first, then at most one
// per 10 s with the count left out and what to do.
func TestAcceptErrorsLoggedOncePerWindow(t *testing.T) {
	var logs logbuf.Buffer
	var mu sync.Mutex
	now := time.Unix(1000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	w := newErrorLogWriter(slog.NewTextHandler(&logs, nil), acceptErrorEvery, clock)
	l := &flakyListener{closed: make(chan struct{})}
	srv := &http.Server{Handler: http.NotFoundHandler(), ErrorLog: log.New(w, "", 0)}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(l) }()
	deadline := time.Now().Add(30 * time.Second)
	for l.n.Load() <= 200 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := strings.Count(logs.String(), "http: Accept error"); got != 1 {
		t.Errorf("%d accept error lines for 100 failed accepts within the window, want 1:\n%s", got, logs.String())
	}
	mu.Lock()
	now = now.Add(11 * time.Second)
	mu.Unlock()
	_, _ = w.Write([]byte("http: Accept error: " + tempErr{}.Error() + "; retrying in 5ms\n"))
	if !strings.Contains(logs.String(), "(and 99 more in the last 11s: the process may be out of file descriptors") {
		t.Errorf("after the window, no line counting the 99 left out:\n%s", logs.String())
	}
	_, _ = w.Write([]byte("http: TLS handshake error from 10.0.0.1:5000: EOF\n"))
	_, _ = w.Write([]byte("http: TLS handshake error from 10.0.0.1:5000: EOF\n"))
	if got := strings.Count(logs.String(), "TLS handshake error"); got != 2 {
		t.Errorf("%d TLS handshake lines of 2: other lines are logged as they come", got)
	}
	srv.Close()
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		t.Errorf("Serve: %v", err)
	}
}

// TestAcceptErrorsThatStopWithinTheWindowAreCounted: 50 accept errors in a
// burst shorter than the window are logged as the first and, at the
// window's end, as the last with the 48 more between them.
func TestAcceptErrorsThatStopWithinTheWindowAreCounted(t *testing.T) {
	var logs logbuf.Buffer
	w := newErrorLogWriter(slog.NewTextHandler(&logs, nil), 200*time.Millisecond, time.Now)
	for i := range 50 {
		_, _ = fmt.Fprintf(w, "http: Accept error: %s (%d); retrying in 5ms\n", tempErr{}.Error(), i)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(logs.String(), "(49); retrying in 5ms (and 48 more in the last") {
		if time.Now().After(deadline) {
			t.Fatalf("no line told of the 49 held back 5 s after the burst:\n%s", logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := strings.Count(logs.String(), "http: Accept error"); got != 2 {
		t.Errorf("%d accept error lines, want 2:\n%s", got, logs.String())
	}
}
