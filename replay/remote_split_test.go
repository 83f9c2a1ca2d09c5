package replay_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

// TestRemoteSplitThroughHTTP: a replay through the frontend reports how
// much of the cache was read from another group as a replay onto the bus
// does, learning it from the outputs on the bus; without the bus the split
// is not known, and the report says so (null local and remote hit ratios,
// "-" in the table). Before, through HTTP every cached token counted as
// local: remote_hit_ratio 0.000 on a global pool that read half of them
// from other groups.
func TestRemoteSplitThroughHTTP(t *testing.T) {
	// One session of 4 turns, each extending the previous: round-robin
	// over 2 groups puts every turn on the other group than the last, so
	// each turn reads its prefix from the other group's segment. Each run
	// has blocks of its own (base): none is cached by a run before it.
	trace := func(base int) []replay.Item {
		var b strings.Builder
		for turn := 1; turn <= 4; turn++ {
			ids := make([]string, turn)
			for k := range ids {
				ids[k] = fmt.Sprint(base + k)
			}
			fmt.Fprintf(&b, `{"timestamp": %d, "input_length": %d, "output_length": 2, "hash_ids": [%s], "session_id": "s%d"}`+"\n",
				turn, 512*turn, strings.Join(ids, ", "), base)
		}
		tr, err := replay.ReadTrace(strings.NewReader(b.String()), replay.FormatMooncake)
		if err != nil {
			t.Fatal(err)
		}
		return tr.Items
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Policy: "round-robin", Pool: "global", Payload: "accounting"})
	run := func(target string, bus bool, base int) *replay.Report {
		t.Helper()
		items := trace(base)
		cfg := replay.Config{Target: target, Mode: replay.ModeSession, Model: c.Model}
		if bus {
			cfg.Conn = testenv.Connect(t, c.NATS)
		}
		results, elapsed := replayOnce(t, cfg, items)
		rep := replay.Summarize("rr", results, replay.IdealHitRatio(items, c.Model, 16), elapsed)
		if rep.OK != len(items) {
			t.Fatalf("%s: ok %d of %d: %v", target, rep.OK, len(items), rep.Errors)
		}
		return rep
	}
	onBus := run(c.NATS.ClientURL(), true, 100)
	if onBus.RemoteHitRatio == nil || *onBus.RemoteHitRatio == 0 {
		t.Fatalf("onto the bus: remote hit ratio %v; the test wants a cluster that reads from other groups", onBus.RemoteHitRatio)
	}
	viaHTTP := run(c.URL, true, 200)
	if viaHTTP.RemoteHitRatio == nil || viaHTTP.LocalHitRatio == nil || *viaHTTP.RemoteHitRatio == 0 ||
		viaHTTP.RemoteTokens > viaHTTP.CachedTokens || *viaHTTP.LocalHitRatio+*viaHTTP.RemoteHitRatio-*viaHTTP.HitRatio > 1e-9 {
		t.Errorf("through HTTP with the bus: hit %v local %v remote %v (%d of %d cached tokens remote); want a remote share, as onto the bus (%v)",
			deref(viaHTTP.HitRatio), viaHTTP.LocalHitRatio, viaHTTP.RemoteHitRatio, viaHTTP.RemoteTokens, viaHTTP.CachedTokens, *onBus.RemoteHitRatio)
	}
	blind := run(c.URL, false, 300)
	if blind.HitRatio == nil || blind.LocalHitRatio != nil || blind.RemoteHitRatio != nil || blind.RemoteTokens != 0 {
		t.Errorf("through HTTP without the bus: hit %v local %v remote %v remote tokens %d; want the hit ratio and no split",
			blind.HitRatio, blind.LocalHitRatio, blind.RemoteHitRatio, blind.RemoteTokens)
	}
	var table strings.Builder
	if err := replay.WriteTable(&table, []*replay.Report{blind}); err != nil {
		t.Fatal(err)
	}
	for _, row := range []string{"local_hit_ratio", "remote_hit_ratio", "remote MiB moved"} {
		if !regexp.MustCompile(`(?m)^ *` + regexp.QuoteMeta(row) + ` +-$`).MatchString(table.String()) {
			t.Errorf("table row %s is not \"-\" without the split:\n%s", row, table.String())
		}
	}
	var page strings.Builder
	if err := replay.WriteHTML(&page, "t", []*replay.Report{blind}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(page.String(), "local/remote not known") {
		t.Errorf("the page does not say the split is not known")
	}
}

// TestImpossibleUsageIsAFailure: a server whose usage has more cached
// tokens than the prompt (or fewer than none) fails that request, saying
// so, rather than put the report's hit_ratio over 1 and over its ideal.
func TestImpossibleUsageIsAFailure(t *testing.T) {
	srv := stubEngine(t, `{"prompt_tokens":512,"prompt_tokens_details":{"cached_tokens":4096}}`, func(*http.Request) {})
	items := oneRequest(t)
	results, elapsed := replayOnce(t, replay.Config{Target: srv.URL}, items)
	rep := replay.Summarize("x", results, replay.IdealHitRatio(items, "m", 16), elapsed)
	if rep.OK != 0 || rep.Failed != 1 || rep.HitRatio != nil {
		t.Fatalf("ok %d failed %d hit ratio %v; want the request failed for its usage", rep.OK, rep.Failed, deref(rep.HitRatio))
	}
	for cause := range rep.Errors {
		if !strings.Contains(cause, "cached tokens of a prompt of 512") {
			t.Errorf("cause %q, want one naming the impossible usage", cause)
		}
	}
}

// TestAskedAgainKeepsItsGroupThroughHTTP: a request the frontend published
// again (its answer lost on the bus: bus id "<X-Request-Id>-<id>-again1")
// is reported with the group that answered it and the cached tokens it
// read from other groups. Before, the report looked them up under
// "<X-Request-Id>-<id>": the group was empty and the remote split unknown
// for that request, after waiting a second for it.
func TestAskedAgainKeepsItsGroupThroughHTTP(t *testing.T) {
	srv := testenv.StartNATS(t)
	publish := publisher(t, testenv.Connect(t, srv))
	var subj messages.Subjects
	engine := stubEngine(t, cachedHalf, func(r *http.Request) {
		busID := r.Header.Get("X-Request-Id") + "-Xq7nuid-again1"
		publish(subj.Meta("g7", "s1"), &messages.ReqMeta{ReqID: busID, SessionID: "s1"})
		publish(subj.Out("fe1"), &messages.Output{ReqID: busID, FinishReason: "length",
			Usage: &messages.Usage{PromptTokens: 512, CompletionTokens: 1, CachedTokens: 256, RemoteCachedTokens: 128}})
	})
	results, _ := replayOnce(t, replay.Config{Target: engine.URL, Conn: testenv.Connect(t, srv)}, oneRequest(t))
	if res := results[0]; res.Err != "" || res.Group != "g7" || res.RemoteUnknown || res.RemoteTokens != 128 {
		t.Fatalf("result: err %q, group %q, remote tokens %d (unknown %v); want group g7 and 128 remote tokens",
			res.Err, res.Group, res.RemoteTokens, res.RemoteUnknown)
	}
}

// TestGroupReadAfterTheAnswerThroughHTTP: the ReqMeta naming a request's
// group can be read from the bus after its HTTP answer and its final
// Output (the replayer's two subscriptions deliver apart). Before, the
// replay stopped waiting once the Output was read, and reported the
// request with no group now and then (a CI run: group "", 128 remote
// tokens).
func TestGroupReadAfterTheAnswerThroughHTTP(t *testing.T) {
	srv := testenv.StartNATS(t)
	publish := publisher(t, testenv.Connect(t, srv))
	var subj messages.Subjects
	engine := stubEngine(t, cachedHalf, func(r *http.Request) {
		busID := r.Header.Get("X-Request-Id") + "-Xq7nuid"
		publish(subj.Out("fe1"), &messages.Output{ReqID: busID, FinishReason: "length",
			Usage: &messages.Usage{PromptTokens: 512, CompletionTokens: 1, CachedTokens: 256, RemoteCachedTokens: 128}})
		time.AfterFunc(200*time.Millisecond, func() {
			publish(subj.Meta("g7", "s1"), &messages.ReqMeta{ReqID: busID, SessionID: "s1"})
		})
	})
	results, _ := replayOnce(t, replay.Config{Target: engine.URL, Conn: testenv.Connect(t, srv)}, oneRequest(t))
	if res := results[0]; res.Err != "" || res.Group != "g7" || res.RemoteTokens != 128 {
		t.Fatalf("result: err %q, group %q, remote tokens %d; want group g7 and 128 remote tokens",
			res.Err, res.Group, res.RemoteTokens)
	}
}

// TestGroupReadAfterTheAnswerOntoTheBus: onto the bus as through HTTP, the
// ReqMeta naming a request's group can be read after its final Output (two
// subscriptions, delivered apart). The replay waits for it, up to a
// second, before reporting the request's group.
func TestGroupReadAfterTheAnswerOntoTheBus(t *testing.T) {
	srv, nc, _ := requestLog(t)
	publish := publisher(t, nc)
	var subj messages.Subjects
	sub, err := nc.Subscribe(subj.RequestAll(), func(m *nats.Msg) {
		req, err := messages.DecodeRequest(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		publish(subj.Out(req.FrontendID), &messages.Output{ReqID: req.RequestID, FinishReason: "length",
			Usage: &messages.Usage{PromptTokens: 512, CompletionTokens: 1, CachedTokens: 256}})
		time.AfterFunc(200*time.Millisecond, func() {
			publish(subj.Meta("g7", "s1"), &messages.ReqMeta{ReqID: req.RequestID, SessionID: "s1"})
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	results, _ := replayOnce(t, replay.Config{Target: srv.ClientURL(), Conn: testenv.Connect(t, srv), Timeout: 10 * time.Second}, oneRequest(t))
	if res := results[0]; res.Err != "" || res.Group != "g7" {
		t.Fatalf("result: err %q, group %q; want group g7", res.Err, res.Group)
	}
}

func deref(p *float64) any {
	if p == nil {
		return nil
	}
	return *p
}

// oneRequest is a trace of one 512-token request with one block.
func oneRequest(t *testing.T) []replay.Item {
	t.Helper()
	tr, err := replay.ReadTrace(strings.NewReader(`{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}`+"\n"), replay.FormatMooncake)
	if err != nil {
		t.Fatal(err)
	}
	return tr.Items
}

// publisher returns a function that publishes msg on subject through nc,
// failing the test (not stopping it: it is called from handlers) on error.
func publisher(t *testing.T, nc *nats.Conn) func(subject string, msg messages.Message) {
	return func(subject string, msg messages.Message) {
		data, err := messages.Marshal(msg)
		if err != nil {
			t.Error(err)
		}
		if err := nc.Publish(subject, data); err != nil {
			t.Error(err)
		}
	}
}

// stubEngine answers every completion with one token of text and usage
// (the JSON of an OpenAI usage object) as a stream, after calling onRequest.
func stubEngine(t *testing.T, usage string, onRequest func(*http.Request)) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		onRequest(r)
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"a\"}]}\n\n")
		fmt.Fprintf(w, "data: {\"usage\":%s}\n\n", usage)
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(srv.Close)
	return srv
}

// replayOnce replays items with cfg and returns the results.
func replayOnce(t *testing.T, cfg replay.Config, items []replay.Item) ([]replay.Result, time.Duration) {
	t.Helper()
	r, err := replay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	results, elapsed, err := r.Run(t.Context(), items)
	if err != nil {
		t.Fatal(err)
	}
	return results, elapsed
}

// cachedHalf is the usage of a 512-token prompt of which 256 were cached.
const cachedHalf = `{"prompt_tokens":512,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":256}}`

// TestSessionModeRunsEachModelsConversationApart: in session mode, one
// session id a capture has with two models is two conversations, as the
// schedulers and the report's turn depths count them, each run closed loop
// on its own. Before, the replay chained them as one: the first turn of
// model b's conversation waited for the answer to model a's.
func TestSessionModeRunsEachModelsConversationApart(t *testing.T) {
	const slow = 600 * time.Millisecond
	srv := stubEngine(t, cachedHalf, func(r *http.Request) {
		var body struct {
			Model string `json:"model"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			t.Error(err)
		}
		if body.Model == "a" {
			time.Sleep(slow)
		}
	})
	items := []replay.Item{
		{SessionID: "s", Prompt: testenv.PromptTokens(1, 512), Request: &messages.Request{Model: "a", SessionID: "s", PromptTokenIDs: testenv.PromptTokens(1, 512)}},
		{SessionID: "s", Prompt: testenv.PromptTokens(2, 512), Request: &messages.Request{Model: "b", SessionID: "s", PromptTokenIDs: testenv.PromptTokens(2, 512)}},
	}
	results, _ := replayOnce(t, replay.Config{Target: srv.URL, Mode: replay.ModeSession}, items)
	for i, res := range results {
		if res.Err != "" || res.TurnDepth != 1 {
			t.Errorf("request %d: error %q, turn %d; want an answer, turn 1", i, res.Err, res.TurnDepth)
		}
	}
	if gap := results[1].Sent.Sub(results[0].Sent); gap > slow/2 {
		t.Errorf("model b's first turn was sent %v after model a's: it waited for another conversation's answer", gap)
	}
}
