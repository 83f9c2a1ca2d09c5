package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

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
	bin, dir, natsAddr, _ := startNATSProc(t)
	httpAddr, natsURL := freeAddr(t), "nats://"+natsAddr
	const requestTimeout = 30 * time.Second
	startProc(t, bin, dir, "frontend", "frontend", "--http-addr", httpAddr, "--nats-url", natsURL, "--request-timeout", requestTimeout.String())
	startProc(t, bin, dir, "scheduler", "scheduler", "--nats-url", natsURL, "--metrics-addr", freeAddr(t))
	proxy := testenv.StartFaultProxy(t, natsAddr)
	workerLog := filepath.Join(dir, "worker.log")
	// 10 ms a token: 40 tokens take 0.4 s.
	startProc(t, bin, dir, "worker", "worker", "--group", "g0", "--tp-size", "1", "--time-scale", "1",
		"--heartbeat-interval", "200ms", "--metrics-addr", freeAddr(t), "--nats-url", proxy.URL())
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
		proxy.Swallow()
		testenv.Eventually(t, 10*time.Second, "the answer's end published into the broken connection", func() bool {
			s := proxy.Swallowed()
			return strings.Contains(s, "PUB kvbus.out.") && strings.Contains(s, "finish_reason")
		})
		proxy.Cut()
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
	// The worker's log line may reach its file after the answer reached
	// the client (its log is written in the background).
	deadline := time.Now().Add(5 * time.Second)
	for republished() < 2 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if n := republished(); n < 2 {
		t.Errorf("the worker logged %d republishes after its reconnects; want one per break", n)
	}
}

// TestAnswerLostOnTheWayToAReconnectingFrontendIsSentAgain: a NATS restart
// under load. The driver's connection comes back before the frontend's
// subscription, and the whole answer of a request not streamed, published
// in between, reaches no one; the server did read it, so the driver forgot
// it at its next delivery check. The frontend, reconnected, heard nothing
// for 3 s, asked the drivers, heard nothing for 2 s more and published the
// request again: computed twice, answered 5 s after the reconnect (7.4 s
// for a 0.3 s answer in a review's rolling restart of `kvbus nats`). The
// driver now keeps an answer, as it keeps a stream, for --stream-replay's
// age, and sends it again when asked: answered once, 3 s after the
// reconnect. Here the frontend's connection drops what the server sends
// it while the answer is published, then breaks.
func TestAnswerLostOnTheWayToAReconnectingFrontendIsSentAgain(t *testing.T) {
	bin, dir, natsAddr, _ := startNATSProc(t)
	httpAddr, natsURL := freeAddr(t), "nats://"+natsAddr
	proxy := testenv.StartFaultProxy(t, natsAddr)
	const requestTimeout = 30 * time.Second
	fe := startProc(t, bin, dir, "frontend", "frontend", "--http-addr", httpAddr, "--nats-url", proxy.URL(), "--request-timeout", requestTimeout.String())
	startProc(t, bin, dir, "scheduler", "scheduler", "--nats-url", natsURL, "--metrics-addr", freeAddr(t))
	worker := startProc(t, bin, dir, "worker", "worker", "--group", "g0", "--tp-size", "1", "--time-scale", "1",
		"--heartbeat-interval", "200ms", "--metrics-addr", freeAddr(t), "--nats-url", natsURL)
	base := "http://" + httpAddr
	testenv.Eventually(t, 60*time.Second, "/healthz 200", func() bool { return healthz(base+"/healthz") == http.StatusOK })

	type answer struct {
		status int
		body   []byte
		at     time.Time
	}
	done := make(chan answer, 1)
	go func() {
		// 10 ms a token: 30 tokens take 0.3 s.
		status, _, b := testenv.Send(t, http.MethodPost, base+"/v1/chat/completions",
			`{"model":"kvbus-sim","max_tokens":30,"ignore_eos":true,"messages":[{"role":"user","content":"what does a restart lose?"}]}`, nil)
		done <- answer{status, b, time.Now()}
	}()
	// Being decoded: the driver's first output reached the frontend (its
	// TTFT observed), so the request went through the frontend's connection
	// before it is silenced; the rest of the answer, 0.3 s of it, is lost.
	testenv.Eventually(t, 10*time.Second, "the frontend's first output of the answer", func() bool {
		return scrapeSum(base+"/metrics", "kvbus_frontend_ttft_seconds_count") >= 1
	})
	proxy.Silence()
	testenv.Eventually(t, 10*time.Second, "the driver's answer", func() bool {
		b, _ := os.ReadFile(worker.log)
		return strings.Contains(string(b), `"msg":"store thread"`)
	})
	// Past the driver's next delivery check and deliveryMargin, after which
	// a driver before the fix forgot the answer: time to pass, not an event
	// to wait for (the driver logs neither); what it follows, the answer's
	// end, is awaited above. Longer under load only makes that surer.
	time.Sleep(time.Second)
	proxy.Cut()
	cutAt := time.Now()
	a := <-done
	if a.status != http.StatusOK {
		t.Fatalf("status %d: %s; want the answer", a.status, a.body)
	}
	feLog, _ := os.ReadFile(fe.log)
	if n := strings.Count(string(feLog), "asked again"); n != 0 {
		t.Errorf("the frontend published the request again (%d log lines say asked again): its driver had the answer", n)
	}
	wLog, _ := os.ReadFile(worker.log)
	if !strings.Contains(string(wLog), "outputs lost on the bus sent again") {
		t.Error("the driver did not send the answer again when asked")
	}
	t.Logf("answered %s after the frontend's connection broke", a.at.Sub(cutAt).Round(time.Millisecond))
}

// scrapeSum is the sum of the samples of the metric name (every label set)
// on the Prometheus text page at url; 0 when the page cannot be read.
func scrapeSum(url, name string) float64 {
	resp, err := http.Get(url)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, name)
		if !ok || (!strings.HasPrefix(rest, " ") && !strings.HasPrefix(rest, "{")) {
			continue
		}
		var v float64
		if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v); err == nil {
			sum += v
		}
	}
	return sum
}
