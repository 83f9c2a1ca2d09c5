package testenv_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
)

// TestSchedulerResendsToSilentRanks: rank 2 loses its first ReqMeta (one
// core NATS message lost). The scheduler hears nothing from it within
// --resend-after, publishes the ReqMeta again, and the request completes in
// about that bound instead of waiting out its 20 s deadline.
func TestSchedulerResendsToSilentRanks(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, DropReqMetas: map[int]int{2: 1},
		ResendAfter: 300 * time.Millisecond, RequestTimeout: 20 * time.Second})
	start := time.Now()
	status, _, raw := post(t, c, "/v1/chat/completions", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hello"}],"max_tokens":4}`, c.Model), nil)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, raw)
	}
	// The driver answers without rank 2; the request ends in the scheduler
	// once rank 2 reported, after the resend.
	completedCount := func() float64 {
		return testenv.CounterSum(t, c.Registry, "kvbus_scheduler_requests_total", map[string]string{"outcome": "completed"})
	}
	testenv.Eventually(t, 5*time.Second, "the request completed in the scheduler", func() bool { return completedCount() == 1 })
	took := time.Since(start)
	if n := len(c.Logs.Lines("fault injection: ReqMeta ignored", "tp_rank=2")); n != 1 {
		t.Fatalf("rank 2 ignored %d ReqMetas, want 1: the fault did not take effect", n)
	}
	resends := testenv.CounterSum(t, c.Registry, "kvbus_scheduler_reqmeta_resends_total", nil)
	completed := completedCount()
	timeouts := testenv.CounterSum(t, c.Registry, "kvbus_scheduler_requests_total", map[string]string{"outcome": "timeout"})
	t.Logf("done after %s: resends %v, completed %v, timeouts %v", took.Round(time.Millisecond), resends, completed, timeouts)
	if resends < 1 || resends > 3 || completed != 1 || timeouts != 0 {
		t.Errorf("resends %v, completed %v, timeouts %v; want 1 (up to 3 on a slow machine), 1, 0", resends, completed, timeouts)
	}
	if took > 3*time.Second {
		t.Errorf("the request took %s to end, want about --resend-after (300 ms)", took)
	}
}

// TestLoadIsClusterWide: with two scheduler replicas, each replica's view of
// a group's load counts the requests the other replica placed there (from
// the driver's reports): both see all 8 requests in flight, where each
// would see only its own ~4 before.
func TestLoadIsClusterWide(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Schedulers: 2, TimeScale: 1, Policy: "least-loaded"})
	const n = 8
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			// 150 output tokens at 10 ms each: the requests stay in flight ~1.5 s.
			body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"long %d"}],"max_tokens":150,"ignore_eos":true}`, c.Model, i)
			if status, _, raw := post(t, c, "/v1/chat/completions", body, nil); status != http.StatusOK {
				t.Errorf("status %d: %s", status, raw)
			}
		})
	}
	dispatched := func(i int) float64 {
		return testenv.CounterSum(t, c.SchedulerRegistries[i], "kvbus_scheduler_requests_total", map[string]string{"outcome": "dispatched"})
	}
	testenv.Eventually(t, 5*time.Second, "every request dispatched", func() bool { return dispatched(0)+dispatched(1) == n })
	if dispatched(0) == 0 || dispatched(1) == 0 {
		t.Logf("one replica dispatched everything (%v, %v): the views are trivially equal", dispatched(0), dispatched(1))
	}
	inflight := func(s *scheduler.Scheduler) int {
		sum := 0
		for _, g := range s.Groups() {
			sum += g.Inflight
		}
		return sum
	}
	testenv.Eventually(t, 2*time.Second, "both replicas to see all 8 requests in flight", func() bool {
		return inflight(c.Schedulers[0]) == n && inflight(c.Schedulers[1]) == n
	})
	split := map[string]int{}
	for _, g := range c.Schedulers[0].Groups() {
		split[g.Name] = g.Inflight
	}
	// Each replica's policies read exactly these GroupStates (the policies'
	// use of them is in ./scheduler's policy tests); the split itself
	// depends on how the two replicas' decisions interleave.
	t.Logf("dispatched %v + %v; each replica sees %d and %d in flight; split %v", dispatched(0), dispatched(1),
		inflight(c.Schedulers[0]), inflight(c.Schedulers[1]), split)
	wg.Wait()
}

// TestDumpLargerThanMaxPayload: against a server whose max payload is
// 16 KiB, a rank holding thousands of blocks (more than one message can
// carry) resyncs: its dump comes in chunks and the index ends up equal to
// what the ranks hold.
func TestDumpLargerThanMaxPayload(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, MaxPayload: 16 << 10})
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	for conv := 0; c.Scheduler.Index().GroupBlocks("g0") < 3000; conv++ {
		if conv > 200 {
			t.Fatalf("only %d blocks after %d conversations", c.Scheduler.Index().GroupBlocks("g0"), conv)
		}
		if _, err := (testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 1000 + conv, MaxTokens: 4}).Run(t.Context(), 1); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, 5*time.Second, "the index to settle", func() bool { return c.Scheduler.Index().Plans() == 0 })
	held := c.Scheduler.Index().GroupBlocks("g0")
	// A heartbeat of g0/1 with a later start time: the scheduler takes it
	// for a restart, and once that process is silent for the heartbeat
	// timeout, the rank's own (earlier) process is the rank again. Either
	// change asks for a dump (3,000 hashes: 24 KB, over 16 KiB); the one
	// that counts is the real process's.
	nc, err := nats.Connect(c.NATS.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	before := len(c.Logs.Lines("rank resynced from its dump", "tp_rank=1"))
	data, _ := messages.Marshal(&messages.Heartbeat{Group: "g0", TPRank: 1, EPRank: 1, WorldSize: 4, Model: c.Model, StartedUnixMs: time.Now().UnixMilli()})
	if err := nc.Publish(messages.Subjects{}.Heartbeat("g0", 1), data); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "a resync from a dump", func() bool {
		return len(c.Logs.Lines("rank resynced from its dump", "tp_rank=1")) > before
	})
	testenv.Eventually(t, 10*time.Second, "the index back to what the ranks hold", func() bool {
		return len(c.Scheduler.Index().Resyncing()) == 0 && c.Scheduler.Index().GroupBlocks("g0") == held
	})
	line := c.Logs.Lines("rank resynced from its dump", "tp_rank=1")[before]
	t.Logf("%d blocks held; %s", held, line)
	if strings.Contains(line, "chunks=1 ") || strings.Contains(line, "chunks=0 ") {
		t.Errorf("the dump came in one chunk: %s", line)
	}
}

// TestTakeOverAfterSchedulerCrash: a replica dispatched a request (its
// SavePlan and ReqMeta went out, the ranks ran it and answered to it) and
// died before acking it; the request log redelivers it to another replica.
// That replica must send it to the same group and attempt, so the ranks
// answer it from memory: the request ends once, with its answer, no
// timeout and no second run.
func TestTakeOverAfterSchedulerCrash(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2})
	nc, err := nats.Connect(c.NATS.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var (
		mu      sync.Mutex
		outputs []*messages.Output
		results = map[int]bool{} // ranks that reported to the dead replica
	)
	if _, err := nc.Subscribe(messages.Subjects{}.Done("sched-dead"), func(m *nats.Msg) {
		if r, err := messages.DecodeRankResult(m.Data); err == nil && !r.Received && !r.Prefilled {
			mu.Lock()
			results[r.TPRank] = true
			mu.Unlock()
		}
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Subscribe(messages.Subjects{}.Out("fe-crash"), func(m *nats.Msg) {
		if o, err := messages.DecodeOutput(m.Data); err == nil {
			mu.Lock()
			outputs = append(outputs, o)
			mu.Unlock()
		}
	}); err != nil {
		t.Fatal(err)
	}
	finals := func() int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, o := range outputs {
			if o.Final() {
				n++
			}
		}
		return n
	}
	prompt := testenv.PromptTokens(77, 100)
	req := &messages.Request{RequestID: "taken-over-1", Model: c.Model, FrontendID: "fe-crash", ArrivalUnixMs: time.Now().UnixMilli(),
		PromptTokenIDs: prompt, SamplingParams: messages.SamplingParams{MaxTokens: 4}, Endpoint: messages.EndpointChat}
	hashes := scheduler.HashBlocks(nil, scheduler.HashSeed(c.Model), prompt, 16)
	// What the dead replica did: its plan, then the ReqMeta to g1.
	plan, _ := messages.Marshal(&messages.SavePlan{SchedulerID: "sched-dead", ReqID: req.RequestID, Group: "g1",
		BlockHashes: hashes, ExpiresUnixMs: time.Now().Add(time.Minute).UnixMilli()})
	meta, _ := messages.Marshal(&messages.ReqMeta{ReqID: req.RequestID, Model: c.Model, Group: "g1", TokenLen: len(prompt),
		TokenIDs: prompt, BlockSize: 16, BlockHashes: hashes, LoadSpec: &messages.LoadSpec{}, CanSave: true, IsLastChunk: true,
		NumPromptTokens: len(prompt), SamplingParams: req.SamplingParams, FrontendID: "fe-crash",
		ResultSubject: messages.Subjects{}.Done("sched-dead"), DeadlineUnixMs: time.Now().Add(time.Minute).UnixMilli()})
	for subj, data := range map[string][]byte{messages.Subjects{}.Plan("sched-dead"): plan} {
		if err := nc.Publish(subj, data); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Publish(messages.Subjects{}.Meta("g1", ""), meta); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "the dead replica's run answered, every rank reported to it", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(results) == 4
	})
	if n := finals(); n != 1 {
		t.Fatalf("%d final outputs of the first run, want 1", n)
	}
	// The redelivery: the request reaches the live replica from the log.
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	data, _ := messages.Marshal(req)
	if _, err := js.Publish(t.Context(), messages.Subjects{}.Request(c.Model), data, jetstream.WithMsgID(req.RequestID)); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "the live replica to end the request", func() bool {
		return testenv.CounterSum(t, c.Registry, "kvbus_scheduler_requests_total", map[string]string{"outcome": "completed"}) == 1
	})
	if n := len(c.Logs.Lines("request taken over from another scheduler replica", "req_id="+req.RequestID, "group=g1")); n != 1 {
		t.Errorf("%d takeover log lines, want 1", n)
	}
	time.Sleep(200 * time.Millisecond) // a second run would have answered by now
	if n := finals(); n != 1 {
		t.Errorf("%d final outputs, want 1: the request ran twice", n)
	}
	if n := testenv.CounterSum(t, c.Registry, "kvbus_scheduler_requests_total", map[string]string{"outcome": "timeout"}); n != 0 {
		t.Errorf("%v timeouts", n)
	}
	if n := len(c.Logs.Lines("ReqMeta again: result sent again", "req_id="+req.RequestID)); n != 4 {
		t.Errorf("%d ranks answered the second ReqMeta from memory, want 4", n)
	}
}

// TestNoGroupIsAFast503: with the only group down, a request gets a 503
// with Retry-After within --no-group-wait (either the frontend knows no
// scheduler is ready, or the scheduler gives up waiting for a group), not a
// 504 after the request timeout.
func TestNoGroupIsAFast503(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, NoGroupWait: 500 * time.Millisecond, RequestTimeout: 20 * time.Second})
	c.KillRank(t, "g0", 3)
	testenv.Eventually(t, 5*time.Second, "the group out", func() bool { return c.Scheduler.ReadyGroups() == 0 })
	// At once (the frontend may still count the scheduler ready), and once
	// the scheduler's announcement said it is not.
	for i := range 2 {
		if i == 1 {
			time.Sleep(1500 * time.Millisecond)
		}
		start := time.Now()
		status, h, raw := post(t, c, "/v1/chat/completions", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}]}`, c.Model), nil)
		took := time.Since(start)
		var body struct{ Error struct{ Code string } }
		_ = json.Unmarshal(raw, &body)
		t.Logf("request %d: %d %s after %s", i, status, body.Error.Code, took.Round(time.Millisecond))
		if status != http.StatusServiceUnavailable || h.Get("Retry-After") == "" ||
			(body.Error.Code != "no_ready_group" && body.Error.Code != "no_ready_scheduler") {
			t.Errorf("request %d: status %d, Retry-After %q, body %s; want 503 no_ready_group/no_ready_scheduler", i, status, h.Get("Retry-After"), raw)
		}
		if took > 3*time.Second {
			t.Errorf("request %d: the 503 took %s", i, took)
		}
	}
}

// TestLoneGroupBrieflyAwayHoldsRequests: a rank of the only group replaced
// (stopped, a new one started): while the group is away the frontend is
// unhealthy, and a request sent then is held, as the scheduler's
// --no-group-wait says, and answered once the group is back. Before, the
// frontend answered it 503 no_ready_scheduler at once, whatever
// --no-group-wait said (a review replacing ranks of one group as processes
// saw 10-20 such 503s per replacement with --no-group-wait 15s).
func TestLoneGroupBrieflyAwayHoldsRequests(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, Ranks: 2, NoGroupWait: 15 * time.Second, RequestTimeout: 30 * time.Second})
	chat := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}],"max_tokens":2}`, c.Model)
	if status, _, raw := post(t, c, "/v1/chat/completions", chat, nil); status != http.StatusOK {
		t.Fatalf("before: %d %s", status, raw)
	}
	restarted := make(chan error, 1)
	go func() { restarted <- c.Cluster.RestartRank("g0", 1) }()
	healthz := func() int {
		resp, err := http.Get(c.URL + "/healthz")
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	// The fault took effect: the frontend knows no scheduler is ready.
	testenv.Eventually(t, 10*time.Second, "the frontend unhealthy while the group is away", func() bool { return healthz() == http.StatusServiceUnavailable })
	start := time.Now()
	status, _, raw := post(t, c, "/v1/chat/completions", chat, nil)
	t.Logf("a request while the group was away: %d after %s", status, time.Since(start).Round(time.Millisecond))
	if status != http.StatusOK {
		t.Errorf("a request while the lone group was away: %d %s, want 200 once it is back (--no-group-wait 15s)", status, raw)
	}
	if err := <-restarted; err != nil {
		t.Fatal(err)
	}
}

// TestReqMetaAboveMaxPayloadIsA413: a request that fits in one message of
// a 1 MiB bus but whose ReqMeta does not (the same token ids, plus a block
// hash per 16 tokens and the LoadSpec) is answered with a 413 at once; the
// scheduler nak'ed it every 100 ms until the client's 504.
func TestReqMetaAboveMaxPayloadIsA413(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 1, MaxPayload: 1 << 20, MaxModelLen: 400_000, RequestTimeout: 20 * time.Second})
	const n = 245_000 // ~980 KB of Request, ~1.1 MB of ReqMeta
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprint(100 + i%800)
	}
	body := fmt.Sprintf(`{"model":%q,"prompt":[%s],"max_tokens":1}`, c.Model, strings.Join(ids, ","))
	status, _, b := post(t, c, "/v1/completions", body, nil)
	if status != http.StatusRequestEntityTooLarge || !strings.Contains(string(b), "max_payload") {
		t.Errorf("a %d-token prompt on a 1 MiB bus: %d %.300s; want a 413 naming max_payload", n, status, b)
	}
	if got := testenv.CounterSum(t, c.SchedulerRegistries[0], "kvbus_scheduler_requests_total", map[string]string{"outcome": "too_large"}); got != 1 {
		t.Errorf("too_large = %v, want 1", got)
	}
}

// TestReqMetaAboveTheDecodersLimitIsA413: on a NATS server that takes
// 16 MiB, a request that fits in a Request (8 MiB, what every decoder on the
// bus takes) but whose ReqMeta does not is answered with a 413 at once. The
// scheduler published it, the server took it, every rank's decoder refused
// it, and the client waited for its deadline.
func TestReqMetaAboveTheDecodersLimitIsA413(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 1, MaxPayload: 16 << 20, MaxModelLen: 2_200_000, MaxBodyBytes: 16 << 20,
		RequestTimeout: 20 * time.Second})
	const n = 2_050_000 // ~8.2 MB of Request, ~9.2 MB of ReqMeta
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprint(100 + i%800)
	}
	body := fmt.Sprintf(`{"model":%q,"prompt":[%s],"max_tokens":1}`, c.Model, strings.Join(ids, ","))
	start := time.Now()
	status, _, b := post(t, c, "/v1/completions", body, nil)
	if status != http.StatusRequestEntityTooLarge || !strings.Contains(string(b), "ReqMeta") {
		t.Errorf("a %d-token prompt on a 16 MiB bus: %d after %s, %.300s; want a 413 naming the ReqMeta", n, status, time.Since(start), b)
	}
	if got := testenv.CounterSum(t, c.SchedulerRegistries[0], "kvbus_scheduler_requests_total", map[string]string{"outcome": "too_large"}); got != 1 {
		t.Errorf("too_large = %v, want 1", got)
	}
}

// TestLostRequestLogIsMadeAgain: the request log, its consumer and the
// session bucket vanish from the server (as from a NATS server restarted
// without its store; here deleted, as `nats stream rm` would). The
// schedulers make them again within seconds: requests are answered, a
// conversation's turns find the previous prompt cached, and both replicas
// see its binding (their watchers follow the new bucket).
func TestLostRequestLogIsMadeAgain(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Schedulers: 2, SessionTTL: time.Minute})
	converse(t, c, 3, 2, map[string]string{"X-Session-ID": "before"})
	js, err := jetstream.New(testenv.Connect(t, c.NATS))
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if err := js.DeleteStream(ctx, messages.RequestStream); err != nil {
		t.Fatal(err)
	}
	if err := js.DeleteKeyValue(ctx, messages.SessionBucket); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Stream(ctx, messages.RequestStream); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("the request log is still there after its deletion: %v", err)
	}
	testenv.Eventually(t, 15*time.Second, "the request log, its consumer and the session bucket made again", func() bool {
		_, cerr := js.Consumer(ctx, messages.RequestStream, bus.SchedulerConsumer)
		_, kerr := js.KeyValue(ctx, messages.SessionBucket)
		return cerr == nil && kerr == nil
	})
	testenv.Eventually(t, 10*time.Second, "both replicas ready again", func() bool {
		for _, s := range c.Schedulers {
			if ok, _ := s.Ready(); !ok {
				return false
			}
		}
		return true
	})

	res := converse(t, c, 4, 3, map[string]string{"X-Session-ID": "after"})
	for i := 1; i < len(res); i++ {
		if due := res[i-1].promptTokens / 16 * 16; float64(res[i].cachedTokens) < 0.95*float64(due) {
			t.Errorf("turn %d: %d tokens cached of the previous prompt's %d", i+1, res[i].cachedTokens, due)
		}
	}
	kv, err := js.KeyValue(ctx, messages.SessionBucket)
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "the binding stored in the new bucket and seen by both replicas", func() bool {
		if _, err := kv.Get(ctx, messages.SessionKey("after")); err != nil {
			return false
		}
		for _, s := range c.Schedulers {
			if b, ok := s.Bindings().Get("after"); !ok || b.Turn != 3 {
				return false
			}
		}
		return true
	})
}

// outcome is how a request sent by sendAll ended, took counting from the
// fault (sendAll's second result, unix nanos, set by the test).
type outcome struct {
	status int
	took   time.Duration
	raw    string
}

// sendAll sends n copies of the chat body at once; each outcome arrives on
// the channel as its answer ends.
func sendAll(t *testing.T, c *testenv.Cluster, body string, n int) (<-chan outcome, *atomic.Int64) {
	results := make(chan outcome, n)
	var fault atomic.Int64
	for range n {
		go func() {
			status, _, raw := post(t, c, "/v1/chat/completions", body, nil)
			results <- outcome{status, time.Since(time.Unix(0, fault.Load())), string(raw)}
		}()
	}
	return results, &fault
}

// TestStoppedSchedulerWatchesItsRequests: scheduler replica 0 is stopped
// (SIGTERM) while requests it dispatched run, then both groups' driver
// ranks die. The requests were acknowledged in the log at dispatch: only
// replica 0 knows them. It keeps watching them while it stops, so each
// ends with a 503 group_failed within the heartbeat timeout; a replica that
// returned at once left them to hang until their 20 s deadline (504).
func TestStoppedSchedulerWatchesItsRequests(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Schedulers: 2, TimeScale: 1, RequestTimeout: 20 * time.Second})
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"a long answer"}],"max_tokens":1500,"ignore_eos":true}`, c.Model)
	const n = 12
	results, killed := sendAll(t, c, body, n)
	testenv.Eventually(t, 10*time.Second, "replica 0 dispatched requests", func() bool { return c.Schedulers[0].Trackers() > 0 })
	mine := c.Schedulers[0].Trackers()
	stopped := make(chan error, 1)
	go func() { stopped <- c.Cluster.StopScheduler(0) }()
	time.Sleep(300 * time.Millisecond) // replica 0 has stopped taking requests
	killed.Store(time.Now().UnixNano())
	c.KillRank(t, "g0", 0)
	c.KillRank(t, "g1", 0)
	failed := 0
	for range n {
		o := <-results
		switch {
		case o.status == http.StatusServiceUnavailable && strings.Contains(o.raw, "group_failed"):
			failed++
			if o.took > 10*time.Second {
				t.Errorf("a request ended %v after its group's driver died; want within the heartbeat timeout", o.took)
			}
		case o.status == http.StatusOK:
		default:
			t.Errorf("a request ended %d after %v: %.200s; want 503 group_failed (or 200)", o.status, o.took, o.raw)
		}
	}
	if failed < mine {
		t.Errorf("%d requests ended group_failed, fewer than the %d replica 0 held when it stopped: the fault did not take effect", failed, mine)
	}
	if err := <-stopped; err != nil {
		t.Error(err)
	}
	// Its requests ended before it stopped, and it said so: replica 1,
	// once replica 0 is silent for longer than the heartbeat timeout (2 s),
	// adopts nothing.
	time.Sleep(2500 * time.Millisecond)
	if n := len(c.Logs.Lines("adopting the requests it dispatched")); n != 0 {
		t.Errorf("replica 1 adopted the requests of a replica that stopped cleanly (%d log lines)", n)
	}
}

// TestCrashedSchedulerRequestsAreAdopted: scheduler replica 0 crashes
// (its connection gone, no stop) while requests it dispatched generate on
// g0, and g0's driver rank dies with it. Those requests were acknowledged
// in the log at dispatch, so only replica 0 knew them: they hung until
// their 30 s deadline (504). Replica 1 now hears replica 0 fall silent,
// adopts its requests from their save plans and the log, and handles g0's
// failure for them as for its own: each ends within seconds, answered
// from g1 or with a retryable 503 group_failed (its answer had begun).
// Requests replica 0 answered before are not adopted: they ran again.
func TestCrashedSchedulerRequestsAreAdopted(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Schedulers: 2, TimeScale: 1, RequestTimeout: 30 * time.Second})
	// g1 is out while the requests are placed: all go to g0.
	if err := c.Cluster.StopRank("g1", 0); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "both replicas to see only g0 ready", func() bool {
		return c.Schedulers[0].ReadyGroups() == 1 && c.Schedulers[1].ReadyGroups() == 1
	})
	// Answered before the crash: not to be adopted (or run again).
	for i := range 8 {
		if status, _, raw := post(t, c, "/v1/chat/completions", chatBody(c.Model, fmt.Sprint("warm-up ", i), ""), nil); status != http.StatusOK {
			t.Fatalf("warm-up: %d %s", status, raw)
		}
	}
	testenv.Eventually(t, 10*time.Second, "the warm-up's trackers ended", func() bool {
		return c.Schedulers[0].Trackers()+c.Schedulers[1].Trackers() == 0
	})
	// Replicas tell each other what ended every 250 ms, in their save
	// plans: the warm-up's must be told before the crash, or the survivor
	// adopts them too.
	awaitEndedInPlanStream(t, c, 8)
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"a long answer"}],"max_tokens":500,"ignore_eos":true}`, c.Model)
	const n = 12
	results, killed := sendAll(t, c, body, n)
	testenv.Eventually(t, 10*time.Second, "every request dispatched", func() bool {
		return c.Schedulers[0].Trackers()+c.Schedulers[1].Trackers() == n
	})
	mine := c.Schedulers[0].Trackers()
	if mine == 0 {
		t.Skip("replica 1 took every request: nothing for the crash to strand")
	}
	c.RestartRank(t, "g1", 0) // g1 is back, to move the requests to
	killed.Store(time.Now().UnixNano())
	crashed := make(chan error, 1)
	go func() { crashed <- c.Cluster.KillScheduler(0) }()
	c.KillRank(t, "g0", 0)
	for range n {
		o := <-results
		switch {
		case o.status != http.StatusOK && !(o.status == http.StatusServiceUnavailable && strings.Contains(o.raw, "group_failed")):
			t.Errorf("a request ended %d %v after the crash: %.200s; want 200 or 503 group_failed", o.status, o.took, o.raw)
		case o.took > 10*time.Second:
			t.Errorf("a request ended %d %v after the crash; want within seconds (the heartbeat timeout is 2 s)", o.status, o.took)
		}
	}
	if err := <-crashed; err != nil {
		t.Error(err)
	}
	// Only the requests still running are adopted: those replica 0 ended
	// before it crashed it had told replica 1 of.
	if got := len(c.Logs.Lines("adopted the requests of a scheduler replica", fmt.Sprintf("adopted=%d ", mine))); got != 1 {
		t.Errorf("no line says %d requests were adopted, the %d replica 0 held when it crashed: %q", mine, mine,
			c.Logs.Lines("adopted the requests of a scheduler replica"))
	}
	// Replica 1 does not know whether an adopted request's output had
	// begun: it moves it, and the frontend ends the answer with an error
	// if it had.
	if got := len(c.Logs.Lines("worker group lost the request", "from=g0", "to=g1")); got < mine {
		t.Errorf("%d requests moved from g0 to g1, want at least the %d adopted ones", got, mine)
	}
}

// TestLoneSchedulerCrashRequestsAreAdopted: the only scheduler replica
// crashes while requests it dispatched generate on g0, and g0's driver rank
// dies with it (a host that ran both). No other replica heard its save
// plans, so the requests hung until their deadline (504), even after a new
// scheduler started. The plans are also kept in the plan stream: the new
// replica reads them at start, finds the dead one silent and adopts its
// requests, which end within seconds of its start, answered from g1 or with
// a retryable 503 group_failed (their answer had begun). When the driver is
// started again at once instead, the new process does not have them: they
// go out as a new attempt, which the frontend does not splice into what the
// old process had sent (each ends 503 group_failed); the same attempt sent
// again ran from the start and was answered 200, half of one run and half
// of another.
func TestLoneSchedulerCrashRequestsAreAdopted(t *testing.T) {
	t.Run("driver dead", func(t *testing.T) { loneSchedulerCrash(t, false) })
	t.Run("driver restarted", func(t *testing.T) { loneSchedulerCrash(t, true) })
}

func loneSchedulerCrash(t *testing.T, restartDriver bool) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Schedulers: 1, TimeScale: 1, RequestTimeout: 30 * time.Second})
	if err := c.Cluster.StopRank("g1", 0); err != nil { // every request goes to g0
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "the scheduler to see only g0 ready", func() bool { return c.Scheduler.ReadyGroups() == 1 })
	// Answered before the crash: ended in the plan stream, not adopted.
	for i := range 4 {
		if status, _, raw := post(t, c, "/v1/chat/completions", chatBody(c.Model, fmt.Sprint("warm-up ", i), ""), nil); status != http.StatusOK {
			t.Fatalf("warm-up: %d %s", status, raw)
		}
	}
	// The scheduler publishes the ids of the requests it ended every 250 ms
	// into the plan stream: the warm-up's must be there before the crash,
	// or the new replica adopts them too.
	awaitEndedInPlanStream(t, c, 4)
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"a long answer"}],"max_tokens":500,"ignore_eos":true}`, c.Model)
	const n = 12
	results, killed := sendAll(t, c, body, n)
	testenv.Eventually(t, 10*time.Second, "every request dispatched", func() bool { return c.Scheduler.Trackers() == n })
	c.RestartRank(t, "g1", 0) // g1 is back, to move the requests to
	killed.Store(time.Now().UnixNano())
	if err := c.Cluster.KillScheduler(0); err != nil {
		t.Fatal(err)
	}
	c.KillRank(t, "g0", 0)
	if restartDriver {
		if err := c.Cluster.RestartRank("g0", 0); err != nil { // not c.RestartRank: no scheduler is ready to wait for
			t.Fatal(err)
		}
	}
	// The fault took effect: with no scheduler, nothing ends.
	select {
	case o := <-results:
		t.Fatalf("a request ended with no scheduler running (%d %.200s): the crash did not strand it", o.status, o.raw)
	case <-time.After(2 * time.Second):
	}
	metas := c.Observe(t, "kvbus.meta.>") // the new replica's ReqMetas
	if err := c.Cluster.StartScheduler(); err != nil {
		t.Fatal(err)
	}
	restarted := time.Now()
	for i := range n {
		var o outcome
		select {
		case o = <-results:
		case <-time.After(20 * time.Second):
			t.Fatalf("%d of %d requests had not ended 20 s after the new scheduler started: not adopted", n-i, n)
		}
		switch took := time.Since(restarted); {
		case o.status != http.StatusOK && !(o.status == http.StatusServiceUnavailable && strings.Contains(o.raw, "group_failed")):
			t.Errorf("a request ended %d %v after the new scheduler started: %.200s; want 200 or 503 group_failed", o.status, took, o.raw)
		case took > 15*time.Second:
			t.Errorf("a request ended %d %v after the new scheduler started; want within seconds (the heartbeat timeout is 2 s)", o.status, took)
		}
	}
	if restartDriver {
		// Sent again as attempt 0, the new driver process ran each from the
		// start and the frontend took its tokens past those the old one
		// had sent: one answer of two runs.
		sameAttempt := map[string]bool{}
		for _, m := range metas.Messages() {
			if meta, err := messages.DecodeReqMeta(m.Data); err == nil && meta.Attempt == 0 {
				sameAttempt[meta.ReqID] = true
			}
		}
		if len(sameAttempt) > 0 {
			t.Errorf("%d of %d requests were sent again as attempt 0 to a driver process started after their dispatch: want a new attempt", len(sameAttempt), n)
		}
	}
	if got := c.Logs.Lines("adopted the requests of a scheduler replica", fmt.Sprintf("adopted=%d ", n)); len(got) != 1 {
		t.Errorf("no line says the %d requests of the crashed replica were adopted (and only they, not the warm-up's): %q", n,
			c.Logs.Lines("adopted the requests of a scheduler replica"))
	}
}

// awaitEndedInPlanStream waits until the first n requests the schedulers
// logged done (all there are by then) are listed as ended in the plan
// stream's save plans, which every replica hears as they are published.
func awaitEndedInPlanStream(t *testing.T, c *testenv.Cluster, n int) {
	t.Helper()
	var done []string
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("%d requests done in the schedulers", n), func() bool {
		done = done[:0]
		for _, l := range c.Logs.Lines("request done") {
			if _, rest, ok := strings.Cut(l, "req_id="); ok {
				done = append(done, strings.Fields(rest)[0])
			}
		}
		return len(done) == n
	})
	testenv.Eventually(t, 10*time.Second, "their ids ended in the plan stream", func() bool {
		ended := endedInPlanStream(t, c)
		for _, id := range done {
			if !ended[id] {
				return false
			}
		}
		return true
	})
}

// endedInPlanStream is the set of request ids the plan stream's save plans
// list as ended; empty while the stream cannot be read.
func endedInPlanStream(t *testing.T, c *testenv.Cluster) map[string]bool {
	t.Helper()
	ended := map[string]bool{}
	nc := testenv.Connect(t, c.NATS)
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return ended
	}
	st, err := js.Stream(t.Context(), messages.Subjects{}.PlanStream())
	if err != nil {
		return ended
	}
	info, err := st.Info(t.Context())
	if err != nil {
		return ended
	}
	for seq := info.State.FirstSeq; seq > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(t.Context(), seq)
		if err != nil {
			continue // deleted
		}
		if p, err := messages.DecodeSavePlan(m.Data); err == nil {
			for _, id := range p.Ended {
				ended[id] = true
			}
		}
	}
	return ended
}

// TestDeadlineDuringGenerationIsATimeout: a request whose deadline passes
// while its group generates is ended by its frontend (504) with an Abort
// whose reason says so; the scheduler counts it as a timeout, as it is,
// not as aborted by a client that went away (nor, when the ranks' own
// deadline reports come first, as a failure: TestRequestOutcomeOfRankErrors).
func TestDeadlineDuringGenerationIsATimeout(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, TimeScale: 1, RequestTimeout: time.Second})
	// 10 ms a token: 500 tokens take 5 s.
	status, _, raw := post(t, c, "/v1/chat/completions", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hello"}],"max_tokens":500,"ignore_eos":true}`, c.Model), nil)
	if status != http.StatusGatewayTimeout {
		t.Fatalf("status %d: %s; want 504 once the 1 s deadline passed", status, raw)
	}
	outcome := func(o string) float64 {
		return testenv.CounterSum(t, c.Registry, "kvbus_scheduler_requests_total", map[string]string{"outcome": o})
	}
	testenv.Eventually(t, 5*time.Second, "the request's end counted in the scheduler", func() bool {
		return outcome("timeout")+outcome("aborted")+outcome("failed")+outcome("completed") > 0
	})
	if outcome("timeout") != 1 || outcome("aborted") != 0 || outcome("failed") != 0 {
		t.Errorf("outcome timeout %v, aborted %v, failed %v; want 1, 0, 0", outcome("timeout"), outcome("aborted"), outcome("failed"))
	}
}
