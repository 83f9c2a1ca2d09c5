package testenv_test

import (
	"bufio"
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
	// Prefill takes 60 µs × 20 per token: about 2.4 s for this prompt.
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, TimeScale: 20})
	metas := c.Observe(t, "kvbus.meta.>")
	prompt := strings.Repeat("a long prompt to prefill slowly ", 300)
	body, _ := json.Marshal(map[string]any{"model": c.Model, "max_tokens": 1, "messages": []map[string]string{{"role": "user", "content": prompt}}})
	type reply struct {
		status int
		body   []byte
	}
	done := make(chan reply, 1)
	go func() {
		status, _, raw := post(t, c, "/v1/chat/completions", string(body), map[string]string{"X-Session-ID": "failover"})
		done <- reply{status, raw}
	}()
	var first *messages.ReqMeta
	testenv.Eventually(t, 10*time.Second, "the first dispatch", func() bool {
		for _, m := range metas.Messages() {
			first, _ = messages.DecodeReqMeta(m.Data)
			return first != nil
		}
		return false
	})
	c.KillRank(t, first.Group, 0) // the driver, in the middle of the prefill
	r := <-done
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	var groups []string
	for _, m := range metas.Messages() {
		meta, _ := messages.DecodeReqMeta(m.Data)
		if meta.ReqID == first.ReqID {
			groups = append(groups, fmt.Sprintf("%s@%d", meta.Group, meta.Attempt))
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
