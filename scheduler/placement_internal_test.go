package scheduler

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvbus/kvbus/messages"
)

// newBareScheduler is a scheduler on an embedded server that is not
// running: its handlers and placement are called directly.
func newBareScheduler(t *testing.T) (*Scheduler, *nats.Conn) {
	t.Helper()
	nc := embeddedConn(t)
	s, err := New(Config{Conn: nc, ID: "s0", Policy: KVPolicy{}, HeartbeatTimeout: time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	return s, nc
}

// holding makes a one-rank group known and synced in the index, holding
// hashes.
func holding(s *Scheduler, g string, hashes ...uint64) {
	s.index.ObserveRank(g, 0, 1, 1, 0)
	s.index.ApplyDump(g, 0, kvDump(g, 0, 1, hashes...))
}

// heard records a heartbeat of group g's only rank at at, with queued
// prefill tokens.
func heard(s *Scheduler, g string, at time.Time, queuedTokens int64) {
	s.groups.observe(&messages.Heartbeat{Group: g, TPRank: 0, WorldSize: 1, StartedUnixMs: 1, QueuedPrefillTokens: queuedTokens}, at)
}

// promptTracker is a request of blocks full blocks and one token more.
func promptTracker(id string, blocks int) *RequestTracker {
	toks := make([]uint32, blocks*16+1)
	for i := range toks {
		toks[i] = uint32(i) + uint32(len(id))*100_000 + uint32(id[len(id)-1])*1000
	}
	t := &RequestTracker{ReqID: id, SessionID: "s-" + id, Model: "m", FrontendID: "fe", TokenLen: len(toks), TokenIDs: toks,
		Request:  &messages.Request{RequestID: id, FrontendID: "fe", Model: "m", PromptTokenIDs: toks},
		Received: time.Now(), Deadline: time.Now().Add(time.Minute), Results: map[int]*messages.RankResult{}}
	t.BlockHashes = HashBlocks(nil, HashSeed("m"), toks, 16)
	return t
}

// TestPlaceReadsOnlyFromLiveGroups: a group that stopped sending
// heartbeats stays in the index until its blocks are cleared, but nobody
// answers a pool read from it: its blocks are neither in the cost nor in
// the LoadSpec.
func TestPlaceReadsOnlyFromLiveGroups(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	tr := promptTracker("r1", 20)
	holding(s, "g0")
	holding(s, "gone", tr.BlockHashes[:10]...)
	holding(s, "draining", tr.BlockHashes[:4]...)
	heard(s, "g0", now, 0)
	heard(s, "gone", now.Add(-5*time.Second), 0)
	s.groups.observe(&messages.Heartbeat{Group: "draining", TPRank: 0, WorldSize: 1, StartedUnixMs: 1, Draining: true}, now)
	groups := s.PlaceableGroups(now)
	if len(groups) != 1 || groups[0].Name != "g0" {
		t.Fatalf("placeable groups = %+v, want g0 only", groups)
	}
	if _, err := s.place(tr, groups, Binding{}, false); err != nil {
		t.Fatal(err)
	}
	// The draining group still answers reads of its 4 blocks; the one that
	// is gone does not.
	want := []messages.RemoteRun{{Group: "draining", FromBlock: 0, Blocks: 4}}
	if fmt.Sprint(tr.Remote) != fmt.Sprint(want) || tr.LoadBlocks != 4 {
		t.Errorf("LoadSpec: remote %+v, %d blocks loaded; want %+v, 4", tr.Remote, tr.LoadBlocks, want)
	}
	if groups[0].RemoteBlocks != 4 {
		t.Errorf("g0's cost counts %d remote blocks, want 4", groups[0].RemoteBlocks)
	}
}

// TestPlaceBindingCreditIsNotRemote: the blocks the bound group is
// credited with (the previous turn, still being saved) are not also
// counted as pool reads; past them only what the pool holds is.
func TestPlaceBindingCreditIsNotRemote(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	tr := promptTracker("r2", 20)
	holding(s, "g0")
	holding(s, "g1", tr.BlockHashes[:10]...)
	heard(s, "g0", now, 5*16)
	heard(s, "g1", now, 0)
	groups := s.PlaceableGroups(now)
	b := Binding{Group: "g0", Blocks: 10, LastHash: tr.BlockHashes[9]} // g0 served blocks 0-9
	g, err := s.place(tr, groups, b, true)
	if err != nil {
		t.Fatal(err)
	}
	for _, gs := range groups {
		if gs.CachedBlocks+gs.RemoteBlocks > 10 {
			t.Errorf("%s: %d cached + %d remote blocks, but only blocks 0-9 exist anywhere", gs.Name, gs.CachedBlocks, gs.RemoteBlocks)
		}
	}
	// Both have the first 10 blocks (credited or held); g0 has 5 queued.
	if g != "g1" {
		t.Errorf("placed on %s, want g1: the same prefix, no queue", g)
	}
}

// TestPlaceReadsThePreviousTurnsSaveFromABusyGroup: a session's previous
// turn was answered on g0, whose ranks are still saving its last blocks
// (planned, not yet confirmed) while g0 has other prefills queued. The next
// turn goes to the idle g1, which holds the turn before's prefix; the
// previous turn's blocks are read from g0's save, not recomputed: the
// answer came, so that save is imminent whatever g0 has queued. Before,
// only groups with an empty queue counted as savers, and such turns (a
// review with every role its own process, 3 groups of 2 ranks) found
// 62-90% of the previous prompt.
func TestPlaceReadsThePreviousTurnsSaveFromABusyGroup(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	tr := promptTracker("r3", 20)
	holding(s, "g0", tr.BlockHashes[:8]...)
	holding(s, "g1", tr.BlockHashes[:8]...)
	s.index.Plan("g0", tr.BlockHashes[:14], now.Add(time.Minute)) // the previous turn: blocks 0-13
	heard(s, "g0", now, 40*16)
	heard(s, "g1", now, 0)
	groups := s.PlaceableGroups(now)
	b := Binding{Group: "g0", Blocks: 14, LastHash: tr.BlockHashes[13], UpdatedUnixMs: now.UnixMilli()}
	g, err := s.place(tr, groups, b, true)
	if err != nil {
		t.Fatal(err)
	}
	if g != "g1" {
		t.Fatalf("placed on %s, want g1: g0 has 40 blocks queued", g)
	}
	want := []messages.RemoteRun{{Group: "g0", FromBlock: 8, Blocks: 6, Saving: true}}
	if fmt.Sprint(tr.Remote) != fmt.Sprint(want) || tr.LoadBlocks != 14 {
		t.Errorf("LoadSpec: remote %+v, %d blocks loaded; want %+v, 14: the previous turn's blocks", tr.Remote, tr.LoadBlocks, want)
	}
}

// TestRescueSpreadsStrandedRequests: requests moved off a failed group
// are placed one after another, each seeing the work of those moved before
// it, not all on the group that was idlest before the move.
func TestRescueSpreadsStrandedRequests(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	for _, g := range []string{"g0", "g1", "g2"} {
		holding(s, g)
	}
	heard(s, "g0", now.Add(-5*time.Second), 0) // failed
	heard(s, "g1", now, 0)
	heard(s, "g2", now, 10*16)
	for i := range 6 {
		tr := promptTracker(fmt.Sprint("m", i), 20)
		tr.Group, tr.WorldSize, tr.queued = "g0", 1, 20
		s.trackers.add(tr)
	}
	s.rescue(now)
	count := map[string]int{}
	for i := range 6 {
		s.trackers.update(fmt.Sprint("m", i), func(t *RequestTracker) { count[t.Group]++ })
	}
	if count["g0"] != 0 || count["g1"]+count["g2"] != 6 || count["g2"] == 0 || count["g1"] < count["g2"] {
		t.Errorf("six 21-block requests moved off g0 (g1 idle, g2 with 10 blocks queued) went %v; want them spread, g1 taking no fewer", count)
	}
}

// TestFetchDumpRefusesHugeChunkCounts: a dump reply's chunk count sizes an
// allocation; one far beyond any rank's (1<<62) is malformed, not a crash.
func TestFetchDumpRefusesHugeChunkCounts(t *testing.T) {
	s, nc := newBareScheduler(t)
	s.cfg.DumpTimeout = 2 * time.Second
	// Encoded as a rank would, without the decoder's validation.
	data, err := (&messages.KVEventBatch{V: 1, Group: "g0", Seq: 5, DumpChunks: 1 << 62}).MarshalMsg(nil)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := nc.Subscribe(s.cfg.Subjects.Dump("g0", 0), func(m *nats.Msg) { _ = m.Respond(data) })
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	_, _, err = s.fetchDump(context.Background(), "g0", 0)
	if !errors.Is(err, messages.ErrInvalid) {
		t.Errorf("fetchDump = %v, want an ErrInvalid dump chunk", err)
	}
}

// ackMsg is a request delivered from the log, as onRequest sees it.
type ackMsg struct {
	jetstream.Msg // nil: only the methods below are called
	data          []byte
	acked         bool
}

func (m *ackMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{NumDelivered: 1, Timestamp: time.Now()}, nil
}
func (m *ackMsg) Data() []byte                     { return m.data }
func (m *ackMsg) Subject() string                  { return "kvbus.req.m" }
func (m *ackMsg) Ack() error                       { m.acked = true; return nil }
func (m *ackMsg) NakWithDelay(time.Duration) error { return nil }
func (m *ackMsg) Term() error                      { return nil }

// TestAbortBeforeDispatch: a client that gives up while its request still
// waits in the request log (a backlog is when clients give up) has it
// dropped when the scheduler reaches it, not run for nobody.
func TestAbortBeforeDispatch(t *testing.T) {
	s, nc := newBareScheduler(t)
	b, _ := openTestBindings(t)
	s.bindings.Store(b)
	holding(s, "g0")
	heard(s, "g0", time.Now(), 0)
	metas := make(chan *nats.Msg, 4)
	sub, err := nc.ChanSubscribe(s.cfg.Subjects.MetaGroup("g0"), metas)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	sendAbort(t, s, "gone", messages.AbortReasonClientGone)
	gone, kept := requestMsg(t, "gone"), requestMsg(t, "kept")
	for _, m := range []*ackMsg{gone, kept} {
		if err := s.onRequest(context.Background(), m); err != nil {
			t.Fatal(err)
		}
		if !m.acked {
			t.Errorf("request not acknowledged")
		}
	}
	// Only "kept" goes out: ReqMetas are published in order.
	select {
	case m := <-metas:
		meta, err := messages.DecodeReqMeta(m.Data)
		if err != nil || meta.ReqID != "kept" {
			t.Errorf("first ReqMeta = %v (%v), want kept's: the aborted request was dispatched", meta, err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the request that was not aborted was not dispatched")
	}
	if s.trackers.has("gone") {
		t.Error("the aborted request is tracked")
	}
}

// TestGroupsBeyondTheIndexArePlaceable: the KV index tracks
// MaxIndexedGroups groups; the rest are placed as if they held nothing. With
// one more ready group than that (1,025 engines behind --engine openai are
// 1,025 groups of one rank), the untracked one is placeable, and takes a
// request when every tracked group is busy.
func TestGroupsBeyondTheIndexArePlaceable(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	for i := range MaxIndexedGroups + 1 {
		g := fmt.Sprintf("g%02d", i)
		holding(s, g)
		queued := int64(10_000)
		if i == MaxIndexedGroups {
			queued = 0
		}
		heard(s, g, now, queued)
	}
	if s.index.Synced(fmt.Sprintf("g%02d", MaxIndexedGroups)) {
		t.Fatal("the index tracks more groups than MaxIndexedGroups: the test sets up nothing")
	}
	groups := s.PlaceableGroups(now)
	if len(groups) != MaxIndexedGroups+1 {
		t.Fatalf("%d placeable groups of %d ready", len(groups), MaxIndexedGroups+1)
	}
	g, err := s.place(promptTracker("r1", 4), groups, Binding{}, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("g%02d", MaxIndexedGroups); g != want {
		t.Errorf("placed on %s, want the idle untracked group %s", g, want)
	}
}

// TestRestartSparesWhatTheNewProcessRuns: a rank's new process subscribes
// to ReqMetas before its first heartbeat is heard, so a request dispatched
// in between reaches it; its answers name its start. When the restart is
// heard, that request goes on; one the old process had, never answered by
// the new one, is dispatched again once the grace for a receipt is over.
func TestRestartSparesWhatTheNewProcessRuns(t *testing.T) {
	s, _ := newBareScheduler(t)
	holding(s, "g0")
	t0 := time.Now()
	heard(s, "g0", t0, 0) // the old process (started 1)
	dispatch := func(id string) {
		tr := promptTracker(id, 4)
		if _, err := s.place(tr, s.PlaceableGroups(time.Now()), Binding{}, false); err != nil {
			t.Fatal(err)
		}
		if err := s.buildMeta(tr); err != nil {
			t.Fatal(err)
		}
		s.trackers.add(tr)
	}
	dispatch("old")
	dispatch("new")
	s.trackers.addResult(&messages.RankResult{ReqID: "old", Group: "g0", TPRank: 0, Received: true, StartedUnixMs: 1}, nil)
	s.trackers.prefilled(&messages.RankResult{ReqID: "new", Group: "g0", TPRank: 0, Prefilled: true, StartedUnixMs: 2})
	s.trackers.addResult(&messages.RankResult{ReqID: "new", Group: "g0", TPRank: 0, Prefilled: true, StartedUnixMs: 2}, nil)
	time.Sleep(2 * time.Millisecond)
	now := time.Now()
	s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: 0, WorldSize: 1, StartedUnixMs: 2}, now)
	s.rescue(now)
	if !s.trackers.has("new") || !s.trackers.has("old") {
		t.Fatalf("right after the restart was heard: new kept %v, old kept %v; want both (the old one's grace)", s.trackers.has("new"), s.trackers.has("old"))
	}
	later := now.Add(restartGrace + time.Millisecond)
	s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: 0, WorldSize: 1, StartedUnixMs: 2}, later)
	s.rescue(later)
	if !s.trackers.has("new") {
		t.Error("the request the new process is streaming was ended")
	}
	var attempt int
	s.trackers.update("old", func(t *RequestTracker) { attempt = t.Attempt })
	if attempt != 1 {
		t.Errorf("the old process's request: attempt %d after the grace, want 1 (dispatched again)", attempt)
	}
}

// TestSecondProcessOfARankIsIgnored: a second worker process given a rank
// that is running (an operator's slip: a worker left over from an earlier
// run) publishes KV events and answers dumps under the rank's name. Its
// heartbeats are ignored while the rank's own process, which started later,
// is heard from; its KV events and its dump replies must be too. Before,
// its seqs interleaved with the rank's, so the index took in blocks the
// rank does not hold, was cleared by its AllBlocksCleared, and resynced on
// every other batch.
func TestSecondProcessOfARankIsIgnored(t *testing.T) {
	s, nc := newBareScheduler(t)
	s.cfg.DumpTimeout = 2 * time.Second
	const rank, older = 2000, 1000 // the processes' started_unix_ms
	now := time.Now()
	s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: 0, WorldSize: 1, StartedUnixMs: rank}, now)
	if stale, _, _ := s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: 0, WorldSize: 1, StartedUnixMs: older}, now); !stale {
		t.Fatal("the older process's heartbeat was taken for the rank's")
	}
	holding(s, "g0", 11, 12) // the rank's dump, at seq 1
	deliver := func(b *messages.KVEventBatch, started int64) {
		t.Helper()
		b.StartedUnixMs = started
		data, err := messages.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.onKVEvents(t.Context(), &nats.Msg{Subject: s.cfg.Subjects.KV("g0", 0), Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	deliver(kvBatch("g0", 0, 1, clearedAll(), stored(98)), older) // looks like a restart
	deliver(kvBatch("g0", 0, 9, stored(99)), older)               // a gap in the rank's seqs
	deliver(kvBatch("g0", 0, 2, stored(13)), rank)
	if got := s.index.GroupBlocks("g0"); got != 3 {
		t.Errorf("the index holds %d blocks of g0, want the rank's 3 (11, 12, 13)", got)
	}
	if r := s.index.Resyncing(); len(r) != 0 {
		t.Errorf("resyncing %v: the second process's seqs made a gap", r)
	}

	// A dump request reaches both processes; the second answers first.
	dump := func(started int64, delay time.Duration, hashes ...uint64) {
		data, err := messages.Marshal(&messages.KVEventBatch{Group: "g0", Rank: 0, Seq: 2, StartedUnixMs: started,
			Events: []messages.KVEvent{clearedAll(), stored(hashes...)}})
		if err != nil {
			t.Fatal(err)
		}
		sub, err := nc.Subscribe(s.cfg.Subjects.Dump("g0", 0), func(m *nats.Msg) {
			time.Sleep(delay)
			_ = m.Respond(data)
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Unsubscribe() })
	}
	dump(older, 0, 98, 99)
	dump(rank, 50*time.Millisecond, 11, 12, 13)
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	got, _, err := s.fetchDump(t.Context(), "g0", 0)
	if err != nil {
		t.Fatal(err)
	}
	if got.StartedUnixMs != rank || dumpBlocks(got) != 3 {
		t.Errorf("took the dump of the process started at %d with %d blocks; want the rank's (%d), with 3", got.StartedUnixMs, dumpBlocks(got), rank)
	}
}

// TestReconnectIsNoGroupFailure: a replica cut off from NATS for longer
// than the heartbeat timeout heard no heartbeat meanwhile. Back, it must
// not take its own silence for the groups': the request in flight on g0
// stays there (it was withdrawn as group_failed while g0's ranks finished
// it, and every request in flight failed at a NATS restart). A group still
// silent a heartbeat timeout after the reconnect has failed.
func TestReconnectIsNoGroupFailure(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	holding(s, "g0")
	holding(s, "g1")
	heard(s, "g0", now.Add(-5*time.Second), 0) // before the cut
	heard(s, "g1", now, 0)
	tr := promptTracker("inflight", 4)
	tr.Group, tr.WorldSize, tr.Deadline = "g0", 1, now.Add(time.Minute)
	s.trackers.add(tr)
	// The connection reconnected since the last sweep (the count a sweep
	// compares with was from before).
	s.reconnects = s.cfg.Conn.Stats().Reconnects + 1
	s.sweep(t.Context(), now)
	if !s.trackers.has("inflight") {
		t.Fatal("the request on g0 was withdrawn at the reconnect: this replica's silence was taken for g0's")
	}
	var group string
	s.trackers.update("inflight", func(t *RequestTracker) { group = t.Group })
	if group != "g0" {
		t.Errorf("the request moved to %s at the reconnect; want it left on g0", group)
	}
	// g0 stays silent a heartbeat timeout after the reconnect, while g1
	// is heard: g0 failed, and the request moves.
	later := now.Add(2 * s.cfg.HeartbeatTimeout)
	heard(s, "g1", later, 0)
	s.sweep(t.Context(), later)
	s.trackers.update("inflight", func(t *RequestTracker) { group = t.Group })
	if group == "g0" && s.trackers.has("inflight") {
		t.Error("g0, silent for two heartbeat timeouts after the reconnect, still holds the request")
	}
}

// TestStalledBusIsNoGroupFailure: a NATS server that stalls (SIGSTOP for
// 5 s in a review, a VM paused) keeps every connection open, so nothing
// says the replica is cut off; it hears nothing, its own announcement
// included, then everything at once. Its sweep took the silence for every
// group's and peer's: 8 requests ended group_failed (2 streams cut) and
// both replicas adopted each other's requests, while the workers finished
// them all. Now a replica that has not heard its own announcement back
// judges nothing, and once the bus delivers again every rank gets a
// heartbeat timeout from then, as after a reconnect.
func TestStalledBusIsNoGroupFailure(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	holding(s, "g0")
	holding(s, "g1")
	before := now.Add(-5 * time.Second) // the stall began
	heard(s, "g0", before, 0)
	heard(s, "g1", before, 0)
	s.selfHeard.Store(before.UnixNano())
	tr := promptTracker("inflight", 4)
	tr.Group, tr.WorldSize, tr.Deadline = "g0", 1, now.Add(time.Minute)
	s.trackers.add(tr)
	group := func() string {
		var g string
		s.trackers.update("inflight", func(t *RequestTracker) { g = t.Group })
		return g
	}
	// Still stalled: nothing is judged.
	s.sweep(t.Context(), now)
	if !s.trackers.has("inflight") || group() != "g0" {
		t.Fatal("the request on g0 was withdrawn while the bus delivered nothing: the replica took its own deafness for g0's silence")
	}
	// The bus delivers again: this replica's announcement, then g1's
	// heartbeat; g0's is still in the queue.
	back := now.Add(100 * time.Millisecond)
	s.selfHeard.Store(back.UnixNano())
	heard(s, "g1", back, 0)
	s.sweep(t.Context(), back.Add(100*time.Millisecond))
	if !s.trackers.has("inflight") || group() != "g0" {
		t.Fatalf("the request was withdrawn from g0 (now on %q) as the stalled bus came back", group())
	}
	// g0 stays silent two heartbeat timeouts after: it failed.
	later := back.Add(2 * s.cfg.HeartbeatTimeout)
	s.selfHeard.Store(later.UnixNano())
	heard(s, "g1", later, 0)
	s.sweep(t.Context(), later)
	if group() == "g0" && s.trackers.has("inflight") {
		t.Error("g0, silent for two heartbeat timeouts after the bus came back, still holds the request")
	}
}

// TestBindingNotCreditedAfterTheGroupLostItsCache: a session's previous
// turn is credited to the group it ran on (its binding) until a rank of that
// group loses what it held — a restarted engine or worker process clears its
// store — after which only what the index holds counts. The binding kept
// steering the next turn to an engine that had restarted empty, credited
// with the whole previous prompt.
func TestBindingNotCreditedAfterTheGroupLostItsCache(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	tr := promptTracker("r1", 12)
	holding(s, "g0")
	holding(s, "g1")
	heard(s, "g0", now, 0)
	heard(s, "g1", now, 0)
	binding := Binding{Group: "g0", Blocks: 10, LastHash: tr.BlockHashes[9], Turn: 1, UpdatedUnixMs: now.Add(-time.Second).UnixMilli()}
	credit := func() int {
		t.Helper()
		groups := s.PlaceableGroups(time.Now())
		if _, err := s.place(tr, groups, binding, true); err != nil {
			t.Fatal(err)
		}
		for _, g := range groups {
			if g.Name == "g0" {
				return g.CachedBlocks
			}
		}
		t.Fatal("g0 is not placeable")
		return 0
	}
	if n := credit(); n != 10 {
		t.Fatalf("before any loss g0 is credited %d blocks, want the binding's 10", n)
	}
	// g0's only rank restarts: its first batch clears its store.
	s.index.Apply(kvBatch("g0", 0, 1, clearedAll()))
	if n := credit(); n != 0 {
		t.Errorf("after g0 lost its cache it is credited %d blocks, want 0", n)
	}
	// A binding made after the loss (the next turn ran there again) counts.
	binding.UpdatedUnixMs = time.Now().Add(time.Millisecond).UnixMilli()
	if n := credit(); n != 10 {
		t.Errorf("a binding newer than the loss is credited %d blocks, want 10", n)
	}
}

// TestBindingCreditEndsWhenTheIndexKnows: the session's binding credits
// its group with the previous turn's blocks while the ranks' KV events may
// not have told the index (within PlanTTL of that turn). Later the index
// knows, and it says g0 evicted them: the next turn goes to the idle g1,
// not behind g0's queue to prefill all 12 blocks there.
func TestBindingCreditEndsWhenTheIndexKnows(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	tr := promptTracker("r1", 12)
	s.index.ObserveRank("g0", 0, 1, 1, 0)
	s.index.ApplyDump("g0", 0, kvDump("g0", 0, 1, tr.BlockHashes[:10]...)) // turn 1's blocks stored
	s.index.Apply(kvBatch("g0", 0, 2, removed(tr.BlockHashes[:10]...)))    // and evicted
	holding(s, "g1")
	heard(s, "g0", now, 8*16)
	heard(s, "g1", now, 0)
	if n := s.index.GroupBlocks("g0"); n != 0 {
		t.Fatalf("index: g0 holds %d blocks, want 0 (the setup did not evict them)", n)
	}
	for _, tc := range []struct {
		age  time.Duration
		want string
	}{
		{time.Second, "g0"}, // the events may be on their way: credited
		{time.Minute, "g1"},
	} {
		binding := Binding{Group: "g0", Blocks: 10, LastHash: tr.BlockHashes[9], Turn: 1, UpdatedUnixMs: now.Add(-tc.age).UnixMilli()}
		tr := promptTracker("r1", 12)
		if g, err := s.place(tr, s.PlaceableGroups(now), binding, true); err != nil || g != tc.want {
			t.Errorf("a turn %v after its previous one, whose blocks g0 evicted: placed on %s (err %v, LoadSpec %d blocks); want %s",
				tc.age, g, err, tr.LoadBlocks, tc.want)
		}
	}
}

// TestAbortInTheLogCountsItsOutcome: a request its client gave up on while
// it waited in the request log counts in kvbus_scheduler_requests_total as
// aborted (timeout when the frontend's deadline passed) when the log
// delivers it, once, as a request aborted after its dispatch does; a
// redelivery of it is a duplicate. Before, each counted as a duplicate, and
// a backlog's client aborts showed as redeliveries, not as aborts.
func TestAbortInTheLogCountsItsOutcome(t *testing.T) {
	s, _ := newBareScheduler(t)
	b, _ := openTestBindings(t)
	s.bindings.Store(b)
	holding(s, "g0")
	heard(s, "g0", time.Now(), 0)
	for id, reason := range map[string]string{"gone": messages.AbortReasonClientGone, "late": messages.AbortReasonTimeout} {
		sendAbort(t, s, id, reason)
	}
	for _, id := range []string{"gone", "late", "gone"} {
		if err := s.onRequest(context.Background(), requestMsg(t, id)); err != nil {
			t.Fatal(err)
		}
	}
	checkOutcomes(t, s, map[string]float64{"aborted": 1, "timeout": 1, "duplicate": 1, "dispatched": 0})
}

// abortingPolicy places every request on its group, after running abort
// (a client that gives up while its request is placed).
type abortingPolicy struct {
	group string
	abort func(id string)
}

func (p abortingPolicy) Place(t *RequestTracker, _ []GroupState) (string, error) {
	p.abort(t.ReqID)
	return p.group, nil
}

// TestAbortWhilePlacedAnnouncesNoPlan: a request whose client gives up
// while the scheduler places it is not dispatched, announces no save plan
// (nothing will save its blocks) and counts as aborted. Before, its plan
// credited its group with its prompt's blocks for --plan-ttl, so the
// session's next request was told to load blocks never saved, and the
// request counted under no outcome.
func TestAbortWhilePlacedAnnouncesNoPlan(t *testing.T) {
	s, nc := newBareScheduler(t)
	b, _ := openTestBindings(t)
	s.bindings.Store(b)
	holding(s, "g0")
	heard(s, "g0", time.Now(), 0)
	s.cfg.Policy = abortingPolicy{group: "g0", abort: func(id string) { sendAbort(t, s, id, messages.AbortReasonClientGone) }}
	plans := make(chan *nats.Msg, 4)
	sub, err := nc.ChanSubscribe(s.cfg.Subjects.Plan(s.cfg.ID), plans)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	msg := requestMsg(t, "gone")
	if err := s.onRequest(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
	if !msg.acked {
		t.Error("request not acknowledged")
	}
	if n := s.index.Plans(); n != 0 {
		t.Errorf("%d (group, block) save plans in the index for a request aborted before its dispatch, want 0", n)
	}
	select {
	case m := <-plans:
		if p, err := messages.DecodeSavePlan(m.Data); err == nil && p.ReqID == "gone" {
			t.Errorf("a save plan announced for the aborted request: %d blocks", len(p.BlockHashes))
		}
	case <-time.After(200 * time.Millisecond):
	}
	checkOutcomes(t, s, map[string]float64{"aborted": 1})
}

// TestAbortOutcomeByReason: a dispatched request counts `aborted` only
// when nobody waits for it (its client went away, its frontend stopped),
// `timeout` when its deadline passed, and `withdrawn` when its frontend
// gave it up for a copy it published again. Before, every Abort counted
// `aborted`: the copies a NATS failover made the frontend give up looked
// like clients that went away.
func TestAbortOutcomeByReason(t *testing.T) {
	s, _ := newBareScheduler(t)
	b, _ := openTestBindings(t)
	s.bindings.Store(b)
	holding(s, "g0")
	heard(s, "g0", time.Now(), 0)
	reasons := map[string]string{
		"gone":    messages.AbortReasonClientGone,
		"stopped": messages.AbortReasonFrontendStopped,
		"late":    messages.AbortReasonTimeout + ": no answer within 10s",
		"copy":    "answer lost on the bus; asked again as copy-again1",
	}
	for id, reason := range reasons {
		if err := s.onRequest(context.Background(), requestMsg(t, id)); err != nil {
			t.Fatal(err)
		}
		sendAbort(t, s, id, reason)
	}
	checkOutcomes(t, s, map[string]float64{"dispatched": 4, "aborted": 2, "timeout": 1, "withdrawn": 1})
}

// checkOutcomes checks kvbus_scheduler_requests_total by outcome.
func checkOutcomes(t *testing.T, s *Scheduler, want map[string]float64) {
	t.Helper()
	for outcome, n := range want {
		if got := counterValue(t, s.m.requests.WithLabelValues(outcome)); got != n {
			t.Errorf("kvbus_scheduler_requests_total{outcome=%q} = %v, want %v", outcome, got, n)
		}
	}
}

// counterValue returns c's value.
func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// requestMsg is the request log's delivery of a 40-token request id.
func requestMsg(t *testing.T, id string) *ackMsg {
	t.Helper()
	data, err := messages.Marshal(&messages.Request{RequestID: id, FrontendID: "fe", Model: "m",
		ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: make([]uint32, 40)})
	if err != nil {
		t.Fatal(err)
	}
	return &ackMsg{data: data}
}

// sendAbort hands s a frontend's Abort of id.
func sendAbort(t *testing.T, s *Scheduler, id, reason string) {
	t.Helper()
	data, err := messages.Marshal(&messages.Abort{ReqID: id, Reason: reason})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.onAbort(context.Background(), &nats.Msg{Data: data}); err != nil {
		t.Fatal(err)
	}
}

// TestPlaceReadsOnlyFromGroupsOfItsWorldSize: a rank copies a run from the
// same tp_rank of its source, so a group reads the pool only from groups of
// its own world size. A 2-rank group's blocks were planned as reads for a
// 1-rank group (with real processes, a tp 2 group reading from a tp 4
// group: every block failed verification, the turn found none of its 720
// cached tokens, and the cost had counted them).
func TestPlaceReadsOnlyFromGroupsOfItsWorldSize(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	tr := promptTracker("r3", 20)
	holding(s, "g0")
	for r := range 2 {
		s.index.ObserveRank("g1", r, 2, 1, 0)
		s.index.ApplyDump("g1", r, kvDump("g1", r, 1, tr.BlockHashes[:10]...))
		s.groups.observe(&messages.Heartbeat{Group: "g1", TPRank: r, WorldSize: 2, StartedUnixMs: 1, QueuedPrefillTokens: 50 * 16}, now)
	}
	heard(s, "g0", now, 0)
	groups := s.PlaceableGroups(now)
	if len(groups) != 2 {
		t.Fatalf("placeable groups = %+v, want g0 and g1", groups)
	}
	g, err := s.place(tr, groups, Binding{}, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, gs := range groups {
		if gs.Name == "g0" && gs.RemoteBlocks != 0 {
			t.Errorf("g0 (1 rank) counts %d blocks readable from g1 (2 ranks), want 0", gs.RemoteBlocks)
		}
	}
	if g == "g0" && (len(tr.Remote) != 0 || tr.LoadBlocks != 0) {
		t.Errorf("LoadSpec on g0: remote %+v, %d blocks loaded; want none: g1's ranks hold other shards", tr.Remote, tr.LoadBlocks)
	}
}

// TestResultLostAcrossAReconnectIsAskedAgain: a rank heard from before a
// NATS restart whose result was published across it (lost: the server
// died, or the scheduler had not subscribed again yet) is sent the ReqMeta
// again after the reconnect, and answers with its result again. The
// request waited for its deadline instead, its client long answered by the
// driver: with real processes, 3 requests held a replica's trackers, and
// their group's load, for the 30 s request timeout after a NATS restart,
// and then counted as timeouts.
func TestResultLostAcrossAReconnectIsAskedAgain(t *testing.T) {
	s, nc := newBareScheduler(t)
	now := time.Now()
	for r := range 2 {
		s.index.ObserveRank("g0", r, 2, 1, 0)
		s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: r, WorldSize: 2, StartedUnixMs: 1}, now)
	}
	sub, err := nc.SubscribeSync("test.meta.lost")
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	tr := promptTracker("lost", 4)
	tr.Group, tr.WorldSize, tr.Deadline, tr.Prefilled = "g0", 2, now.Add(time.Minute), true
	tr.Dispatched, tr.metaSubj, tr.metaData = now, "test.meta.lost", []byte("meta")
	tr.Heard = map[int]int64{0: 1, 1: 1} // both ranks took it before the cut
	tr.Results[0] = &messages.RankResult{ReqID: "lost", Group: "g0", TPRank: 0}
	s.trackers.add(tr)
	s.reconnects = s.cfg.Conn.Stats().Reconnects + 1 // a reconnect since the last sweep
	for i := range 4 {
		at := now.Add(time.Duration(i) * s.cfg.ResendAfter / 2)
		for r := range 2 {
			s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: r, WorldSize: 2, StartedUnixMs: 1}, at)
		}
		s.sweep(t.Context(), at)
	}
	if _, err := sub.NextMsg(time.Second); err != nil {
		t.Errorf("rank 1's result, lost across the reconnect, was not asked for again (%v): the request waits for its deadline", err)
	}
	if !s.trackers.has("lost") {
		t.Error("the request ended without rank 1's result")
	}
}

// TestNewReplicaWaitsForTheGroupsItHeardInPart: a replica that just
// started hears a group's driver at once (it sends a heartbeat at every
// prefill) but its other ranks only at their next heartbeat, up to a
// heartbeat interval later. Until then the group is not ready, and a
// conversation whose prefix it holds had its next turn placed on another
// group, with nothing to load (a review, every role its own process: a
// second scheduler started while 7 clients ran, turn 8 of a conversation
// found 0 of 608 tokens 0.7 s later). Within the heartbeat timeout of its
// start, a request waits (within UnsyncedWait) while a group is heard in
// part.
func TestNewReplicaWaitsForTheGroupsItHeardInPart(t *testing.T) {
	s, _ := newBareScheduler(t)
	b, _ := openTestBindings(t)
	s.bindings.Store(b)
	now := time.Now()
	holding(s, "g0")
	heard(s, "g0", now, 0)
	s.groups.observe(&messages.Heartbeat{Group: "g1", TPRank: 0, WorldSize: 2, StartedUnixMs: 1}, now)
	m := requestMsg(t, "r1")
	if err := s.onRequest(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if m.acked {
		t.Fatal("placed while g1's rank 1 was not heard yet since the replica started: want it to wait")
	}
	s.groups.observe(&messages.Heartbeat{Group: "g1", TPRank: 1, WorldSize: 2, StartedUnixMs: 1}, time.Now())
	for r := range 2 { // the dumps its heartbeats asked for
		s.index.ObserveRank("g1", r, 2, 1, 0)
		s.index.ApplyDump("g1", r, kvDump("g1", r, 1))
	}
	if err := s.onRequest(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if !m.acked {
		t.Fatal("not placed once every group was heard in full")
	}
	// Past the heartbeat timeout of the start, a group missing a rank is a
	// failure, not one forming: nothing waits for it.
	s.started = time.Now().Add(-2 * s.cfg.HeartbeatTimeout)
	s.groups.observe(&messages.Heartbeat{Group: "g2", TPRank: 0, WorldSize: 2, StartedUnixMs: 1}, time.Now())
	m2 := requestMsg(t, "r2")
	if err := s.onRequest(context.Background(), m2); err != nil {
		t.Fatal(err)
	}
	if !m2.acked {
		t.Error("a long-running replica held a request back for a group missing a rank")
	}
}

// TestNewReplicaWaitsForTheGroupsItHasNotSynced: a replica that just
// started asks each rank for a dump when it first hears it, and places only
// on groups whose index is synced. Once one group's dumps were in, a
// request was placed at once, though another group, heard in full, had its
// dumps on the way: a conversation whose prefix that group held went to
// the synced one and loaded nothing (a review, every role its own process:
// a scheduler SIGKILLed and restarted at once and a second one added under
// 8 conversations; turn 7 of one found 0 of 1,008 tokens, placed on g0 2 ms
// before the new replica's last dump of g1, which held the prefix, came
// in). Within the heartbeat timeout of its start, a request waits (within
// UnsyncedWait) while a ready group's index is not synced yet.
func TestNewReplicaWaitsForTheGroupsItHasNotSynced(t *testing.T) {
	s, _ := newBareScheduler(t)
	b, _ := openTestBindings(t)
	s.bindings.Store(b)
	now := time.Now()
	holding(s, "g0")
	heard(s, "g0", now, 0)
	s.index.ObserveRank("g1", 0, 1, 1, 0) // its dump asked for, not in yet
	heard(s, "g1", now, 0)
	if n := len(s.index.placeable(s.groups.ready(now))); n != 1 {
		t.Fatalf("%d placeable groups, want 1 (g0 synced, g1 not): the fault did not take effect", n)
	}
	m := requestMsg(t, "r1")
	if err := s.onRequest(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if m.acked {
		t.Fatal("placed while g1's dump was not in yet since the replica started: want it to wait")
	}
	s.index.ApplyDump("g1", 0, kvDump("g1", 0, 1))
	if err := s.onRequest(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if !m.acked {
		t.Fatal("not placed once every ready group was synced")
	}
	// Past the heartbeat timeout of the start, a group resyncing is placed
	// around, as before: nothing waits for it.
	s.started = time.Now().Add(-2 * s.cfg.HeartbeatTimeout)
	s.index.ObserveRank("g2", 0, 1, 1, 0)
	heard(s, "g2", time.Now(), 0)
	m2 := requestMsg(t, "r2")
	if err := s.onRequest(context.Background(), m2); err != nil {
		t.Fatal(err)
	}
	if !m2.acked {
		t.Error("a long-running replica held a request back for a group whose index is resyncing")
	}
}

// TestPlaceKnowsAnotherReplicasPreviousTurnFromItsPlan: with two scheduler
// replicas, a session's previous turn was dispatched by s0 to g0, which is
// busy; the next turn reaches s1 before the session bucket's watcher tells
// s1 of that turn (the answer comes in milliseconds, the binding's write
// and its watch later). s1 learns the binding from s0's save plan, which
// left s0 before the answer did: it places the turn on the idle g1 and
// reads the previous turn's blocks from g0's save. Before, s1 knew only
// the bucket's binding (none here; in a review with every role its own
// process, two replicas and 60 conversations, the turn before's, on
// another group), took g0 for an ordinary busy group that is no source of
// what it saves, and 32-47 of 420 turns found only the turn before's
// prefix (e.g. 160 of 256 tokens).
func TestPlaceKnowsAnotherReplicasPreviousTurnFromItsPlan(t *testing.T) {
	s0, nc0 := newBareScheduler(t)
	s1, _ := newBareScheduler(t)
	s1.cfg.ID = "s1"
	for _, s := range []*Scheduler{s0, s1} {
		js, err := jetstream.New(embeddedConn(t))
		if err != nil {
			t.Fatal(err)
		}
		// Not run: no write reaches the bucket, no watcher tells s1.
		b, err := OpenSessionBindings(t.Context(), js, SessionBindingsConfig{Bucket: SessionBucket, TTL: time.Minute,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		s.bindings.Store(b)
	}
	now := time.Now()
	next := promptTracker("r4", 20) // the next turn: 20 blocks
	prev := promptTracker("r4", 20) // the previous turn: its first 14
	prev.ReqID, prev.TokenIDs, prev.TokenLen = "r4-prev", prev.TokenIDs[:14*16+1], 14*16+1
	prev.BlockHashes = prev.BlockHashes[:14]
	prev.Group, prev.LocalBlocks, prev.TurnDepth = "g0", 8, 1
	for _, s := range []*Scheduler{s0, s1} {
		holding(s, "g0", next.BlockHashes[:8]...)
		holding(s, "g1", next.BlockHashes[:8]...)
		heard(s, "g0", now, 40*16)
		heard(s, "g1", now, 0)
	}
	plans, err := nc0.SubscribeSync(s0.cfg.Subjects.Plan(s0.cfg.ID))
	if err != nil {
		t.Fatal(err)
	}
	s0.publishPlan(prev)
	m, err := plans.NextMsg(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := s1.onPlan(t.Context(), m); err != nil {
		t.Fatal(err)
	}
	binding, bound := s1.bindings.Load().GetModel(next.Model, next.SessionID)
	if !bound || binding.Group != "g0" || binding.Blocks != 14 || binding.Turn != 1 {
		t.Errorf("s1's binding of the session = %+v (bound %v), want g0, 14 blocks, turn 1: s0's plan said so", binding, bound)
	}
	g, err := s1.place(next, s1.PlaceableGroups(now), binding, bound)
	if err != nil {
		t.Fatal(err)
	}
	if g != "g1" || next.LoadBlocks != 14 {
		t.Errorf("placed on %s loading %d blocks (remote %+v); want g1 loading 14: the previous turn's, 6 of them from g0's save",
			g, next.LoadBlocks, next.Remote)
	}
}

// TestRequestsWaitForTheRanksBackAfterAReconnect: after a NATS restart
// every role reconnects on its own schedule (¼ s apart, with jitter). A
// replica back before a group's ranks placed requests there at once: the
// ranks not back yet missed the ReqMeta (core NATS), the driver answered,
// and though a resend reached them a second later they had not registered
// the request's saves, so the next turn, sent the moment the answer came,
// loaded none of those blocks there (a review, every role its own process,
// `kvbus nats` killed -9 and restarted under 16 streaming conversations:
// g1's ranks 1 and 3 reconnected 80 and 180 ms after the scheduler, and a
// conversation's turn 7 found 416 of 896 cached tokens). Within the
// heartbeat timeout of its reconnect, a request now waits (within
// UnsyncedWait) while a group has a rank not heard since the cut.
func TestRequestsWaitForTheRanksBackAfterAReconnect(t *testing.T) {
	s := longRunningReplica(t)
	now := time.Now()
	beat := func(rank int, at time.Time) {
		s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: rank, WorldSize: 2, StartedUnixMs: 1}, at)
	}
	before := now.Add(-2 * time.Second)
	for r := range 2 {
		beat(r, before)
		s.index.ObserveRank("g0", r, 2, 1, 0)
		s.index.ApplyDump("g0", r, kvDump("g0", r, 1))
	}
	// g1 died before the cut, and is not forgotten yet: no reason to wait.
	s.groups.observe(&messages.Heartbeat{Group: "g1", TPRank: 0, WorldSize: 1, StartedUnixMs: 1}, now.Add(-3*time.Minute))
	reconnect(t, s, before.Add(250*time.Millisecond), now.Add(-time.Second))
	if len(s.index.placeable(s.groups.ready(time.Now()))) != 1 {
		t.Fatal("g0 is not placeable after the reconnect: the fault did not take effect")
	}
	beat(0, time.Now()) // the driver is back; rank 1 not yet
	m := requestMsg(t, "r1")
	if err := s.onRequest(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if m.acked {
		t.Fatal("placed on g0 while its rank 1 was not heard since this replica's reconnect: want it to wait for the rank")
	}
	beat(1, time.Now())
	if err := s.onRequest(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if !m.acked {
		t.Fatal("not placed once every rank of g0 was heard again (g1, dead before the cut, held it?)")
	}
	// A rank that stays away holds no request past UnsyncedWait: its
	// retries are counted in its deliveries.
	reconnect(t, s, time.Now(), time.Now())
	beat(0, time.Now())
	late := &manyDeliveriesMsg{ackMsg: requestMsg(t, "r2"), n: uint64(s.cfg.UnsyncedWait/noGroupRetry) + 1}
	if err := s.onRequest(context.Background(), late); err != nil {
		t.Fatal(err)
	}
	if !late.acked {
		t.Error("a request that waited UnsyncedWait for a rank not back is still held")
	}
}

// longRunningReplica is a bare scheduler started an hour ago (no start-up
// wait), with session bindings and a heartbeat timeout no pause of a
// loaded test host outlasts.
func longRunningReplica(t *testing.T) *Scheduler {
	s, _ := newBareScheduler(t)
	s.cfg.HeartbeatTimeout, s.groups.timeout = time.Minute, time.Minute
	s.cfg.ForgetGroupAfter = time.Hour
	b, _ := openTestBindings(t)
	s.bindings.Store(b)
	s.started = time.Now().Add(-time.Hour)
	return s
}

// reconnect runs s's last sweep before a cut from NATS (at last), then
// the sweep that finds the connection reconnected (at back; the count it
// compares with was from before).
func reconnect(t *testing.T, s *Scheduler, last, back time.Time) {
	s.sweep(t.Context(), last)
	s.reconnects = s.cfg.Conn.Stats().Reconnects + 1
	s.sweep(t.Context(), back)
}

// manyDeliveriesMsg is a request delivered n times.
type manyDeliveriesMsg struct {
	*ackMsg
	n uint64
}

func (m *manyDeliveriesMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{NumDelivered: m.n, Timestamp: time.Now()}, nil
}

// TestAReconnectHoldsNoRequestForAnotherModelsRank: after a reconnect a
// request waits for the ranks not heard since the cut of the groups it
// may go to. A rank of a group of another model (one that died during the
// cut, or is slow back) held every request of every model, each up to
// UnsyncedWait, for the heartbeat timeout after the reconnect: a request
// of model m never goes to model other's ranks.
func TestAReconnectHoldsNoRequestForAnotherModelsRank(t *testing.T) {
	s := longRunningReplica(t)
	now := time.Now()
	beat := func(g, model string, rank int, at time.Time) {
		s.groups.observe(&messages.Heartbeat{Group: g, TPRank: rank, WorldSize: 2, StartedUnixMs: 1, Model: model}, at)
	}
	before := now.Add(-2 * time.Second)
	for _, g := range []struct{ name, model string }{{"g0", "m"}, {"g1", "other"}} {
		for r := range 2 {
			beat(g.name, g.model, r, before)
			s.index.ObserveRank(g.name, r, 2, 1, 0)
			s.index.ApplyDump(g.name, r, kvDump(g.name, r, 1))
		}
	}
	reconnect(t, s, before.Add(250*time.Millisecond), now.Add(-time.Second))
	// g0 (model m) is back in full; g1 (model other) has rank 1 still away.
	at := time.Now()
	beat("g0", "m", 0, at)
	beat("g0", "m", 1, at)
	beat("g1", "other", 0, at)
	m := requestMsg(t, "r1") // model m
	if err := s.onRequest(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if !m.acked {
		t.Error("a request of model m held for a rank of model other's group not back since the reconnect")
	}
	// A rank of its own model's group still holds it.
	beat("g0", "m", 0, time.Now())
	s.sweep(t.Context(), time.Now())
	s.reconnects = s.cfg.Conn.Stats().Reconnects + 1
	s.sweep(t.Context(), time.Now())
	beat("g0", "m", 0, time.Now())
	beat("g1", "other", 0, time.Now())
	beat("g1", "other", 1, time.Now())
	m2 := requestMsg(t, "r2")
	if err := s.onRequest(context.Background(), m2); err != nil {
		t.Fatal(err)
	}
	if m2.acked {
		t.Error("placed while g0's rank 1 was not heard since the reconnect")
	}
}
