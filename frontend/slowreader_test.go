package frontend_test

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
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
	conn := dialSmallWindow(t, strings.TrimPrefix(c.URL, "http://"))
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

// TestAnswerCutAtTheDeadlineIsNotCounted200: a client that reads its answer
// too slowly to have it by the request's deadline has the answer cut off
// at the write deadline (--request-timeout and a second). The request is
// counted and logged as what it was, a 504 (the client never got the end
// of its answer), streamed or not. Before, the handler went on through the
// outputs it held after the write had failed, "wrote" [DONE] into the
// broken connection and logged "request completed": counted 200 while the
// client got a stream without [DONE] (the real binary: 32 prompts × 1,000
// tokens read at ~20 kB/s, cut at 61 s, logged completed).
func TestAnswerCutAtTheDeadlineIsNotCounted200(t *testing.T) {
	for _, tc := range []struct {
		name                string
		stream, passthrough bool
	}{
		{"stream", true, false},
		{"whole", false, false},
		{"relayed stream", true, true}, // --engine openai
	} {
		t.Run(tc.name, func(t *testing.T) {
			const timeout = time.Second
			reg := prometheus.NewRegistry()
			fe := startFrontend(t, func(c *frontend.Config) { c.RequestTimeout, c.Registry, c.Passthrough = timeout, reg, tc.passthrough })
			// 160 outputs of 64 KiB of text: 10 MiB, far more than
			// loopback's socket buffers take, all there at once.
			text := strings.Repeat("x", 64<<10)
			answering(t, fe, func(*messages.Request) []*messages.Output {
				outs := make([]*messages.Output, 160)
				for i := range outs {
					outs[i] = &messages.Output{Index: i, Text: text, TokenIDs: []uint32{1}}
					if tc.passthrough {
						outs[i].Raw = []byte(`{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"` + text + `"}]}`)
					}
				}
				last := outs[len(outs)-1]
				last.FinishReason, last.Usage = "length", &messages.Usage{PromptTokens: 1, CompletionTokens: len(outs)}
				return outs
			})
			conn := dialSmallWindow(t, strings.TrimPrefix(fe.url, "http://"))
			body := fmt.Sprintf(`{"prompt":"hi","max_tokens":160,"stream":%v}`, tc.stream)
			if _, err := fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: kvbus\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
				len(body), body); err != nil {
				t.Fatal(err)
			}
			// The client reads nothing until its request has ended.
			ended := func() float64 { return testenv.CounterSum(t, reg, "kvbus_frontend_requests_total", nil) }
			testenv.Eventually(t, 10*time.Second, "the request to end", func() bool { return ended() > 0 })
			ok := testenv.CounterSum(t, reg, "kvbus_frontend_requests_total", map[string]string{"status": "200"})
			cut := testenv.CounterSum(t, reg, "kvbus_frontend_requests_total", map[string]string{"status": "504"})
			if ok != 0 || cut != 1 {
				t.Errorf("an answer cut off at the write deadline counted %v times as 200 and %v times as 504; want it under 504", ok, cut)
			}
			// What the client gets is what the frontend had written: no end.
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			got, _ := io.ReadAll(conn)
			if bytes.HasSuffix(got, []byte("data: [DONE]\n\n0\r\n\r\n")) || len(got) >= 10<<20 {
				t.Fatalf("the client read %d bytes, the whole answer; the test needs one cut off", len(got))
			}
		})
	}
}

// dialSmallWindow connects to addr with a small receive buffer, set before
// the connection is made (after, the window already offered stays).
func dialSmallWindow(t *testing.T, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		}); err != nil {
			return err
		}
		return serr
	}}
	conn, err := d.DialContext(t.Context(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}
