package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// swallowProxy forwards TCP connections to a NATS server. swallow makes the
// connections open at that moment drop what their clients send, keeping a
// copy (the bytes a process wrote just before its server stopped, which
// the server never read); cut then closes them, and the clients reconnect
// through the proxy, which forwards the new connections whole.
type swallowProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	conns  []*proxied
}

type proxied struct {
	client, server net.Conn
	swallowing     atomic.Bool
	mu             sync.Mutex
	swallowed      bytes.Buffer
}

func startSwallowProxy(t *testing.T, target string) *swallowProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &swallowProxy{ln: ln, target: target}
	t.Cleanup(func() {
		ln.Close()
		p.cut()
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			pc := &proxied{client: c, server: s}
			p.mu.Lock()
			p.conns = append(p.conns, pc)
			p.mu.Unlock()
			go func() { _, _ = io.Copy(c, s); c.Close() }()
			go pc.forward()
		}
	}()
	return p
}

// forward copies what the client sends to the server, or keeps it while
// the connection swallows.
func (pc *proxied) forward() {
	defer pc.server.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := pc.client.Read(buf)
		if n > 0 {
			if pc.swallowing.Load() {
				pc.mu.Lock()
				pc.swallowed.Write(buf[:n])
				pc.mu.Unlock()
			} else if _, werr := pc.server.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *swallowProxy) url() string { return "nats://" + p.ln.Addr().String() }

// swallow starts dropping what the open connections' clients send.
func (p *swallowProxy) swallow() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pc := range p.conns {
		pc.swallowing.Store(true)
	}
}

// swallowed is what the connections dropped.
func (p *swallowProxy) swallowed() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var b strings.Builder
	for _, pc := range p.conns {
		pc.mu.Lock()
		b.Write(pc.swallowed.Bytes())
		pc.mu.Unlock()
	}
	return b.String()
}

// cut closes the open connections and forgets them.
func (p *swallowProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pc := range p.conns {
		pc.client.Close()
		pc.server.Close()
	}
	p.conns = nil
}

// TestLastOutputsLostWithTheDriversConnectionAreSentAgain: the driver's
// connection breaks after it published a request's last outputs, which its
// server never read (what a NATS server of a cluster that stops does to
// the bytes in flight to it), while the frontend's connection stays up, so
// the frontend cannot tell a lost answer from one still computed. The
// driver, reconnected, publishes again what its server had not confirmed:
// the client gets the whole answer, streamed or not, within seconds of the
// break, where before it waited for --request-timeout. The proxy's copy of
// the dropped bytes shows each answer's end was among them.
func TestLastOutputsLostWithTheDriversConnectionAreSentAgain(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	dir := t.TempDir()
	bin := buildBinary(t, dir)
	natsAddr, httpAddr := freeAddr(t), freeAddr(t)
	natsURL := "nats://" + natsAddr
	startProc(t, bin, dir, "nats", "nats", "--addr", natsAddr, "--data-dir", filepath.Join(dir, "js"))
	const requestTimeout = 30 * time.Second
	startProc(t, bin, dir, "frontend", "frontend", "--http-addr", httpAddr, "--nats-url", natsURL, "--request-timeout", requestTimeout.String())
	startProc(t, bin, dir, "scheduler", "scheduler", "--nats-url", natsURL, "--metrics-addr", freeAddr(t))
	proxy := startSwallowProxy(t, natsAddr)
	workerLog := filepath.Join(dir, "worker.log")
	// 10 ms a token: 40 tokens take 0.4 s.
	startProc(t, bin, dir, "worker", "worker", "--group", "g0", "--tp-size", "1", "--time-scale", "1",
		"--heartbeat-interval", "200ms", "--metrics-addr", freeAddr(t), "--nats-url", proxy.url())
	base := "http://" + httpAddr
	testenv.Eventually(t, 60*time.Second, "/healthz 200", func() bool { return healthz(base+"/healthz") == http.StatusOK })
	client := &http.Client{Timeout: requestTimeout + 10*time.Second}
	defer client.CloseIdleConnections()

	// breakDriver drops what the worker sends once answer began, until its
	// end (finish_reason) is among the dropped bytes, then closes the
	// worker's connection.
	breakDriver := func(t *testing.T, began <-chan struct{}) time.Time {
		t.Helper()
		<-began
		proxy.swallow()
		testenv.Eventually(t, 10*time.Second, "the answer's end published into the broken connection", func() bool {
			s := proxy.swallowed()
			return strings.Contains(s, "PUB kvbus.out.") && strings.Contains(s, "finish_reason")
		})
		proxy.cut()
		return time.Now()
	}
	body := func(stream bool) string {
		req := map[string]any{"model": "kvbus-sim", "max_tokens": 40, "ignore_eos": true, "stream": stream,
			"messages": []map[string]string{{"role": "user", "content": "what does a bus lose when a server stops?"}}}
		if stream {
			req["stream_options"] = map[string]any{"include_usage": true}
		}
		b, _ := json.Marshal(req)
		return string(b)
	}
	republished := func() int {
		b, _ := os.ReadFile(workerLog)
		return strings.Count(string(b), "outputs published just before it sent again")
	}

	t.Run("not streamed", func(t *testing.T) {
		began := make(chan struct{})
		go func() { time.Sleep(150 * time.Millisecond); close(began) }() // within the 0.4 s of decoding
		type answer struct {
			status int
			body   []byte
			at     time.Time
		}
		done := make(chan answer, 1)
		go func() {
			resp, err := client.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body(false)))
			if err != nil {
				t.Error(err)
				done <- answer{}
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			done <- answer{resp.StatusCode, b, time.Now()}
		}()
		cutAt := breakDriver(t, began)
		a := <-done
		var got struct {
			Choices []struct {
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
			Usage struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
		}
		if a.status != http.StatusOK || json.Unmarshal(a.body, &got) != nil || len(got.Choices) != 1 {
			t.Fatalf("status %d: %s; want the answer", a.status, a.body)
		}
		if got.Usage.CompletionTokens != 40 || got.Choices[0].FinishReason != "length" {
			t.Errorf("answer of %d tokens, finish %q; want the whole 40, length", got.Usage.CompletionTokens, got.Choices[0].FinishReason)
		}
		if wait := a.at.Sub(cutAt); wait > 5*time.Second {
			t.Errorf("the answer came %s after the driver's connection broke; want it within seconds, not at the deadline", wait)
		}
	})

	t.Run("streamed", func(t *testing.T) {
		began := make(chan struct{})
		type stream struct {
			events []string
			at     time.Time
			err    error
		}
		done := make(chan stream, 1)
		go func() {
			resp, err := client.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body(true)))
			if err != nil {
				close(began)
				done <- stream{err: err}
				return
			}
			defer resp.Body.Close()
			var s stream
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				line, ok := strings.CutPrefix(sc.Text(), "data: ")
				if !ok {
					continue
				}
				if len(s.events) == 0 {
					close(began) // the stream is under way at the client
				}
				s.events = append(s.events, line)
			}
			if len(s.events) == 0 {
				close(began)
			}
			s.at, s.err = time.Now(), sc.Err()
			done <- s
		}()
		cutAt := breakDriver(t, began)
		s := <-done
		if s.err != nil || len(s.events) == 0 || s.events[len(s.events)-1] != "[DONE]" {
			t.Fatalf("stream ended with %v after %d events; want [DONE] (events: %q)", s.err, len(s.events), s.events)
		}
		tokens, content := 0, 0
		for _, e := range s.events[:len(s.events)-1] {
			var ev struct {
				Error   any `json:"error"`
				Choices []struct {
					Delta struct {
						Content string `json:"content"`
					} `json:"delta"`
				} `json:"choices"`
				Usage *struct {
					CompletionTokens int `json:"completion_tokens"`
				} `json:"usage"`
			}
			if err := json.Unmarshal([]byte(e), &ev); err != nil || ev.Error != nil {
				t.Fatalf("event %s: %v; want no error event", e, err)
			}
			if ev.Usage != nil {
				tokens = ev.Usage.CompletionTokens
			}
			for _, c := range ev.Choices {
				if c.Delta.Content != "" {
					content++
				}
			}
		}
		if tokens != 40 || content == 0 {
			t.Errorf("stream of %d tokens in %d content events; want the whole 40", tokens, content)
		}
		if wait := s.at.Sub(cutAt); wait > 5*time.Second {
			t.Errorf("the stream ended %s after the driver's connection broke; want it within seconds, not at the deadline", wait)
		}
	})
	if n := republished(); n < 2 {
		t.Errorf("the worker logged %d republishes after its reconnects; want one per break", n)
	}
}
