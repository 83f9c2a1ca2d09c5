package frontend_test

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestStreamNeverReadFreesItsSlot: a client that opens a streamed answer far
// larger than the sockets can hold and never reads it, keeping its
// connection open, holds its request only until the request's deadline
// (--request-timeout): its in-flight slot is free again, and the outputs the
// frontend held for it with it. Before, the handler stayed blocked in its
// write for as long as the client kept the connection: the slot (with
// --max-inflight 1, every later request got 429) and every output queued
// for it were held past the deadline, without bound.
func TestStreamNeverReadFreesItsSlot(t *testing.T) {
	const timeout = 2 * time.Second
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 1, MaxInflight: 1, RequestTimeout: timeout, TimeScale: 0.001})
	// A small receive buffer, set before the connection is made (after,
	// the window already offered stays).
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		}); err != nil {
			return err
		}
		return serr
	}}
	conn, err := d.DialContext(t.Context(), "tcp", strings.TrimPrefix(c.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// 64 prompts of 2,000 tokens, each token an event of ~200 bytes (the sim
	// at a time scale above 0 sends one output a token): ~25 MB, far more
	// than loopback's socket buffers take.
	prompts := make([]string, 64)
	for i := range prompts {
		prompts[i] = fmt.Sprintf("%q", fmt.Sprint("prompt ", i))
	}
	body := `{"prompt":[` + strings.Join(prompts, ",") + `],"max_tokens":2000,"ignore_eos":true,"stream":true}`
	if _, err := fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: kvbus\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		len(body), body); err != nil {
		t.Fatal(err)
	}
	// The client reads nothing. Past the request's deadline (and the
	// second it has to write its last event), its slot is free: the next
	// request is answered, not refused with a 429.
	time.Sleep(timeout + 2*time.Second)
	chat := `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	var status int
	var got []byte
	testenv.Eventually(t, 10*time.Second, "the unread stream's slot to be freed", func() bool {
		status, _, got = send(t, http.MethodPost, c.URL+"/v1/chat/completions", chat, map[string]string{"Content-Type": "application/json"})
		return status != http.StatusTooManyRequests
	})
	if status != http.StatusOK {
		t.Fatalf("the next request: %d %.300s", status, got)
	}
}

// TestKeptAliveConnectionOutlivesAGenerateDeadline: the write deadline a
// generate request sets (its --request-timeout and a second) does not stay
// on its kept-alive connection (net/http clears it after each response):
// requests sent on it after that deadline passed are answered.
func TestKeptAliveConnectionOutlivesAGenerateDeadline(t *testing.T) {
	const timeout = time.Second
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 1, RequestTimeout: timeout})
	client := newClient(t)
	do := func(method, path, body string) (status int, reused bool) {
		req, err := http.NewRequestWithContext(httptrace.WithClientTrace(t.Context(), &httptrace.ClientTrace{
			GotConn: func(i httptrace.GotConnInfo) { reused = i.Reused },
		}), method, c.URL+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, reused
	}
	chat := `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	if status, _ := do(http.MethodPost, "/v1/chat/completions", chat); status != http.StatusOK {
		t.Fatalf("first request: %d", status)
	}
	time.Sleep(timeout + 1500*time.Millisecond) // past its write deadline
	for _, r := range []struct{ method, path, body string }{
		{http.MethodGet, "/v1/models", ""},
		{http.MethodPost, "/v1/chat/completions", chat},
	} {
		status, reused := do(r.method, r.path, r.body)
		if !reused {
			t.Fatalf("%s %s went on a new connection; the test needs the kept-alive one", r.method, r.path)
		}
		if status != http.StatusOK {
			t.Fatalf("%s %s on the kept-alive connection after the first request's deadline: %d", r.method, r.path, status)
		}
	}
}
