package top_test

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	tea "charm.land/bubbletea/v2"
	"github.com/charmbracelet/x/ansi"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/top"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestWatcherSeesWhatClientsSee: top, reading only the bus with the
// observer key, reports the groups as the heartbeats describe them, every finished
// request, and for each turn depth exactly the hit ratio the clients got
// in their usage; each session is listed on the group that served it.
func TestWatcherSeesWhatClientsSee(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Ranks: 2, AuthDir: dir})
	w := c.StartTop(t) // the observer key

	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	prompt, cached := map[int]int{}, map[int]int{}
	var slowest time.Duration
	for conv := range 2 {
		d := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 300 + conv,
			Headers: map[string]string{"X-Session-ID": fmt.Sprint("top-", conv)}}.Start()
		for turn := range 4 {
			start := time.Now()
			got, err := d.Next(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			slowest = max(slowest, time.Since(start))
			depth := min(turn+1, 4)
			prompt[depth] += got.PromptTokens
			cached[depth] += got.CachedTokens
		}
	}
	var s top.Snapshot
	testenv.Eventually(t, 5*time.Second, "8 finished requests and both groups' ranks heard", func() bool {
		s = w.Snapshot(time.Now())
		return s.Finished == 8 && len(s.Groups) == 2 && s.Groups[0].Ranks == 2 && s.Groups[1].Ranks == 2
	})
	for _, g := range s.Groups {
		if g.State != "ready" || g.Ranks != 2 || g.WorldSize != 2 {
			t.Errorf("group %+v, want ready with 2 of 2 ranks", g)
		}
	}
	for depth, label := range map[int]string{1: "1", 2: "2", 3: "3", 4: "4+"} {
		want := float64(cached[depth]) / float64(prompt[depth])
		if got := s.HitRatio[label]; got != want {
			t.Errorf("turn %s: top says hit ratio %.4f, the clients got %.4f", label, got, want)
		}
	}
	if s.HitRatio["2"] < 0.8 {
		t.Errorf("turn 2 hit ratio %.2f: the conversations should hit", s.HitRatio["2"])
	}
	// TTFT runs from the frontend's arrival to top reading the first
	// output, which top, one more subscriber, may read a little after the
	// frontend relayed it and the client's turn ended.
	if s.TTFTP50Ms <= 0 || s.TTFTP50Ms > s.TTFTP95Ms || time.Duration(s.TTFTP95Ms*float64(time.Millisecond)) > slowest+50*time.Millisecond {
		t.Errorf("TTFT p50 %.2f ms p95 %.2f ms, the slowest turn took %s", s.TTFTP50Ms, s.TTFTP95Ms, slowest)
	}
	if len(s.Sessions) != 2 {
		t.Fatalf("sessions %+v", s.Sessions)
	}
	for _, ss := range s.Sessions {
		if ss.Turns != 4 || (ss.Group != "g0" && ss.Group != "g1") {
			t.Errorf("session %+v, want 4 turns on g0 or g1", ss)
		}
		if !strings.Contains(c.Logs.String(), fmt.Sprintf("session_id=%s group=%s outcome=completed", ss.ID, ss.Group)) {
			t.Errorf("session %s is listed on %s, the scheduler placed it elsewhere", ss.ID, ss.Group)
		}
	}
	screen := top.NewModel(w, time.Second, 10).Render()
	for _, want := range []string{"g0", "g1", "ready", "top-0", "top-1", "hit ratio by turn"} {
		if !strings.Contains(screen, want) {
			t.Errorf("the screen lacks %q:\n%s", want, screen)
		}
	}
}

// TestWatcherNeedsTheObserverKey: with keys on the bus, a role's key cannot
// watch everything, and top says which key it needs.
func TestWatcherNeedsTheObserverKey(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t)
	nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), NKeySeedFile: filepath.Join(dir, "worker.nk")})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	w, err := top.New(top.Config{Conn: nc})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Run(t.Context()); err == nil || !strings.Contains(err.Error(), "observer.nk") {
		t.Errorf("Run with a worker key: %v, want an error naming the observer key", err)
	}
}

// TestWatcherEndsAbortedRequests: a request whose client went away (an
// Abort on the bus; the driver publishes no final output for it) leaves
// in_flight at once and counts as aborted, not finished; a scheduler's
// withdrawal from one group (a group-scoped Abort) does not end it.
func TestWatcherEndsAbortedRequests(t *testing.T) {
	srv := testenv.StartNATS(t)
	nc := testenv.Connect(t, srv)
	w, err := top.New(top.Config{Conn: nc})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	<-w.Subscribed()
	s := messages.Subjects{}
	publish := func(subject string, m messages.Message) {
		data, err := messages.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := nc.Publish(subject, data); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"r1", "r2"} {
		publish(s.Request("kvbus-sim"), &messages.Request{RequestID: id, FrontendID: "fe-1", SessionID: "s", Model: "kvbus-sim", PromptTokenIDs: []uint32{1, 2, 3}})
	}
	publish(s.Abort(), &messages.Abort{ReqID: "r1", Group: "g0", BeforeAttempt: 1, Reason: "dispatched again"})
	publish(s.Abort(), &messages.Abort{ReqID: "r2", Reason: "client disconnected"})
	testenv.Eventually(t, 5*time.Second, "the client's abort seen", func() bool { return w.Snapshot(time.Now()).Aborted == 1 })
	snap := w.Snapshot(time.Now())
	if snap.InFlight != 1 || snap.Finished != 0 {
		t.Errorf("in_flight %d, finished %d; want 1 (the withdrawn request goes on) and 0", snap.InFlight, snap.Finished)
	}
}

// TestConfigRefusesNegatives: a negative window, heartbeat timeout or
// session count is refused (a negative window silently became 1 min).
func TestConfigRefusesNegatives(t *testing.T) {
	nc := testenv.Connect(t, testenv.StartNATS(t))
	for _, cfg := range []top.Config{
		{Conn: nc, Window: -time.Second},
		{Conn: nc, HeartbeatTimeout: -time.Second},
		{Conn: nc, Sessions: -1},
	} {
		if _, err := top.New(cfg); err == nil {
			t.Errorf("top.New(%+v) accepted it", cfg)
		}
	}
	if _, err := top.New(top.Config{Conn: nc}); err != nil {
		t.Errorf("the defaults: %v", err)
	}
}

// testBus is a watcher following a fresh NATS server, and a way to publish on
// it.
type testBus struct {
	srv *bus.Server
	w   *top.Watcher
	s   messages.Subjects
	t   *testing.T
	nc  *nats.Conn
	// clientAborts counts the aborts published of requests whose client
	// went away: what the watcher counts as Aborted once it read them.
	clientAborts int
}

func startWatcher(t *testing.T, cfg top.Config) *testBus {
	t.Helper()
	srv := testenv.StartNATS(t)
	nc := testenv.Connect(t, srv)
	cfg.Conn = nc
	w, err := top.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	<-w.Subscribed()
	return &testBus{srv: srv, w: w, t: t, nc: nc}
}

func (b *testBus) publish(subject string, m messages.Message) {
	b.t.Helper()
	data, err := messages.Marshal(m)
	if err != nil {
		b.t.Fatal(err)
	}
	if err := b.nc.Publish(subject, data); err != nil {
		b.t.Fatal(err)
	}
	if a, ok := m.(*messages.Abort); ok && a.Reason == "client disconnected" {
		b.clientAborts++
	}
}

// flush waits until what was published reached the watcher (one
// subscription: it reads in order).
func (b *testBus) flush() {
	b.t.Helper()
	// A marker request, aborted by its client: once the watcher counted
	// every client abort published, the marker's included, it read all
	// that came before. (Waiting for one more abort than a snapshot taken
	// here showed could be met by an earlier abort read late.)
	id := fmt.Sprint("flush-", b.clientAborts)
	b.publish(b.s.Request("m"), &messages.Request{RequestID: id, FrontendID: "fe", Model: "m"})
	b.publish(b.s.Abort(), &messages.Abort{ReqID: id, Reason: "client disconnected"})
	testenv.Eventually(b.t, 5*time.Second, "the watcher to catch up", func() bool { return b.w.Snapshot(time.Now()).Aborted >= b.clientAborts })
}

func (b *testBus) request(id, session string, arrival time.Time) {
	b.t.Helper()
	b.publish(b.s.Request("m"), &messages.Request{RequestID: id, FrontendID: "fe", SessionID: session, Model: "m",
		ArrivalUnixMs: arrival.UnixMilli(), PromptTokenIDs: []uint32{1, 2, 3, 4}})
}

func (b *testBus) finish(id string, prompt, cached int) {
	b.t.Helper()
	b.publish(b.s.Out("fe"), &messages.Output{ReqID: id, Text: "x", FinishReason: "stop",
		Usage: &messages.Usage{PromptTokens: prompt, CachedTokens: cached}})
}

func (b *testBus) heartbeat(hb messages.Heartbeat) {
	b.t.Helper()
	b.publish(b.s.Heartbeat(hb.Group, hb.TPRank), &hb)
}

// TestWatcherSortsAbortsByReason: only a client that went away counts as
// aborted; a timeout and a stopping frontend are failures; a request the
// log refused (publish failed: 503 request_log_full) never ran: it is not
// counted, and its session turn is undone, so the next turn keeps its
// depth (top counted all four as aborted, and the refused one as a turn).
func TestWatcherSortsAbortsByReason(t *testing.T) {
	b := startWatcher(t, top.Config{})
	now := time.Now()
	b.request("gone", "a", now)
	b.request("slow", "b", now)
	b.request("cut", "c", now)
	b.request("refused", "d", now)
	b.publish(b.s.Abort(), &messages.Abort{ReqID: "gone", Reason: "client disconnected"})
	b.publish(b.s.Abort(), &messages.Abort{ReqID: "slow", Reason: "timeout"})
	b.publish(b.s.Abort(), &messages.Abort{ReqID: "cut", Reason: "frontend stopped"})
	b.publish(b.s.Abort(), &messages.Abort{ReqID: "refused", Reason: "publish failed"})
	// Session e: turn 1 runs, turn 2 is refused, the retry is turn 2.
	b.request("e1", "e", now)
	b.finish("e1", 100, 0)
	b.request("e2", "e", now)
	b.publish(b.s.Abort(), &messages.Abort{ReqID: "e2", Reason: "publish failed"})
	b.request("e2-retry", "e", now)
	b.finish("e2-retry", 100, 80)
	b.flush()
	s := b.w.Snapshot(time.Now())
	if s.Aborted != 2 || s.Failed != 2 || s.Finished != 4 || s.InFlight != 0 { // one abort is flush's
		t.Errorf("aborted %d failed %d finished %d in flight %d; want 2 (with the flush marker), 2, 4, 0", s.Aborted, s.Failed, s.Finished, s.InFlight)
	}
	if r, ok := s.HitRatio["2"]; !ok || r != 0.8 {
		t.Errorf("hit ratio by turn %v: the retried turn is turn 2 (0.80)", s.HitRatio)
	}
	if _, ok := s.HitRatio["3"]; ok {
		t.Errorf("hit ratio by turn %v: the refused turn was counted", s.HitRatio)
	}
	for _, ss := range s.Sessions {
		if ss.ID == "d" {
			t.Errorf("session d, whose only request never ran, is listed: %+v", ss)
		}
		if ss.ID == "e" && ss.Turns != 2 {
			t.Errorf("session e has %d turns, want 2", ss.Turns)
		}
	}
}

// TestWatcherFollowsRequestsAskedAgain: a request the frontend publishes
// again because its answer was lost on the bus (Request.again_of) is the
// same turn of its session, and the copies it gives up (aborted "asked
// again as", "a copy of it answered first") are not failures: the client
// got its answer. Top counted each copy given up as failed and each copy
// as one more turn, so one lost answer showed a failure and moved the
// session's later turns a depth down.
func TestWatcherFollowsRequestsAskedAgain(t *testing.T) {
	b := startWatcher(t, top.Config{})
	now := time.Now()
	b.request("t1", "s", now)
	b.finish("t1", 100, 0)
	// Turn 2's answer is lost: asked again, the lost copy given up.
	b.request("t2", "s", now)
	b.publish(b.s.Request("m"), &messages.Request{RequestID: "t2-again1", AgainOf: "t2", FrontendID: "fe", SessionID: "s", Model: "m",
		ArrivalUnixMs: now.UnixMilli(), PromptTokenIDs: []uint32{1, 2, 3, 4}})
	b.publish(b.s.Abort(), &messages.Abort{ReqID: "t2", Reason: "answer lost on the bus; asked again as t2-again1"})
	// Heard nothing after a reconnect: asked again, both kept; the copy
	// answers first and the first is given up.
	b.publish(b.s.Request("m"), &messages.Request{RequestID: "t2-again2", AgainOf: "t2", FrontendID: "fe", SessionID: "s", Model: "m",
		ArrivalUnixMs: now.UnixMilli(), PromptTokenIDs: []uint32{1, 2, 3, 4}})
	b.publish(b.s.Abort(), &messages.Abort{ReqID: "t2-again1", Reason: "a copy of it answered first: t2-again2"})
	b.finish("t2-again2", 100, 80)
	b.request("t3", "s", now)
	b.finish("t3", 100, 90)
	b.flush()
	s := b.w.Snapshot(time.Now())
	if s.Failed != 0 || s.Finished != 3 || s.InFlight != 0 {
		t.Errorf("failed %d finished %d in flight %d; want 0, 3, 0: the copies given up are not failures", s.Failed, s.Finished, s.InFlight)
	}
	if r := s.HitRatio; r["2"] != 0.8 || r["3"] != 0.9 {
		t.Errorf("hit ratio by turn %v; want 2: 0.80 and 3: 0.90 (the copies are turn 2)", r)
	}
	if _, ok := s.HitRatio["4+"]; ok {
		t.Errorf("hit ratio by turn %v: the copies were counted as turns", s.HitRatio)
	}
	for _, ss := range s.Sessions {
		if ss.ID == "s" && (ss.Turns != 3 || ss.Recent != 3) {
			t.Errorf("session s has %d turns, %d recent; want 3, 3", ss.Turns, ss.Recent)
		}
	}
}

// TestTTFTFromTheFrontendsClock: a request that reached the frontend
// 800 ms before top read it (top paused or behind) has a TTFT of at least
// 800 ms, not the ~0 ms top's own clock gave both ends.
func TestTTFTFromTheFrontendsClock(t *testing.T) {
	b := startWatcher(t, top.Config{})
	b.request("r", "s", time.Now().Add(-800*time.Millisecond))
	b.finish("r", 10, 0)
	b.flush()
	if s := b.w.Snapshot(time.Now()); s.TTFTP50Ms < 790 {
		t.Errorf("TTFT p50 %.1f ms, want about 800 (from the request's arrival_unix_ms)", s.TTFTP50Ms)
	}
}

// TestTTFTOfRequestsAbortedAfterTheirFirstToken: a request whose first
// token reached its client before the client went away (or before its
// deadline passed) had a time to first token, and the frontend observes it
// in kvbus_frontend_ttft_seconds and vllm:time_to_first_token_seconds. Top
// dropped it: a review's 3 streams cancelled after 3 chunks each were 3
// TTFTs on the frontend's /metrics and none in top's (ttft_p50_ms 0).
func TestTTFTOfRequestsAbortedAfterTheirFirstToken(t *testing.T) {
	b := startWatcher(t, top.Config{})
	for id, reason := range map[string]string{"left": "client disconnected", "late": "timeout"} {
		b.request(id, id, time.Now().Add(-800*time.Millisecond))
		b.publish(b.s.Out("fe"), &messages.Output{ReqID: id, Text: "x"})
		b.publish(b.s.Abort(), &messages.Abort{ReqID: id, Reason: reason})
	}
	b.flush()
	s := b.w.Snapshot(time.Now())
	if s.Aborted != 2 || s.Failed != 1 { // the flush marker is aborted too
		t.Fatalf("aborted %d, failed %d; want 2 (one and the flush marker) and 1", s.Aborted, s.Failed)
	}
	if s.TTFTP50Ms < 790 || s.TTFTP95Ms < 790 {
		t.Errorf("TTFT p50 %.1f ms, p95 %.1f ms; want about 800 (both requests' first token came 800 ms after their arrival)", s.TTFTP50Ms, s.TTFTP95Ms)
	}
}

// TestTTFTNotForAWholeAnswer: a request to an engine (--engine openai,
// Request.body set) that does not stream is answered in one output, the
// whole answer: its time is the e2e latency, not a TTFT, as the frontend
// counts it. Top took it as the TTFT, so a cluster of non-streaming
// clients showed their full latency as TTFT p50.
func TestTTFTNotForAWholeAnswer(t *testing.T) {
	b := startWatcher(t, top.Config{})
	for i, stream := range []bool{false, false, true} {
		id := fmt.Sprint("r", i)
		arrival := time.Now().Add(-2 * time.Second)
		if stream {
			arrival = time.Now() // its first token comes at once
		}
		b.publish(b.s.Request("m"), &messages.Request{RequestID: id, FrontendID: "fe", SessionID: id, Model: "m", Stream: stream,
			ArrivalUnixMs: arrival.UnixMilli(), PromptTokenIDs: []uint32{1, 2}, Body: []byte(`{"model":"m","prompt":"x"}`)})
		if stream {
			b.publish(b.s.Out("fe"), &messages.Output{ReqID: id, Raw: []byte(`{"choices":[]}`)})
		}
		b.publish(b.s.Out("fe"), &messages.Output{ReqID: id, FinishReason: "stop", Raw: []byte(`{"choices":[]}`),
			Usage: &messages.Usage{PromptTokens: 2}})
	}
	b.flush()
	if s := b.w.Snapshot(time.Now()); s.Finished != 3 || s.TTFTP95Ms > 1000 {
		t.Errorf("finished %d, TTFT p95 %.0f ms; want 3 and the streamed request's TTFT only (well under 2,000 ms, the answers' latency)",
			s.Finished, s.TTFTP95Ms)
	}
}

// TestPoolTrafficOncePerAttempt: a ReqMeta the scheduler publishes again
// because a rank had not answered (the same attempt: the ranks that have
// it read nothing again) adds no pool traffic; a request dispatched again
// to another group (a higher attempt) reads its runs there, and counts.
// Each resend counted the request's remote runs again: POOL_IN and
// POOL_OUT doubled under a lossy bus.
func TestPoolTrafficOncePerAttempt(t *testing.T) {
	b := startWatcher(t, top.Config{})
	for _, g := range []string{"g1", "g2", "g3"} {
		b.heartbeat(messages.Heartbeat{Group: g, WorldSize: 1, Model: "m"})
	}
	b.request("r", "s", time.Now())
	meta := func(group string, attempt int) *messages.ReqMeta {
		return &messages.ReqMeta{ReqID: "r", SessionID: "s", Group: group, Attempt: attempt, FrontendID: "fe", ResultSubject: "done",
			BlockSize: 1, TokenLen: 8, TokenIDs: make(messages.TokenIDs, 8), BlockHashes: make(messages.BlockHashes, 8),
			LoadSpec: &messages.LoadSpec{CanLoad: true, KVPoolCachedTokens: 5, Remote: []messages.RemoteRun{{Group: "g1", Blocks: 5}}}}
	}
	b.publish(b.s.Meta("g2", "s"), meta("g2", 0))
	b.publish(b.s.Meta("g2", "s"), meta("g2", 0)) // a resend
	b.publish(b.s.Meta("g3", "s"), meta("g3", 1)) // dispatched again
	b.publish(b.s.Meta("g3", "s"), meta("g3", 1)) // a resend
	b.flush()
	in, out := map[string]int{}, map[string]int{}
	for _, g := range b.w.Snapshot(time.Now()).Groups {
		in[g.Name], out[g.Name] = g.PoolIn, g.PoolOut
	}
	if out["g1"] != 10 || in["g2"] != 5 || in["g3"] != 5 {
		t.Errorf("pool out of g1 %d, in g2 %d, in g3 %d; want 10, 5, 5 (once per attempt)", out["g1"], in["g2"], in["g3"])
	}
}

// TestSessionHitRatioOfCompletedTurns: a session's HIT is over its
// completed turns, as the cluster's hit ratio by turn and the scheduler's
// counters are: a turn that failed (group_failed, an engine's error) loaded
// nothing and is not a cache miss. Its prompt counted with 0 cached, so a
// session whose group failed showed its HIT halved.
func TestSessionHitRatioOfCompletedTurns(t *testing.T) {
	b := startWatcher(t, top.Config{})
	b.request("t1", "s", time.Now())
	b.finish("t1", 100, 80)
	b.request("t2", "s", time.Now())
	b.publish(b.s.Out("fe"), &messages.Output{ReqID: "t2", Error: &messages.OutputError{Code: "group_failed", Message: "gone"}})
	b.flush()
	s := b.w.Snapshot(time.Now())
	if len(s.Sessions) == 0 || s.Sessions[0].ID != "s" || s.Sessions[0].HitRatio != 0.8 {
		t.Errorf("sessions %+v; want s with a hit ratio of 0.80 (its completed turn)", s.Sessions)
	}
}

// TestGroupsAsTheirRanksSayThem: a group whose ranks all went silent stays
// listed as down with when it was last heard (it vanished); a rank slower
// than 3 s is live under a longer HeartbeatTimeout; ranks that disagree on
// the world size show a conflict (the group flapped between incomplete
// 1/4 and 3/4); blocks are the group's (not the sum over its ranks) with
// its capacity, bytes the sum; groups sort naturally (g2 before g10).
func TestGroupsAsTheirRanksSayThem(t *testing.T) {
	b := startWatcher(t, top.Config{HeartbeatTimeout: 5 * time.Second})
	for tp := range 4 {
		b.heartbeat(messages.Heartbeat{Group: "g10", TPRank: tp, WorldSize: 4, Model: "m", UsedBlocks: 100, CapacityBlocks: 1000, UsedBytes: 10})
	}
	for tp, ws := range []int{4, 4, 8} {
		b.heartbeat(messages.Heartbeat{Group: "g2", TPRank: tp, WorldSize: ws, Model: "m"})
	}
	b.heartbeat(messages.Heartbeat{Group: "g2", TPRank: 0, WorldSize: 4, Model: "m"}) // again: no reset
	b.flush()
	now := time.Now()
	s := b.w.Snapshot(now.Add(4 * time.Second)) // past 3 s, within the 5 s timeout
	if len(s.Groups) != 2 || s.Groups[0].Name != "g2" || s.Groups[1].Name != "g10" {
		t.Fatalf("groups %+v, want g2 then g10", s.Groups)
	}
	g2, g10 := s.Groups[0], s.Groups[1]
	if g2.State != "conflict" || g2.Conflict != "world size 4 vs 8" || g2.Ranks != 3 {
		t.Errorf("g2 %+v, want a conflict of world size 4 vs 8 with 3 ranks", g2)
	}
	if g10.State != "ready" || g10.Ranks != 4 || g10.Blocks != 100 || g10.CapacityBlocks != 1000 || g10.Bytes != 40 {
		t.Errorf("g10 %+v, want ready 4/4, 100 of 1000 blocks, 40 bytes", g10)
	}
	screen := top.NewModel(b.w, time.Second, 10).Report(true)
	if !strings.Contains(screen, "conflict (world size 4 vs 8)") {
		t.Errorf("the screen does not show the conflict:\n%s", screen)
	}
	later := b.w.Snapshot(now.Add(12 * time.Second))
	if len(later.Groups) != 2 {
		t.Fatalf("12 s after the last heartbeat: groups %+v, want both, down", later.Groups)
	}
	if g := later.Groups[1]; g.State != "down" || g.Ranks != 0 || g.WorldSize != 4 || g.LastHeardMs < 11_000 {
		t.Errorf("g10 silent for 12 s: %+v, want down 0/4 heard 12 s ago", g)
	}
}

// TestGroupBlocksAreWhatEveryRankHolds: a group's blocks are those every
// live rank holds (each rank holds its shard of a block; a load needs them
// all), the fewest any rank reports, as kvbus_scheduler_group_blocks
// counts them. A review killed one rank of a 2-rank group holding 20
// blocks and restarted it empty: the scheduler counted 0, top showed 20
// (the largest any rank reported).
func TestGroupBlocksAreWhatEveryRankHolds(t *testing.T) {
	b := startWatcher(t, top.Config{})
	b.heartbeat(messages.Heartbeat{Group: "g1", TPRank: 0, WorldSize: 2, Model: "m", UsedBlocks: 20, CapacityBlocks: 20, UsedBytes: 20 << 20})
	b.heartbeat(messages.Heartbeat{Group: "g1", TPRank: 1, WorldSize: 2, Model: "m", UsedBlocks: 0, CapacityBlocks: 20, UsedBytes: 0})
	b.flush()
	s := b.w.Snapshot(time.Now())
	if len(s.Groups) != 1 {
		t.Fatalf("groups %+v, want g1", s.Groups)
	}
	if g := s.Groups[0]; g.State != "ready" || g.Blocks != 0 || g.CapacityBlocks != 20 || g.Bytes != 20<<20 {
		t.Errorf("g1 %+v, want ready with 0 of 20 blocks (rank 1 holds none) and 20 MiB held", g)
	}
}

// TestGroupsOfSeveralModels: with groups of two models the screen has a
// MODEL column (one model: none, as before), and a group whose live ranks
// serve different models — which the schedulers refuse to place on — is a
// conflict naming them (it showed as ready).
func TestGroupsOfSeveralModels(t *testing.T) {
	b := startWatcher(t, top.Config{})
	for tp := range 2 {
		b.heartbeat(messages.Heartbeat{Group: "ga", TPRank: tp, WorldSize: 2, Model: "model-a"})
		b.heartbeat(messages.Heartbeat{Group: "gb", TPRank: tp, WorldSize: 2, Model: "model-b"})
	}
	b.heartbeat(messages.Heartbeat{Group: "gmix", TPRank: 0, WorldSize: 2, Model: "model-a"})
	b.heartbeat(messages.Heartbeat{Group: "gmix", TPRank: 1, WorldSize: 2, Model: "model-b"})
	b.flush()
	s := b.w.Snapshot(time.Now())
	if len(s.Groups) != 3 {
		t.Fatalf("groups %+v, want 3", s.Groups)
	}
	ga, gb, mix := s.Groups[0], s.Groups[1], s.Groups[2]
	if ga.Model != "model-a" || ga.State != "ready" || gb.Model != "model-b" || gb.State != "ready" {
		t.Errorf("ga %+v, gb %+v: want ready groups of model-a and model-b", ga, gb)
	}
	if mix.State != "conflict" || mix.Conflict != "models model-a vs model-b" || mix.Model != "model-a" {
		t.Errorf("gmix %+v, want a conflict of models model-a vs model-b (its driver's model-a)", mix)
	}
	screen := top.NewModel(b.w, time.Second, 10).Report(true)
	for _, want := range []string{"MODEL", "conflict (models model-a vs model-b)", "model-b"} {
		if !strings.Contains(screen, want) {
			t.Errorf("the screen lacks %q:\n%s", want, screen)
		}
	}
	one := startWatcher(t, top.Config{})
	one.heartbeat(messages.Heartbeat{Group: "g0", TPRank: 0, WorldSize: 1, Model: "m"})
	one.flush()
	if screen := top.NewModel(one.w, time.Second, 10).Report(true); strings.Contains(screen, "MODEL") {
		t.Errorf("one model: the screen has a MODEL column:\n%s", screen)
	}
}

// TestSchedulersAsTheFrontendSeesThem: a scheduler silent for over 3 s is
// not ready (top said ready for 10 s), a stopped one says so, and when none
// is ready the screen says what the frontends answer.
func TestSchedulersAsTheFrontendSeesThem(t *testing.T) {
	b := startWatcher(t, top.Config{})
	now := time.Now()
	b.publish(b.s.Announce("scheduler", "s1"), &messages.Announcement{Role: "scheduler", ID: "s1", Ready: true, ReadyGroups: 2, UnixMs: now.UnixMilli()})
	b.publish(b.s.Announce("scheduler", "s2"), &messages.Announcement{Role: "scheduler", ID: "s2", Reason: "request consumer not running",
		Stopped: true, UnixMs: now.UnixMilli()})
	b.flush()
	s := b.w.Snapshot(now.Add(5 * time.Second))
	if len(s.Schedulers) != 2 || s.Schedulers[0].State != "silent" || s.Schedulers[0].Ready || s.Schedulers[1].State != "stopped" || !s.NoReadyScheduler {
		t.Errorf("schedulers %+v (no ready scheduler: %v), want s1 silent, s2 stopped, none ready", s.Schedulers, s.NoReadyScheduler)
	}
	screen := top.NewModel(b.w, time.Second, 10).At(now.Add(5 * time.Second)).Report(true)
	for _, want := range []string{"no ready scheduler: frontends answer 503 no_ready_scheduler", "scheduler s1 silent ", "s (not ready)", "scheduler s2 stopped"} {
		if !strings.Contains(screen, want) {
			t.Errorf("the screen lacks %q:\n%s", want, screen)
		}
	}
	if got := b.w.Snapshot(now.Add(time.Second)); got.NoReadyScheduler || got.Schedulers[0].State != "ready" {
		t.Errorf("1 s after: %+v, want s1 ready", got.Schedulers)
	}
}

// TestScreenEscapesWhatTheBusSays: session ids (and group names) come from
// whoever publishes on the bus, e.g. `kvbus replay` of a trace: their
// control and format characters are shown escaped, so they can neither
// drive the operator's terminal nor fake rows (they were printed raw).
func TestScreenEscapesWhatTheBusSays(t *testing.T) {
	b := startWatcher(t, top.Config{})
	// Refused by the bus's decoder (a session id the frontend refuses: a
	// control character, invalid UTF-8), so never on the screen; and ids
	// it takes that a terminal would still obey (a bidi override, a line
	// separator), shown escaped.
	refused := []string{"\x1b]0;PWNED\x07\x1b[2J", "\ng7 ready 4/4", "x\u0085z", "bad\xff"}
	taken := map[string]string{"abc\u202edef": `abc\u202edef`, "x\u2028y": `x\u2028y`}
	n := 0
	for _, id := range refused {
		b.request(fmt.Sprint("r", n), id, time.Now())
		n++
	}
	for id := range taken {
		b.request(fmt.Sprint("r", n), id, time.Now())
		n++
	}
	b.flush()
	for _, screen := range []string{top.NewModel(b.w, time.Second, 10).Report(true), top.NewModel(b.w, time.Second, 10).Render()} {
		plain := ansiSGR.ReplaceAllString(screen, "") // the view's own styling
		for _, bad := range []string{"\x1b", "\x07", "\u202e", "\u2028", "\u0085", "\xff"} {
			if strings.Contains(plain, bad) {
				t.Errorf("the screen holds %q:\n%s", bad, screen)
			}
		}
		for _, gone := range []string{"PWNED", "g7 ready", "x\\u0085z", "bad"} {
			if strings.Contains(plain, gone) {
				t.Errorf("the screen shows %q, a session id the bus refuses:\n%s", gone, screen)
			}
		}
		for _, want := range taken {
			if !strings.Contains(plain, want) {
				t.Errorf("the screen lacks %s:\n%s", want, screen)
			}
		}
	}
	for in, want := range map[string]string{"naïve 会话 🙂 a\\b": `naïve 会话 🙂 a\\b`, "\x1b]0;PWNED\x07": `\x1b]0;PWNED\a`,
		"\ng7": `\ng7`, "z\xff": `z\xff`, "y\u0085": `y\u0085`} {
		if got := top.Printable(in); got != want {
			t.Errorf("Printable(%q) = %q, want %q", in, got, want)
		}
	}
}

// ansiSGR matches the styling escape sequences the view itself writes.
var ansiSGR = regexp.MustCompile("\x1b\\[[0-9;]*m")

// TestScreenMeasuresColumnsNotBytes: wide (CJK, emoji) session ids line up
// and are cut at a character, not inside one (truncate cut at a byte:
// invalid UTF-8; %-36s padded by bytes: misaligned); backspace in the
// filter removes a character, not a byte.
func TestScreenMeasuresColumnsNotBytes(t *testing.T) {
	b := startWatcher(t, top.Config{})
	ids := []string{"ascii-session", "会话会话会话会话会话会话会话会话会话会话会话会话", "🙂🙂🙂 émoji", "ç"}
	for i, id := range ids {
		b.request(fmt.Sprint("r", i), id, time.Now())
	}
	b.flush()
	screen := top.NewModel(b.w, time.Second, 10).Report(true)
	if !utf8.ValidString(screen) {
		t.Fatalf("the screen is not valid UTF-8:\n%q", screen)
	}
	var col []int
	for _, line := range strings.Split(screen, "\n") {
		if strings.HasPrefix(line, "SESSION") || strings.Contains(line, "会") || strings.Contains(line, "ascii-session") ||
			strings.Contains(line, "émoji") || strings.HasPrefix(line, "ç ") {
			// The last column (HIT, right-aligned) ends at the same
			// screen column on every row.
			col = append(col, ansi.StringWidth(line))
		}
	}
	if len(col) != 5 {
		t.Fatalf("session rows %v in:\n%s", col, screen)
	}
	for _, c := range col {
		if c != col[0] {
			t.Errorf("the session rows do not line up (%v):\n%s", col, screen)
		}
	}

	m := tea.Model(top.NewModel(b.w, time.Second, 10))
	for _, k := range []tea.KeyPressMsg{{Code: '/', Text: "/"}, {Code: 'é', Text: "é"}, {Code: 'ç', Text: "ç"}, {Code: tea.KeyBackspace}} {
		m, _ = m.Update(k)
	}
	screen = m.(top.Model).Render()
	if !utf8.ValidString(screen) || !strings.Contains(screen, "filter: é_") {
		t.Errorf("typed é ç and backspace: the filter is not é:\n%q", screen)
	}
}

// TestScreenFitsTheTerminal: at 60x15 the header wraps, the group table
// drops columns, the sessions take what is left and the help line stays
// on screen (the header and table were cut without a sign, the sessions
// pushed the help line off).
func TestScreenFitsTheTerminal(t *testing.T) {
	b := startWatcher(t, top.Config{})
	for g := range 3 {
		b.heartbeat(messages.Heartbeat{Group: fmt.Sprint("g", g), TPRank: 0, WorldSize: 1, Model: "m", UsedBlocks: 5, CapacityBlocks: 100})
	}
	for i := range 20 {
		b.request(fmt.Sprint("r", i), fmt.Sprintf("session-%02d", i), time.Now())
	}
	b.flush()
	m, _ := tea.Model(top.NewModel(b.w, time.Second, 50)).Update(tea.WindowSizeMsg{Width: 60, Height: 15})
	screen := ansiSGR.ReplaceAllString(m.(top.Model).Render(), "")
	lines := strings.Split(strings.TrimSuffix(screen, "\n"), "\n")
	if len(lines) > 15 {
		t.Errorf("%d lines on a 15-line terminal:\n%s", len(lines), screen)
	}
	for _, l := range lines {
		if ansi.StringWidth(l) > 60 {
			t.Errorf("a line of %d columns on a 60-column terminal: %q", ansi.StringWidth(l), l)
		}
	}
	if !strings.HasPrefix(lines[len(lines)-1], "q quit") {
		t.Errorf("the help line is not the last line:\n%s", screen)
	}
	for _, want := range []string{"aborted by clients", "(last 60s)", "g2", "RANKS", "session-"} {
		if !strings.Contains(screen, want) {
			t.Errorf("the screen lacks %q:\n%s", want, screen)
		}
	}
	if strings.Contains(screen, "POOL_OUT") {
		t.Errorf("POOL_OUT should be dropped first at 60 columns:\n%s", screen)
	}
}

// TestWatcherSaysItLostNATS: while NATS is unreachable the view says so,
// with the URL (no password) and since when, and keeps the last rows,
// marked stale (the cluster looked empty, the scheduler ready).
func TestWatcherSaysItLostNATS(t *testing.T) {
	b := startWatcher(t, top.Config{URL: "nats://kvbus:***@example:4222"})
	b.heartbeat(messages.Heartbeat{Group: "g0", TPRank: 0, WorldSize: 1, Model: "m"})
	b.publish(b.s.Announce("scheduler", "s1"), &messages.Announcement{Role: "scheduler", ID: "s1", Ready: true, ReadyGroups: 1, UnixMs: time.Now().UnixMilli()})
	b.flush()
	b.srv.Shutdown()
	testenv.Eventually(t, 5*time.Second, "the disconnection seen", func() bool { return b.w.Snapshot(time.Now()).Disconnected != nil })
	s := b.w.Snapshot(time.Now().Add(10 * time.Second))
	if !s.Stale || len(s.Groups) != 1 || s.Groups[0].State != "ready" || len(s.Schedulers) != 1 || s.Schedulers[0].State != "ready" {
		t.Errorf("disconnected: %+v, want the last rows, stale", s)
	}
	screen := top.NewModel(b.w, time.Second, 10).At(time.Now().Add(10 * time.Second)).Report(true)
	if !regexp.MustCompile(`disconnected from NATS at nats://127\.0\.0\.1:\d+ since \d\d:\d\d:\d\d, reconnecting`).MatchString(screen) ||
		!strings.Contains(screen, "ready (stale)") {
		t.Errorf("the screen does not say NATS is lost:\n%s", screen)
	}
}

// TestSessionsAreBounded: past MaxSessions the least recently active
// session is forgotten; the busiest are listed first.
func TestSessionsAreBounded(t *testing.T) {
	b := startWatcher(t, top.Config{MaxSessions: 3, Sessions: 2})
	for i, id := range []string{"a", "b", "c", "a", "d"} {
		b.request(fmt.Sprint("r", i), id, time.Now())
	}
	b.flush()
	s := b.w.Snapshot(time.Now())
	if s.SessionsTracked != 3 || len(s.Sessions) != 2 || s.Sessions[0].ID != "a" || s.Sessions[1].ID != "c" {
		t.Errorf("tracked %d, listed %+v; want 3 (b forgotten), a then c", s.SessionsTracked, s.Sessions)
	}
	if got := b.w.SnapshotWith(time.Now(), top.SnapshotOptions{Sessions: 5, Filter: "d"}).Sessions; len(got) != 1 || got[0].ID != "d" {
		t.Errorf("filtered on d: %+v", got)
	}
}

// TestSessionsAreConversationsOfOneModel: one session id sent with two
// models is two conversations, each with its own turns, as the schedulers
// count them (a session is a session of one model): model b's first turn
// is turn 1, and each shows as its own row with its model and group. Top
// kept one row per id: model b's turns were counted as turns 2 and 3 of
// model a's conversation, under whichever group served last, with one hit
// ratio over both models' prompts.
func TestSessionsAreConversationsOfOneModel(t *testing.T) {
	b := startWatcher(t, top.Config{})
	for _, hb := range []messages.Heartbeat{{Group: "ga", WorldSize: 1, Model: "model-a"}, {Group: "gb", WorldSize: 1, Model: "model-b"}} {
		b.heartbeat(hb)
	}
	turn := func(id, model, group string, cached int) {
		b.publish(b.s.Request(model), &messages.Request{RequestID: id, FrontendID: "fe", SessionID: "s", Model: model,
			ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: []uint32{1, 2, 3, 4}})
		b.publish(b.s.Meta(group, "s"), &messages.ReqMeta{ReqID: id, SessionID: "s", Group: group, FrontendID: "fe", ResultSubject: "done",
			BlockSize: 1, TokenLen: 4, TokenIDs: make(messages.TokenIDs, 4), BlockHashes: make(messages.BlockHashes, 4)})
		b.finish(id, 100, cached)
	}
	turn("a1", "model-a", "ga", 0)
	turn("b1", "model-b", "gb", 0)
	turn("b2", "model-b", "gb", 90)
	b.flush()
	s := b.w.Snapshot(time.Now())
	if r := s.HitRatio; r["1"] != 0 || r["2"] != 0.9 || len(r) != 2 {
		t.Errorf("hit ratio by turn %v; want 1: 0 and 2: 0.90 only (model b's first turn is a turn 1)", r)
	}
	rows := map[string]top.SessionRow{}
	for _, ss := range s.Sessions {
		if ss.ID == "s" {
			rows[ss.Model] = ss
		}
	}
	if a, bb := rows["model-a"], rows["model-b"]; len(rows) != 2 || a.Turns != 1 || a.Group != "ga" || a.HitRatio != 0 ||
		bb.Turns != 2 || bb.Group != "gb" || bb.HitRatio != 0.45 {
		t.Errorf("sessions %+v; want s of model-a (1 turn on ga, hit 0) and s of model-b (2 turns on gb, hit 0.45)", s.Sessions)
	}
	screen := top.NewModel(b.w, time.Second, 10).Report(true)
	var lines []string
	for _, l := range strings.Split(screen, "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[0] == "s" {
			lines = append(lines, strings.Join(f, " "))
		}
	}
	if !slices.Contains(lines, "s model-b gb 2 2 0.45") || !slices.Contains(lines, "s model-a ga 1 1 0.00") {
		t.Errorf("session lines %q; want s model-b gb 2 2 0.45 and s model-a ga 1 1 0.00:\n%s", lines, screen)
	}
}

// TestRankMessagesOnAnotherRanksSubjectAreNotShown: a heartbeat or KV batch
// whose group and rank are not those of its subject is dropped, as the
// schedulers drop it. The bus lets a worker-g1 key publish only on g1's
// subjects, but top read the group from the body: a review's worker-g1 key
// sent heartbeats on kvbus.hb.g1.0 naming g2, draining and not ready, and
// top showed g2 `not_ready` with 0 blocks while every scheduler counted
// the heartbeats malformed and kept placing on a ready g2.
func TestRankMessagesOnAnotherRanksSubjectAreNotShown(t *testing.T) {
	b := startWatcher(t, top.Config{})
	for tp := range 2 {
		b.heartbeat(messages.Heartbeat{Group: "g2", TPRank: tp, WorldSize: 2, Model: "m", UsedBlocks: 7, CapacityBlocks: 10})
	}
	forged := messages.Heartbeat{Group: "g2", TPRank: 0, WorldSize: 2, Model: "m", CapacityBlocks: 10,
		Draining: true, NotReady: true, NotReadyReason: "forged"}
	b.publish(b.s.Heartbeat("g1", 0), &forged)
	wide := messages.Heartbeat{Group: "g2", TPRank: 3, WorldSize: 4, Model: "m"}
	b.publish(b.s.Heartbeat("g2", 0), &wide) // g2's own subject, another rank's body
	b.publish(b.s.KV("g1", 0), &messages.KVEventBatch{Group: "g3", Rank: 0, Seq: 1})
	b.flush()
	s := b.w.Snapshot(time.Now())
	if len(s.Groups) != 1 {
		t.Fatalf("groups %+v, want g2 alone (g1 and g3 only named in bodies on other subjects)", s.Groups)
	}
	if g := s.Groups[0]; g.Name != "g2" || g.State != "ready" || g.Ranks != 2 || g.WorldSize != 2 || g.Blocks != 7 {
		t.Errorf("g2 %+v, want ready 2/2 with 7 blocks: the messages on other ranks' subjects dropped", g)
	}
}

// TestInFlightCountsWhatStartedBeforeTop: requests sent before top
// subscribed are in flight too. A review's `kvbus top --once --json` taken
// 2 s into 30 requests of 3 s each said in_flight 0 beside two groups of
// 15 in flight each (the header counted only requests top saw start).
func TestInFlightCountsWhatStartedBeforeTop(t *testing.T) {
	b := startWatcher(t, top.Config{})
	for _, g := range []string{"g1", "g2"} {
		b.heartbeat(messages.Heartbeat{Group: g, TPRank: 0, WorldSize: 1, Model: "m", InflightRequests: 15})
	}
	b.flush()
	if s := b.w.Snapshot(time.Now()); s.InFlight != 30 {
		t.Errorf("in flight %d, want the 30 the groups' drivers hold", s.InFlight)
	}
	// One request top saw start, on a group whose driver counts it: not twice.
	b.request("r1", "s1", time.Now())
	b.heartbeat(messages.Heartbeat{Group: "g1", TPRank: 0, WorldSize: 1, Model: "m", InflightRequests: 0})
	b.heartbeat(messages.Heartbeat{Group: "g2", TPRank: 0, WorldSize: 1, Model: "m", InflightRequests: 1})
	b.flush()
	if s := b.w.Snapshot(time.Now()); s.InFlight != 1 {
		t.Errorf("in flight %d, want 1", s.InFlight)
	}
}

// TestStreamEchoesAreNotShown: the server sends a stream's message wherever
// its requester names (a direct get's reply, a push consumer's deliver
// subject), past the requester's publish permissions. A review's worker-g1
// key put a heartbeat of g2's rank 0 (draining, not ready) into its own
// slot of KVBUS_RANKS and had a direct get answer it on kvbus.hb.g2.0: top
// showed g2 not_ready with 0 blocks while the scheduler dropped the echo
// (bus.Subscribe) and kept placing on a ready g2.
func TestStreamEchoesAreNotShown(t *testing.T) {
	b := startWatcher(t, top.Config{})
	b.heartbeat(messages.Heartbeat{Group: "g2", TPRank: 0, WorldSize: 1, Model: "m", UsedBlocks: 7, CapacityBlocks: 10})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	js, err := jetstream.New(b.nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b.s.SlotBucket(), Storage: jetstream.MemoryStorage})
	if err != nil {
		t.Fatal(err)
	}
	forged, err := messages.Marshal(&messages.Heartbeat{Group: "g2", TPRank: 0, WorldSize: 1, Model: "m", CapacityBlocks: 10,
		Draining: true, NotReady: true, NotReadyReason: "forged"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "g1.7", forged); err != nil {
		t.Fatal(err)
	}
	// The echo reaches the subject (else this test shows nothing)...
	raw, err := b.nc.SubscribeSync(b.s.Heartbeat("g2", 0))
	if err != nil {
		t.Fatal(err)
	}
	bucket := b.s.SlotBucket()
	if err := b.nc.PublishMsg(&nats.Msg{Subject: "$JS.API.DIRECT.GET.KV_" + bucket + ".$KV." + bucket + ".g1.7",
		Reply: b.s.Heartbeat("g2", 0)}); err != nil {
		t.Fatal(err)
	}
	if m, err := raw.NextMsg(5 * time.Second); err != nil || m.Header.Get(jetstream.StreamHeader) == "" {
		t.Fatalf("the direct get's answer did not reach %s out of the stream (%v)", b.s.Heartbeat("g2", 0), err)
	}
	// ...and top, which reads in order, read it before the flush marker.
	b.flush()
	s := b.w.Snapshot(time.Now())
	if len(s.Groups) != 1 || s.Groups[0].State != "ready" || s.Groups[0].Blocks != 7 {
		t.Errorf("groups %+v, want g2 ready with 7 blocks: the stream's echo dropped", s.Groups)
	}
}
