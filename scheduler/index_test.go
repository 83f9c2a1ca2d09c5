package scheduler

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// ---- helpers to build KV event batches ----

func stored(hashes ...uint64) messages.KVEvent {
	return messages.KVEvent{Type: messages.EventBlockStored, BlockHashes: hashes}
}

func removed(hashes ...uint64) messages.KVEvent {
	return messages.KVEvent{Type: messages.EventBlockRemoved, BlockHashes: hashes}
}

func clearedAll() messages.KVEvent { return messages.KVEvent{Type: messages.EventAllBlocksCleared} }

func kvBatch(group string, rank int, seq uint64, events ...messages.KVEvent) *messages.KVEventBatch {
	return &messages.KVEventBatch{Group: group, Rank: rank, Seq: seq, Events: events}
}

// kvDump is a rank's answer to a dump request, as the workers build it:
// AllBlocksCleared, then everything it holds, at its current seq.
func kvDump(group string, rank int, seq uint64, hashes ...uint64) *messages.KVEventBatch {
	return kvBatch(group, rank, seq, clearedAll(), stored(hashes...))
}

// hashChain returns n distinct synthetic block hashes; chains with other ids
// never share a hash.
func hashChain(id, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(id)<<32 | uint64(i+1)
	}
	return out
}

// span returns c[from:to] as a fresh slice.
func span(c []uint64, from, to int) []uint64 { return slices.Clone(c[from:to]) }

// readyIndex returns an index whose groups have worldSize ranks, each heard
// of (a heartbeat) and synced from an empty dump at seq 0, so that their
// next batch is seq 1.
func readyIndex(t testing.TB, worldSize int, groups ...string) *KVIndex {
	t.Helper()
	x := NewKVIndex()
	for _, g := range groups {
		for r := range worldSize {
			if !x.ObserveRank(g, r, worldSize, 1, 0) {
				t.Fatalf("first heartbeat of %s/%d did not ask for a dump", g, r)
			}
			if x.ApplyDump(g, r, kvDump(g, r, 0)) {
				t.Fatalf("empty dump of %s/%d found a gap", g, r)
			}
		}
	}
	if rs := x.Resyncing(); len(rs) != 0 {
		t.Fatalf("ranks still resyncing after their dumps: %v", rs)
	}
	return x
}

// seqs hands out consecutive seqs per (group, rank).
type seqs map[rankID]uint64

func (s seqs) next(group string, rank int) uint64 {
	s[rankID{group, rank}]++
	return s[rankID{group, rank}]
}

// prefixes returns Match's IndexBlocks by group name for names.
func prefixes(x *KVIndex, hashes []uint64, names ...string) map[string]int {
	gs := make([]GroupState, len(names))
	for i, n := range names {
		gs[i] = GroupState{Name: n, IndexBlocks: -1}
	}
	x.Match(hashes, gs)
	out := map[string]int{}
	for _, g := range gs {
		out[g.Name] = g.IndexBlocks
	}
	return out
}

// checkPrefixes checks Match and PrefixMatch against want (group → prefix).
func checkPrefixes(t *testing.T, x *KVIndex, hashes []uint64, want map[string]int) {
	t.Helper()
	var names []string
	for n := range want {
		names = append(names, n)
	}
	slices.Sort(names)
	if got := prefixes(x, hashes, names...); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("Match = %v, want %v", got, want)
	}
	pm := x.PrefixMatch(hashes, nil)
	for _, n := range names {
		id, ok := x.GroupID(n)
		if !ok {
			if want[n] != 0 {
				t.Errorf("GroupID(%s) unknown, want prefix %d", n, want[n])
			}
			continue
		}
		if id >= len(pm) || pm[id] != want[n] {
			t.Errorf("PrefixMatch = %v: group %s (id %d) want %d", pm, n, id, want[n])
		}
	}
}

func TestKVIndexPrefixRequiresEveryRank(t *testing.T) {
	a := hashChain(1, 10)
	type rankBlocks struct {
		group  string
		rank   int
		hashes []uint64
	}
	tests := []struct {
		name       string
		worldSize  int
		groups     []string
		hold       []rankBlocks
		query      []uint64
		want       map[string]int // prefix by group
		wantBlocks map[string]int // GroupBlocks
	}{
		{
			name: "one rank of two holds it", worldSize: 2, groups: []string{"g0"},
			hold:  []rankBlocks{{"g0", 0, a}},
			query: a, want: map[string]int{"g0": 0}, wantBlocks: map[string]int{"g0": 0},
		},
		{
			name: "every rank holds it", worldSize: 2, groups: []string{"g0"},
			hold:  []rankBlocks{{"g0", 0, a}, {"g0", 1, a}},
			query: a, want: map[string]int{"g0": 10}, wantBlocks: map[string]int{"g0": 10},
		},
		{
			name: "the shortest rank bounds the prefix", worldSize: 4, groups: []string{"g0"},
			hold:  []rankBlocks{{"g0", 0, a}, {"g0", 1, span(a, 0, 7)}, {"g0", 2, a}, {"g0", 3, span(a, 0, 8)}},
			query: a, want: map[string]int{"g0": 7}, wantBlocks: map[string]int{"g0": 7},
		},
		{
			name: "three groups hold different prefixes", worldSize: 2, groups: []string{"g0", "g1", "g2"},
			hold: []rankBlocks{
				{"g0", 0, a}, {"g0", 1, a},
				{"g1", 0, span(a, 0, 5)}, {"g1", 1, a},
				{"g2", 0, span(a, 0, 1)}, {"g2", 1, span(a, 0, 1)},
			},
			query:      a,
			want:       map[string]int{"g0": 10, "g1": 5, "g2": 1, "unknown": 0},
			wantBlocks: map[string]int{"g0": 10, "g1": 5, "g2": 1, "unknown": 0},
		},
		{
			name: "a hole in the middle stops the prefix", worldSize: 2, groups: []string{"g0", "g1"},
			hold: []rankBlocks{
				{"g0", 0, append(span(a, 0, 4), a[5:]...)}, {"g0", 1, a},
				{"g1", 0, a}, {"g1", 1, a},
			},
			query: a, want: map[string]int{"g0": 4, "g1": 10}, wantBlocks: map[string]int{"g0": 9, "g1": 10},
		},
		{
			name: "the first block missing: nothing", worldSize: 1, groups: []string{"g0"},
			hold:  []rankBlocks{{"g0", 0, a[1:]}},
			query: a, want: map[string]int{"g0": 0}, wantBlocks: map[string]int{"g0": 9},
		},
		{
			name: "a query shorter than what is held", worldSize: 1, groups: []string{"g0"},
			hold:  []rankBlocks{{"g0", 0, a}},
			query: a[:3], want: map[string]int{"g0": 3}, wantBlocks: map[string]int{"g0": 10},
		},
		{
			name: "an empty query", worldSize: 1, groups: []string{"g0"},
			hold:  []rankBlocks{{"g0", 0, a}},
			query: nil, want: map[string]int{"g0": 0}, wantBlocks: map[string]int{"g0": 10},
		},
		{
			name: "another chain does not match", worldSize: 1, groups: []string{"g0"},
			hold:  []rankBlocks{{"g0", 0, a}},
			query: hashChain(2, 10), want: map[string]int{"g0": 0}, wantBlocks: map[string]int{"g0": 10},
		},
		{
			name: "blocks stored in reverse order", worldSize: 2, groups: []string{"g0"},
			hold: []rankBlocks{
				{"g0", 0, reversed(a)}, {"g0", 1, span(a, 0, 6)},
			},
			query: a, want: map[string]int{"g0": 6}, wantBlocks: map[string]int{"g0": 6},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := readyIndex(t, tt.worldSize, tt.groups...)
			sq := seqs{}
			for _, h := range tt.hold {
				if x.Apply(kvBatch(h.group, h.rank, sq.next(h.group, h.rank), stored(h.hashes...))) {
					t.Fatalf("in-order batch of %s/%d asked for a dump", h.group, h.rank)
				}
			}
			checkPrefixes(t, x, tt.query, tt.want)
			for g, n := range tt.wantBlocks {
				if got := x.GroupBlocks(g); got != n {
					t.Errorf("GroupBlocks(%s) = %d, want %d", g, got, n)
				}
			}
		})
	}
}

func reversed(s []uint64) []uint64 {
	r := slices.Clone(s)
	slices.Reverse(r)
	return r
}

func TestKVIndexRemoveAndClear(t *testing.T) {
	a := hashChain(1, 10)
	type step struct {
		name       string
		batch      *messages.KVEventBatch
		want       map[string]int // prefix of a by group
		wantBlocks map[string]int
	}
	// g0 and g1 have two ranks each and both hold all of a at seq 1.
	tests := []struct {
		name  string
		steps []step
	}{
		{"BlockRemoved on one rank", []step{
			{"rank 1 drops block 5", kvBatch("g0", 1, 2, removed(a[5])),
				map[string]int{"g0": 5, "g1": 10}, map[string]int{"g0": 9, "g1": 10}},
			{"rank 0 drops it too: no change to the prefix", kvBatch("g0", 0, 2, removed(a[5])),
				map[string]int{"g0": 5, "g1": 10}, map[string]int{"g0": 9, "g1": 10}},
			{"removing a block never stored is a no-op", kvBatch("g0", 0, 3, removed(hashChain(9, 3)...)),
				map[string]int{"g0": 5, "g1": 10}, map[string]int{"g0": 9, "g1": 10}},
			{"removing twice is a no-op", kvBatch("g0", 1, 3, removed(a[5])),
				map[string]int{"g0": 5, "g1": 10}, map[string]int{"g0": 9, "g1": 10}},
			{"rank 1 drops block 0", kvBatch("g0", 1, 4, removed(a[0])),
				map[string]int{"g0": 0, "g1": 10}, map[string]int{"g0": 8, "g1": 10}},
			{"both store both again", kvBatch("g0", 1, 5, stored(a[0], a[5])),
				map[string]int{"g0": 5, "g1": 10}, map[string]int{"g0": 9, "g1": 10}},
			{"rank 0 too", kvBatch("g0", 0, 4, stored(a[5])),
				map[string]int{"g0": 10, "g1": 10}, map[string]int{"g0": 10, "g1": 10}},
		}},
		{"AllBlocksCleared on one rank clears that rank only", []step{
			{"rank 0 of g0 cleared", kvBatch("g0", 0, 2, clearedAll()),
				map[string]int{"g0": 0, "g1": 10}, map[string]int{"g0": 0, "g1": 10}},
			// Rank 1 still holds everything: rank 0 storing a prefix again
			// makes that prefix full at once.
			{"rank 0 stores 4 blocks again", kvBatch("g0", 0, 3, stored(a[:4]...)),
				map[string]int{"g0": 4, "g1": 10}, map[string]int{"g0": 4, "g1": 10}},
			{"clear then store in one batch", kvBatch("g0", 1, 2, clearedAll(), stored(a[:2]...)),
				map[string]int{"g0": 2, "g1": 10}, map[string]int{"g0": 2, "g1": 10}},
			{"store then clear in one batch", kvBatch("g1", 1, 2, stored(hashChain(3, 2)...), clearedAll()),
				map[string]int{"g0": 2, "g1": 0}, map[string]int{"g0": 2, "g1": 0}},
			{"clearing an empty rank", kvBatch("g1", 1, 3, clearedAll()),
				map[string]int{"g0": 2, "g1": 0}, map[string]int{"g0": 2, "g1": 0}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := readyIndex(t, 2, "g0", "g1")
			for _, g := range []string{"g0", "g1"} {
				for r := range 2 {
					x.Apply(kvBatch(g, r, 1, stored(a...)))
				}
			}
			checkPrefixes(t, x, a, map[string]int{"g0": 10, "g1": 10})
			for _, st := range tt.steps {
				if x.Apply(st.batch) {
					t.Fatalf("%s: in-order batch asked for a dump", st.name)
				}
				t.Run(st.name, func(t *testing.T) {
					checkPrefixes(t, x, a, st.want)
					for g, n := range st.wantBlocks {
						if got := x.GroupBlocks(g); got != n {
							t.Errorf("GroupBlocks(%s) = %d, want %d", g, got, n)
						}
					}
				})
			}
		})
	}
}

func TestKVIndexClearOneRankKeepsOthersEntries(t *testing.T) {
	a := hashChain(1, 10)
	x := readyIndex(t, 2, "g0")
	x.Apply(kvBatch("g0", 0, 1, stored(a...)))
	x.Apply(kvBatch("g0", 1, 1, stored(a[:6]...)))
	if e, f := x.Size(); e != 10 || f != 6 {
		t.Fatalf("Size = %d entries, %d full; want 10, 6", e, f)
	}
	x.Apply(kvBatch("g0", 0, 2, clearedAll()))
	// Rank 1's six blocks are still entries.
	if e, f := x.Size(); e != 6 || f != 0 {
		t.Errorf("after clearing rank 0: Size = %d entries, %d full; want 6, 0", e, f)
	}
	x.Apply(kvBatch("g0", 1, 2, clearedAll()))
	if e, f := x.Size(); e != 0 || f != 0 {
		t.Errorf("after clearing both: Size = %d entries, %d full; want 0, 0", e, f)
	}
}

func TestKVIndexWorldSize(t *testing.T) {
	a := hashChain(1, 8)
	x := NewKVIndex()
	// Events before any heartbeat: the world size is unknown, nothing is
	// full yet, but every rank's blocks are kept.
	for r := range 2 {
		if x.Apply(kvBatch("g0", r, 1, stored(a...))) {
			t.Fatalf("rank %d: seq 1 of a new rank asked for a dump", r)
		}
	}
	x.Apply(kvBatch("g0", 2, 1, stored(a[:3]...)))
	checkPrefixes(t, x, a, map[string]int{"g0": 0})
	if n := x.GroupBlocks("g0"); n != 0 {
		t.Errorf("GroupBlocks before the world size is known = %d", n)
	}

	steps := []struct {
		name       string
		worldSize  int
		want       int // prefix of a
		wantBlocks int
	}{
		{"world size 3 learned later", 3, 3, 3},
		{"world size 4: rank 3 holds nothing", 4, 0, 0},
		{"back to 3", 3, 3, 3},
	}
	// With ranks 0, 1, 2: a[:3] is held by three ranks, a[3:] by two.
	for _, st := range steps {
		x.ObserveRank("g0", 0, st.worldSize, 1, 0)
		t.Run(st.name, func(t *testing.T) {
			checkPrefixes(t, x, a, map[string]int{"g0": st.want})
			if got := x.GroupBlocks("g0"); got != st.wantBlocks {
				t.Errorf("GroupBlocks = %d, want %d", got, st.wantBlocks)
			}
		})
	}
	// A new rank 3 in a group of 4 stores everything: only a[:3] is on all
	// four.
	x.ObserveRank("g0", 0, 4, 1, 0)
	x.Apply(kvBatch("g0", 3, 1, stored(a...)))
	checkPrefixes(t, x, a, map[string]int{"g0": 3})
	if got := x.GroupBlocks("g0"); got != 3 {
		t.Errorf("GroupBlocks with 4 ranks = %d, want 3", got)
	}
	// Stores after the world size is known are counted incrementally.
	x.Apply(kvBatch("g0", 2, 2, stored(a[3:]...)))
	checkPrefixes(t, x, a, map[string]int{"g0": 8})
	if got := x.GroupBlocks("g0"); got != 8 {
		t.Errorf("GroupBlocks = %d, want 8", got)
	}
}

// TestKVIndexWorldSizeShrinks: a group re-formed with fewer ranks. A block
// counts when every rank of the new world size (ranks 0..ws-1) holds it; what
// departed ranks held must not keep it from counting.
func TestKVIndexWorldSizeShrinks(t *testing.T) {
	a := hashChain(1, 8)
	x := readyIndex(t, 4, "g0")
	for r := range 4 {
		x.Apply(kvBatch("g0", r, 1, stored(a...)))
	}
	checkPrefixes(t, x, a, map[string]int{"g0": 8})
	// The group comes back with two ranks, 0 and 1, which still hold a.
	x.ObserveRank("g0", 0, 2, 1, 0)
	x.ObserveRank("g0", 1, 2, 1, 0)
	if got := x.GroupBlocks("g0"); got != 8 {
		t.Errorf("after shrinking 4 → 2 ranks that both hold all 8 blocks: GroupBlocks = %d, want 8", got)
	}
	checkPrefixes(t, x, a, map[string]int{"g0": 8})

	// The other way round: blocks that only the departed ranks 2 and 3 hold
	// are on no rank of the new group and must not count.
	b := hashChain(2, 4)
	y := readyIndex(t, 4, "g0")
	for r := 2; r < 4; r++ {
		y.Apply(kvBatch("g0", r, 1, stored(b...)))
	}
	y.ObserveRank("g0", 0, 2, 1, 0)
	y.ObserveRank("g0", 1, 2, 1, 0)
	if got := y.GroupBlocks("g0"); got != 0 {
		t.Errorf("after shrinking 4 → 2: blocks held only by departed ranks 2 and 3 count: GroupBlocks = %d, want 0", got)
	}
	checkPrefixes(t, y, b, map[string]int{"g0": 0})
}

// idxOp is one step of a seq-handling scenario on group g0.
type idxOp struct {
	name       string
	do         func(x *KVIndex) bool // returns needDump
	wantDump   bool
	wantPrefix int   // of the chain, for g0, after the step
	wantBlocks int   // GroupBlocks("g0") after the step; -1: not checked
	wantResync []int // ranks of g0 waiting for a dump
}

func applyOp(b *messages.KVEventBatch) func(*KVIndex) bool {
	return func(x *KVIndex) bool { return x.Apply(b) }
}

func dumpOp(rank int, d *messages.KVEventBatch) func(*KVIndex) bool {
	return func(x *KVIndex) bool { return x.ApplyDump("g0", rank, d) }
}

func observeOp(rank, ws int, started int64) func(*KVIndex) bool {
	return func(x *KVIndex) bool { return x.ObserveRank("g0", rank, ws, started, 0) }
}

func runIdxOps(t *testing.T, x *KVIndex, chain []uint64, ops []idxOp) {
	t.Helper()
	for i, op := range ops {
		got := op.do(x)
		if got != op.wantDump {
			t.Errorf("step %d %q: needDump = %v, want %v", i, op.name, got, op.wantDump)
		}
		if p := prefixes(x, chain, "g0")["g0"]; p != op.wantPrefix {
			t.Errorf("step %d %q: prefix = %d, want %d", i, op.name, p, op.wantPrefix)
		}
		if op.wantBlocks >= 0 {
			if n := x.GroupBlocks("g0"); n != op.wantBlocks {
				t.Errorf("step %d %q: GroupBlocks = %d, want %d", i, op.name, n, op.wantBlocks)
			}
		}
		rs := x.Resyncing()["g0"]
		slices.Sort(rs)
		if !slices.Equal(rs, op.wantResync) {
			t.Errorf("step %d %q: Resyncing = %v, want %v", i, op.name, rs, op.wantResync)
		}
	}
}

func TestKVIndexSeq(t *testing.T) {
	c := hashChain(1, 20)
	const g = "g0"
	tests := []struct {
		name string
		ws   int // world size of g0
		ops  []idxOp
	}{
		{"in order, duplicates, a gap held back until the dump", 1, []idxOp{
			{"first heartbeat asks for a dump", observeOp(0, 1, 100), true, 0, 0, []int{0}},
			{"same start time: nothing", observeOp(0, 1, 100), false, 0, 0, []int{0}},
			{"empty dump at seq 0", dumpOp(0, kvDump(g, 0, 0)), false, 0, 0, nil},
			{"seq 1", applyOp(kvBatch(g, 0, 1, stored(c[0], c[1]))), false, 2, 2, nil},
			{"seq 2", applyOp(kvBatch(g, 0, 2, stored(c[2]))), false, 3, 3, nil},
			{"seq 2 again is ignored", applyOp(kvBatch(g, 0, 2, stored(c[3]))), false, 3, 3, nil},
			{"an older seq is ignored", applyOp(kvBatch(g, 0, 1, removed(c[0]))), false, 3, 3, nil},
			// seq 3 is lost: it removed c[1] and stored c[3].
			{"seq 4 after 2: a gap", applyOp(kvBatch(g, 0, 4, stored(c[4]))), true, 3, 3, []int{0}},
			{"seq 6 held back", applyOp(kvBatch(g, 0, 6, removed(c[5]), stored(c[6]))), false, 3, 3, []int{0}},
			{"seq 5 held back", applyOp(kvBatch(g, 0, 5, stored(c[5], c[1]))), false, 3, 3, []int{0}},
			{"seq 6 again held back", applyOp(kvBatch(g, 0, 6, removed(c[5]), stored(c[6]))), false, 3, 3, []int{0}},
			// The dump at seq 4 has c0, c2, c3, c4 (no c1: seq 3 removed it).
			// Replay: seq 5 stores c5 and c1, seq 6 removes c5 and stores
			// c6 — in seq order, whatever the arrival order.
			{"dump at seq 4 replaces and replays", dumpOp(0, kvDump(g, 0, 4, c[0], c[2], c[3], c[4])),
				false, 5, 6, nil},
			{"seq 7 in order after the replay", applyOp(kvBatch(g, 0, 7, stored(c[5]))), false, 7, 7, nil},
			{"seq 9: a second gap", applyOp(kvBatch(g, 0, 9, stored(c[7]))), true, 7, 7, []int{0}},
			{"seq 10 held", applyOp(kvBatch(g, 0, 10, stored(c[8]))), false, 7, 7, []int{0}},
			{"dump at seq 9 (seq 9 itself is in it)", dumpOp(0, kvDump(g, 0, 9, c[:8]...)), false, 9, 9, nil},
			{"seq 10 again is a duplicate", applyOp(kvBatch(g, 0, 10, clearedAll())), false, 9, 9, nil},
			{"seq 11", applyOp(kvBatch(g, 0, 11, stored(c[9]))), false, 10, 10, nil},
		}},
		{"a dump older than what is held back finds the gap again", 1, []idxOp{
			{"seq 1", applyOp(kvBatch(g, 0, 1, stored(c[0]))), false, 1, 1, nil},
			{"seq 3: gap", applyOp(kvBatch(g, 0, 3, stored(c[2]))), true, 1, 1, []int{0}},
			{"seq 5 held", applyOp(kvBatch(g, 0, 5, stored(c[4]))), false, 1, 1, []int{0}},
			// The dump is at seq 3: seq 4 is still missing before seq 5.
			{"dump at seq 3", dumpOp(0, kvDump(g, 0, 3, c[0], c[1], c[2])), true, 3, 3, []int{0}},
			{"seq 6 held", applyOp(kvBatch(g, 0, 6, stored(c[5]))), false, 3, 3, []int{0}},
			{"dump at seq 5", dumpOp(0, kvDump(g, 0, 5, c[:5]...)), false, 6, 6, nil},
		}},
		{"a rank first seen mid-stream needs a dump", 1, []idxOp{
			{"first batch is seq 7", applyOp(kvBatch(g, 0, 7, stored(c[19]))), true, 0, 0, []int{0}},
			{"seq 8 held", applyOp(kvBatch(g, 0, 8, stored(c[3]))), false, 0, 0, []int{0}},
			// The dump at seq 7 covers seq 7; seq 8 is replayed.
			{"dump at seq 7", dumpOp(0, kvDump(g, 0, 7, c[0], c[1], c[2])), false, 4, 4, nil},
			{"seq 9", applyOp(kvBatch(g, 0, 9, stored(c[4]))), false, 5, 5, nil},
		}},
		{"a restart with seq 1 and AllBlocksCleared needs no dump", 2, []idxOp{
			{"rank 1 synced at seq 50", dumpOp(1, kvDump(g, 1, 50, c...)), false, 0, 0, nil},
			{"rank 0 synced at seq 50", dumpOp(0, kvDump(g, 0, 50, c...)), false, 20, 20, nil},
			{"rank 0 restarts: seq 1 clears it", applyOp(kvBatch(g, 0, 1, clearedAll(), stored(c[0]))), false, 1, 1, nil},
			{"seq 2 in order", applyOp(kvBatch(g, 0, 2, stored(c[1]))), false, 2, 2, nil},
			{"rank 1 is untouched: it still holds everything", applyOp(kvBatch(g, 0, 3, stored(c[2:]...))), false, 20, 20, nil},
		}},
		{"a changed start time asks for a dump once", 1, []idxOp{
			{"first heartbeat", observeOp(0, 1, 100), true, 0, 0, []int{0}},
			{"again", observeOp(0, 1, 100), false, 0, 0, []int{0}},
			{"dump", dumpOp(0, kvDump(g, 0, 3, c[:3]...)), false, 3, 3, nil},
			{"seq 4", applyOp(kvBatch(g, 0, 4, stored(c[3]))), false, 4, 4, nil},
			{"same start time", observeOp(0, 1, 100), false, 4, 4, nil},
			{"restarted: new start time", observeOp(0, 1, 200), true, 4, 4, []int{0}},
			{"the new start time again", observeOp(0, 1, 200), false, 4, 4, []int{0}},
			{"seq 1 of the new process starts it clean", applyOp(kvBatch(g, 0, 1, clearedAll(), stored(c[10]))), false, 0, 1, nil},
			{"dump of the new process at seq 1", dumpOp(0, kvDump(g, 0, 1, c[0])), false, 1, 1, nil},
			{"seq 2", applyOp(kvBatch(g, 0, 2, stored(c[1]))), false, 2, 2, nil},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := NewKVIndex()
			x.ObserveRank(g, 0, tt.ws, 0, 0) // known size, start time unknown: no dump asked
			runIdxOps(t, x, c, tt.ops)
		})
	}
}

func TestKVIndexObserveRankFirstHeartbeat(t *testing.T) {
	x := NewKVIndex()
	for r := range 3 {
		if !x.ObserveRank("g0", r, 3, 42, 0) {
			t.Errorf("first heartbeat of rank %d: no dump asked", r)
		}
		if x.ObserveRank("g0", r, 3, 42, 0) {
			t.Errorf("second heartbeat of rank %d asked for a dump again", r)
		}
	}
	got := x.Resyncing()
	slices.Sort(got["g0"])
	if len(got) != 1 || !slices.Equal(got["g0"], []int{0, 1, 2}) {
		t.Errorf("Resyncing = %v, want g0: [0 1 2]", got)
	}
	// Events held back while waiting, then the dumps.
	a := hashChain(1, 4)
	for r := range 3 {
		if x.Apply(kvBatch("g0", r, 1, stored(a...))) {
			t.Errorf("rank %d: a held-back batch asked for another dump", r)
		}
	}
	if n := x.GroupBlocks("g0"); n != 0 {
		t.Errorf("GroupBlocks = %d while every rank waits for its dump", n)
	}
	for r := range 3 {
		if x.ApplyDump("g0", r, kvDump("g0", r, 0)) {
			t.Errorf("rank %d: dump at seq 0 then seq 1 found a gap", r)
		}
	}
	if n := x.GroupBlocks("g0"); n != 4 {
		t.Errorf("GroupBlocks after the dumps = %d, want 4", n)
	}
	if rs := x.Resyncing(); len(rs) != 0 {
		t.Errorf("Resyncing after the dumps = %v", rs)
	}
}

func TestKVIndexResyncingAcrossGroups(t *testing.T) {
	x := readyIndex(t, 2, "g0", "g1", "g2")
	x.Apply(kvBatch("g0", 1, 5, stored(1)))
	x.Apply(kvBatch("g2", 0, 3, stored(1)))
	x.Apply(kvBatch("g2", 1, 1, stored(1))) // in order
	x.ObserveRank("g1", 0, 2, 99, 0)        // restarted
	got := x.Resyncing()
	for k := range got {
		slices.Sort(got[k])
	}
	want := map[string][]int{"g0": {1}, "g1": {0}, "g2": {0}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("Resyncing = %v, want %v", got, want)
	}
}

func TestKVIndexPendingIsBounded(t *testing.T) {
	x := readyIndex(t, 1, "g0")
	c := hashChain(1, 2)
	x.Apply(kvBatch("g0", 0, 1, stored(c[0])))
	if !x.Apply(kvBatch("g0", 0, 3, stored(c[1]))) {
		t.Fatal("gap not detected")
	}
	const last = 3 + maxPendingBatches + 500
	for seq := uint64(4); seq <= last; seq++ {
		if x.Apply(kvBatch("g0", 0, seq)) {
			t.Fatalf("seq %d: a held-back batch asked for another dump", seq)
		}
	}
	x.mu.RLock()
	n := len(x.groups["g0"].ranks[0].pending)
	x.mu.RUnlock()
	if n > maxPendingBatches {
		t.Errorf("%d batches held back, limit %d", n, maxPendingBatches)
	}
	// The dump is older than the oldest batch still held: the gap shows.
	if !x.ApplyDump("g0", 0, kvDump("g0", 0, 3, c...)) {
		t.Error("a dump older than the held batches did not report the gap")
	}
	// A dump at the last seq settles it.
	if x.ApplyDump("g0", 0, kvDump("g0", 0, last, c...)) {
		t.Error("a dump at the last seq found a gap")
	}
	if x.Apply(kvBatch("g0", 0, last+1)) || len(x.Resyncing()) != 0 {
		t.Error("seq after the dump not applied in order")
	}
	if got := prefixes(x, c, "g0")["g0"]; got != 2 {
		t.Errorf("prefix %d, want 2", got)
	}
}

// TestKVIndexPendingIsBoundedInBytes: the batches held back during a
// resync are bounded by their size too, not only by their number. A forged
// group whose rank never answers a dump (every role may publish heartbeats
// and KV events without auth) had 40 batches of a million hashes held in
// each scheduler, 320 MB, and 4,096 of them would have held 32 GiB.
func TestKVIndexPendingIsBoundedInBytes(t *testing.T) {
	x := readyIndex(t, 1, "g0")
	c := hashChain(1, 2)
	x.Apply(kvBatch("g0", 0, 1, stored(c[0])))
	if !x.Apply(kvBatch("g0", 0, 3, stored(c[1]))) {
		t.Fatal("gap not detected")
	}
	big := make([]uint64, messages.MaxMessageBytes/8) // one batch as large as the bus takes, shared
	const batches = 100
	for seq := uint64(4); seq < 4+batches; seq++ {
		if x.Apply(kvBatch("g0", 0, seq, stored(big...))) {
			t.Fatalf("seq %d: a held-back batch asked for another dump", seq)
		}
	}
	x.mu.RLock()
	held := 0
	for _, b := range x.groups["g0"].ranks[0].pending {
		held += batchBytes(b)
	}
	x.mu.RUnlock()
	if held > maxPendingBytes {
		t.Fatalf("%d MiB of batches held back during a resync, limit %d MiB", held>>20, maxPendingBytes>>20)
	}
	// The rank's dump at the last seq settles it, whatever was dropped.
	last := uint64(3 + batches)
	if x.ApplyDump("g0", 0, kvDump("g0", 0, last, c...)) {
		t.Error("a dump at the last seq found a gap")
	}
	if x.Apply(kvBatch("g0", 0, last+1)) || len(x.Resyncing()) != 0 {
		t.Error("seq after the dump not applied in order")
	}
	if got := prefixes(x, c, "g0")["g0"]; got != 2 {
		t.Errorf("prefix %d, want 2", got)
	}
}

func TestKVIndexGroupBlocksAndSize(t *testing.T) {
	x := NewKVIndex()
	for _, o := range []struct {
		g      string
		r, ws  int
		hashes []uint64
	}{
		{"g0", 0, 2, []uint64{1, 2, 3, 4, 5}},
		{"g0", 1, 2, []uint64{1, 2, 3}},
		{"g1", 0, 1, []uint64{1, 2, 100}},
	} {
		x.ObserveRank(o.g, o.r, o.ws, 1, 0)
		x.ApplyDump(o.g, o.r, kvDump(o.g, o.r, 1, o.hashes...))
	}
	// Entries are (group, hash) pairs: 5 for g0, 3 for g1. Full blocks are
	// hashes full in some group: {1, 2, 3} ∪ {1, 2, 100}.
	if e, f := x.Size(); e != 8 || f != 4 {
		t.Errorf("Size = %d entries, %d full; want 8, 4", e, f)
	}
	for g, want := range map[string]int{"g0": 3, "g1": 3, "nope": 0} {
		if got := x.GroupBlocks(g); got != want {
			t.Errorf("GroupBlocks(%s) = %d, want %d", g, got, want)
		}
	}
	if id0, ok0 := x.GroupID("g0"); !ok0 || id0 != 0 {
		t.Errorf("GroupID(g0) = %d, %v", id0, ok0)
	}
	if id1, ok1 := x.GroupID("g1"); !ok1 || id1 != 1 {
		t.Errorf("GroupID(g1) = %d, %v", id1, ok1)
	}
	if _, ok := x.GroupID("nope"); ok {
		t.Error("GroupID of an unknown group")
	}
	x.Apply(kvBatch("g0", 1, 2, removed(1, 2, 3, 99)))
	// Rank 0 of g0 still holds 1..5: the entries stay, none is full in g0.
	if e, f := x.Size(); e != 8 || f != 3 || x.GroupBlocks("g0") != 0 {
		t.Errorf("after g0/1 dropped its blocks: Size = %d, %d, GroupBlocks(g0) = %d; want 8, 3, 0", e, f, x.GroupBlocks("g0"))
	}
}

func TestKVIndexTooManyGroups(t *testing.T) {
	x := NewKVIndex()
	const n = MaxIndexedGroups + 6
	h := hashChain(1, 3)
	names := make([]string, n)
	for i := range n {
		names[i] = fmt.Sprintf("g%02d", i)
		x.ObserveRank(names[i], 0, 1, 1, 0)
		x.ApplyDump(names[i], 0, kvDump(names[i], 0, 0))
		if x.Apply(kvBatch(names[i], 0, 1, stored(h...))) {
			t.Errorf("group %d asked for a dump", i)
		}
		x.Apply(kvBatch(names[i], 0, 7, stored(h...))) // a gap: ignored for extra groups
	}
	got := prefixes(x, h, names...)
	for i, name := range names {
		want := 3
		if i >= MaxIndexedGroups {
			want = 0
			if _, ok := x.GroupID(name); ok {
				t.Errorf("extra group %s has an id", name)
			}
			if x.ObserveRank(name, 0, 1, 2, 0) || x.ApplyDump(name, 0, kvDump(name, 0, 9)) || x.GroupBlocks(name) != 0 {
				t.Errorf("extra group %s is tracked", name)
			}
		}
		if got[name] != want {
			t.Errorf("prefix of %s = %d, want %d", name, got[name], want)
		}
	}
	if pm := x.PrefixMatch(h, nil); len(pm) != MaxIndexedGroups {
		t.Errorf("PrefixMatch over %d groups", len(pm))
	}
	if rs := x.Resyncing(); len(rs) != MaxIndexedGroups {
		t.Errorf("%d groups resyncing, want the %d indexed ones", len(rs), MaxIndexedGroups)
	}
	// Ranks out of range are ignored too.
	if x.Apply(kvBatch("g00", 64, 5, stored(h...))) || x.Apply(kvBatch("g00", -1, 5)) ||
		x.ObserveRank("g00", 64, 1, 3, 0) || x.ObserveRank("g00", 0, 65, 3, 0) || x.ApplyDump("g00", -1, kvDump("g00", -1, 1)) {
		t.Error("a rank out of range was tracked")
	}
}

// refIndex is the naive model: group → rank → set of hashes.
type refIndex map[string]map[int]map[uint64]bool

func (m refIndex) apply(b *messages.KVEventBatch) {
	rs := m[b.Group][b.Rank]
	for _, ev := range b.Events {
		switch ev.Type {
		case messages.EventBlockStored:
			for _, h := range ev.BlockHashes {
				rs[h] = true
			}
		case messages.EventBlockRemoved:
			for _, h := range ev.BlockHashes {
				delete(rs, h)
			}
		case messages.EventAllBlocksCleared:
			clear(rs)
		}
	}
}

func (m refIndex) full(group string, h uint64) bool {
	for _, rs := range m[group] {
		if !rs[h] {
			return false
		}
	}
	return true
}

func (m refIndex) prefix(group string, hashes []uint64) int {
	for i, h := range hashes {
		if !m.full(group, h) {
			return i
		}
	}
	return len(hashes)
}

func (m refIndex) blocks(group string) int {
	n := 0
	for h := range m[group][0] {
		if m.full(group, h) {
			n++
		}
	}
	return n
}

func TestKVIndexMatchesModel(t *testing.T) {
	const (
		ranks    = 3
		chains   = 6
		chainLen = 24
		ops      = 2000
	)
	groups := []string{"ga", "gb"}
	rng := rand.New(rand.NewPCG(7, 11))
	pool := make([][]uint64, chains)
	for i := range pool {
		pool[i] = hashChain(i+1, chainLen)
	}
	x := readyIndex(t, ranks, groups...)
	ref := refIndex{}
	for _, g := range groups {
		ref[g] = map[int]map[uint64]bool{}
		for r := range ranks {
			ref[g][r] = map[uint64]bool{}
		}
	}
	sq := seqs{}
	randomHashes := func() []uint64 {
		c := pool[rng.IntN(chains)]
		if rng.IntN(3) == 0 { // scattered blocks
			var hs []uint64
			for range 1 + rng.IntN(6) {
				hs = append(hs, c[rng.IntN(chainLen)])
			}
			return hs
		}
		from := rng.IntN(chainLen)
		if rng.IntN(2) == 0 {
			from = 0 // a prefix, the common case
		}
		return span(c, from, from+1+rng.IntN(chainLen-from))
	}
	for op := 1; op <= ops; op++ {
		g := groups[rng.IntN(len(groups))]
		r := rng.IntN(ranks)
		var events []messages.KVEvent
		for range 1 + rng.IntN(3) {
			switch p := rng.IntN(100); {
			case p < 60:
				events = append(events, stored(randomHashes()...))
			case p < 97:
				events = append(events, removed(randomHashes()...))
			default:
				events = append(events, clearedAll())
			}
		}
		b := kvBatch(g, r, sq.next(g, r), events...)
		if x.Apply(b) {
			t.Fatalf("op %d: an in-order batch asked for a dump", op)
		}
		ref.apply(b)
		if op%100 != 0 {
			continue
		}
		for q := range 50 {
			c := pool[rng.IntN(chains)]
			query := c[:rng.IntN(chainLen+1)]
			if q%5 == 0 && len(query) > 0 { // a query that diverges
				query = append(slices.Clone(query[:len(query)-1]), 0xdead)
			}
			got := prefixes(x, query, groups...)
			for _, gn := range groups {
				if want := ref.prefix(gn, query); got[gn] != want {
					t.Fatalf("after %d ops, query %d (chain of %d): Match[%s] = %d, model says %d", op, q, len(query), gn, got[gn], want)
				}
			}
		}
		for _, gn := range groups {
			if got, want := x.GroupBlocks(gn), ref.blocks(gn); got != want {
				t.Fatalf("after %d ops: GroupBlocks(%s) = %d, model says %d", op, gn, got, want)
			}
		}
		entries, full := x.Size()
		wantEntries, wantFull := 0, map[uint64]bool{}
		for _, gn := range groups {
			seen := map[uint64]bool{}
			for _, rs := range ref[gn] {
				for h := range rs {
					seen[h] = true
					if ref.full(gn, h) {
						wantFull[h] = true
					}
				}
			}
			wantEntries += len(seen)
		}
		if entries != wantEntries || full != len(wantFull) {
			t.Fatalf("after %d ops: Size = %d, %d; model says %d, %d", op, entries, full, wantEntries, len(wantFull))
		}
	}
}

// TestKVIndexForget: a forgotten group's blocks, plans and seqs go, its id
// is reused by the next new group (so a long-running scheduler that sees
// more than MaxIndexedGroups names over its life still indexes the live
// ones), the other groups keep theirs, and the name, if it comes back, is
// a new group that asks for a dump.
func TestKVIndexForget(t *testing.T) {
	x := NewKVIndex()
	h := hashChain(1, 3)
	only := hashChain(2, 2) // held by g05 alone
	names := make([]string, MaxIndexedGroups)
	for i := range names {
		names[i] = fmt.Sprintf("g%02d", i)
		x.ObserveRank(names[i], 0, 1, 1, 0)
		x.ApplyDump(names[i], 0, kvDump(names[i], 0, 0))
		x.Apply(kvBatch(names[i], 0, 1, stored(h...)))
	}
	x.Apply(kvBatch("g05", 0, 2, stored(only...)))
	x.Plan("g05", hashChain(3, 4), time.Now().Add(time.Hour))
	x.Plan("g06", hashChain(3, 4), time.Now().Add(time.Hour))
	if _, ok := x.GroupID("extra"); ok || x.ObserveRank("extra", 0, 1, 1, 0) {
		t.Fatal("a 65th group was indexed")
	}
	entries, full := x.Size()
	x.Forget("g05")
	x.Forget("g10")
	x.Forget("never-seen") // no-op
	if e, f := x.Size(); e != entries-2*len(h)-len(only) || f != full-len(only) {
		t.Errorf("after forgetting two groups: %d entries, %d full blocks; want %d, %d", e, f, entries-2*len(h)-len(only), full-len(only))
	}
	if n := x.Plans(); n != 4 {
		t.Errorf("%d plans left, want g06's 4", n)
	}
	if _, ok := x.GroupID("g05"); ok {
		t.Error("g05 still has an id")
	}
	// Two new groups take the freed ids and are indexed.
	for _, name := range []string{"extra", "g05"} {
		if !x.ObserveRank(name, 0, 1, 2, 0) {
			t.Errorf("%s: first heartbeat after the id was freed asked for no dump", name)
		}
		if id, ok := x.GroupID(name); !ok || (id != 5 && id != 10) {
			t.Errorf("%s: id %d, %v; want a freed one (5 or 10)", name, id, ok)
		}
		x.ApplyDump(name, 0, kvDump(name, 0, 0))
	}
	checkPrefixes(t, x, h, map[string]int{"extra": 0, "g05": 0, "g04": 3, "g63": 3})
	checkPrefixes(t, x, only, map[string]int{"g05": 0})
	x.Apply(kvBatch("extra", 0, 1, stored(h...)))
	checkPrefixes(t, x, h, map[string]int{"extra": 3, "g05": 0, "g04": 3})
	if pm := x.PrefixMatch(h, nil); len(pm) != MaxIndexedGroups {
		t.Errorf("PrefixMatch over %d ids, want %d", len(pm), MaxIndexedGroups)
	}
}

// TestKVIndexMatchAcrossIDReuse: Match walks the prefix and maps names to
// ids under one lock, so a group that takes a forgotten group's id is never
// credited with that group's blocks.
func TestKVIndexMatchAcrossIDReuse(t *testing.T) {
	x := NewKVIndex()
	h := hashChain(1, 8)
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		for !stop.Load() {
			x.ObserveRank("old", 0, 1, 1, 0)
			x.ApplyDump("old", 0, kvDump("old", 0, 0))
			x.Apply(kvBatch("old", 0, 1, stored(h...))) // holds h at the free id
			x.Forget("old")
			x.ObserveRank("new", 0, 1, 1, 0) // takes the same id; holds nothing
			x.Forget("new")
		}
	})
	defer func() { stop.Store(true); wg.Wait() }()
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); {
		g := []GroupState{{Name: "new"}}
		x.Match(h, g)
		if g[0].IndexBlocks != 0 {
			t.Fatalf("Match credited the new group, which holds nothing, with %d blocks of the forgotten group's", g[0].IndexBlocks)
		}
	}
}

// TestKVIndexForgetIdle: groups not heard of (heartbeat, batch or plan) for
// the given time are forgotten together; the others stay.
func TestKVIndexForgetIdle(t *testing.T) {
	x := readyIndex(t, 1, "a", "b", "c")
	h := hashChain(1, 2)
	for _, g := range []string{"a", "b", "c"} {
		x.Apply(kvBatch(g, 0, 1, stored(h...)))
	}
	time.Sleep(20 * time.Millisecond)
	x.Plan("b", hashChain(2, 1), time.Now().Add(time.Hour)) // b was heard of just now
	if gone := x.ForgetIdle(time.Now(), 10*time.Millisecond, time.Now().Add(-5*time.Millisecond)); len(gone) != 0 {
		t.Fatalf("forgot %v within 10 ms of a reconnect; want none forgotten yet", gone)
	}
	gone := x.ForgetIdle(time.Now(), 10*time.Millisecond, time.Time{})
	slices.Sort(gone)
	if !slices.Equal(gone, []string{"a", "c"}) {
		t.Fatalf("forgot %v, want [a c]", gone)
	}
	checkPrefixes(t, x, h, map[string]int{"a": 0, "b": 2, "c": 0})
	if e, f := x.Size(); e != 2 || f != 2 {
		t.Errorf("%d entries, %d full blocks left; want b's 2, 2", e, f)
	}
}

// TestShrunkGroupAsksNoGoneRankForDumps: a group formed again of fewer
// ranks (another --tp-size) while a rank above the new size still waited
// for its dump: that rank no longer exists, and is not asked for dumps
// again and again (each ask failed, warned and backed off, for as long as
// the group lived).
func TestShrunkGroupAsksNoGoneRankForDumps(t *testing.T) {
	x := NewKVIndex()
	for r := range 4 {
		x.ObserveRank("g0", r, 4, 1, 0) // first heard: each waits for a dump
	}
	for r := range 3 {
		x.ApplyDump("g0", r, kvDump("g0", r, 1))
	}
	if got := x.Resyncing(); len(got["g0"]) != 1 {
		t.Fatalf("Resyncing() = %v; want rank 3 of 4 waiting for its dump (the setup)", got)
	}
	for r := range 2 { // formed again as tp-size 2 (new processes)
		x.ObserveRank("g0", r, 2, 2, 0)
		x.ApplyDump("g0", r, kvDump("g0", r, 1))
	}
	if !x.Synced("g0") {
		t.Fatal("g0 not synced")
	}
	if got := x.Resyncing(); len(got) != 0 {
		t.Errorf("Resyncing() = %v for a synced group of 2 ranks; want none (rank 3 no longer exists)", got)
	}
}
