package scheduler

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

func hb(group string, rank, worldSize int) *messages.Heartbeat {
	return &messages.Heartbeat{Group: group, TPRank: rank, EPRank: rank, WorldSize: worldSize, StartedUnixMs: 1}
}

func readyNames(gs []GroupState) []string {
	var out []string
	for _, g := range gs {
		out = append(out, g.Name)
	}
	return out
}

func TestGroupTableReady(t *testing.T) {
	const timeout = 3 * time.Second
	t0 := time.Unix(1_700_000_000, 0)
	type step struct {
		name    string
		observe []*messages.Heartbeat // at now
		now     time.Duration         // since t0
		want    []string              // ready groups
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"ready only when every rank reported", []step{
			{"no heartbeat", nil, 0, nil},
			{"rank 0 of 2", []*messages.Heartbeat{hb("g0", 0, 2)}, 0, nil},
			{"rank 0 again", []*messages.Heartbeat{hb("g0", 0, 2)}, time.Second, nil},
			{"rank 1 too", []*messages.Heartbeat{hb("g0", 1, 2)}, time.Second, []string{"g0"}},
		}},
		{"a stale rank makes the group not ready", []step{
			{"both ranks", []*messages.Heartbeat{hb("g0", 0, 2), hb("g0", 1, 2)}, 0, []string{"g0"}},
			{"at the timeout still fresh", nil, timeout, []string{"g0"}},
			{"past the timeout", nil, timeout + time.Millisecond, nil},
			{"rank 1 comes back alone", []*messages.Heartbeat{hb("g0", 1, 2)}, 4 * time.Second, nil},
			{"rank 0 too", []*messages.Heartbeat{hb("g0", 0, 2)}, 5 * time.Second, []string{"g0"}},
			{"rank 1 goes stale first", []*messages.Heartbeat{hb("g0", 0, 2)}, 7500 * time.Millisecond, nil},
		}},
		{"world size change resets the ranks", []step{
			{"group of 2", []*messages.Heartbeat{hb("g0", 0, 2), hb("g0", 1, 2)}, 0, []string{"g0"}},
			{"rank 0 now says 3", []*messages.Heartbeat{hb("g0", 0, 3)}, time.Second, nil},
			{"rank 1 of 3", []*messages.Heartbeat{hb("g0", 1, 3)}, time.Second, nil},
			{"rank 2 of 3", []*messages.Heartbeat{hb("g0", 2, 3)}, time.Second, []string{"g0"}},
			{"shrunk to 1", []*messages.Heartbeat{hb("g0", 0, 1)}, 2 * time.Second, []string{"g0"}},
		}},
		{"groups are independent and sorted by name", []step{
			{"b ready", []*messages.Heartbeat{hb("b", 0, 1)}, 0, []string{"b"}},
			{"a half", []*messages.Heartbeat{hb("a", 0, 2)}, 0, []string{"b"}},
			{"a full, c ready", []*messages.Heartbeat{hb("a", 1, 2), hb("c", 0, 1)}, 0, []string{"a", "b", "c"}},
			{"b goes stale", []*messages.Heartbeat{hb("a", 0, 2), hb("a", 1, 2), hb("c", 0, 1)}, 4 * time.Second, []string{"a", "c"}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			gt := newGroupTable(timeout, 16, 0.25, 0.5)
			for _, st := range tt.steps {
				now := t0.Add(st.now)
				for _, h := range st.observe {
					gt.observe(h, now)
				}
				if got := readyNames(gt.ready(now)); !slices.Equal(got, st.want) {
					t.Fatalf("%s: ready = %v, want %v", st.name, got, st.want)
				}
			}
		})
	}
}

func TestGroupTableState(t *testing.T) {
	gt := newGroupTable(time.Second, 16, 0.25, 0.5)
	now := time.Now()
	for r, depth := range []int{3, 7, 1} {
		h := hb("g0", r, 3)
		h.QueueDepth = depth
		gt.observe(h, now)
	}
	gt.addInflight("g0", 2, 0)
	gt.addInflight("g0", 3, 0)
	gt.addInflight("g0", -1, 0)
	gt.addInflight("unknown", 5, 0) // ignored, no panic
	got := gt.ready(now)
	want := []GroupState{{Name: "g0", WorldSize: 3, Inflight: 4, QueueDepth: 7}}
	if !slices.Equal(got, want) {
		t.Errorf("ready = %+v, want %+v", got, want)
	}
}

// TestGroupTableLoadIsClusterWide: the load a replica sees is the driver's
// last report (which counts every replica's requests) plus this replica's
// changes since; a driver heartbeat replaces the changes it has seen.
func TestGroupTableLoadIsClusterWide(t *testing.T) {
	gt := newGroupTable(time.Second, 16, 0.25, 0.5)
	now := time.Now()
	driver := func(inflight int, queuedTokens int64) {
		h := hb("g0", 0, 2)
		h.InflightRequests, h.QueuedPrefillTokens = inflight, queuedTokens
		gt.observe(h, now)
	}
	gt.observe(hb("g0", 1, 2), now)
	check := func(step string, inflight, queued int) {
		t.Helper()
		got := gt.ready(now)
		if len(got) != 1 || got[0].Inflight != inflight || got[0].QueuedBlocks != queued {
			t.Errorf("%s: ready = %+v, want inflight %d, queued blocks %d", step, got, inflight, queued)
		}
	}
	driver(5, 100) // another replica's requests: 100 tokens = 7 blocks
	check("driver report", 5, 7)
	gt.addInflight("g0", 2, 10)
	check("+2 dispatched here", 7, 17)
	gt.addInflight("g0", -1, -3)
	check("one done here", 6, 14)
	driver(6, 0)
	check("next driver report replaces the local changes", 6, 0)
	gt.addInflight("g0", -10, -10)
	check("never below zero", 0, 0)
	gt.observe(hb("g0", 1, 2), now) // a non-driver heartbeat changes nothing
	check("non-driver heartbeat", 0, 0)
	// Loads hold the engine too: 160 local tokens (10 blocks) at 0.25 of a
	// block's prefill and 320 remote (20 blocks) at 0.5 add 2.5 + 10 blocks.
	h := hb("g0", 0, 2)
	h.InflightRequests, h.QueuedPrefillTokens, h.QueuedLoadTokens, h.QueuedRemoteLoadTokens = 2, 32, 160, 320
	gt.observe(h, now)
	check("loads queued", 2, 2+13)
}

// TestGroupTableTakesOffTheHeadsProgress: once a group's pace is learnt
// from its prefills, the work its engine has done on the prefill at the
// head of its queue comes off the queue — up to that prefill's blocks, so
// an engine stuck on one never looks idle.
func TestGroupTableTakesOffTheHeadsProgress(t *testing.T) {
	gt := newGroupTable(time.Second, 16, 0.25, 0.5)
	now := time.Now()
	ms := time.Millisecond
	gt.observe(hb("g0", 1, 2), now)
	driver := func(at time.Time, prefillingUs int64) {
		h := hb("g0", 0, 2)
		// 100 blocks queued; the head is 30 of them, on the engine for prefillingUs.
		h.InflightRequests, h.QueuedPrefillTokens, h.PrefillingTokens, h.PrefillingUs = 4, 1600, 480, prefillingUs
		gt.observe(h, at)
	}
	queued := func(at time.Time) int {
		t.Helper()
		got := gt.ready(at)
		if len(got) != 1 {
			t.Fatalf("ready = %+v", got)
		}
		return got[0].QueuedBlocks
	}
	driver(now, 5000)
	if q := queued(now.Add(10 * ms)); q != 100 {
		t.Errorf("pace unknown: %d blocks queued, want all 100", q)
	}
	gt.observePrefill("g0", 10, 10_000) // 10 blocks in 10 ms: 1 ms a block
	for _, tc := range []struct {
		after time.Duration
		want  int
	}{
		{0, 95},       // 5 ms on the head at the heartbeat
		{10 * ms, 85}, // and 10 ms since
		{40 * ms, 70}, // the head's 30 blocks at most
	} {
		if q := queued(now.Add(tc.after)); q != tc.want {
			t.Errorf("%v after the heartbeat: %d blocks queued, want %d", tc.after, q, tc.want)
		}
	}
	// This replica's own dispatches are not worked off: they may not have
	// reached the engine.
	gt.addInflight("g0", 1, 7)
	if q := queued(now.Add(40 * ms)); q != 77 {
		t.Errorf("with 7 blocks dispatched here: %d queued, want 77", q)
	}
	// The pace moves towards new prefills: 1 ms + 0.2 × (2 ms − 1 ms).
	gt.observePrefill("g0", 10, 20_000)
	gt.observePrefill("unknown", 10, 20_000) // ignored
	driver(now, 0)
	if q := queued(now.Add(12 * ms)); q != 90 {
		t.Errorf("at 1.2 ms a block, 12 ms into the head: %d queued, want 90", q)
	}
}

// TestGroupTableRestartsAndDuplicates: a rank's later started_unix_ms is a
// restart, recorded when heard; an earlier one while the rank's process is
// heard from is a second, older process claiming the same rank: its
// heartbeats are not the rank's (no restart, no liveness), reported once a
// minute, not on every heartbeat.
func TestGroupTableRestartsAndDuplicates(t *testing.T) {
	gt := newGroupTable(time.Second, 16, 0.25, 0.5)
	var gap time.Duration
	beat := func(started int64, at time.Time) (stale, report bool) {
		h := hb("g0", 0, 1)
		h.StartedUnixMs = started
		stale, report, gap = gt.observe(h, at)
		return stale, report
	}
	t0 := time.Now()
	beat(100, t0)
	if r := gt.restarts(); r != nil {
		t.Fatalf("first heartbeat counted as a restart: %v", r)
	}
	t1 := t0.Add(time.Second)
	beat(200, t1)
	if at := gt.restarts()["g0"][0].at; !at.Equal(t1) {
		t.Fatalf("restart heard at %v, want %v", at, t1)
	}
	if gap != 0 {
		t.Errorf("gap %v across a restart, want none", gap)
	}
	if stale, report := beat(100, t1.Add(100*time.Millisecond)); !stale || !report {
		t.Errorf("the older process's heartbeat: stale %v report %v, want both", stale, report)
	}
	if stale, report := beat(100, t1.Add(200*time.Millisecond)); !stale || report {
		t.Errorf("again within a minute: stale %v report %v, want stale, not reported", stale, report)
	}
	if stale, _ := beat(200, t1.Add(300*time.Millisecond)); stale {
		t.Error("the newer process's heartbeat is stale")
	}
	// The gap is between one process's heartbeats: not across a restart,
	// not from the older process's.
	if gap != 300*time.Millisecond {
		t.Errorf("gap %v after the newer process's heartbeats 300 ms apart, want 300ms", gap)
	}
	if at := gt.restarts()["g0"][0].at; !at.Equal(t1) {
		t.Errorf("after the older process's heartbeats: restart at %v, want still %v", at, t1)
	}
	gt.reconnected(t1.Add(time.Minute), t1) // cut off from NATS until then
	beat(200, t1.Add(2*time.Minute))
	if gap != time.Minute {
		t.Errorf("gap %v a minute after this replica reconnected, want 1m0s (its outage is not the rank's)", gap)
	}
	if _, report := beat(100, t1.Add(2*time.Minute+100*time.Millisecond)); !report {
		t.Error("not reported again after a minute")
	}
}

// TestGroupTableRankBackWithAnEarlierStart: a rank's new process whose
// started_unix_ms is below the old one's (its host's clock is behind, or
// of two processes given one rank the newer exited) is the rank once the
// process that outranked it is silent for the timeout.
func TestGroupTableRankBackWithAnEarlierStart(t *testing.T) {
	gt := newGroupTable(3*time.Second, 16, 0.25, 0.5)
	beat := func(rank int, started int64, at time.Time) (stale bool) {
		h := hb("g0", rank, 2)
		h.StartedUnixMs = started
		stale, _, _ = gt.observe(h, at)
		return stale
	}
	t0 := time.Now()
	beat(0, 1_000_000, t0)
	beat(1, 1_000_000, t0) // then it crashes
	if !beat(1, 996_000, t0.Add(time.Second)) {
		t.Error("an earlier start while the rank's process is heard from is not stale")
	}
	for i := 4; i <= 10; i++ { // the old process is silent past the timeout
		at := t0.Add(time.Duration(i) * time.Second)
		beat(0, 1_000_000, at)
		if beat(1, 996_000, at) {
			t.Fatalf("%d s after the old process's last heartbeat, the new one is still stale", i)
		}
	}
	if got := readyNames(gt.ready(t0.Add(10*time.Second + 100*time.Millisecond))); len(got) != 1 {
		t.Errorf("ready groups with rank 1 back: %v, want [g0]", got)
	}
	if rs := gt.restarts()["g0"][1]; rs.started != 996_000 {
		t.Errorf("the new process is not recorded as a restart: %+v", rs)
	}
}

// TestGroupTableStatusMatchesItsRanks drives a group table through random
// heartbeats (world sizes, failing health checks, drains, two models, an
// older second process, reconnects, time passing) and checks after every
// step that ready, sources and alive say what a walk over every rank's last
// heartbeat says: the per-group status kept by observe is only a cache.
func TestGroupTableStatusMatchesItsRanks(t *testing.T) {
	const timeout = 3 * time.Second
	rng := rand.New(rand.NewPCG(7, 7))
	t0 := time.Unix(1_700_000_000, 0)
	gt := newGroupTable(timeout, 16, 0.25, 0.5)
	now := t0
	names := []string{"g0", "g1", "g2", "g3", "g4"}
	sizes := map[string]int{}
	for step := range 20_000 {
		switch k := rng.IntN(100); {
		case k < 80:
			g := names[rng.IntN(len(names))]
			if sizes[g] == 0 || rng.IntN(50) == 0 {
				sizes[g] = 1 + rng.IntN(4)
			}
			h := hb(g, rng.IntN(sizes[g]), sizes[g])
			h.StartedUnixMs = 1 + int64(rng.IntN(3)) // now and then an older or newer process
			h.NotReady = rng.IntN(20) == 0
			h.Draining = rng.IntN(20) == 0
			h.QueueDepth = rng.IntN(5)
			h.Model = []string{"a", "a", "a", "b"}[rng.IntN(4)]
			gt.observe(h, now)
		case k < 99:
			now = now.Add(time.Duration(rng.IntN(400)) * time.Millisecond)
		default:
			gt.reconnected(now, now)
		}
		if want, got := walkReady(gt, now), gt.ready(now); !slices.Equal(got, want) {
			t.Fatalf("step %d: ready = %+v, want %+v", step, got, want)
		}
		wantSources, wantAlive := walkAlive(gt, now)
		if got := gt.sources(now); !slices.Equal(got, wantSources) {
			t.Fatalf("step %d: sources = %v, want %v", step, got, wantSources)
		}
		if got := gt.alive(now); !maps.Equal(got, wantAlive) {
			t.Fatalf("step %d: alive = %v, want %v", step, got, wantAlive)
		}
	}
}

// walkReady is groupTable.ready computed from every rank's last heartbeat.
func walkReady(t *groupTable, now time.Time) []GroupState {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]GroupState, 0, len(t.order))
	for _, g := range t.order {
		alive, depth, draining := 0, 0, false
		model, mixed := "", false
		for _, r := range g.ranks {
			if t.heardLocked(r.seen, now) && !r.notReady {
				alive++
				depth = max(depth, r.queueDepth)
				draining = draining || r.draining
				if alive > 1 && r.model != model {
					mixed = true
				}
				model = r.model
			}
		}
		if alive == g.worldSize && !draining && !mixed {
			inflight, queued := g.load(now)
			out = append(out, GroupState{Name: g.name, Model: model, WorldSize: g.worldSize, Inflight: inflight, QueuedBlocks: queued, QueueDepth: depth})
		}
	}
	return out
}

// walkAlive is groupTable.sources (sorted) and alive computed from every
// rank's last heartbeat.
func walkAlive(t *groupTable, now time.Time) ([]string, map[string]bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var sources []string
	alive := map[string]bool{}
	for _, g := range t.order {
		n := 0
		for _, r := range g.ranks {
			if t.heardLocked(r.seen, now) && !r.notReady {
				n++
			}
		}
		alive[g.name] = n == g.worldSize
		if alive[g.name] {
			sources = append(sources, g.name)
		}
	}
	return sources, alive
}

// BenchmarkGroupTableReady256Groups is the group table's share of one
// routing decision over 256 groups of 4 ranks: the ready list and the
// pool's sources.
func BenchmarkGroupTableReady256Groups(b *testing.B) {
	gt := newGroupTable(3*time.Second, 16, 0.25, 0.5)
	now := time.Now()
	for g := range 256 {
		for r := range 4 {
			h := hb(fmt.Sprint("g", g), r, 4)
			h.Model = "m"
			gt.observe(h, now)
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		if len(gt.ready(now)) != 256 || len(gt.sources(now)) != 256 {
			b.Fatal("not every group ready")
		}
	}
}

// TestGroupTableNegativeLoadIsNone: a driver's heartbeat with counts below
// zero (an older kvbus whose counters drifted, a hand-made heartbeat)
// gives its group no load, never less than none: the requests this
// replica dispatched there since count in full. Before, -1000 queued
// tokens hid the next 62 blocks dispatched there, and -3 in flight the next
// 3 requests: the group looked idle while it filled.
func TestGroupTableNegativeLoadIsNone(t *testing.T) {
	gt := newGroupTable(time.Second, 16, 0.25, 0.5)
	now := time.Now()
	h := hb("g0", 0, 1)
	h.InflightRequests, h.QueueDepth = -3, -3
	h.QueuedPrefillTokens, h.QueuedLoadTokens, h.QueuedRemoteLoadTokens = -1000, -1600, -3200
	h.PrefillingUs, h.PrefillingTokens = -5000, -160
	gt.observe(h, now)
	gt.addInflight("g0", 2, 10)
	got := gt.ready(now)
	if len(got) != 1 || got[0].Inflight != 2 || got[0].QueuedBlocks != 10 || got[0].QueueDepth != 0 {
		t.Fatalf("ready = %+v, want inflight 2, queued blocks 10 (dispatched here since), queue depth 0", got)
	}
}
