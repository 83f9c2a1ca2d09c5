package testenv_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

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
		data, err := messages.Marshal(&messages.Output{ReqID: req.RequestID, Index: 2, Text: " injected"})
		if err == nil {
			err = nc.Publish(subj.Out(req.FrontendID), data)
		}
		if err != nil {
			t.Error(err)
		}
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

	seen := loseFirstOutputs(t, c, 1)
	status, _, out := testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions", body(false), nil)
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
// have lost its answer, or only be slow (here: the driver handles it 5 s
// late). It is asked again and kept: the client gets one whole answer from
// whichever copy answers first, the other is aborted, and the frontend
// listens for neither afterwards. Before, it waited 10 s and, had the
// answer been lost, ended with a 503.
func TestAnswerHeardNothingAfterAReconnectIsAskedAgain(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 2, DelayFirstReqMeta: map[int]time.Duration{0: 5 * time.Second},
		RequestTimeout: 30 * time.Second})
	seen := loseFirstOutputs(t, c, 0)
	aborts := c.Observe(t, messages.Subjects{}.Abort())
	type answer struct {
		status int
		out    []byte
	}
	done := make(chan answer, 1)
	go func() {
		status, _, out := testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions",
			fmt.Sprintf(`{"model":%q,"max_tokens":12,"ignore_eos":true,"messages":[{"role":"user","content":"slow"}]}`, c.Model), nil)
		done <- answer{status, out}
	}()
	testenv.Eventually(t, 5*time.Second, "the request published", func() bool { return len(seen()) == 1 })
	if err := c.Cluster.RestartNATS(); err != nil {
		t.Fatal(err)
	}
	a := <-done
	var resp struct {
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if a.status != http.StatusOK || json.Unmarshal(a.out, &resp) != nil || resp.Usage.CompletionTokens != 12 {
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
