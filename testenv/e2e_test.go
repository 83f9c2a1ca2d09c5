package testenv_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// The fake engines' ZeroMQ PUB sockets leave go-zeromq's writer goroutine
// behind when closed (a known leak of the library, not of kvbus).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// post sends a JSON body to path of the cluster's frontend.
func post(t *testing.T, c *testenv.Cluster, path, body string, headers map[string]string) (int, http.Header, []byte) {
	t.Helper()
	return testenv.Send(t, http.MethodPost, c.URL+path, body, headers)
}

func chatBody(model, content string, extra string) string {
	return fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":8%s}`, model, content, extra)
}

// busRequests decodes the Requests observed on the request subjects.
func busRequests(t *testing.T, o *testenv.Observer) []*messages.Request {
	t.Helper()
	var out []*messages.Request
	for _, m := range o.Messages() {
		r, err := messages.DecodeRequest(m.Data)
		if err != nil {
			t.Fatalf("observed a bad Request: %v", err)
		}
		out = append(out, r)
	}
	return out
}

func TestSessionReachesEveryRank(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	subj := messages.Subjects{}
	metas := c.Observe(t, subj.All()) // every kvbus message
	status, h, body := post(t, c, "/v1/chat/completions", chatBody(c.Model, "hi", ""), map[string]string{"X-Session-ID": "abc"})
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, body)
	}
	if got := h.Get("X-Session-ID"); got != "abc" {
		t.Errorf("X-Session-ID echo = %q, want abc", got)
	}

	// On the bus: one ReqMeta on the group's session-keyed subject, whose
	// session_id is abc, and a RankResult from each of the 4 ranks.
	wantMeta := subj.Meta("g0", "abc")
	testenv.Eventually(t, 5*time.Second, "4 rank results", func() bool {
		n := 0
		for _, m := range metas.Messages() {
			if strings.HasPrefix(m.Subject, "kvbus.done.") {
				if r, err := messages.DecodeRankResult(m.Data); err == nil && !r.Prefilled {
					n++
				}
			}
		}
		return n == 4
	})
	var nMeta, prefilled int
	ranks := map[int]bool{}
	for _, m := range metas.Messages() {
		switch {
		case strings.HasPrefix(m.Subject, "kvbus.meta."):
			nMeta++
			if m.Subject != wantMeta {
				t.Errorf("ReqMeta on %s, want %s", m.Subject, wantMeta)
			}
			if strings.Contains(m.Subject, "abc") {
				t.Errorf("raw session id in subject %s", m.Subject)
			}
			meta, err := messages.DecodeReqMeta(m.Data)
			if err != nil {
				t.Fatal(err)
			}
			if meta.SessionID != "abc" || meta.SamplingParams.SessionFromExtraArgs() != "abc" {
				t.Errorf("ReqMeta session_id %q, extra_args %v", meta.SessionID, meta.SamplingParams.ExtraArgs)
			}
		case strings.HasPrefix(m.Subject, "kvbus.done."):
			r, err := messages.DecodeRankResult(m.Data)
			if err != nil {
				t.Fatal(err)
			}
			if r.Prefilled {
				prefilled++
				if r.TPRank != 0 {
					t.Errorf("prefill reported by rank %d, want the driver", r.TPRank)
				}
				continue
			}
			ranks[r.TPRank] = true
		}
	}
	if nMeta != 1 {
		t.Errorf("%d ReqMetas published, want exactly 1 (NATS fans out)", nMeta)
	}
	if len(ranks) != 4 {
		t.Errorf("results from ranks %v, want 0..3", ranks)
	}
	if prefilled != 1 {
		t.Errorf("%d prefill reports, want 1 from the driver", prefilled)
	}
	// In the logs: a store thread line with session_id=abc per tp_rank.
	for r := range 4 {
		lines := c.Logs.Lines(`msg="store thread"`, "session_id=abc", fmt.Sprintf("tp_rank=%d ", r), fmt.Sprintf("ep_rank=%d ", r), "group=g0")
		if len(lines) != 1 {
			t.Errorf("tp_rank %d: %d store thread lines with session_id=abc, want 1", r, len(lines))
		}
	}
}

func TestSessionPrecedenceEndToEnd(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	reqs := c.Observe(t, messages.Subjects{}.RequestAll())
	metas := c.Observe(t, "kvbus.meta.>")
	cases := []struct {
		name    string
		extra   string
		headers map[string]string
		want    string
	}{
		{"X-Session-ID", "", map[string]string{"X-Session-ID": "s-hdr"}, "s-hdr"},
		{"X-Correlation-ID alone", "", map[string]string{"X-Correlation-ID": "corr-1"}, "corr-1"},
		{"X-Session-ID beats X-Correlation-ID", "", map[string]string{"X-Correlation-ID": "corr-2", "X-Session-ID": "s-2"}, "s-2"},
		{"body session_id beats headers", `,"session_id":"body-1"`, map[string]string{"X-Session-ID": "s-3"}, "body-1"},
		{"vllm_xargs beats headers", `,"vllm_xargs":{"session_id":"xa-1","other":7}`, map[string]string{"X-Session-ID": "s-4"}, "xa-1"},
		{"body session_id beats vllm_xargs", `,"session_id":"body-2","vllm_xargs":{"session_id":"xa-2"}`, nil, "body-2"},
		{"no session", "", nil, ""},
	}
	for i, tc := range cases {
		status, h, body := post(t, c, "/v1/chat/completions", chatBody(c.Model, fmt.Sprintf("case %d", i), tc.extra), tc.headers)
		if status != http.StatusOK {
			t.Fatalf("%s: status %d: %s", tc.name, status, body)
		}
		if got := h.Get("X-Session-ID"); got != tc.want {
			t.Errorf("%s: X-Session-ID echo %q, want %q", tc.name, got, tc.want)
		}
	}
	testenv.Eventually(t, 5*time.Second, "all requests and metas observed", func() bool {
		return len(reqs.Messages()) == len(cases) && len(metas.Messages()) == len(cases)
	})
	got := busRequests(t, reqs)
	for i, tc := range cases {
		r := got[i]
		if r.SessionID != tc.want {
			t.Errorf("%s: Request.session_id %q, want %q", tc.name, r.SessionID, tc.want)
		}
		v, has := r.SamplingParams.ExtraArgs[messages.ExtraArgSessionID]
		switch {
		case tc.want == "" && has:
			t.Errorf("%s: extra_args has session_id %v; the key must be absent without a session", tc.name, v)
		case tc.want != "" && v != tc.want:
			t.Errorf("%s: extra_args session_id %v, want %q", tc.name, v, tc.want)
		}
		if tc.name == "vllm_xargs beats headers" && r.SamplingParams.ExtraArgs["other"] == nil {
			t.Errorf("%s: other vllm_xargs keys must pass into extra_args: %v", tc.name, r.SamplingParams.ExtraArgs)
		}
	}
	for _, m := range metas.Messages() {
		meta, err := messages.DecodeReqMeta(m.Data)
		if err != nil {
			t.Fatal(err)
		}
		if want := (messages.Subjects{}).Meta(meta.Group, meta.SessionID); m.Subject != want {
			t.Errorf("ReqMeta for session %q on %s, want %s", meta.SessionID, m.Subject, want)
		}
		if meta.SessionID == "" && !strings.HasSuffix(m.Subject, ".none") {
			t.Errorf("no-session ReqMeta on %s, want the .none key", m.Subject)
		}
	}
}

func TestSessionPolicyIsSticky(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Policy: "session"})
	metas := c.Observe(t, "kvbus.meta.>")
	const sessions, turns = 12, 3
	for turn := range turns {
		for s := range sessions {
			status, _, body := post(t, c, "/v1/chat/completions", chatBody(c.Model, fmt.Sprintf("turn %d", turn), ""),
				map[string]string{"X-Session-ID": fmt.Sprintf("sess-%d", s)})
			if status != http.StatusOK {
				t.Fatalf("status %d: %s", status, body)
			}
			// A client's think time: the previous request is finished in
			// the scheduler too, so bounded load (which counts in-flight
			// requests) does not move a session of a sequential client.
			testenv.Eventually(t, 5*time.Second, "request finished", func() bool { return c.Scheduler.Trackers() == 0 })
		}
	}
	testenv.Eventually(t, 5*time.Second, "all metas", func() bool { return len(metas.Messages()) == sessions*turns })
	groupOf := map[string]string{}
	used := map[string]bool{}
	for _, m := range metas.Messages() {
		meta, err := messages.DecodeReqMeta(m.Data)
		if err != nil {
			t.Fatal(err)
		}
		used[meta.Group] = true
		if g, ok := groupOf[meta.SessionID]; ok && g != meta.Group {
			t.Errorf("session %s moved from %s to %s", meta.SessionID, g, meta.Group)
		}
		groupOf[meta.SessionID] = meta.Group
	}
	if len(used) != 2 {
		t.Errorf("sessions used groups %v; %d sessions should spread over both", used, sessions)
	}
}

func TestConcurrentSessionsAllComplete(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2})
	const n, sessions = 200, 20
	client := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	defer client.CloseIdleConnections()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			body := chatBody(c.Model, fmt.Sprintf("request %d", i), "")
			req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(body))
			req.Header.Set("X-Session-ID", fmt.Sprintf("s%d", i%sessions))
			resp, err := client.Do(req)
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			var out struct {
				Choices []struct {
					Message struct{ Content string }
				}
			}
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &out) != nil || len(out.Choices) != 1 {
				errs <- fmt.Errorf("request %d: status %d body %s", i, resp.StatusCode, b)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	testenv.Eventually(t, 5*time.Second, "no live trackers", func() bool { return c.Scheduler.Trackers() == 0 })
	// The scheduler logs a request's "request done" line once its tracker
	// has ended (countDone, after addResult): no tracker left does not say
	// the last line is in.
	completed := func() int { return len(c.Logs.Lines(`msg="request done"`, "outcome=completed")) }
	testenv.Eventually(t, 5*time.Second, fmt.Sprintf("%d requests done", n), func() bool { return completed() >= n })
	if got := completed(); got != n {
		t.Errorf("%d requests completed in the scheduler, want %d", got, n)
	}
}

func TestStreamingEndToEnd(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{TimeScale: 0.001})
	body := `{"model":"` + c.Model + `","messages":[{"role":"user","content":"stream please"}],"max_tokens":12,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`
	status, h, raw := post(t, c, "/v1/chat/completions", body, map[string]string{"X-Session-ID": "st"})
	if status != http.StatusOK || !strings.HasPrefix(h.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d content-type %q: %s", status, h.Get("Content-Type"), raw)
	}
	events := strings.Split(strings.TrimSuffix(string(raw), "\n\n"), "\n\n")
	if events[len(events)-1] != "data: [DONE]" {
		t.Fatalf("last event %q, want data: [DONE]", events[len(events)-1])
	}
	var text strings.Builder
	var usage map[string]any
	for _, ev := range events[:len(events)-1] {
		var chunk struct {
			Object  string
			Choices []struct {
				Delta        struct{ Content string }
				FinishReason *string `json:"finish_reason"`
			}
			Usage map[string]any
		}
		if err := json.Unmarshal(bytes.TrimPrefix([]byte(ev), []byte("data: ")), &chunk); err != nil {
			t.Fatalf("event %q: %v", ev, err)
		}
		if chunk.Object != "chat.completion.chunk" {
			t.Errorf("object %q", chunk.Object)
		}
		for _, ch := range chunk.Choices {
			text.WriteString(ch.Delta.Content)
		}
		if chunk.Usage != nil {
			usage = chunk.Usage
		}
	}
	if usage == nil || usage["completion_tokens"].(float64) != 12 {
		t.Errorf("usage %v, want completion_tokens 12", usage)
	}
	if len(strings.Fields(text.String())) != 12 {
		t.Errorf("streamed text %q: want 12 words (one per token)", text.String())
	}

	// The same request not streamed gets the same text (the sim's answer
	// follows the prompt), in two outputs on the bus: its first token at
	// once, the rest with the finish reason. It came in 13, one per token.
	outs := c.Observe(t, "kvbus.out.>")
	status, _, raw = post(t, c, "/v1/chat/completions", strings.Replace(body, `,"stream":true,"stream_options":{"include_usage":true}`, "", 1), map[string]string{"X-Session-ID": "st"})
	var whole struct {
		Choices []struct{ Message struct{ Content string } }
	}
	if err := json.Unmarshal(raw, &whole); status != http.StatusOK || err != nil || len(whole.Choices) != 1 {
		t.Fatalf("not streamed: status %d (%v): %s", status, err, raw)
	}
	if whole.Choices[0].Message.Content != text.String() {
		t.Errorf("not streamed: %q, want the streamed text %q", whole.Choices[0].Message.Content, text.String())
	}
	if n := len(testenv.RequestOutputs(outs.Messages())); n != 2 {
		t.Errorf("the answer not streamed came in %d outputs on the bus; want 2", n)
	}
}
