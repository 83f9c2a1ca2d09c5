package testenv_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// inject publishes a made-up output on subject, as if a driver sent it.
func inject(t *testing.T, nc *nats.Conn, subject string, o *messages.Output) {
	data, err := messages.Marshal(o)
	if err == nil {
		err = nc.Publish(subject, data)
	}
	if err != nil {
		t.Error(err)
	}
}

// loseFirstOutputs makes the answers of the next n requests published look
// lost on the bus: as each request is logged, an output that skips
// indexes 0 and 1 reaches its frontend ahead of the real ones (what the
// frontend sees when a NATS server of a cluster dropped them). It returns
// the request ids seen, in order.
func loseFirstOutputs(t *testing.T, c *testenv.Cluster, n int) func() []string {
	t.Helper()
	nc := testenv.Connect(t, c.NATS)
	var mu sync.Mutex
	var ids []string
	subj := messages.Subjects{}
	if _, err := nc.Subscribe(subj.RequestAll(), func(m *nats.Msg) {
		var req messages.Request
		if err := messages.Unmarshal(m.Data, &req); err != nil {
			t.Error(err)
			return
		}
		mu.Lock()
		ids = append(ids, req.RequestID)
		lose := len(ids) <= n
		mu.Unlock()
		if !lose {
			return
		}
		inject(t, nc, subj.Out(req.FrontendID), &messages.Output{ReqID: req.RequestID, Index: 2, Text: " injected"})
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), ids...)
	}
}

// TestAnswerLostOnTheBusIsAskedAgain: an answer lost on the bus before any
// of it reached the client (an output index skipped) is asked again under
// a new bus id, and the client gets the whole answer, streamed or not,
// where it got a 503 output_lost before; after two losses of the same
// request the 503 stands.
func TestAnswerLostOnTheBusIsAskedAgain(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 2, TimeScale: 1})
	body := func(stream bool) string {
		return fmt.Sprintf(`{"model":%q,"max_tokens":12,"ignore_eos":true,"stream":%v,"messages":[{"role":"user","content":"%s"}]}`,
			c.Model, stream, strings.Repeat("tell me about caches and prefixes ", 20))
	}
	askedAgain := func() float64 { return testenv.CounterSum(t, c.Registry, "kvbus_frontend_asked_again_total", nil) }

	const session = "lost-conv"
	seen := loseFirstOutputs(t, c, 1)
	status, _, out := testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions", body(false), map[string]string{"X-Session-ID": session})
	var resp struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if status != http.StatusOK || json.Unmarshal(out, &resp) != nil || len(resp.Choices) != 1 {
		t.Fatalf("non-streamed answer after a loss: %d %s; want 200 with one choice", status, out)
	}
	if resp.Usage.CompletionTokens != 12 || strings.Contains(resp.Choices[0].Message.Content, "injected") {
		t.Errorf("answer %q with %d completion tokens; want 12 tokens, none of the lost request's", resp.Choices[0].Message.Content, resp.Usage.CompletionTokens)
	}
	// The fault took effect: the request went out twice, the second time
	// under the first's id with -again1.
	if ids := seen(); len(ids) != 2 || ids[1] != ids[0]+"-again1" || askedAgain() != 1 {
		t.Fatalf("requests published %v, asked again %v; want the request and its -again1, asked again once", ids, askedAgain())
	}
	// The copy asked again is the same turn of its session: the next
	// message is turn 2 (it was numbered 3: the copy counted as turn 2).
	next := fmt.Sprintf(`{"model":%q,"max_tokens":4,"ignore_eos":true,"messages":[{"role":"user","content":"%s"},{"role":"assistant","content":%q},{"role":"user","content":"and then?"}]}`,
		c.Model, strings.Repeat("tell me about caches and prefixes ", 20), resp.Choices[0].Message.Content)
	if status, _, out := testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions", next, map[string]string{"X-Session-ID": session}); status != http.StatusOK {
		t.Fatalf("turn 2: %d %s", status, out)
	}
	if b, ok := c.Schedulers[0].Bindings().Get(session); !ok || b.Turn != 2 {
		t.Errorf("session after turn 2: %+v (bound %v); want turn 2", b, ok)
	}

	// Streamed, lost before its first chunk: the client gets the whole
	// stream.
	seen = loseFirstOutputs(t, c, 1)
	status, _, out = testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions", body(true), nil)
	if status != http.StatusOK || !strings.HasSuffix(strings.TrimSpace(string(out)), "data: [DONE]") ||
		strings.Contains(string(out), "error") || strings.Contains(string(out), "injected") {
		t.Fatalf("streamed answer after a loss: %d %s; want 200 and a whole stream", status, out)
	}
	if ids := seen(); len(ids) != 2 || askedAgain() != 2 {
		t.Fatalf("requests published %v, asked again %v in all; want 2 and 2", ids, askedAgain())
	}

	// Lost three times: asked again twice, then the 503 for the client to
	// retry.
	seen = loseFirstOutputs(t, c, 3)
	status, _, out = testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions", body(false), nil)
	if status != http.StatusServiceUnavailable || !strings.Contains(string(out), "output_lost") {
		t.Fatalf("answer lost three times: %d %s; want 503 output_lost", status, out)
	}
	if ids := seen(); len(ids) != 3 || askedAgain() != 4 {
		t.Fatalf("requests published %v, asked again %v in all; want 3 and 4", ids, askedAgain())
	}
}

// TestAnswerHeardNothingAfterAReconnectIsAskedAgain: a request in flight
// when NATS restarts that hears nothing for 3 s after the reconnect may
// have lost its answer, or only be slow (here: its driver handles its
// ReqMeta 8 s late, so no driver holds it when asked). It is asked again and
// kept: the client gets one whole answer from whichever copy answers
// first, the other is aborted, and the frontend listens for neither
// afterwards. Before, it waited 10 s and, had the answer been lost, ended
// with a 503.
func TestAnswerHeardNothingAfterAReconnectIsAskedAgain(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 2, DelayFirstReqMeta: map[int]time.Duration{0: 8 * time.Second},
		RequestTimeout: 30 * time.Second})
	seen := loseFirstOutputs(t, c, 0)
	aborts := c.Observe(t, messages.Subjects{}.Abort())
	done := sendAsync(t, c.URL+"/v1/chat/completions",
		fmt.Sprintf(`{"model":%q,"max_tokens":12,"ignore_eos":true,"messages":[{"role":"user","content":"slow"}]}`, c.Model), nil)
	testenv.Eventually(t, 5*time.Second, "the request published", func() bool { return len(seen()) == 1 })
	if err := c.Cluster.RestartNATS(); err != nil {
		t.Fatal(err)
	}
	a := <-done
	if u, ok := a.usage(); !ok || u.CompletionTokens != 12 {
		t.Fatalf("answer of a request silent after a reconnect: %d %s; want 200 with 12 tokens", a.status, a.out)
	}
	askedAgain := testenv.CounterSum(t, c.Registry, "kvbus_frontend_asked_again_total", nil)
	ids := seen()
	t.Logf("requests published after the restart: %v; asked again %v", ids, askedAgain)
	if askedAgain != 1 || len(ids) < 1 || !strings.HasSuffix(ids[len(ids)-1], "-again1") {
		t.Errorf("asked again %v times, requests seen %v; want once, as <id>-again1", askedAgain, ids)
	}
	// The copy that did not answer first is aborted, once; the first one
	// was kept while the copy was asked (aborted then, as an answer known
	// lost is, the reason would name the copy).
	var reasons []string
	testenv.Eventually(t, 5*time.Second, "the slower copy aborted", func() bool {
		reasons = reasons[:0]
		for _, m := range aborts.Messages() {
			var a messages.Abort
			if messages.Unmarshal(m.Data, &a) == nil && strings.HasPrefix(a.ReqID, ids[0]) {
				reasons = append(reasons, a.ReqID+": "+a.Reason)
			}
		}
		return len(reasons) > 0
	})
	if len(reasons) != 1 || !strings.Contains(reasons[0], "a copy of it answered first") {
		t.Errorf("aborts of the request and its copy: %q; want one, of the copy that answered second", reasons)
	}
	// Neither copy is listened for once the answer is back.
	testenv.Eventually(t, 5*time.Second, "no request left in flight at the frontend", func() bool {
		return testenv.GaugeSum(t, c.Registry, "kvbus_frontend_inflight_requests", nil) == 0
	})
}

// TestRequestHeldByItsDriverIsNotAskedAgainAfterAReconnect: requests that
// hear nothing after a NATS reconnect because their driver is still on
// them (the sim 100 times slower: one prefills 1,000 prompt tokens for
// 6 s, the other waits for it in the group's prefill queue) are asked
// about, their driver says it holds them, and no copy is published: each
// client gets its one answer. Before, every such request was published
// again, and under overload the copies doubled the groups' queues.
func TestRequestHeldByItsDriverIsNotAskedAgainAfterAReconnect(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 2, TimeScale: 100, RequestTimeout: 60 * time.Second})
	seen := loseFirstOutputs(t, c, 0)
	var done []<-chan answerOf
	start := time.Now()
	for i, words := range []int{1000, 300} {
		body := fmt.Sprintf(`{"model":%q,"max_tokens":1,"ignore_eos":true,"messages":[{"role":"user","content":%q}]}`,
			c.Model, strings.Repeat(" cache", words))
		done = append(done, sendAsync(t, c.URL+"/v1/chat/completions", body, nil))
		testenv.Eventually(t, 5*time.Second, "the request published", func() bool { return len(seen()) == i+1 })
	}
	if err := c.Cluster.RestartNATS(); err != nil {
		t.Fatal(err)
	}
	for _, d := range done {
		a := <-d
		if u, ok := a.usage(); !ok || u.CompletionTokens != 1 {
			t.Fatalf("answer of a request its driver held across a reconnect: %d %s; want 200 with 1 token", a.status, a.out)
		}
	}
	// The fault took effect: the frontend reconnected and suspected both
	// requests (they heard nothing for 3 s after the reconnect), and asked
	// the drivers about each.
	took := time.Since(start)
	asked := testenv.CounterSum(t, c.Registry, "kvbus_frontend_resends_total", nil)
	if took < 4*time.Second || asked != 2 {
		t.Fatalf("answered after %v with %v asks to the drivers; want two asks, the answers after the 3 s wait", took, asked)
	}
	if n := testenv.CounterSum(t, c.Registry, "kvbus_frontend_asked_again_total", nil); n != 0 || len(seen()) != 2 {
		t.Errorf("asked again %v times, requests published %v; want the two requests, never asked again", n, seen())
	}
}

// TestRequestWaitingForItsLoadIsNotAskedAgainAfterAReconnect: a driver
// holds a request from its ReqMeta on, before it starts it: here request B
// waits for the blocks of request A, of the same prompt, which the driver
// saves 8 s late, when NATS restarts. Asked about, the driver says it holds
// it, and no copy is published.
func TestRequestWaitingForItsLoadIsNotAskedAgainAfterAReconnect(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 2, StoreDelays: map[int]time.Duration{0: 8 * time.Second},
		SaveWait: 15 * time.Second, RequestTimeout: 60 * time.Second})
	seen := loseFirstOutputs(t, c, 0)
	metas := c.Observe(t, messages.Subjects{}.MetaGroup("g0"))
	body := fmt.Sprintf(`{"model":%q,"max_tokens":4,"ignore_eos":true,"messages":[{"role":"user","content":%q}]}`, c.Model, strings.Repeat(" cache", 200))
	var done []<-chan answerOf
	for i, session := range []string{"a", "b"} {
		done = append(done, sendAsync(t, c.URL+"/v1/chat/completions", body, map[string]string{"X-Session-ID": session}))
		// Its ReqMeta reached the ranks: B's driver holds it, waiting
		// for A's blocks.
		testenv.Eventually(t, 5*time.Second, "the ReqMeta of "+session, func() bool { return len(metas.Messages()) == i+1 })
	}
	time.Sleep(100 * time.Millisecond)
	if err := c.Cluster.RestartNATS(); err != nil {
		t.Fatal(err)
	}
	cached := 0
	for _, d := range done {
		a := <-d
		u, ok := a.usage()
		if !ok {
			t.Fatalf("answer after the reconnect: %d %s; want 200", a.status, a.out)
		}
		cached += u.Details.CachedTokens
	}
	// The fault took effect: B waited for A's blocks (it loaded all 12 of
	// them), both heard nothing for 3 s after the reconnect (A's answer
	// waits for its blocks' save, as the session's next turn needs), and
	// the drivers were asked about each.
	if cached != 192 {
		t.Errorf("%d prompt tokens cached over both answers; want B's 192 (A's 12 blocks)", cached)
	}
	if asked := testenv.CounterSum(t, c.Registry, "kvbus_frontend_resends_total", nil); asked != 2 {
		t.Fatalf("%v asks to the drivers; want two, one for each request", asked)
	}
	if n := testenv.CounterSum(t, c.Registry, "kvbus_frontend_asked_again_total", nil); n != 0 || len(seen()) != 2 {
		t.Errorf("asked again %v times, requests published %v; want the two requests, never asked again", n, seen())
	}
}

// answerOf is an HTTP answer's status and body.
type answerOf struct {
	status int
	out    []byte
}

// sendAsync posts body to url on its own goroutine and sends the answer
// on the channel returned.
func sendAsync(t *testing.T, url, body string, headers map[string]string) <-chan answerOf {
	done := make(chan answerOf, 1)
	go func() {
		status, _, out := testenv.Send(t, http.MethodPost, url, body, headers)
		done <- answerOf{status, out}
	}()
	return done
}

// answerUsage is a non-streamed chat answer's usage.
type answerUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	Details          struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// usage returns the answer's usage, and whether it is a 200 that has one.
func (a answerOf) usage() (answerUsage, bool) {
	var resp struct {
		Usage *answerUsage `json:"usage"`
	}
	if a.status != http.StatusOK || json.Unmarshal(a.out, &resp) != nil || resp.Usage == nil {
		return answerUsage{}, false
	}
	return *resp.Usage, true
}

// streamText reads a chat stream: the text of its chunks, its completion
// tokens (include_usage), and the error event, if one came.
func streamText(t *testing.T, raw []byte) (text string, tokens int, errEvent string) {
	t.Helper()
	events := strings.Split(strings.TrimSuffix(string(raw), "\n\n"), "\n\n")
	var b strings.Builder
	for _, ev := range events {
		data := strings.TrimPrefix(ev, "data: ")
		if data == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Delta struct{ Content string }
			}
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			}
			Error json.RawMessage
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("event %q: %v", ev, err)
		}
		if chunk.Error != nil {
			errEvent = string(chunk.Error)
		}
		for _, ch := range chunk.Choices {
			b.WriteString(ch.Delta.Content)
		}
		if chunk.Usage != nil {
			tokens = chunk.Usage.CompletionTokens
		}
	}
	return b.String(), tokens, errEvent
}

// loseOutputsMidStream makes the next stream's outputs look lost on the bus
// once it is under way: when its first output goes by, an output three
// indexes further on reaches the frontend ahead of the real ones.
func loseOutputsMidStream(t *testing.T, c *testenv.Cluster) {
	t.Helper()
	loseOutputsMidStreamOn(t, testenv.Connect(t, c.NATS))
}

// loseOutputsMidStreamOn is loseOutputsMidStream on nc (a key's
// connection).
func loseOutputsMidStreamOn(t *testing.T, nc *nats.Conn) {
	t.Helper()
	var once sync.Once
	if _, err := nc.Subscribe(messages.Subjects{}.Out("*"), func(m *nats.Msg) {
		o, err := messages.DecodeOutput(m.Data)
		if err != nil || o.Index != 0 || o.ReqID == messages.FrontendProbeReqID {
			return
		}
		once.Do(func() {
			inject(t, nc, m.Subject, &messages.Output{ReqID: o.ReqID, Attempt: o.Attempt, Index: 3, Text: " injected"})
		})
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// TestStreamUnderWayGetsLostOutputsAgain: a stream that lost outputs on
// the bus after its first chunk reached the client (an output index
// skipped) asks its driver for them again, and the client gets the whole
// stream, the same as one that lost nothing. A driver without the memory
// (--stream-replay 0) reads no asks, and its heartbeats say so: the
// scheduler names no group, and the ask goes unanswered.
func TestStreamUnderWayGetsLostOutputsAgain(t *testing.T) {
	body := func(model string) string {
		return fmt.Sprintf(`{"model":%q,"max_tokens":24,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"%s"}]}`,
			model, strings.Repeat("tell me about caches and prefixes ", 8))
	}
	resends := func(c *testenv.Cluster) float64 {
		return testenv.CounterSum(t, c.Registry, "kvbus_frontend_resends_total", nil)
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 2, TimeScale: 1})
	status, _, out := testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions", body(c.Model), nil)
	want, wantTokens, errEvent := streamText(t, out)
	if status != http.StatusOK || wantTokens != 24 || errEvent != "" {
		t.Fatalf("stream that lost nothing: %d, %d tokens, error %s", status, wantTokens, errEvent)
	}

	loseOutputsMidStream(t, c)
	status, _, out = testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions", body(c.Model), nil)
	got, tokens, errEvent := streamText(t, out)
	if status != http.StatusOK || errEvent != "" || got != want || tokens != 24 {
		t.Fatalf("stream that lost outputs: %d, %d tokens, error %s, text %q; want the whole stream %q", status, tokens, errEvent, got, want)
	}
	// The fault took effect: the frontend asked once, the driver answered.
	if n := resends(c); n != 1 {
		t.Errorf("resends %v; want 1", n)
	}
	if lines := c.Logs.Lines(`msg="outputs lost on the bus sent again"`); len(lines) != 1 {
		t.Errorf("driver's resend log lines: %q; want one", lines)
	}

	// The same loss without the driver's memory. The outputs were not
	// really lost (one came early): the stream ends whole once they came in
	// order. (Before 2026-12-07 NATS answered "no responders" at once, and
	// it ended with output_lost first.)
	off := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 2, TimeScale: 1, StreamReplay: -1})
	loseOutputsMidStream(t, off)
	status, _, out = testenv.Send(t, http.MethodPost, off.URL+"/v1/chat/completions", body(off.Model), nil)
	if got, _, errEvent = streamText(t, out); status != http.StatusOK || errEvent != "" || got != want {
		t.Fatalf("stream that lost outputs, no driver memory: %d, error %q, text %q; want the whole stream %q", status, errEvent, got, want)
	}
	if n := resends(off); n != 1 {
		t.Errorf("resends without the driver's memory %v; want 1", n)
	}
	handled := func(handler string) float64 {
		return testenv.CounterSum(t, off.Registry, "kvbus_bus_messages_total", map[string]string{"handler": handler})
	}
	testenv.Eventually(t, 5*time.Second, "the scheduler read the ask", func() bool { return handled("scheduler_resend") == 1 })
	if n := handled("worker_resend"); n != 0 {
		t.Errorf("drivers without memory read %v asks; want none (the scheduler names no group for them)", n)
	}
}

// TestLostOutputsAreAskedOfTheirGroupOnly: with three groups and two
// scheduler replicas, a stream that lost outputs on the bus asks the
// schedulers, and one of them names its group: only that group's driver
// reads the ask. Before 2026-12-07 every group's driver read every ask (here
// 3; 1,000 times each of the requests a frontend asks about after a NATS
// restart of a 1,000-group cluster). With keys (kvbus auth init) too: the
// scheduler's key answers in the frontend's inbox, the frontend's asks the
// group's driver, and no role logs a permissions violation.
func TestLostOutputsAreAskedOfTheirGroupOnly(t *testing.T) {
	for _, keys := range []bool{false, true} {
		t.Run(fmt.Sprintf("keys=%v", keys), func(t *testing.T) {
			cfg := testenv.ClusterConfig{Groups: 3, Ranks: 2, Schedulers: 2, TimeScale: 1}
			if keys {
				cfg.AuthDir = t.TempDir()
				if _, err := auth.Init(cfg.AuthDir, messages.Subjects{}, nil, false); err != nil {
					t.Fatal(err)
				}
			}
			c := testenv.StartCluster(t, cfg)
			body := fmt.Sprintf(`{"model":%q,"max_tokens":24,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"%s"}]}`,
				c.Model, strings.Repeat("one group asked ", 8))
			if keys {
				nc, err := bus.Connect(t.Context(), bus.Config{URL: c.NATS.ClientURL(), NKeySeedFile: filepath.Join(cfg.AuthDir, "admin.nk"),
					Logger: slog.New(slog.DiscardHandler)})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(nc.Close)
				loseOutputsMidStreamOn(t, nc)
			} else {
				loseOutputsMidStream(t, c)
			}
			status, _, out := testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions", body, nil)
			if _, tokens, errEvent := streamText(t, out); status != http.StatusOK || errEvent != "" || tokens != 24 {
				t.Fatalf("stream that lost outputs: %d, %d tokens, error %s; want the whole stream", status, tokens, errEvent)
			}
			handled := func(handler string) float64 {
				var n float64
				for _, reg := range c.SchedulerRegistries { // the first holds the ranks' too
					n += testenv.CounterSum(t, reg, "kvbus_bus_messages_total", map[string]string{"handler": handler})
				}
				return n
			}
			// The fault took effect: the frontend asked once, the driver sent.
			if n := testenv.CounterSum(t, c.Registry, "kvbus_frontend_resends_total", nil); n != 1 {
				t.Fatalf("resends %v; want 1", n)
			}
			if lines := c.Logs.Lines(`msg="outputs lost on the bus sent again"`); len(lines) != 1 {
				t.Errorf("driver's resend log lines: %q; want one", lines)
			}
			testenv.Eventually(t, 5*time.Second, "each scheduler replica read the ask", func() bool { return handled("scheduler_resend") == 2 })
			if n := handled("worker_resend"); n != 1 {
				t.Errorf("the drivers of 3 groups read %v asks; want 1 (the request's group's)", n)
			}
			if lines := c.Logs.Lines("permissions violation"); len(lines) > 0 {
				t.Errorf("permissions violations logged:\n%s", strings.Join(lines, "\n"))
			}
		})
	}
}

// TestSlowStreamHeardNothingAfterAReconnectGoesOn: a stream under way when
// NATS restarts that hears nothing for 3 s after the reconnect (here the
// engine takes 8 s a token) asks its driver for what it missed; the driver
// has nothing new, and the stream goes on to its end. Before, the silence
// alone ended it with output_lost.
func TestSlowStreamHeardNothingAfterAReconnectGoesOn(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 2, TimeScale: 800, RequestTimeout: 40 * time.Second})
	outs := c.Observe(t, messages.Subjects{}.Out("*"))
	done := sendAsync(t, c.URL+"/v1/chat/completions",
		fmt.Sprintf(`{"model":%q,"max_tokens":2,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"slow"}]}`, c.Model), nil)
	testenv.Eventually(t, 10*time.Second, "the stream's first output", func() bool { return len(testenv.RequestOutputs(outs.Messages())) > 0 })
	if err := c.Cluster.RestartNATS(); err != nil {
		t.Fatal(err)
	}
	a := <-done
	_, tokens, errEvent := streamText(t, a.out)
	if a.status != http.StatusOK || tokens != 2 || errEvent != "" {
		t.Fatalf("slow stream across a reconnect: %d, %d tokens, error %s; want 200 and both tokens", a.status, tokens, errEvent)
	}
	// The fault took effect: the frontend judged the stream silent and
	// asked its driver, which had nothing to send again.
	if n := testenv.CounterSum(t, c.Registry, "kvbus_frontend_resends_total", nil); n != 1 {
		t.Errorf("resends %v; want 1", n)
	}
	if lines := c.Logs.Lines(`msg="outputs lost on the bus sent again"`, "outputs=0"); len(lines) != 1 {
		t.Errorf("driver's resend log lines with nothing to send: %q; want one", lines)
	}
}
