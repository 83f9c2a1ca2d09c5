package workers_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
)

// httpReply is a client's answer from the frontend.
type httpReply struct {
	status int
	header http.Header
	body   []byte
	events []string // a stream's data lines
	err    error
}

// clientSend sends a request to the frontend in the background. With a
// streamed request, began is closed once text streams (nil: not watched).
func clientSend(t *testing.T, c *testenv.Cluster, body string, began chan<- struct{}) <-chan httpReply {
	t.Helper()
	out := make(chan httpReply, 1)
	go func() {
		var r httpReply
		defer func() { out <- r }()
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(body))
		if err != nil {
			r.err = err
			return
		}
		req.Header.Set("Content-Type", "application/json")
		client := &http.Client{Timeout: 60 * time.Second}
		defer client.CloseIdleConnections()
		resp, err := client.Do(req)
		if err != nil {
			r.err = err
			return
		}
		defer resp.Body.Close()
		r.status, r.header = resp.StatusCode, resp.Header
		if began == nil {
			r.body, r.err = io.ReadAll(resp.Body)
			return
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			line, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			r.events = append(r.events, line)
			if began != nil && strings.Contains(line, `"content":" `) { // real text is streaming
				close(began)
				began = nil
			}
		}
		r.err = sc.Err()
	}()
	return out
}

// errorCode is the code of an OpenAI error body, or "".
func errorCode(body []byte) string {
	var b struct {
		Error struct {
			Code *string `json:"code"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &b) != nil || b.Error.Code == nil {
		return ""
	}
	return *b.Error.Code
}

// TestDriverStoppedPastShutdownTimeoutIsRetryable: the driver rank of a
// group is stopped (SIGTERM) while its requests need longer than its
// --shutdown-timeout (2 s here). A planned drain is no failure of the
// model: the requests it cuts off end with a retryable error (group_failed:
// a 503 with Retry-After, an error chunk in a stream), and one whose output
// had not started (here in the middle of its prefill) is dispatched again
// on the other group by the scheduler's failover and answered; with no
// other group it too ends with the 503, at once. Before, every one of them
// ended with a 500 engine_error ("generation stopped: worker shutting
// down"), no Retry-After, and none was dispatched again.
func TestDriverStoppedPastShutdownTimeoutIsRetryable(t *testing.T) {
	for _, groups := range []int{2, 1} {
		t.Run(fmt.Sprintf("%d groups", groups), func(t *testing.T) {
			// Round-robin places the k-th request on group k mod groups (g0
			// first); at --time-scale 20 a token's decode takes 200 ms and a
			// prompt token's prefill 1.2 ms.
			c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: groups, Ranks: 2, TimeScale: 20, Policy: scheduler.PolicyRoundRobin})
			metas := c.Observe(t, "kvbus.meta.>")
			outs := c.Observe(t, "kvbus.out.>")
			dispatches := func(reqID string) []string { // group@attempt, in order
				var out []string
				for _, m := range metas.Messages() {
					if meta, _ := messages.DecodeReqMeta(m.Data); meta != nil && (reqID == "" || meta.ReqID == reqID) {
						if d := fmt.Sprintf("%s@%d", meta.Group, meta.Attempt); len(out) == 0 || out[len(out)-1] != d {
							out = append(out, d)
						}
					}
				}
				return out
			}
			placed := 0
			// send places a request and returns its bus request id; on two
			// groups a short filler goes to g1 before each but the first,
			// so that every request of the test lands on g0.
			send := func(body string, began chan<- struct{}) (<-chan httpReply, string) {
				t.Helper()
				if groups == 2 && placed > 0 {
					filler := clientSend(t, c, fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"filler %d"}],"max_tokens":1}`, c.Model, placed), nil)
					if r := <-filler; r.err != nil || r.status != http.StatusOK {
						t.Fatalf("filler: status %d, %v: %s", r.status, r.err, r.body)
					}
					placed++
				}
				reply := clientSend(t, c, body, began)
				placed++
				var meta *messages.ReqMeta
				testenv.Eventually(t, 10*time.Second, "the request's dispatch", func() bool {
					seen := map[string]bool{} // a ReqMeta published again counts once
					for _, m := range metas.Messages() {
						if mm, _ := messages.DecodeReqMeta(m.Data); mm != nil && !seen[mm.ReqID] {
							if seen[mm.ReqID] = true; len(seen) == placed {
								meta = mm
								return true
							}
						}
					}
					return false
				})
				if meta.Group != "g0" {
					t.Fatalf("request %s placed on %s (dispatches %v), want g0", meta.ReqID, meta.Group, dispatches(""))
				}
				return reply, meta.ReqID
			}
			// In the middle of its answer, streamed.
			began := make(chan struct{})
			streamed, _ := send(fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"streamed"}],"max_tokens":100,"ignore_eos":true,"stream":true}`, c.Model), began)
			select {
			case <-began:
			case <-time.After(10 * time.Second):
				t.Fatal("the streamed request streamed no text")
			}
			// In the middle of its answer, not streamed: the client has seen
			// nothing, the frontend has its first chunks.
			whole, wholeID := send(fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"whole"}],"max_tokens":100,"ignore_eos":true}`, c.Model), nil)
			testenv.Eventually(t, 10*time.Second, "the first output of the non-streamed request", func() bool {
				for _, m := range outs.Messages() {
					if o, _ := messages.DecodeOutput(m.Data); o != nil && o.ReqID == wholeID {
						return true
					}
				}
				return false
			})
			// Prefilling (about 6 s, behind the others) when the driver gives
			// up: nothing of it has left the group.
			prompt := strings.Repeat("a long prompt to prefill slowly ", 700)
			body, _ := json.Marshal(map[string]any{"model": c.Model, "max_tokens": 1, "messages": []map[string]string{{"role": "user", "content": prompt}}})
			queued, queuedID := send(string(body), nil)

			stopAt := time.Now()
			stopped := make(chan error, 1)
			go func() { stopped <- c.Cluster.StopRank("g0", 0) }() // SIGTERM to the driver
			// The drain grace (200 ms), --shutdown-timeout (2 s), at most a
			// second more for the scheduler to withdraw what it moves, and
			// room for a busy host: far below the request timeout (60 s).
			const cutOff = 8 * time.Second

			s := <-streamed
			if s.err != nil {
				t.Fatalf("streamed request: %v", s.err)
			}
			if n := len(s.events); n < 2 || s.events[n-1] != "[DONE]" || !strings.Contains(s.events[n-2], `"code":"group_failed"`) {
				t.Errorf("the stream cut off by the drain ended with %q, want a group_failed error then [DONE]", s.events[max(0, len(s.events)-2):])
			}
			if took := time.Since(stopAt); took > cutOff {
				t.Errorf("the stream ended %s after the stop, want within %s", took.Round(time.Millisecond), cutOff)
			}
			w := <-whole
			if w.err != nil {
				t.Fatalf("non-streamed request: %v", w.err)
			}
			if w.status != http.StatusServiceUnavailable || w.header.Get("Retry-After") == "" || errorCode(w.body) != "group_failed" {
				t.Errorf("the answer cut off by the drain: status %d, Retry-After %q: %s; want a 503 group_failed with Retry-After",
					w.status, w.header.Get("Retry-After"), w.body)
			}
			q := <-queued
			if q.err != nil {
				t.Fatalf("queued request: %v", q.err)
			}
			moves := dispatches(queuedID)
			if groups == 2 {
				// The other group answers it.
				if q.status != http.StatusOK {
					t.Errorf("the request that had not started: status %d: %s; want 200 from the other group", q.status, q.body)
				}
				if len(moves) != 2 || moves[0] != "g0@0" || moves[1] != "g1@1" {
					t.Errorf("the request that had not started was dispatched %v, want [g0@0 g1@1]", moves)
				}
			} else {
				// Nowhere to go: the client hears at once that a retry will do.
				if q.status != http.StatusServiceUnavailable || q.header.Get("Retry-After") == "" || errorCode(q.body) != "group_failed" {
					t.Errorf("the request that had not started, with no other group: status %d, Retry-After %q: %s; want a 503 group_failed with Retry-After",
						q.status, q.header.Get("Retry-After"), q.body)
				}
				if took := time.Since(stopAt); took > cutOff {
					t.Errorf("it was answered %s after the stop, want within %s", took.Round(time.Millisecond), cutOff)
				}
				if len(moves) != 1 {
					t.Errorf("dispatched %v with no other group, want once", moves)
				}
			}
			if err := <-stopped; err != nil {
				t.Fatal(err)
			}
			if lines := c.Logs.Lines("engine_error"); len(lines) != 0 {
				t.Errorf("a planned drain was reported as a model failure: %q", lines)
			}
			if t.Failed() {
				t.Logf("logs:\n%s", c.Logs.String())
			}
		})
	}
}
