package replay_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// knownTrace is 3 sessions × 3 turns in Mooncake format: turn k of session
// s is blocks [s0 … s(k-1)] of 512 tokens, one second apart. An infinite
// cache hits the previous turn's blocks: per session 0 + 512 + 1024 of
// 512 + 1024 + 1536 prompt tokens, so both ratios are exactly 0.5.
func knownTrace() string {
	var b strings.Builder
	for turn := 1; turn <= 3; turn++ {
		for s := range 3 {
			ids := make([]string, turn)
			for k := range turn {
				ids[k] = fmt.Sprint(100*s + k)
			}
			fmt.Fprintf(&b, `{"timestamp": %d, "input_length": %d, "output_length": 3, "hash_ids": [%s], "session_id": "s%d"}`+"\n",
				1000*(turn-1)+s, 512*turn, strings.Join(ids, ", "), s)
		}
	}
	return b.String()
}

func TestKnownAnswerReplay(t *testing.T) {
	tr, err := replay.ReadTrace(strings.NewReader(knownTrace()), replay.FormatAuto)
	if err != nil {
		t.Fatal(err)
	}
	if tr.Format != replay.FormatMooncake || len(tr.Items) != 9 || tr.Sessions() != 3 {
		t.Fatalf("parsed %s, %d items, %d sessions", tr.Format, len(tr.Items), tr.Sessions())
	}
	if got := replay.IdealHitRatio(tr.Items, "kvbus-sim", 16); got != 0.5 {
		t.Fatalf("ideal hit ratio %v, want exactly 0.5", got)
	}
	for _, target := range []string{"nats", "http"} {
		t.Run(target, func(t *testing.T) {
			c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Payload: "accounting"})
			nc := testenv.Connect(t, c.NATS)
			cfg := replay.Config{Target: c.NATS.ClientURL(), Conn: nc, Speed: 10, Mode: replay.ModeSession, Model: c.Model}
			if target == "http" {
				cfg.Target = c.URL
			}
			r, err := replay.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			results, elapsed, err := r.Run(t.Context(), tr.Items)
			if err != nil {
				t.Fatal(err)
			}
			rep := replay.Summarize("kv", results, replay.IdealHitRatio(tr.Items, c.Model, 16), elapsed)
			if rep.OK != 9 || rep.Failed != 0 {
				t.Fatalf("ok %d failed %d: %v", rep.OK, rep.Failed, rep.Errors)
			}
			if *rep.HitRatio != 0.5 || rep.IdealHitRatio != 0.5 {
				t.Errorf("hit_ratio %v ideal %v, want exactly 0.5 and 0.5", *rep.HitRatio, rep.IdealHitRatio)
				for _, res := range results {
					t.Logf("%s turn %d group %s prompt %d cached %d sent %v", res.SessionID, res.TurnDepth, res.Group, res.PromptTokens, res.CachedTokens, res.Sent.Format("15:04:05.000"))
				}
			}
			if math.Abs(rep.HitRatioByTurn["1"]) != 0 || rep.HitRatioByTurn["3"] != 1024.0/1536 {
				t.Errorf("by turn %v", rep.HitRatioByTurn)
			}
			if rep.TTFT.P50 <= 0 || rep.E2E.P99 < rep.TTFT.P50 {
				t.Errorf("latencies ttft %+v e2e %+v", rep.TTFT, rep.E2E)
			}
			if len(rep.GroupRequests) == 0 {
				t.Errorf("no group learned from ReqMeta subjects")
			}
		})
	}
}

// TestSessionModeIsClosedLoop checks that turn n+1 of a session is never
// sent before turn n finished, even when the trace has them at once.
func TestSessionModeIsClosedLoop(t *testing.T) {
	var b strings.Builder
	for turn := 1; turn <= 4; turn++ {
		fmt.Fprintf(&b, `{"timestamp": 0, "input_length": %d, "output_length": 20, "hash_ids": [%s], "session_id": "only"}`+"\n",
			512*turn, strings.TrimSuffix(strings.Repeat("7, ", turn), ", "))
	}
	tr, err := replay.ReadTrace(strings.NewReader(b.String()), "")
	if err != nil {
		t.Fatal(err)
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{TimeScale: 0.01, Payload: "accounting"})
	r, err := replay.New(replay.Config{Target: c.NATS.ClientURL(), Conn: testenv.Connect(t, c.NATS), Mode: replay.ModeSession, Model: c.Model})
	if err != nil {
		t.Fatal(err)
	}
	results, _, err := r.Run(t.Context(), tr.Items)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i < len(results); i++ {
		prevEnd := results[i-1].Sent.Add(results[i-1].E2E)
		if results[i].Err != "" || results[i].Sent.Before(prevEnd) {
			t.Errorf("turn %d sent at %v, before turn %d ended at %v (err %q)", i+1, results[i].Sent, i, prevEnd, results[i].Err)
		}
	}
}

func TestCaptureReplayRoundTrip(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2})
	onBus := c.Observe(t, "kvbus.req.>")
	for i := range 5 {
		body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"capture me %d"}],"max_tokens":5,"seed":%d,"stop":["zz"],"vllm_xargs":{"tag":"x%d"},"cache_salt":"salt-%d"}`, c.Model, i, i, i, i%2)
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("X-Session-ID", fmt.Sprintf("cap-%d", i%2))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	http.DefaultClient.CloseIdleConnections()
	nc := testenv.Connect(t, c.NATS)
	var file bytes.Buffer
	n, err := replay.Capture(t.Context(), replay.CaptureConfig{Conn: nc}, &file)
	if err != nil || n != 5 {
		t.Fatalf("captured %d requests, err %v; want 5", n, err)
	}
	// Captured payloads are byte-exact copies of what was on the bus.
	cr, err := replay.NewCaptureReader(bytes.NewReader(file.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	bus := onBus.Messages()
	for i := range 5 {
		req, err := messages.DecodeRequest(bus[i].Data)
		if err != nil {
			t.Fatal(err)
		}
		if req.CacheSalt != fmt.Sprintf("salt-%d", i%2) {
			t.Fatalf("request %d on the bus: cache_salt %q, want salt-%d", i, req.CacheSalt, i%2)
		}
		f, err := cr.Next()
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(f.Payload, bus[i].Data) || f.Subject != bus[i].Subject {
			t.Fatalf("frame %d differs from the bus message", i)
		}
	}
	tr, err := replay.ReadTrace(bytes.NewReader(file.Bytes()), replay.FormatAuto)
	if err != nil || tr.Format != replay.FormatCapture || len(tr.Items) != 5 {
		t.Fatalf("read capture: %v, %+v", err, tr)
	}
	replayed := c.Observe(t, "kvbus.req.>")
	r, err := replay.New(replay.Config{Target: c.NATS.ClientURL(), Conn: nc, Speed: 100, Model: c.Model})
	if err != nil {
		t.Fatal(err)
	}
	results, _, err := r.Run(t.Context(), tr.Items)
	if err != nil {
		t.Fatal(err)
	}
	for _, res := range results {
		if res.Err != "" {
			t.Fatalf("replayed request failed: %s", res.Err)
		}
	}
	testenv.Eventually(t, 5*time.Second, "5 replayed requests", func() bool { return len(replayed.Messages()) == 5 })
	norm := func(data []byte) *messages.Request {
		req, err := messages.DecodeRequest(data)
		if err != nil {
			t.Fatal(err)
		}
		req.RequestID, req.FrontendID, req.ArrivalUnixMs, req.DeadlineUnixMs, req.TimeoutMs = "", "", 0, 0, 0 // the replayer's own
		delete(req.SamplingParams.ExtraArgs, replay.ExtraArgOriginalID)
		return req
	}
	byOriginal := map[string]*messages.Request{}
	for _, m := range replayed.Messages() {
		req, _ := messages.DecodeRequest(m.Data)
		orig, _ := req.SamplingParams.ExtraArgs.String(replay.ExtraArgOriginalID)
		if req.RequestID == orig || orig == "" {
			t.Fatalf("replayed request %q keeps no new id / original id %q", req.RequestID, orig)
		}
		byOriginal[orig] = norm(m.Data)
	}
	for _, m := range bus {
		orig, _ := messages.DecodeRequest(m.Data)
		got := byOriginal[orig.RequestID]
		if want := norm(m.Data); !reflect.DeepEqual(got, want) {
			t.Errorf("replayed %+v\nwant     %+v", got, want)
		}
	}
}

// sharedTrace returns the path of a file of ../shared/traces, skipping the
// test when it is absent. Attribution: see that folder's README (TraceLab:
// Apache-2.0 / CC BY 4.0, SyFI Lab UW; Azure LLM inference trace: CC-BY-4.0,
// Patel et al., Splitwise, ISCA 2024; Mooncake: Apache-2.0, kvcache-ai).
func sharedTrace(t *testing.T, name string) string {
	t.Helper()
	path := filepath.Join("..", "..", "shared", "traces", name)
	if _, err := os.Stat(path); err != nil {
		t.Skipf("shared trace %s not available: %v", name, err)
	}
	return path
}

func TestSharedTracesReplay(t *testing.T) {
	cases := []struct {
		file  string
		limit int
		speed float64
		infer bool
		check func(t *testing.T, rep *replay.Report)
	}{
		{"mooncake_synthetic_head1000.jsonl", 300, 200, true, func(t *testing.T, rep *replay.Report) {
			if rep.IdealHitRatio <= 0 {
				t.Errorf("the Mooncake head shares prefixes, ideal hit ratio %v", rep.IdealHitRatio)
			}
		}},
		{"tracelab_example_round_trace.jsonl", 0, 1000, false, func(t *testing.T, rep *replay.Report) {
			if rep.IdealHitRatio < 0.5 || *rep.HitRatio <= 0 {
				t.Errorf("agent sessions reuse their prefix: hit %v ideal %v", *rep.HitRatio, rep.IdealHitRatio)
			}
		}},
		{"azure_llm_2023_code.csv", 300, 200, false, func(t *testing.T, rep *replay.Report) {
			if rep.IdealHitRatio != 0 || *rep.HitRatio != 0 {
				t.Errorf("unique prompts must not share: hit %v ideal %v", *rep.HitRatio, rep.IdealHitRatio)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.file, func(t *testing.T) {
			tr, err := replay.ReadTraceFile(sharedTrace(t, tc.file), replay.FormatAuto)
			if err != nil {
				t.Fatal(err)
			}
			if tc.infer {
				replay.InferSessions(tr, replay.MooncakeBlockTokens)
			}
			if tc.limit > 0 {
				tr.Items = tr.Items[:tc.limit]
			}
			c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Payload: "accounting", KVCapacity: 1 << 40})
			r, err := replay.New(replay.Config{Target: c.NATS.ClientURL(), Conn: testenv.Connect(t, c.NATS), Speed: tc.speed, Model: c.Model,
				Mode: replay.ModeSession})
			if err != nil {
				t.Fatal(err)
			}
			results, elapsed, err := r.Run(t.Context(), tr.Items)
			if err != nil {
				t.Fatal(err)
			}
			rep := replay.Summarize("kv", results, replay.IdealHitRatio(tr.Items, c.Model, 16), elapsed)
			if rep.Failed != 0 || rep.OK != len(tr.Items) {
				t.Fatalf("ok %d failed %d: %v", rep.OK, rep.Failed, rep.Errors)
			}
			if *rep.HitRatio > rep.IdealHitRatio+1e-9 {
				t.Errorf("hit ratio %v above the ideal %v", *rep.HitRatio, rep.IdealHitRatio)
			}
			tc.check(t, rep)
			t.Logf("%s: %d requests, hit %.3f ideal %.3f, ttft p50 %.1f ms", tc.file, rep.OK, *rep.HitRatio, rep.IdealHitRatio, rep.TTFT.P50)
		})
	}
}

// BenchmarkReplayerPublish measures how fast the replayer publishes
// requests onto the bus (acknowledged by the request log), with short
// prompts and nothing consuming them.
func BenchmarkReplayerPublish(b *testing.B) {
	srv := testenv.StartNATS(b)
	nc := testenv.Connect(b, srv)
	js, err := jetstream.New(nc)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := bus.EnsureRequestStream(b.Context(), js, bus.StreamConfig{}); err != nil {
		b.Fatal(err)
	}
	const n = 20000
	items := make([]replay.Item, n)
	for i := range items {
		items[i] = replay.Item{Prompt: testenv.PromptTokens(i, 16), OutputTokens: 1}
	}
	var published int
	var elapsed time.Duration
	for b.Loop() {
		r, err := replay.New(replay.Config{Target: srv.ClientURL(), Conn: nc, NoWait: true})
		if err != nil {
			b.Fatal(err)
		}
		results, el, err := r.Run(b.Context(), items)
		if err != nil {
			b.Fatal(err)
		}
		for _, res := range results {
			if res.Err != "" {
				b.Fatal(res.Err)
			}
		}
		published += len(results)
		elapsed += el
	}
	b.ReportMetric(float64(published)/elapsed.Seconds(), "req/s")
}

// TestCaptureRanges: --from-seq and --since select a part of the log, and
// --follow captures new requests live.
func TestCaptureRanges(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	send := func(n int) {
		for i := range n {
			body := fmt.Sprintf(`{"model":%q,"prompt":"range %d","max_tokens":1}`, c.Model, i)
			resp, err := http.Post(c.URL+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
		}
		http.DefaultClient.CloseIdleConnections()
	}
	send(4)
	mid := time.Now()
	send(3)
	nc := testenv.Connect(t, c.NATS)
	count := func(cfg replay.CaptureConfig) int {
		var buf bytes.Buffer
		cfg.Conn = nc
		n, err := replay.Capture(t.Context(), cfg, &buf)
		if err != nil {
			t.Fatal(err)
		}
		tr, err := replay.ReadTrace(&buf, replay.FormatCapture)
		if err != nil && n > 0 {
			t.Fatal(err)
		}
		if tr != nil && len(tr.Items) != n {
			t.Fatalf("wrote %d frames, read %d", n, len(tr.Items))
		}
		return n
	}
	if n := count(replay.CaptureConfig{}); n != 7 {
		t.Errorf("whole log: %d requests, want 7", n)
	}
	if n := count(replay.CaptureConfig{FromSeq: 5}); n != 3 {
		t.Errorf("--from-seq 5: %d requests, want 3", n)
	}
	if n := count(replay.CaptureConfig{Since: mid}); n != 3 {
		t.Errorf("--since: %d requests, want 3", n)
	}
	if n := count(replay.CaptureConfig{Until: mid}); n != 4 {
		t.Errorf("--until: %d requests, want 4", n)
	}
	// --follow keeps capturing what arrives; started at the log's next
	// sequence it sees exactly the new requests, whatever the timing.
	ctx, cancel := context.WithCancel(t.Context())
	live := &testenv.LogBuffer{}
	got := make(chan int, 1)
	go func() {
		n, err := replay.Capture(ctx, replay.CaptureConfig{Conn: nc, Follow: true, FromSeq: 8}, live)
		if err != nil {
			t.Error(err)
		}
		got <- n
	}()
	send(2)
	testenv.Eventually(t, 5*time.Second, "2 live requests captured", func() bool { return strings.Count(live.String(), "kvbus.req.") == 2 })
	cancel()
	if n := <-got; n != 2 {
		t.Errorf("--follow captured %d requests, want the 2 new ones", n)
	}
}

// otherModelCapture is a capture of n completions made on a cluster that
// served the model "prod-model".
func otherModelCapture(t *testing.T, n int) []byte {
	t.Helper()
	var file bytes.Buffer
	cw, err := replay.NewCaptureWriter(&file)
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		data, err := messages.Marshal(&messages.Request{RequestID: fmt.Sprint("prod-", i), FrontendID: "fe-prod", Model: "prod-model",
			Endpoint: messages.EndpointCompletions, PromptTokenIDs: testenv.PromptTokens(i, 40), SamplingParams: messages.SamplingParams{MaxTokens: 2}})
		if err != nil {
			t.Fatal(err)
		}
		if err := cw.Write(replay.Frame{Time: time.Unix(int64(i), 0), Subject: "kvbus.req.prod-model", Payload: data}); err != nil {
			t.Fatal(err)
		}
	}
	if err := cw.Flush(); err != nil {
		t.Fatal(err)
	}
	return file.Bytes()
}

// TestModelReplacesACapturesModel: Config.Model, when set, is the model
// a captured request asks for (a production capture replayed on a cluster
// serving another name); left empty, a captured request keeps its own and
// a trace's asks for kvbus-sim. Before, a capture's model was kept
// whatever the replay was told.
func TestModelReplacesACapturesModel(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Payload: "accounting"})
	capture, err := replay.ReadTrace(bytes.NewReader(otherModelCapture(t, 3)), replay.FormatCapture)
	if err != nil {
		t.Fatal(err)
	}
	trace, err := replay.ReadTrace(strings.NewReader(knownTrace()), replay.FormatMooncake)
	if err != nil {
		t.Fatal(err)
	}
	run := func(model string, items []replay.Item) []replay.Result {
		t.Helper()
		r, err := replay.New(replay.Config{Target: c.URL, Model: model, Speed: 100})
		if err != nil {
			t.Fatal(err)
		}
		results, _, err := r.Run(t.Context(), items)
		if err != nil {
			t.Fatal(err)
		}
		return results
	}
	for _, res := range run(c.Model, capture.Items) {
		if res.Err != "" {
			t.Errorf("captured request replayed with Model %q: %s", c.Model, res.Err)
		}
	}
	for _, res := range run("", capture.Items) {
		if !strings.Contains(res.Err, "model_not_found") || !strings.Contains(res.Err, "prod-model") {
			t.Errorf("captured request replayed without a model: %q, want its own prod-model, which this cluster does not serve", res.Err)
		}
	}
	for _, res := range run("", trace.Items[:3]) {
		if res.Err != "" {
			t.Errorf("trace request replayed without a model (kvbus-sim): %s", res.Err)
		}
	}
}

// TestTurnsAreCountedPerModel: a captured session id used with two models
// is two conversations, as the schedulers count them: each model's first
// turn is turn 1. The replay numbered the turns by session id alone, so
// the capture's second request of the served model (after one of another
// model) was reported as turn 3, its hit ratio under "3".
func TestTurnsAreCountedPerModel(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Payload: "accounting"})
	var file bytes.Buffer
	cw, err := replay.NewCaptureWriter(&file)
	if err != nil {
		t.Fatal(err)
	}
	prompt := testenv.PromptTokens(7, 64)
	for i, model := range []string{c.Model, "other-model", c.Model} {
		data, err := messages.Marshal(&messages.Request{RequestID: fmt.Sprint("r", i), FrontendID: "fe", Model: model, SessionID: "s",
			Endpoint: messages.EndpointCompletions, PromptTokenIDs: prompt, SamplingParams: messages.SamplingParams{MaxTokens: 2}})
		if err != nil {
			t.Fatal(err)
		}
		if err := cw.Write(replay.Frame{Time: time.Unix(int64(i), 0), Subject: "kvbus.req." + messages.ModelToken(model), Payload: data}); err != nil {
			t.Fatal(err)
		}
	}
	if err := cw.Flush(); err != nil {
		t.Fatal(err)
	}
	capture, err := replay.ReadTrace(bytes.NewReader(file.Bytes()), replay.FormatCapture)
	if err != nil {
		t.Fatal(err)
	}
	r, err := replay.New(replay.Config{Target: c.URL, Speed: 100})
	if err != nil {
		t.Fatal(err)
	}
	results, elapsed, err := r.Run(t.Context(), capture.Items)
	if err != nil {
		t.Fatal(err)
	}
	var depths []int
	for _, res := range results {
		depths = append(depths, res.TurnDepth)
	}
	if !slices.Equal(depths, []int{1, 1, 2}) || results[0].Err != "" || results[2].Err != "" || !strings.Contains(results[1].Err, "model_not_found") {
		t.Errorf("turn depths %v, errors %q; want 1, 1, 2 (the other model's turn is its own turn 1), the served model's turns answered", depths,
			[]string{results[0].Err, results[1].Err, results[2].Err})
	}
	rep := replay.Summarize("replay", results, 0, elapsed)
	if _, ok := rep.HitRatioByTurn["3"]; ok || rep.HitRatioByTurn["2"] == 0 {
		t.Errorf("hit ratio by turn %v; want the served model's second turn (all of it cached but its last block) under 2", rep.HitRatioByTurn)
	}
}
