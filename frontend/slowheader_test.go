package frontend_test

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvbus/kvbus/frontend"
)

// TestSlowHeaderClient checks that a client trickling a request's headers
// and never finishing them is disconnected after ReadHeaderTimeout, while
// other connections are served.
func TestSlowHeaderClient(t *testing.T) {
	const headerTimeout = 300 * time.Millisecond
	fe := startFrontend(t, func(c *frontend.Config) { c.ReadHeaderTimeout = headerTimeout })
	addr := strings.TrimPrefix(fe.url, "http://")

	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	start := time.Now()
	if _, err := conn.Write([]byte("POST /v1/chat/completions HTTP/1.1\r\nHost: kvbus\r\n")); err != nil {
		t.Fatal(err)
	}
	// Trickle one header byte every 50 ms, never ending the headers.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for _, b := range []byte("X-Slow: " + strings.Repeat("a", 200)) {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if _, err := conn.Write([]byte{b}); err != nil {
				return // the server closed the connection
			}
		}
	})
	defer wg.Wait()
	defer close(stop)

	// Meanwhile a normal request on another connection is served.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, fe.url+"/v1/models", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := newClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /v1/models beside a slow client: %d", resp.StatusCode)
	}

	// The server closes the slow connection: a read ends with EOF or a
	// reset, not with the client's own deadline.
	const bound = 3 * time.Second
	if err := conn.SetReadDeadline(time.Now().Add(bound)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 512)
	var readErr error
	for readErr == nil {
		_, readErr = conn.Read(buf) // a 408 or 400 before the close is fine
	}
	elapsed := time.Since(start)
	var ne net.Error
	if errors.As(readErr, &ne) && ne.Timeout() {
		t.Fatalf("slow-header connection still open after %v (ReadHeaderTimeout %v)", bound, headerTimeout)
	}
	if elapsed < headerTimeout-50*time.Millisecond {
		t.Fatalf("slow-header connection closed after %v, before ReadHeaderTimeout %v: %v", elapsed, headerTimeout, readErr)
	}
	t.Logf("slow-header connection closed by the server after %v: %v", elapsed, readErr)
}

// stallBody opens a connection to fe, sends a generate request's headers
// with framing (its body's framing header, the blank line and part of the
// body) and nothing more, and gives the connection a read deadline of wait.
func stallBody(t *testing.T, url, framing string, wait time.Duration) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if _, err := conn.Write([]byte("POST /v1/chat/completions HTTP/1.1\r\nHost: kvbus\r\nContent-Type: application/json\r\n" + framing)); err != nil {
		t.Fatal(err)
	}
	if err := conn.SetReadDeadline(time.Now().Add(wait)); err != nil {
		t.Fatal(err)
	}
	return conn
}

// contentLengthPart declares a 1,000-byte body and sends its first bytes.
const contentLengthPart = "Content-Length: 1000\r\n\r\n{\"messages\":"

// TestSlowBodyClient: a client that sends its headers and part of a body,
// then stalls, is answered 408 after ReadBodyTimeout; with --max-inflight 1
// the next request is taken.
func TestSlowBodyClient(t *testing.T) {
	const bodyTimeout = 300 * time.Millisecond
	fe := startFrontend(t, func(c *frontend.Config) { c.ReadBodyTimeout, c.MaxInflight = bodyTimeout, 1 })
	conn := stallBody(t, fe.url, contentLengthPart, 5*time.Second)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer to a stalled body: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout {
		t.Fatalf("stalled body: status %d, want 408", resp.StatusCode)
	}
	// Its slot is free again: the next request is judged (a 400 for its
	// empty messages), not refused with a 429.
	status, _, body := send(t, http.MethodPost, fe.url+"/v1/chat/completions", `{"messages":[]}`, map[string]string{"Content-Type": "application/json"})
	if status != http.StatusBadRequest {
		t.Fatalf("the next request: %d %.200s, want 400", status, body)
	}
}

// TestSlowBodyUnderAShortRequestTimeoutIs408: with --request-timeout below
// the body's 30 s, a client whose body stalls is answered 408 at the
// request's deadline. The 408 was written at the body timeout, past the
// answer's write deadline (the request's deadline and a second): the
// client got nothing at all, its connection left open (--request-timeout
// 15s: nothing in 45 s), while the frontend counted and logged a 408.
func TestSlowBodyUnderAShortRequestTimeoutIs408(t *testing.T) {
	const requestTimeout = 500 * time.Millisecond
	fe := startFrontend(t, func(c *frontend.Config) { c.ReadBodyTimeout, c.RequestTimeout = 5*time.Second, requestTimeout })
	for _, tc := range []struct{ name, framing string }{
		{"content-length", contentLengthPart},
		{"chunked", "Transfer-Encoding: chunked\r\n\r\nc\r\n{\"messages\":\r\n"},
	} {
		start := time.Now()
		conn := stallBody(t, fe.url, tc.framing, 10*time.Second)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		conn.Close()
		if err != nil {
			t.Fatalf("%s: no answer to a stalled body after %v: %v", tc.name, time.Since(start).Round(time.Millisecond), err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestTimeout {
			t.Fatalf("%s: stalled body: status %d, want 408", tc.name, resp.StatusCode)
		}
		if took := time.Since(start); took > requestTimeout+2*time.Second {
			t.Fatalf("%s: 408 after %v, want it at the request's deadline (%v)", tc.name, took, requestTimeout)
		}
	}
}

// TestSlowBodyConnectionClosedAfterIts408: once a stalled body is answered
// 408 (Connection: close), the server closes the connection, though the
// client sends no more. It waited for the rest of the declared body with
// no deadline, for as long as the client kept the connection: a goroutine
// and a socket held without bound by clients that declare a body and
// send part of it.
func TestSlowBodyConnectionClosedAfterIts408(t *testing.T) {
	fe := startFrontend(t, func(c *frontend.Config) { c.ReadBodyTimeout = 300 * time.Millisecond })
	conn := stallBody(t, fe.url, contentLengthPart, 5*time.Second)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no answer to a stalled body: %v", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout {
		t.Fatalf("stalled body: status %d, want 408", resp.StatusCode)
	}
	answered := time.Now()
	if _, err := br.ReadByte(); !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("after its 408 (Connection: close) the connection stayed open %v: %v", time.Since(answered).Round(time.Millisecond), err)
	}
}

// TestSlowBodyHoldsNoSlot: a client stalled mid-body holds no --max-inflight
// slot while its body is read: with --max-inflight 1 another client's
// request is judged at once (a 400 for its empty messages), not refused
// with a 429 for as long as --read-body-timeout runs.
func TestSlowBodyHoldsNoSlot(t *testing.T) {
	fe := startFrontend(t, func(c *frontend.Config) { c.ReadBodyTimeout, c.MaxInflight = time.Minute, 1 })
	conn, err := net.Dial("tcp", strings.TrimPrefix(fe.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Expect: 100-continue: net/http answers "100 Continue" when the
	// handler first reads the body, so the client knows its request is in
	// the handler before it stalls.
	if _, err := conn.Write([]byte("POST /v1/chat/completions HTTP/1.1\r\nHost: kvbus\r\nContent-Type: application/json\r\n" +
		"Expect: 100-continue\r\nContent-Length: 1000\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	if err := conn.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || !strings.Contains(line, "100 Continue") {
		t.Fatalf("the stalled request's handler never read its body: %q %v", line, err)
	}
	if _, err := conn.Write([]byte(`{"messages":`)); err != nil {
		t.Fatal(err)
	}
	status, _, body := send(t, http.MethodPost, fe.url+"/v1/chat/completions", `{"messages":[]}`, map[string]string{"Content-Type": "application/json"})
	if status != http.StatusBadRequest {
		t.Fatalf("a request while another's body stalls: %d %.200s, want 400 (429: the stalled body holds the only slot)", status, body)
	}
}
