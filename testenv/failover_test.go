package testenv_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestGroupFailureBeforeOutputRedispatches: a request whose group dies
// before it produced any output is dispatched again on another group and
// answers normally.
func TestGroupFailureBeforeOutputRedispatches(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, TimeScale: 20})
	metas := c.Observe(t, "kvbus.meta.>")
	done, first := sendSlowPrefill(t, c, metas, "failover")
	c.KillRank(t, first.Group, 0) // the driver, in the middle of the prefill
	r := <-done
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	var groups []string
	for _, m := range metas.Messages() {
		meta, _ := messages.DecodeReqMeta(m.Data)
		// A ReqMeta published again to the same group and attempt (the dead
		// driver did not answer within --resend-after) counts once.
		if d := fmt.Sprintf("%s@%d", meta.Group, meta.Attempt); meta.ReqID == first.ReqID && (len(groups) == 0 || groups[len(groups)-1] != d) {
			groups = append(groups, d)
		}
	}
	if len(groups) != 2 || !strings.HasPrefix(groups[0], first.Group+"@0") || strings.HasPrefix(groups[1], first.Group) || !strings.HasSuffix(groups[1], "@1") {
		t.Errorf("dispatches %v: want the first group at attempt 0, then the other at attempt 1", groups)
	}
	if got := testenv.CounterSum(t, c.SchedulerRegistries[0], "kvbus_scheduler_requests_total", map[string]string{"outcome": "redispatched"}); got != 1 {
		t.Errorf("redispatched = %v, want 1", got)
	}
	testenv.Eventually(t, 5*time.Second, "no tracker left", func() bool { return c.Scheduler.Trackers() == 0 })
}

// slowReply is the answer to sendSlowPrefill's request.
type slowReply struct {
	status int
	body   []byte
	took   time.Duration
}

// sendSlowPrefill sends, in the background, a chat request whose prefill
// takes about 2.4 s at --time-scale 20, and waits for its first ReqMeta
// among metas.
func sendSlowPrefill(t *testing.T, c *testenv.Cluster, metas *testenv.Observer, session string) (<-chan slowReply, *messages.ReqMeta) {
	t.Helper()
	prompt := strings.Repeat("a long prompt to prefill slowly ", 300) // 60 µs × 20 per token
	body, _ := json.Marshal(map[string]any{"model": c.Model, "max_tokens": 1, "messages": []map[string]string{{"role": "user", "content": prompt}}})
	done := make(chan slowReply, 1)
	start := time.Now()
	go func() {
		status, _, raw := post(t, c, "/v1/chat/completions", string(body), map[string]string{"X-Session-ID": session})
		done <- slowReply{status, raw, time.Since(start)}
	}()
	var first *messages.ReqMeta
	testenv.Eventually(t, 10*time.Second, "the first dispatch", func() bool {
		for _, m := range metas.Messages() {
			first, _ = messages.DecodeReqMeta(m.Data)
			return first != nil
		}
		return false
	})
	return done, first
}

// TestGroupFailureWhileGeneratingANonStreamedAnswerMovesIt: a request
// whose group breaks after its prefill, while the driver generates an
// answer that is not streamed, is dispatched again on another group and
// answered whole, with a 200: the frontend holds a non-streamed answer
// until its end and replaces it with a newer attempt's. It was ended with
// a 503 group_failed, as a streamed answer under way must be (4 such
// requests when a fault review killed a driver under load).
func TestGroupFailureWhileGeneratingANonStreamedAnswerMovesIt(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, TimeScale: 1}) // 10 ms per token
	metas := c.Observe(t, "kvbus.meta.>")
	results := c.Observe(t, "kvbus.done.>")
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"not streamed"}],"max_tokens":300,"ignore_eos":true}`, c.Model)
	type reply struct {
		status int
		raw    []byte
	}
	done := make(chan reply, 1)
	go func() {
		status, _, raw := post(t, c, "/v1/chat/completions", body, nil)
		done <- reply{status, raw}
	}()
	var meta *messages.ReqMeta
	testenv.Eventually(t, 10*time.Second, "the driver's prefill report", func() bool {
		for _, m := range results.Messages() {
			if r, err := messages.DecodeRankResult(m.Data); err == nil && r.Prefilled {
				for _, mm := range metas.Messages() {
					meta, _ = messages.DecodeReqMeta(mm.Data)
				}
				return meta != nil
			}
		}
		return false
	})
	c.KillRank(t, meta.Group, 2) // a non-driver rank: the group is broken while its driver generates
	r := <-done
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.raw)
	}
	var answer struct {
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		}
	}
	if err := json.Unmarshal(r.raw, &answer); err != nil || answer.Usage.CompletionTokens != 300 {
		t.Fatalf("answer %s (%v): want all 300 tokens", r.raw, err)
	}
	var groups []string
	for _, m := range metas.Messages() {
		if rm, _ := messages.DecodeReqMeta(m.Data); rm != nil && rm.ReqID == meta.ReqID && rm.Attempt == 1 {
			groups = append(groups, rm.Group)
		}
	}
	if len(groups) == 0 || groups[0] == meta.Group {
		t.Errorf("attempt 1 went to %v, want the other group than %s", groups, meta.Group)
	}
	testenv.Eventually(t, 5*time.Second, "no tracker left", func() bool { return c.Scheduler.Trackers() == 0 })
}

// TestGroupFailureWhileStreamingEndsWithAnError: a request that already
// streamed part of its answer cannot move; it ends with an error chunk.
func TestGroupFailureWhileStreamingEndsWithAnError(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, TimeScale: 1}) // 10 ms per token
	metas := c.Observe(t, "kvbus.meta.>")
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"stream"}],"max_tokens":300,"ignore_eos":true,"stream":true}`, c.Model)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(body))
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	killed := false
	var events []string
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		events = append(events, line)
		if !killed && strings.Contains(line, `"content":" `) { // real text is streaming
			// The observer's own connection may hear the ReqMeta after the
			// answer began (a loaded CI host read none here).
			testenv.Eventually(t, 5*time.Second, "the ReqMeta observed", func() bool { return len(metas.Messages()) > 0 })
			meta, err := messages.DecodeReqMeta(metas.Messages()[0].Data)
			if err != nil {
				t.Fatal(err)
			}
			c.KillRank(t, meta.Group, 2) // a non-driver rank: the group is broken
			killed = true
		}
	}
	if !killed {
		t.Fatalf("no text streamed: %v", events)
	}
	if n := len(events); n < 2 || events[n-1] != "[DONE]" || !strings.Contains(events[n-2], `"code":"group_failed"`) {
		t.Fatalf("stream ended with %q, want a group_failed error then [DONE]", events[max(0, len(events)-2):])
	}
	testenv.Eventually(t, 5*time.Second, "no tracker left", func() bool { return c.Scheduler.Trackers() == 0 })
	// The frontend's last line for it does not say it completed (it did,
	// right after "request failed while streaming").
	if lines := c.Logs.Lines("request failed while streaming"); len(lines) != 1 {
		t.Errorf("%d 'request failed while streaming' lines, want 1", len(lines))
	}
	if lines := c.Logs.Lines("request completed", "stream=true"); len(lines) != 0 {
		t.Errorf("the failed stream was logged as completed: %q", lines)
	}
	if lines := c.Logs.Lines("request ended with an error after its stream began"); len(lines) != 1 {
		t.Errorf("%d lines saying the stream ended with an error, want 1", len(lines))
	}
	// Nor does vLLM's success counter count it (it did, as finished "stop").
	if n := testenv.CounterSum(t, c.Registry, "vllm:request_success_total", nil); n != 0 {
		t.Errorf("vllm:request_success_total = %v after a stream that failed, want 0", n)
	}
}

// TestRedeliveredRequestRunsOnce: a request delivered again by the log after
// it ended (a scheduler died before its ack) is not run a second time.
func TestRedeliveredRequestRunsOnce(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	reqs := c.Observe(t, "kvbus.req.>")
	metas := c.Observe(t, "kvbus.meta.>")
	if status, _, raw := post(t, c, "/v1/chat/completions", chatBody(c.Model, "once", ""), nil); status != http.StatusOK {
		t.Fatalf("status %d: %s", status, raw)
	}
	testenv.Eventually(t, 5*time.Second, "request done", func() bool { return c.Scheduler.Trackers() == 0 && len(reqs.Messages()) == 1 })
	js, err := jetstream.New(testenv.Connect(t, c.NATS))
	if err != nil {
		t.Fatal(err)
	}
	// The same request again, under another message id: as a redelivery.
	m := reqs.Messages()[0]
	if _, err := js.Publish(t.Context(), m.Subject, m.Data, jetstream.WithMsgID("again")); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "the duplicate seen", func() bool {
		return testenv.CounterSum(t, c.SchedulerRegistries[0], "kvbus_scheduler_requests_total", map[string]string{"outcome": "duplicate"}) == 1
	})
	if n := len(metas.Messages()); n != 1 {
		t.Errorf("%d ReqMetas, want 1: the request ran again", n)
	}
}

// TestShutdownFinishesInFlight: stopping the cluster (SIGTERM in kvbus
// serve) lets an in-flight request finish, and new requests are refused
// instead of hanging.
func TestShutdownFinishesInFlight(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{TimeScale: 1}) // 10 ms per token
	metas := c.Observe(t, "kvbus.meta.>")
	done := make(chan int, 1)
	go func() {
		status, _, _ := post(t, c, "/v1/chat/completions", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"finish me"}],"max_tokens":60,"ignore_eos":true}`, c.Model), nil)
		done <- status
	}()
	testenv.Eventually(t, 5*time.Second, "the request in flight", func() bool { return len(metas.Messages()) == 1 })
	stopped := make(chan struct{})
	go func() { c.Cluster.Stop(); _ = c.Cluster.Wait(); close(stopped) }()
	if status := <-done; status != http.StatusOK {
		t.Errorf("in-flight request ended with %d during shutdown, want 200", status)
	}
	<-stopped
	client := &http.Client{Timeout: 5 * time.Second}
	resp, err := client.Post(c.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody(c.Model, "late", "")))
	if err == nil {
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Errorf("a request after shutdown got %d, want refused or 503", resp.StatusCode)
		}
	}
}

// TestClientDisconnectAborts: a client that goes away mid-stream causes an
// Abort; the scheduler drops the tracker and passes the Abort on to the
// request's group, and to no other, and the driver stops generating.
func TestClientDisconnectAborts(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, TimeScale: 1})
	aborts := c.Observe(t, "kvbus.ctl.abort")
	groupAborts := c.Observe(t, "kvbus.ctl.abort.*")
	metas := c.Observe(t, "kvbus.meta.>")
	done := c.Observe(t, "kvbus.done.>")
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"leave"}],"max_tokens":500,"ignore_eos":true,"stream":true}`, c.Model)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(body))
	client := &http.Client{}
	defer client.CloseIdleConnections()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	id := resp.Header.Get("X-Request-Id")
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if strings.Contains(sc.Text(), `"content":" `) {
			break // text is streaming: now leave
		}
	}
	cancel()
	resp.Body.Close()
	testenv.Eventually(t, 5*time.Second, "an Abort for the request", func() bool {
		for _, m := range aborts.Messages() {
			if a, err := messages.DecodeAbort(m.Data); err == nil && a.ReqID == id && a.Group == "" {
				return true
			}
		}
		return false
	})
	testenv.Eventually(t, 5*time.Second, "the tracker dropped", func() bool { return c.Scheduler.Trackers() == 0 })
	testenv.Eventually(t, 5*time.Second, "the driver stopped", func() bool {
		for _, m := range done.Messages() {
			if r, err := messages.DecodeRankResult(m.Data); err == nil && r.ReqID == id && r.TPRank == 0 && !r.Prefilled {
				return r.Error != "" && r.CompletionTokens < 500
			}
		}
		return false
	})
	var group string
	for _, m := range metas.Messages() {
		if meta, err := messages.DecodeReqMeta(m.Data); err == nil && meta.ReqID == id {
			group = meta.Group
		}
	}
	var to []string
	for _, m := range groupAborts.Messages() {
		if a, err := messages.DecodeAbort(m.Data); err == nil && a.ReqID == id {
			to = append(to, m.Subject)
		}
	}
	if want := "kvbus.ctl.abort." + group; group == "" || len(to) != 1 || to[0] != want {
		t.Errorf("the client's Abort went to %q, want to %s only (the group of its ReqMeta)", to, want)
	}
}

// TestScaleDownDrainsAGroup: a rank stopped gracefully (a scaled-down
// worker) takes its group out of placement at once, and the group's
// in-flight request still finishes.
func TestScaleDownDrainsAGroup(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, TimeScale: 1})
	metas := c.Observe(t, "kvbus.meta.>")
	done := make(chan int, 1)
	go func() {
		status, _, _ := post(t, c, "/v1/chat/completions", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"drain"}],"max_tokens":80,"ignore_eos":true}`, c.Model), nil)
		done <- status
	}()
	testenv.Eventually(t, 5*time.Second, "the request in flight", func() bool { return len(metas.Messages()) == 1 })
	first, _ := messages.DecodeReqMeta(metas.Messages()[0].Data)
	stopped := make(chan error, 1)
	go func() { stopped <- c.Cluster.StopRank(first.Group, 3) }()
	testenv.Eventually(t, 5*time.Second, "the group out of placement", func() bool { return c.Scheduler.ReadyGroups() == 1 })
	// New requests go to the other group while the draining one finishes.
	for i := range 3 {
		if status, _, raw := post(t, c, "/v1/chat/completions", chatBody(c.Model, fmt.Sprint("after ", i), ""), nil); status != http.StatusOK {
			t.Fatalf("status %d: %s", status, raw)
		}
	}
	if status := <-done; status != http.StatusOK {
		t.Errorf("the draining group's request ended with %d, want 200", status)
	}
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	for _, m := range metas.Messages()[1:] {
		if meta, _ := messages.DecodeReqMeta(m.Data); meta.Group == first.Group {
			t.Errorf("request %s placed on the draining group %s", meta.ReqID, first.Group)
		}
	}
}

// TestRankRestartMidRequestRedispatches: a rank crashes in the middle of a
// request's prefill and its supervisor starts a new process of it at once,
// well within the heartbeat timeout, so its group never looks unready. The
// new process knows nothing of the request, which had streamed nothing: it
// is dispatched again (attempt 1) and answers, instead of waiting for its
// deadline. For the driver, and for another rank before it reported (its
// store thread is slowed down: a rank that did report lost nothing).
func TestRankRestartMidRequestRedispatches(t *testing.T) {
	for _, rank := range []int{0, 2} {
		t.Run(fmt.Sprintf("tp_rank %d", rank), func(t *testing.T) {
			c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, TimeScale: 20, RequestTimeout: 30 * time.Second,
				StoreDelays: map[int]time.Duration{2: 3 * time.Second}})
			metas := c.Observe(t, "kvbus.meta.>")
			done, first := sendSlowPrefill(t, c, metas, "restart")
			time.Sleep(300 * time.Millisecond) // past --receipt-after: every rank said it has the request
			c.CrashRestartRank(t, first.Group, rank)
			var r slowReply
			select {
			case r = <-done:
			case <-time.After(20 * time.Second):
				t.Fatalf("no answer 20 s after the rank restarted: the request waits for its deadline (%d trackers)", c.Scheduler.Trackers())
			}
			if r.status != http.StatusOK {
				t.Fatalf("after %s: status %d: %s", r.took.Round(time.Millisecond), r.status, r.body)
			}
			attempts := map[int]bool{}
			for _, m := range metas.Messages() {
				if meta, _ := messages.DecodeReqMeta(m.Data); meta != nil && meta.ReqID == first.ReqID {
					attempts[meta.Attempt] = true
				}
			}
			if !attempts[0] || !attempts[1] || len(attempts) != 2 {
				t.Errorf("attempts dispatched %v: want 0, then 1 after the restart", attempts)
			}
			if got := testenv.CounterSum(t, c.SchedulerRegistries[0], "kvbus_scheduler_requests_total", map[string]string{"outcome": "redispatched"}); got != 1 {
				t.Errorf("redispatched = %v, want 1", got)
			}
			testenv.Eventually(t, 10*time.Second, "no tracker left", func() bool { return c.Scheduler.Trackers() == 0 })
		})
	}
}

// TestGroupFailureAfterTheAnswerIsNoFailure: a rank that dies while it
// still saves a request whose driver has answered (the client has its whole
// answer) leaves that request completed, not failed: the scheduler counted
// it failed, logged "the request ends with an error" and sent the frontend
// an error for an answer it had delivered (with real processes, a worker
// rank killed under load: 13 of the 14 requests so counted had been
// answered 200).
func TestGroupFailureAfterTheAnswerIsNoFailure(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, TimeScale: 0,
		StoreDelays: map[int]time.Duration{2: 10 * time.Second}})
	status, _, body := testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions",
		`{"messages":[{"role":"user","content":"answered before the rank dies"}],"max_tokens":4}`, nil)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, body)
	}
	c.KillRank(t, "g0", 2) // still saving the request's blocks
	testenv.Eventually(t, 10*time.Second, "the request's tracker gone", func() bool { return c.Scheduler.Trackers() == 0 })
	count := func(outcome string) float64 {
		return testenv.CounterSum(t, c.SchedulerRegistries[0], "kvbus_scheduler_requests_total", map[string]string{"outcome": outcome})
	}
	if failed, completed := count("failed"), count("completed"); failed != 0 || completed != 1 {
		t.Errorf("a request answered 200 counted failed %v, completed %v; want 0 and 1", failed, completed)
	}
	if n := strings.Count(c.Logs.String(), "during generation; the request ends with an error"); n != 0 {
		t.Errorf("the scheduler logged %d requests ending with an error; the only one was answered", n)
	}
}
