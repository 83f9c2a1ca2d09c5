package testenv_test

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/internal/saltforge"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
)

// turnResult is what one turn of a conversation reported.
type turnResult struct {
	reqID        string
	promptTokens int
	cachedTokens int
	group        string
}

// userTurn is a deterministic user message of about 60 tokens.
func userTurn(conv, n int) string {
	var b strings.Builder
	for i := range 40 {
		fmt.Fprintf(&b, "conversation %d turn %d word %d, ", conv, n, i)
	}
	return b.String()
}

// converse runs a multi-turn chat: each turn sends all previous messages,
// the assistant's answers and a new user message. After each turn it waits
// until the KV index holds the turn's prompt blocks on the group that ran
// it (what a real client's think time gives), then goes on.
func converse(t *testing.T, c *testenv.Cluster, conv, turns int, headers map[string]string) []turnResult {
	t.Helper()
	metas := c.Observe(t, "kvbus.meta.>")
	var msgs []map[string]string
	var out []turnResult
	for n := range turns {
		msgs = append(msgs, map[string]string{"role": "user", "content": userTurn(conv, n)})
		body, _ := json.Marshal(map[string]any{"model": c.Model, "messages": msgs, "max_tokens": 12})
		tr, answer := settledChat(t, c, metas, string(body), headers)
		msgs = append(msgs, map[string]string{"role": "assistant", "content": answer})
		out = append(out, tr)
		t.Logf("turn %d: group %s, prompt %d tokens, cached %d", n+1, tr.group, tr.promptTokens, tr.cachedTokens)
	}
	return out
}

// settledChat sends one chat request, then waits until every scheduler's
// KV index holds its prompt's blocks on the group that ran it, confirmed by
// every rank's events; metas observes kvbus.meta.>. It returns what the
// turn reported and the assistant's answer.
func settledChat(t *testing.T, c *testenv.Cluster, metas *testenv.Observer, body string, headers map[string]string) (turnResult, string) {
	t.Helper()
	status, h, raw := post(t, c, "/v1/chat/completions", body, headers)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, raw)
	}
	var resp struct {
		Choices []struct{ Message struct{ Content string } }
		Usage   answerUsage
	}
	if err := json.Unmarshal(raw, &resp); err != nil {
		t.Fatal(err)
	}
	tr := turnResult{reqID: h.Get("X-Request-Id"), promptTokens: resp.Usage.PromptTokens, cachedTokens: resp.Usage.Details.CachedTokens}
	meta := metaOf(t, metas, tr.reqID)
	tr.group = meta.Group
	testenv.Eventually(t, 5*time.Second, "the index to hold the turn's blocks", func() bool {
		for _, s := range c.Schedulers {
			g := []scheduler.GroupState{{Name: meta.Group}}
			s.Index().Match(meta.BlockHashes, g)
			// Held, and confirmed by every rank's events (no save plan left).
			if g[0].IndexBlocks != len(meta.BlockHashes) || s.Index().Plans() != 0 {
				return false
			}
		}
		return true
	})
	return tr, resp.Choices[0].Message.Content
}

// metaOf waits for the ReqMeta of request reqID among those metas
// observed, and returns it.
func metaOf(t *testing.T, metas *testenv.Observer, reqID string) *messages.ReqMeta {
	t.Helper()
	var meta *messages.ReqMeta
	testenv.Eventually(t, 5*time.Second, "the ReqMeta of "+reqID, func() bool {
		for _, m := range metas.Messages() {
			if rm, err := messages.DecodeReqMeta(m.Data); err == nil && rm.ReqID == reqID {
				meta = rm
				return true
			}
		}
		return false
	})
	return meta
}

// hits counts the turns n >= 2 whose cached tokens cover every full block of
// turn n-1's prompt.
func hits(turns []turnResult) int {
	n := 0
	for i := 1; i < len(turns); i++ {
		if turns[i].cachedTokens >= turns[i-1].promptTokens/16*16 && turns[i].cachedTokens > 0 {
			n++
		}
	}
	return n
}

func TestMultiTurnCacheHits(t *testing.T) {
	const turns = 4
	t.Run("kv with a session", func(t *testing.T) {
		c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 4, Policy: scheduler.PolicyKV})
		res := converse(t, c, 1, turns, map[string]string{"X-Session-ID": "conv-1"})
		for i := 1; i < turns; i++ {
			full := res[i-1].promptTokens / 16 * 16
			if res[i].cachedTokens < full {
				t.Errorf("turn %d: cached_tokens %d < %d (all full blocks of turn %d's %d-token prompt)", i+1, res[i].cachedTokens, full, i, res[i-1].promptTokens)
			}
			if res[i].group != res[0].group {
				t.Errorf("turn %d ran on %s, turn 1 on %s", i+1, res[i].group, res[0].group)
			}
		}
		if res[0].cachedTokens != 0 {
			t.Errorf("turn 1 reported %d cached tokens on an empty cluster", res[0].cachedTokens)
		}
		// The scheduler's own accounting agrees with what clients saw.
		testenv.Eventually(t, 5*time.Second, "trackers drained", func() bool { return c.Scheduler.Trackers() == 0 })
		var cached int
		for _, r := range res {
			cached += r.cachedTokens
		}
		m := c.SchedulerRegistries[0]
		// The tracker ends a moment before its counters move.
		testenv.Eventually(t, 5*time.Second, "kvbus_scheduler_actual_cached_tokens_total to match what clients saw", func() bool {
			return int(testenv.CounterSum(t, m, "kvbus_scheduler_actual_cached_tokens_total", nil)) == cached
		})
		if got := testenv.CounterSum(t, m, "kvbus_scheduler_cached_tokens_total", map[string]string{"turn_depth": "4+"}); int(got) != res[3].cachedTokens {
			t.Errorf("cached tokens at turn depth 4+ = %v, want %d", got, res[3].cachedTokens)
		}
		testenv.Eventually(t, 2*time.Second, "gauges refreshed", func() bool {
			mfs, err := m.Gather()
			if err != nil {
				t.Fatal(err)
			}
			names := map[string]bool{}
			for _, mf := range mfs {
				names[mf.GetName()] = true
			}
			for _, want := range []string{"kvbus_scheduler_routing_seconds", "kvbus_scheduler_predicted_cached_tokens_total",
				"kvbus_scheduler_prompt_tokens_total", "kvbus_scheduler_group_queue_blocks", "kvbus_scheduler_group_blocks",
				"kvbus_scheduler_index_entries", "kvbus_scheduler_index_blocks"} {
				if !names[want] {
					return false
				}
			}
			return true
		})
	})
	t.Run("kv with accounting payloads and session eviction", func(t *testing.T) {
		c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Payload: "accounting", Evict: "session"})
		res := converse(t, c, 4, turns, map[string]string{"X-Session-ID": "conv-4"})
		if got := hits(res); got != turns-1 {
			t.Errorf("%d of %d later turns hit: %+v", got, turns-1, res)
		}
	})
	t.Run("kv without a session: the index finds the prefix", func(t *testing.T) {
		c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 4, Policy: scheduler.PolicyKV})
		res := converse(t, c, 2, turns, nil)
		if got := hits(res); got != turns-1 {
			t.Errorf("%d of %d later turns hit: %+v", got, turns-1, res)
		}
	})
	t.Run("round-robin mostly misses with private stores", func(t *testing.T) {
		c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 4, Policy: scheduler.PolicyRoundRobin, Pool: scheduler.PoolLocal})
		res := converse(t, c, 3, turns, map[string]string{"X-Session-ID": "conv-3"})
		if got := hits(res); got > 1 {
			t.Errorf("round-robin: %d of %d later turns hit, want at most 1: %+v", got, turns-1, res)
		}
	})
	t.Run("round-robin hits with the global pool", func(t *testing.T) {
		c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 4, Policy: scheduler.PolicyRoundRobin})
		res := converse(t, c, 5, turns, map[string]string{"X-Session-ID": "conv-5"})
		if got := hits(res); got != turns-1 {
			t.Errorf("round-robin on the global pool: %d of %d later turns hit: %+v", got, turns-1, res)
		}
	})
}

// rankHoldings asks every rank of a group for a dump and returns, per rank,
// the set of block hashes it holds.
func rankHoldings(t *testing.T, c *testenv.Cluster, group string, ranks int) []map[uint64]bool {
	t.Helper()
	nc := testenv.Connect(t, c.NATS)
	out := make([]map[uint64]bool, ranks)
	for r := range ranks {
		msg, err := nc.Request(messages.Subjects{}.Dump(group, r), nil, 5*time.Second)
		if err != nil {
			t.Fatalf("dump %s/%d: %v", group, r, err)
		}
		b, err := messages.DecodeKVEventBatch(msg.Data)
		if err != nil {
			t.Fatal(err)
		}
		out[r] = map[uint64]bool{}
		for _, ev := range b.Events {
			for _, h := range ev.BlockHashes {
				out[r][h] = true
			}
		}
	}
	return out
}

func TestEvictionReachesTheIndex(t *testing.T) {
	// tiny at TP 4: 16 bytes per token per rank, 256 bytes per block; room
	// for 40 blocks per rank, and every prompt has 25.
	const capacityBlocks = 40
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, KVCapacity: capacityBlocks * 256})
	kv := c.Observe(t, "kvbus.kv.>")
	metas := c.Observe(t, "kvbus.meta.>")
	done := c.Observe(t, "kvbus.done.>")
	var prompts []string
	for _, i := range []int{0, 1, 1, 0, 2, 2, 1} { // hits, evictions, and reloads of half-evicted prompts
		prompts = append(prompts, userTurn(100+i, 0))
	}
	for i, p := range prompts {
		body, _ := json.Marshal(map[string]any{"model": c.Model, "messages": []map[string]string{{"role": "user", "content": p}}, "max_tokens": 4})
		if status, _, raw := post(t, c, "/v1/chat/completions", string(body), nil); status != http.StatusOK {
			t.Fatalf("request %d: status %d: %s", i, status, raw)
		}
		testenv.Eventually(t, 5*time.Second, "trackers drained", func() bool { return c.Scheduler.Trackers() == 0 })
	}
	removed := 0
	for _, m := range kv.Messages() {
		b, err := messages.DecodeKVEventBatch(m.Data)
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range b.Events {
			if ev.Type == messages.EventBlockRemoved {
				removed += len(ev.BlockHashes)
			}
		}
	}
	if removed == 0 {
		t.Fatal("no BlockRemoved event with a store that holds half a prompt")
	}
	// Nothing failed: every load the scheduler asked for was there.
	predicted := map[string]int{}
	for _, m := range metas.Messages() {
		rm, _ := messages.DecodeReqMeta(m.Data)
		predicted[rm.ReqID] = rm.LoadSpec.KVPoolCachedTokens
	}
	loads := 0
	for _, m := range done.Messages() {
		r, _ := messages.DecodeRankResult(m.Data)
		if r.Prefilled {
			continue // the driver's early report
		}
		loads += r.LoadedTokens
		if r.FailedBlocks != 0 || r.Error != "" {
			t.Errorf("rank %d of %s: failed_blocks %d, error %q", r.TPRank, r.ReqID, r.FailedBlocks, r.Error)
		}
		if r.LoadedTokens != predicted[r.ReqID] {
			t.Errorf("rank %d of %s loaded %d tokens, LoadSpec said %d", r.TPRank, r.ReqID, r.LoadedTokens, predicted[r.ReqID])
		}
	}
	if loads == 0 {
		t.Error("no request loaded anything: the test checks nothing")
	}
	// The index holds exactly the blocks all four ranks hold.
	held := rankHoldings(t, c, "g0", 4)
	all := 0
	for h := range held[0] {
		if held[1][h] && held[2][h] && held[3][h] {
			all++
		}
	}
	testenv.Eventually(t, 5*time.Second, "index equal to the ranks' holdings", func() bool {
		return c.Scheduler.Index().GroupBlocks("g0") == all
	})
	if all > capacityBlocks {
		t.Errorf("%d blocks held by every rank, capacity %d", all, capacityBlocks)
	}
	// Every block stored and no longer held was evicted to make room, and
	// each eviction's idle time was observed.
	stored := testenv.CounterSum(t, c.Registry, "kvbus_worker_blocks_total", map[string]string{"op": "stored"})
	heldAll := 0
	for _, h := range held {
		heldAll += len(h)
	}
	evicted := testenv.HistogramCount(t, c.Registry, "kvbus_worker_store_block_idle_before_evict_seconds", nil)
	if int(stored)-heldAll != int(evicted) || evicted < float64(removed) {
		t.Errorf("%v blocks stored, %d held, %v evictions observed (%d BlockRemoved events); want every block stored and not held evicted",
			stored, heldAll, evicted, removed)
	}
}

func TestRankRestartDropsItsEntries(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1})
	converse(t, c, 7, 1, map[string]string{"X-Session-ID": "restart"})
	before := c.Scheduler.Index().GroupBlocks("g0")
	if before == 0 {
		t.Fatal("no blocks indexed after one turn")
	}
	c.RestartRank(t, "g0", 2)
	// Rank 2 comes back empty: no block is held by all four ranks any more.
	testenv.Eventually(t, 10*time.Second, "stale entries gone", func() bool {
		return c.Scheduler.Index().GroupBlocks("g0") == 0
	})
	// The next turn is not told to load what rank 2 lost, and it stores again.
	res := converse(t, c, 7, 1, map[string]string{"X-Session-ID": "restart"})
	if res[0].cachedTokens != 0 {
		t.Errorf("after the restart the turn loaded %d tokens", res[0].cachedTokens)
	}
	if got := c.Scheduler.Index().GroupBlocks("g0"); got != before {
		t.Errorf("after re-storing, %d blocks indexed, want %d", got, before)
	}
}

func TestTwoSchedulersShareBindings(t *testing.T) {
	// The TTL leaves both replicas' watchers room to hear turn 3 before the
	// binding expires, on a CI host running other packages' tests too (2 s
	// once did not).
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 4, Schedulers: 2, SessionTTL: 4 * time.Second})
	res := converse(t, c, 9, 3, map[string]string{"X-Session-ID": "shared"})
	for i := range res {
		if res[i].group != res[0].group {
			t.Errorf("turn %d on %s, turn 1 on %s", i+1, res[i].group, res[0].group)
		}
	}
	testenv.Eventually(t, 4*time.Second, "both replicas bind the session to its group", func() bool {
		for _, s := range c.Schedulers {
			b, ok := s.Bindings().Get("shared")
			if !ok || b.Group != res[0].group || b.Turn != 3 {
				return false
			}
		}
		return true
	})
	// Both replicas handled turns: the consumer is shared.
	// After the TTL the binding is gone everywhere.
	testenv.Eventually(t, 15*time.Second, "expired bindings dropped", func() bool {
		for _, s := range c.Schedulers {
			if _, ok := s.Bindings().Get("shared"); ok {
				return false
			}
		}
		return true
	})
}

// fakeRank is a rank of world size 1 driven by the test: it sends
// heartbeats, publishes KV event batches when told (or skips one, to lose
// it), and answers dumps with what it really holds.
type fakeRank struct {
	mu   sync.Mutex
	seq  uint64
	held []uint64
}

func TestKVEventGapIsRepairedByADump(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1})
	subj := messages.Subjects{}
	nc := testenv.Connect(t, c.NATS)
	fr := &fakeRank{}
	var dumps atomic.Int64
	if _, err := nc.Subscribe(subj.Dump("gx", 0), func(m *nats.Msg) {
		dumps.Add(1)
		fr.mu.Lock()
		b := &messages.KVEventBatch{Seq: fr.seq, Group: "gx", Events: []messages.KVEvent{
			{Type: messages.EventAllBlocksCleared},
			{Type: messages.EventBlockStored, BlockHashes: slices.Clone(fr.held)},
		}}
		fr.mu.Unlock()
		data, _ := messages.Marshal(b)
		_ = m.Respond(data)
	}); err != nil {
		t.Fatal(err)
	}
	hb, _ := messages.Marshal(&messages.Heartbeat{Group: "gx", WorldSize: 1, StartedUnixMs: 1})
	publish := func(store []uint64, lose bool) {
		fr.mu.Lock()
		fr.seq++
		fr.held = append(fr.held, store...)
		b := &messages.KVEventBatch{Seq: fr.seq, Group: "gx", Events: []messages.KVEvent{{Type: messages.EventBlockStored, BlockHashes: store}}}
		fr.mu.Unlock()
		if lose {
			return
		}
		data, _ := messages.Marshal(b)
		if err := nc.Publish(subj.KV("gx", 0), data); err != nil {
			t.Fatal(err)
		}
	}
	blocks := func() int {
		g := []scheduler.GroupState{{Name: "gx"}}
		c.Scheduler.Index().Match([]uint64{1, 2, 3, 4}, g)
		return g[0].IndexBlocks
	}
	beat := func() bool { _ = nc.Publish(subj.Heartbeat("gx", 0), hb); return true }

	// First sight of the rank: the scheduler learns its (empty) state.
	testenv.Eventually(t, 5*time.Second, "the first dump", func() bool { return beat() && dumps.Load() == 1 })
	testenv.Eventually(t, 5*time.Second, "resync done", func() bool { return len(c.Scheduler.Index().Resyncing()) == 0 })
	publish([]uint64{1, 2}, false)
	testenv.Eventually(t, 5*time.Second, "blocks 1, 2 indexed", func() bool { return blocks() == 2 })
	publish([]uint64{3}, true) // lost on the way
	publish([]uint64{4}, false)
	testenv.Eventually(t, 5*time.Second, "the gap repaired by a dump", func() bool { return beat() && blocks() == 4 })
	if dumps.Load() != 2 {
		t.Errorf("%d dumps, want 2 (first sight, then the gap)", dumps.Load())
	}
	if got := testenv.CounterSum(t, c.SchedulerRegistries[0], "kvbus_scheduler_kv_resyncs_total", nil); got < 2 {
		t.Errorf("kvbus_scheduler_kv_resyncs_total = %v, want >= 2", got)
	}
	// Later batches apply normally again.
	publish([]uint64{5}, false)
	testenv.Eventually(t, 5*time.Second, "block 5 indexed", func() bool {
		g := []scheduler.GroupState{{Name: "gx"}}
		c.Scheduler.Index().Match([]uint64{1, 2, 3, 4, 5}, g)
		return g[0].IndexBlocks == 5
	})
}

// TestCacheSaltSeparatesPrefixes: a prompt sent with vLLM's cache_salt
// shares cached blocks only with the same prompt sent with the same salt,
// as vLLM keys a salted prompt's first block with its salt: another
// tenant's salt, or none, finds nothing cached.
func TestCacheSaltSeparatesPrefixes(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Policy: scheduler.PolicyKV})
	metas := c.Observe(t, "kvbus.meta.>")
	body := func(salt string) string { return saltedChat(c.Model, 7, salt) }
	steps := []struct {
		salt   string
		cached bool // whether the prompt's full blocks are due cached
	}{
		{"tenant-a", false},
		{"tenant-b", false}, // another salt
		{"", false},         // no salt
		{"tenant-a", true},
		{"tenant-b", true},
		{"", true},
	}
	for i, st := range steps {
		tr, _ := settledChat(t, c, metas, body(st.salt), nil)
		want := 0
		if st.cached {
			want = (tr.promptTokens - 1) / 16 * 16 // every full block but the last token's
		}
		if want == 0 && st.cached {
			t.Fatalf("the prompt has %d tokens: too short to hold a full block", tr.promptTokens)
		}
		if tr.cachedTokens != want {
			t.Errorf("request %d (cache_salt %q): cached_tokens %d of a %d-token prompt, want %d", i+1, st.salt, tr.cachedTokens, tr.promptTokens, want)
		}
	}
}

// TestMaxSessionsBoundsTheBindings: with --max-sessions 3, a fourth and a
// fifth session are not bound (the replica knows three, and so does the
// bucket), the bound ones keep updating, and an unbound session's next turn
// still finds its whole previous prompt through the KV index. The warning
// says so once, and the metrics count it. Before, every new session id was
// bound for the TTL: a gateway sending a new X-Correlation-ID with each
// request grew the bucket and every replica by its request rate × TTL.
func TestMaxSessionsBoundsTheBindings(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, MaxSessions: 3})
	var res [][]turnResult
	for i := range 5 {
		res = append(res, converse(t, c, 40+i, 2, map[string]string{"X-Session-ID": fmt.Sprint("bounded-", i)}))
	}
	b := c.Scheduler.Bindings()
	for i := range 5 {
		bound, ok := b.Get(fmt.Sprint("bounded-", i))
		if want := i < 3; ok != want {
			t.Errorf("session %d bound %v, want %v", i, ok, want)
		} else if ok && bound.Turn != 2 {
			t.Errorf("session %d's binding is of turn %d, want 2: a bound session keeps updating", i, bound.Turn)
		}
		if got := hits(res[i]); got != 1 {
			t.Errorf("session %d: its second turn found %d of its first prompt's %d tokens cached", i, res[i][1].cachedTokens, res[i][0].promptTokens)
		}
	}
	nc := testenv.Connect(t, c.NATS)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(t.Context(), scheduler.SessionBucket)
	if err != nil {
		t.Fatal(err)
	}
	st, err := kv.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if n := st.Values(); n != 3 {
		t.Errorf("the session bucket holds %d values, want 3", n)
	}
	m := c.SchedulerRegistries[0]
	if got := testenv.GaugeSum(t, m, "kvbus_scheduler_sessions", nil); got != 3 {
		t.Errorf("kvbus_scheduler_sessions = %v, want 3", got)
	}
	// Each unbound session's two turns were each refused a binding.
	if got := testenv.CounterSum(t, m, "kvbus_scheduler_sessions_unbound_total", nil); got != 4 {
		t.Errorf("kvbus_scheduler_sessions_unbound_total = %v, want 4", got)
	}
	if n := len(c.Logs.Lines("as many sessions are bound as --max-sessions allows")); n != 1 {
		t.Errorf("the bound was logged %d times, want once", n)
	}
}

// TestGroupCacheIsWhatEveryRankLoaded: a turn whose previous turn's blocks
// one rank has not saved yet (its store thread is 3 s late, past its
// --save-wait) loads them on the driver and recomputes them on that rank.
// A tensor-parallel group prefills a block that any of its ranks lacks, so
// the scheduler counts as loaded only what every rank loaded: 0 here. It
// counted the driver's 192 before (what it tells its client), as it did
// for the turns a rank restarted empty under (SIGKILL and a new process
// at once: the turns placed before the restart was heard).
func TestGroupCacheIsWhatEveryRankLoaded(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, Ranks: 2, StoreDelays: map[int]time.Duration{1: 3 * time.Second},
		SaveWait: 300 * time.Millisecond})
	done := c.Observe(t, "kvbus.done.>")
	msgs := []map[string]string{{"role": "user", "content": userTurn(8, 0)}}
	var answers []answerUsage
	for n := range 2 {
		body, _ := json.Marshal(map[string]any{"model": c.Model, "messages": msgs, "max_tokens": 4})
		status, _, raw := post(t, c, "/v1/chat/completions", string(body), map[string]string{"X-Session-ID": "late-rank"})
		if status != http.StatusOK {
			t.Fatalf("turn %d: status %d: %s", n+1, status, raw)
		}
		var a struct {
			Choices []struct {
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
			} `json:"choices"`
			Usage answerUsage `json:"usage"`
		}
		if err := json.Unmarshal(raw, &a); err != nil || len(a.Choices) == 0 {
			t.Fatalf("turn %d: %v: %s", n+1, err, raw)
		}
		answers = append(answers, a.Usage)
		msgs = append(msgs, map[string]string{"role": "assistant", "content": a.Choices[0].Message.Content},
			map[string]string{"role": "user", "content": userTurn(8, n+1)})
	}
	testenv.Eventually(t, 10*time.Second, "trackers drained", func() bool { return c.Scheduler.Trackers() == 0 })
	// The fault took effect: the driver loaded every full block of turn 1,
	// rank 1 none of them.
	full := answers[0].PromptTokens / 16 * 16
	if answers[1].Details.CachedTokens != full {
		t.Fatalf("turn 2: the driver loaded %d tokens; want %d (every full block of turn 1): the test checks nothing", answers[1].Details.CachedTokens, full)
	}
	failed := 0
	for _, m := range done.Messages() {
		r, _ := messages.DecodeRankResult(m.Data)
		if !r.Prefilled && r.TPRank == 1 {
			failed += r.FailedBlocks
		}
	}
	if failed != full/16 {
		t.Fatalf("rank 1 failed %d blocks; want %d (all of turn 1's): the test checks nothing", failed, full/16)
	}
	m := c.SchedulerRegistries[0]
	testenv.Eventually(t, 5*time.Second, "both requests counted", func() bool {
		return testenv.CounterSum(t, m, "kvbus_scheduler_requests_total", map[string]string{"outcome": "completed"}) == 2
	})
	if got := testenv.CounterSum(t, m, "kvbus_scheduler_actual_cached_tokens_total", nil); got != 0 {
		t.Errorf("kvbus_scheduler_actual_cached_tokens_total = %v; want 0 (rank 1 loaded nothing; the driver %d)", got, full)
	}
	if got := testenv.CounterSum(t, m, "kvbus_scheduler_cached_tokens_total", nil); got != 0 {
		t.Errorf("kvbus_scheduler_cached_tokens_total = %v; want 0", got)
	}
	if got := testenv.CounterSum(t, m, "kvbus_scheduler_predicted_cached_tokens_total", nil); int(got) != full {
		t.Errorf("kvbus_scheduler_predicted_cached_tokens_total = %v; want %d (turn 2's LoadSpec)", got, full)
	}
}

// TestForgedCacheSaltSharesNoBlocks: a client that knows an unsalted prompt
// (a public system prompt) picks the 8-byte cache_salt whose seed is the
// hash of one of its blocks (saltforge runs xxh3 backwards) and sends the
// prompt's rest under it. Its blocks must not match the unsalted prompt's:
// a salted prompt shares nothing with an unsalted one. When the salt was
// hashed with xxh3 seeded with the model's seed, it found every full block
// of the rest cached (the 1,632 tokens after block 25 of a 2,048-token
// prompt: 1,616 cached).
func TestForgedCacheSaltSharesNoBlocks(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Policy: scheduler.PolicyKV})
	metas := c.Observe(t, "kvbus.meta.>")
	// A prompt with a block whose forged salt is valid UTF-8 (JSON carries
	// nothing else): about 1 block in 100.
	r := rand.New(rand.NewPCG(7, 7))
	var prompt []uint32
	var salt string
	block := -1
	for block < 0 {
		prompt = make([]uint32, 2048)
		for i := range prompt {
			prompt[i] = 1000 + r.Uint32N(100000)
		}
		for b, h := range scheduler.HashBlocks(nil, scheduler.HashSeed(c.Model), prompt, 16) {
			if s := saltforge.Salt8(scheduler.HashSeed(c.Model), h); utf8.ValidString(s) {
				block, salt = b, s
				break
			}
		}
	}
	complete := func(p []uint32, salt string) turnResult {
		t.Helper()
		b := map[string]any{"model": c.Model, "prompt": p, "max_tokens": 1}
		if salt != "" {
			b["cache_salt"] = salt
		}
		body, _ := json.Marshal(b)
		status, h, raw := post(t, c, "/v1/completions", string(body), nil)
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, raw)
		}
		var resp struct{ Usage answerUsage }
		if err := json.Unmarshal(raw, &resp); err != nil {
			t.Fatal(err)
		}
		tr := turnResult{reqID: h.Get("X-Request-Id"), promptTokens: resp.Usage.PromptTokens, cachedTokens: resp.Usage.Details.CachedTokens}
		meta := metaOf(t, metas, tr.reqID)
		testenv.Eventually(t, 5*time.Second, "the index to hold the prompt's blocks", func() bool {
			g := []scheduler.GroupState{{Name: meta.Group}}
			c.Schedulers[0].Index().Match(meta.BlockHashes, g)
			return g[0].IndexBlocks == len(meta.BlockHashes) && c.Schedulers[0].Index().Plans() == 0
		})
		return tr
	}
	if tr := complete(prompt, ""); tr.cachedTokens != 0 {
		t.Fatalf("the unsalted prompt found %d tokens cached on a new cluster", tr.cachedTokens)
	}
	rest := prompt[16*(block+1):]
	if tr := complete(rest, salt); tr.cachedTokens != 0 {
		t.Errorf("the prompt's rest after block %d under the forged cache_salt %q found %d of its %d tokens cached, want 0",
			block, salt, tr.cachedTokens, tr.promptTokens)
	}
	// The salt's own prompts still share: the same rest under it again.
	if tr, want := complete(rest, salt), (len(rest)-1)/16*16; tr.cachedTokens != want {
		t.Errorf("the rest again under its salt found %d tokens cached, want %d", tr.cachedTokens, want)
	}
}

// TestSessionsShareAPromptUnlessSalted: the cache is keyed by content, not
// by session, as vLLM's prefix cache: a second session sending the first's
// prompt finds its full blocks cached, on whichever group it lands (the
// global pool); the session only steers placement. A cache_salt is what
// keeps a prompt apart, within one session too.
func TestSessionsShareAPromptUnlessSalted(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Policy: scheduler.PolicyRoundRobin})
	metas := c.Observe(t, "kvbus.meta.>")
	body := func(salt string) string { return saltedChat(c.Model, 11, salt) }
	steps := []struct {
		session, salt string
		cached        bool
	}{
		{"alice", "", false},
		{"bob", "", true},       // another session, the same prompt
		{"", "", true},          // no session
		{"bob", "bob's", false}, // salted: nothing of the unsalted prompt
		{"alice", "bob's", true},
	}
	var first string
	for i, st := range steps {
		var h map[string]string
		if st.session != "" {
			h = map[string]string{"X-Session-ID": st.session}
		}
		tr, _ := settledChat(t, c, metas, body(st.salt), h)
		if i == 1 && tr.group == first {
			t.Errorf("bob's request ran on %s as alice's: round-robin did not move it, the pool went unread", tr.group)
		}
		if i == 0 {
			first = tr.group
		}
		want := 0
		if st.cached {
			want = (tr.promptTokens - 1) / 16 * 16
		}
		if tr.cachedTokens != want {
			t.Errorf("request %d (session %q, cache_salt %q, group %s): cached_tokens %d of %d, want %d",
				i+1, st.session, st.salt, tr.group, tr.cachedTokens, tr.promptTokens, want)
		}
	}
}

// saltedChat is a chat request of userTurn(seed, 0), with cache_salt salt
// ("": none).
func saltedChat(model string, seed int, salt string) string {
	b := map[string]any{"model": model, "max_tokens": 4,
		"messages": []map[string]string{{"role": "user", "content": userTurn(seed, 0)}}}
	if salt != "" {
		b["cache_salt"] = salt
	}
	out, _ := json.Marshal(b)
	return string(out)
}

// TestAConversationLongerThanTheStoreIsPromisedWhatItKeeps: a rank saves
// at most as many blocks of a prompt as its store holds (its first ones),
// so the next turn, sent the moment the answer arrives, is told to load
// those and no more, and every rank loads all it was told.
func TestAConversationLongerThanTheStoreIsPromisedWhatItKeeps(t *testing.T) {
	// tiny at TP 4: 256 bytes per block; room for 8 blocks per rank.
	const capacityBlocks = 8
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, KVCapacity: capacityBlocks * 256})
	metas := c.Observe(t, "kvbus.meta.>")
	done := c.Observe(t, "kvbus.done.>")
	prompt := testenv.PromptTokens(11, 12*16+1) // 12 full blocks
	var ids []string
	for turn := range 3 {
		toks := make([]string, len(prompt))
		for i, v := range prompt {
			toks[i] = fmt.Sprint(v)
		}
		body := fmt.Sprintf(`{"model":%q,"prompt":[%s],"max_tokens":2}`, c.Model, strings.Join(toks, ","))
		status, h, raw := post(t, c, "/v1/completions", body, map[string]string{"X-Session-ID": "longer-than-the-store"})
		if status != http.StatusOK {
			t.Fatalf("turn %d: status %d: %s", turn+1, status, raw)
		}
		ids = append(ids, h.Get("X-Request-Id"))
		prompt = append(prompt, testenv.PromptTokens(20+turn, 32)...)
	}
	testenv.Eventually(t, 5*time.Second, "every rank's result of every turn", func() bool {
		n := 0
		for _, m := range done.Messages() {
			if r, err := messages.DecodeRankResult(m.Data); err == nil && !r.Prefilled {
				n++
			}
		}
		return n == 3*4
	})
	for turn, id := range ids[1:] {
		meta := metaOf(t, metas, id)
		if got := meta.LoadSpec.KVPoolCachedTokens; got != capacityBlocks*16 {
			t.Errorf("turn %d: LoadSpec of %d tokens, want the %d the store keeps", turn+2, got, capacityBlocks*16)
		}
		for _, m := range done.Messages() {
			r, err := messages.DecodeRankResult(m.Data)
			if err != nil || r.Prefilled || r.ReqID != id {
				continue
			}
			if r.FailedBlocks != 0 || r.LoadedTokens != meta.LoadSpec.KVPoolCachedTokens {
				t.Errorf("turn %d, rank %d: loaded %d tokens of the %d promised, failed_blocks %d",
					turn+2, r.TPRank, r.LoadedTokens, meta.LoadSpec.KVPoolCachedTokens, r.FailedBlocks)
			}
		}
	}
}
