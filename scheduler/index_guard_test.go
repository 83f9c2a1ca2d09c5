package scheduler

import (
	"fmt"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// prefixOn returns how many leading blocks of hashes the index gives group.
func prefixOn(x *KVIndex, group string, hashes []uint64) int {
	g := []GroupState{{Name: group}}
	x.Match(hashes, g)
	return g[0].IndexBlocks
}

// TestKVIndexRejectsImpossibleSeq: a batch whose seq is impossibly far past
// the rank's known seq is dropped and counted, with no resync; once the
// rank's seq is known, the same holds for batches held back in a resync.
func TestKVIndexRejectsImpossibleSeq(t *testing.T) {
	x := NewKVIndex()
	x.ObserveRank("g0", 0, 1, 0, 0)
	a := hashChain(1, 3)
	if x.Apply(kvBatch("g0", 0, 1, clearedAll(), stored(a[0]))) {
		t.Fatal("the rank's first batch asked for a dump")
	}
	forged := kvBatch("g0", 0, 1<<40, stored(42))
	if x.Apply(forged) {
		t.Error("a forged seq asked for a dump")
	}
	if got := x.Rejected(); got != 1 {
		t.Errorf("Rejected = %d, want 1", got)
	}
	if len(x.Resyncing()) != 0 {
		t.Errorf("resyncing %v after a forged seq", x.Resyncing())
	}
	if x.Apply(kvBatch("g0", 0, 2, stored(a[1]))) || prefixOn(x, "g0", a) != 2 {
		t.Errorf("the rank's next real batch was not applied: prefix %d", prefixOn(x, "g0", a))
	}
	// A real gap: resync; a forged batch held back meanwhile is dropped
	// when the dump arrives, and the resync ends.
	if !x.Apply(kvBatch("g0", 0, 4, stored(a[2]))) {
		t.Fatal("a gap did not ask for a dump")
	}
	x.Apply(kvBatch("g0", 0, 1<<41, stored(43)))
	if x.ApplyDump("g0", 0, kvDump("g0", 0, 3, a[0], a[1])) {
		t.Error("the dump found another gap")
	}
	if got := x.Rejected(); got != 2 {
		t.Errorf("Rejected = %d, want 2", got)
	}
	if len(x.Resyncing()) != 0 || prefixOn(x, "g0", a) != 3 || !x.Synced("g0") {
		t.Errorf("after the dump: resyncing %v, prefix %d, synced %v; want none, 3, true", x.Resyncing(), prefixOn(x, "g0", a), x.Synced("g0"))
	}
}

// TestKVIndexStaleDumpIgnored: a dump asked of a rank's old process is
// ignored once the rank restarted.
func TestKVIndexStaleDumpIgnored(t *testing.T) {
	x := NewKVIndex()
	a := hashChain(2, 4)
	if !x.ObserveRank("g0", 0, 1, 100, 0) {
		t.Fatal("first heartbeat: no dump asked")
	}
	epoch := x.Epoch("g0", 0)
	x.ApplyDumpOf("g0", 0, epoch, kvDump("g0", 0, 7, a...))
	if prefixOn(x, "g0", a) != 4 {
		t.Fatal("dump not applied")
	}
	if !x.ObserveRank("g0", 0, 1, 200, 0) { // restarted
		t.Fatal("restart: no dump asked")
	}
	x.ApplyDumpOf("g0", 0, epoch, kvDump("g0", 0, 9, a...)) // late answer of the old process
	if x.Synced("g0") {
		t.Error("a stale dump ended the resync")
	}
	x.ApplyDumpOf("g0", 0, x.Epoch("g0", 0), kvDump("g0", 0, 1))
	if !x.Synced("g0") || prefixOn(x, "g0", a) != 0 {
		t.Errorf("after the new process's dump: synced %v, prefix %d; want true, 0", x.Synced("g0"), prefixOn(x, "g0", a))
	}
}

// TestKVIndexPlans: a plan counts a group's blocks before the ranks'
// events confirm them; confirmation, an eviction, a rank's restart or the
// plan's expiry end it.
func TestKVIndexPlans(t *testing.T) {
	a := hashChain(3, 5)
	now := time.Now()
	tests := []struct {
		name  string
		after func(x *KVIndex)
		want  int // prefix on g0 after
		plans int
	}{
		{"a plan counts at once", func(*KVIndex) {}, 5, 5},
		{"confirmed by both ranks: held, no plan left", func(x *KVIndex) {
			x.Apply(kvBatch("g0", 0, 2, stored(a...)))
			x.Apply(kvBatch("g0", 1, 2, stored(a...)))
		}, 5, 0},
		{"one rank stored: still planned", func(x *KVIndex) { x.Apply(kvBatch("g0", 0, 2, stored(a...))) }, 5, 5},
		{"a rank evicted a planned block: the prefix stops there", func(x *KVIndex) {
			x.Apply(kvBatch("g0", 0, 2, stored(a[2]), removed(a[2])))
		}, 2, 4},
		// A rank's put evicted a block another of its threads had just
		// saved, before that thread's BlockStored went out: the rank
		// publishes only the removal (workers' publishStored).
		{"a rank evicted a planned block before it said it stored it: the prefix stops there", func(x *KVIndex) {
			x.Apply(kvBatch("g0", 0, 2, removed(a[2])))
		}, 2, 4},
		{"a rank restarted: the group's plans go", func(x *KVIndex) { x.Apply(kvBatch("g0", 1, 1, clearedAll())) }, 0, 0},
		{"expired", func(x *KVIndex) { x.ExpirePlans(now.Add(time.Minute)) }, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := NewKVIndex()
			for r := range 2 {
				x.ObserveRank("g0", r, 2, 0, 0)
				x.Apply(kvBatch("g0", r, 1, clearedAll()))
			}
			x.ObserveRank("g1", 0, 1, 0, 0)
			x.Plan("g0", a, now.Add(30*time.Second))
			tt.after(x)
			if got := prefixOn(x, "g0", a); got != tt.want {
				t.Errorf("prefix on g0 = %d, want %d", got, tt.want)
			}
			if got := prefixOn(x, "g1", a); got != 0 {
				t.Errorf("prefix on g1 = %d, want 0 (the plan is g0's)", got)
			}
			if got := x.Plans(); got != tt.plans {
				t.Errorf("Plans() = %d, want %d", got, tt.plans)
			}
		})
	}
}

// TestKVIndexSynced: a group is synced when each of its ranks is known
// from its first batch or a dump, and none waits for a dump.
func TestKVIndexSynced(t *testing.T) {
	x := NewKVIndex()
	if x.Synced("g0") {
		t.Error("unknown group synced")
	}
	x.ObserveRank("g0", 0, 2, 5, 0)
	x.ObserveRank("g0", 1, 2, 5, 0)
	x.Apply(kvBatch("g0", 0, 1, clearedAll()))
	if x.Synced("g0") {
		t.Error("synced with rank 1 unknown")
	}
	x.ApplyDump("g0", 0, kvDump("g0", 0, 1))
	x.ApplyDump("g0", 1, kvDump("g0", 1, 3))
	if !x.Synced("g0") {
		t.Errorf("not synced after both dumps: resyncing %v", x.Resyncing())
	}
	x.Apply(kvBatch("g0", 1, 6, stored(1))) // a gap
	if x.Synced("g0") {
		t.Error("synced while a rank waits for a dump")
	}
}

// TestKVIndexRemoteRuns: past a group's own prefix, the runs other groups
// hold in full, keeping one source while it holds the next block.
func TestKVIndexRemoteRuns(t *testing.T) {
	x := NewKVIndex()
	a := hashChain(4, 8)
	for _, g := range []string{"g0", "g1", "g2"} {
		x.ObserveRank(g, 0, 1, 0, 0)
		x.Apply(kvBatch(g, 0, 1, clearedAll()))
	}
	x.Apply(kvBatch("g0", 0, 2, stored(a[:2]...)))  // g0: blocks 0-1
	x.Apply(kvBatch("g1", 0, 2, stored(a[:5]...)))  // g1: blocks 0-4
	x.Apply(kvBatch("g2", 0, 2, stored(a[3:7]...))) // g2: blocks 3-6
	all := []string{"g0", "g1", "g2"}
	if got := x.PoolPrefix(a, all, nil); got != 7 {
		t.Errorf("PoolPrefix = %d, want 7", got)
	}
	tests := []struct {
		group       string
		from, limit int
		want        []messages.RemoteRun
		end         int
	}{
		{"g0", 2, 8, []messages.RemoteRun{{Group: "g1", FromBlock: 2, Blocks: 3}, {Group: "g2", FromBlock: 5, Blocks: 2}}, 7},
		{"g0", 2, 4, []messages.RemoteRun{{Group: "g1", FromBlock: 2, Blocks: 2}}, 4},
		{"g1", 5, 8, []messages.RemoteRun{{Group: "g2", FromBlock: 5, Blocks: 2}}, 7},
		// g2's own blocks 3-6 are read locally, between and after the runs.
		// g1 holds g0's run too: it is the run's alternate.
		{"g2", 0, 8, []messages.RemoteRun{{Group: "g0", FromBlock: 0, Blocks: 2, Alternates: []string{"g1"}}, {Group: "g1", FromBlock: 2, Blocks: 1}}, 7},
		{"g1", 0, 0, nil, 0},
	}
	for _, tt := range tests {
		got, end := x.RemoteRuns(a, tt.group, tt.from, tt.limit, all, nil)
		if !reflect.DeepEqual(got, tt.want) || end != tt.end {
			t.Errorf("RemoteRuns(%s, %d, %d) = %+v, %d; want %+v, %d", tt.group, tt.from, tt.limit, got, end, tt.want, tt.end)
		}
	}
	// The alternates are the groups holding the longest start of the run,
	// the whole first, then by how much, not by id: g3 holds block 0, g4
	// blocks 0-4. With g0 as the source, g4 holds all of its run, g3 half.
	x.ObserveRank("g3", 0, 1, 0, 0)
	x.Apply(kvBatch("g3", 0, 1, clearedAll()))
	x.Apply(kvBatch("g3", 0, 2, stored(a[:1]...)))
	x.ObserveRank("g4", 0, 1, 0, 0)
	x.Apply(kvBatch("g4", 0, 1, clearedAll()))
	x.Apply(kvBatch("g4", 0, 2, stored(a[:5]...)))
	want := []messages.RemoteRun{{Group: "g0", FromBlock: 0, Blocks: 2, Alternates: []string{"g4", "g3"}}, {Group: "g4", FromBlock: 2, Blocks: 1}}
	if got, end := x.RemoteRuns(a, "g2", 0, 8, []string{"g0", "g3", "g4"}, nil); !reflect.DeepEqual(got, want) || end != 7 {
		t.Errorf("RemoteRuns with partial holders = %+v, %d; want %+v, 7", got, end, want)
	}
	// A source holding more than any other still gets an alternate for the
	// part another holds: g3's block 0 of g1's run of three.
	want = []messages.RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 3, Alternates: []string{"g3"}}}
	if got, end := x.RemoteRuns(a, "g2", 0, 8, []string{"g1", "g3"}, nil); !reflect.DeepEqual(got, want) || end != 7 {
		t.Errorf("RemoteRuns with a shorter alternate = %+v, %d; want %+v, 7", got, end, want)
	}
	// Two whole holders beat a partial one (g3, id 3, would tie-break
	// before g4 only at equal length).
	want = []messages.RemoteRun{{Group: "g0", FromBlock: 0, Blocks: 2, Alternates: []string{"g1", "g4"}}, {Group: "g1", FromBlock: 2, Blocks: 1, Alternates: []string{"g4"}}}
	if got, end := x.RemoteRuns(a, "g2", 0, 8, []string{"g0", "g1", "g3", "g4"}, nil); !reflect.DeepEqual(got, want) || end != 7 {
		t.Errorf("RemoteRuns with three holders = %+v, %d; want %+v, 7", got, end, want)
	}

	// g1 stopped answering (not among the sources): its blocks are
	// nobody's, though the index still lists them until they are cleared.
	if got := x.PoolPrefix(a, []string{"g0", "g2"}, nil); got != 2 {
		t.Errorf("PoolPrefix without g1 = %d, want 2", got)
	}
	if got, end := x.RemoteRuns(a, "g2", 0, 8, []string{"g2"}, nil); len(got) != 0 || end != 0 {
		t.Errorf("RemoteRuns from no other source = %+v, %d; want none, 0", got, end)
	}
	// A group's own blocks are local whatever the sources.
	if got, end := x.RemoteRuns(a, "g1", 0, 8, nil, nil); len(got) != 0 || end != 5 {
		t.Errorf("RemoteRuns on g1 with no sources = %+v, %d; want none, 5", got, end)
	}
}

// TestKVIndexRemoteRunsFromSavers: blocks another group is still saving
// count as a source only if that group is listed as a saver (its prefill
// queue is empty, so the save is imminent).
func TestKVIndexRemoteRunsFromSavers(t *testing.T) {
	x := NewKVIndex()
	a := hashChain(5, 4)
	for _, g := range []string{"g0", "g1"} {
		x.ObserveRank(g, 0, 1, 0, 0)
		x.Apply(kvBatch(g, 0, 1, clearedAll()))
	}
	x.Plan("g1", a, time.Now().Add(time.Minute)) // g1 is saving blocks 0-3
	all := []string{"g0", "g1"}
	if runs, end := x.RemoteRuns(a, "g0", 0, 4, all, nil); len(runs) != 0 || end != 0 {
		t.Errorf("busy saver: runs %+v, end %d; want none", runs, end)
	}
	if got := x.PoolPrefix(a, all, nil); got != 0 {
		t.Errorf("PoolPrefix with no savers = %d, want 0", got)
	}
	// The run is Saving: the read asks g1 to wait for the ReqMeta.
	want := []messages.RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 4, Saving: true}}
	if runs, end := x.RemoteRuns(a, "g0", 0, 4, all, []string{"g1"}); !reflect.DeepEqual(runs, want) || end != 4 {
		t.Errorf("idle saver: runs %+v, end %d; want %+v, 4", runs, end, want)
	}
	// Once g1's rank confirms the first two, the run is still Saving (its
	// last two blocks are not held yet); once it holds them all, not.
	x.Apply(kvBatch("g1", 0, 2, stored(a[:2]...)))
	if runs, _ := x.RemoteRuns(a, "g0", 0, 4, all, []string{"g1"}); !reflect.DeepEqual(runs, want) {
		t.Errorf("saver holding half: runs %+v; want %+v", runs, want)
	}
	x.Apply(kvBatch("g1", 0, 3, stored(a[2:]...)))
	want[0].Saving = false
	if runs, _ := x.RemoteRuns(a, "g0", 0, 4, all, []string{"g1"}); !reflect.DeepEqual(runs, want) {
		t.Errorf("saver holding all: runs %+v; want %+v", runs, want)
	}
	if got := x.PoolPrefix(a, all, []string{"g1"}); got != 4 {
		t.Errorf("PoolPrefix with g1 saving = %d, want 4", got)
	}
	// A group's own plans are local whatever the savers.
	if runs, end := x.RemoteRuns(a, "g1", 0, 4, all, nil); len(runs) != 0 || end != 4 {
		t.Errorf("own plans: runs %+v, end %d; want none, 4", runs, end)
	}
}

// TestKVIndexResyncKeepsPlans: a gap in one rank's KV events (one core
// NATS message lost) makes the index ask that rank for a dump. The rank did
// not restart: the blocks a request just dispatched to the group is still
// saving keep counting, whether no rank holds them yet or some already do.
// A restart of the rank drops them.
func TestKVIndexResyncKeepsPlans(t *testing.T) {
	x := readyIndex(t, 2, "g0")
	prev := hashChain(1, 4) // the previous turn, held by both ranks
	x.Apply(kvBatch("g0", 0, 1, stored(prev...)))
	x.Apply(kvBatch("g0", 1, 1, stored(prev...)))
	next := append(slices.Clone(prev), hashChain(2, 4)...)
	x.Plan("g0", next[4:], time.Now().Add(30*time.Second)) // the turn just dispatched, being saved
	x.Apply(kvBatch("g0", 1, 2, stored(next[4:6]...)))     // rank 1 saved two of them already
	if got := prefixOn(x, "g0", next); got != 8 {
		t.Fatalf("prefix with the plan = %d, want 8", got)
	}
	// Rank 1's batch seq 3 is lost: seq 4 is a gap, the rank is asked for
	// a dump, which says what it holds at seq 4.
	if !x.Apply(kvBatch("g0", 1, 4)) {
		t.Fatal("a gap did not ask for a dump")
	}
	x.ApplyDump("g0", 1, kvDump("g0", 1, 4, next[:6]...))
	if got := prefixOn(x, "g0", next); got != 8 {
		t.Errorf("after rank 1's resync: prefix = %d, want 8 (the plan of the turn being saved was dropped; %d plans left)", got, x.Plans())
	}
	// A restart: the rank lost what it was saving.
	x.Apply(kvBatch("g0", 1, 1, clearedAll()))
	if got := prefixOn(x, "g0", next); got != 0 {
		t.Errorf("after rank 1 restarted: prefix = %d, want 0", got)
	}
}

// TestKVIndexRestartHeardByHeartbeatDropsPlans: a rank restarts and its new
// process's first KV batch (seq 1, AllBlocksCleared) is lost; the index
// learns of the restart from the heartbeat's started_unix_ms and asks for
// a dump. The new process lost what the old one was saving: the group's
// plans go, as at an AllBlocksCleared.
func TestKVIndexRestartHeardByHeartbeatDropsPlans(t *testing.T) {
	x := readyIndex(t, 2, "g0")
	turn := hashChain(1, 8)
	x.Plan("g0", turn, time.Now().Add(10*time.Second)) // being saved by both ranks
	if got := prefixOn(x, "g0", turn); got != 8 {
		t.Fatalf("prefix with the plan = %d, want 8", got)
	}
	if !x.ObserveRank("g0", 1, 2, 2, 0) { // a new started_unix_ms
		t.Fatal("a restart heard in a heartbeat did not ask for a dump")
	}
	x.ApplyDump("g0", 1, kvDump("g0", 1, 1))
	if got := prefixOn(x, "g0", turn); got != 0 {
		t.Errorf("after rank 1 restarted: prefix = %d, want 0 (the plan outlived the loss of what it was saving)", got)
	}
}

// TestKVIndexBeyond64Groups: group ids past 63 live in further words of
// 64; prefix matches, remote runs, save plans, sizes and forgetting work
// across them as within the first.
func TestKVIndexBeyond64Groups(t *testing.T) {
	const n = 200 // ids 0–199: four words, the last one partial
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("g%03d", i)
	}
	x := readyIndex(t, 2, names...)
	a := hashChain(7, 40)
	// Group i holds blocks [0, i%40) on both ranks; g199 only on rank 0.
	for i, g := range names {
		for r := range 2 {
			if g == "g199" && r == 1 {
				continue
			}
			if x.Apply(kvBatch(g, r, 1, stored(a[:i%40]...))) {
				t.Fatalf("%s/%d asked for a dump", g, r)
			}
		}
	}
	pm := x.PrefixMatch(a, nil)
	for i, g := range names {
		id, ok := x.GroupID(g)
		if !ok {
			t.Fatalf("%s not indexed", g)
		}
		want := i % 40
		if g == "g199" {
			want = 0
		}
		if pm[id] != want {
			t.Errorf("prefix of %s (id %d) = %d, want %d", g, id, pm[id], want)
		}
	}
	// One entry per (group, block), g199's on one rank too; blocks 0–38 are
	// held in full by the groups with i%40 == 39 (but g199).
	if entries, full := x.Size(); entries != 5*780 || full != 39 {
		t.Errorf("Size() = %d entries, %d full blocks; want %d, 39", entries, full, 5*780)
	}

	// g150 holds blocks 0–29 (150%40), g159, g039 and g079 0–38.
	if got := x.PoolPrefix(a, []string{"g150"}, nil); got != 30 {
		t.Errorf("PoolPrefix from g150 alone = %d, want 30", got)
	}
	want := []messages.RemoteRun{{Group: "g150", FromBlock: 5, Blocks: 25, Alternates: []string{"g159"}}, {Group: "g159", FromBlock: 30, Blocks: 9}}
	if runs, end := x.RemoteRuns(a, "g005", 5, 40, []string{"g150", "g159"}, nil); !reflect.DeepEqual(runs, want) || end != 39 {
		t.Errorf("RemoteRuns from g150, g159 = %+v, %d; want %+v, 39", runs, end, want)
	}
	// g130 (the third word) reads past its own 10 blocks from the lowest
	// id among its sources: g039, in the first word.
	want = []messages.RemoteRun{{Group: "g039", FromBlock: 10, Blocks: 29, Alternates: []string{"g079"}}}
	if runs, end := x.RemoteRuns(a, "g130", 0, 40, []string{"g079", "g039"}, nil); !reflect.DeepEqual(runs, want) || end != 39 {
		t.Errorf("RemoteRuns from g079, g039 = %+v, %d; want %+v, 39", runs, end, want)
	}
	// With more holders of the whole run, the two of lowest id but the
	// source are its alternates, across words (g199 holds it on one rank
	// only: not a source).
	want = []messages.RemoteRun{{Group: "g039", FromBlock: 10, Blocks: 29, Alternates: []string{"g079", "g119"}}}
	if runs, end := x.RemoteRuns(a, "g130", 0, 40, []string{"g199", "g159", "g119", "g079", "g039"}, nil); !reflect.DeepEqual(runs, want) || end != 39 {
		t.Errorf("RemoteRuns from five holders = %+v, %d; want %+v, 39", runs, end, want)
	}

	// A longer start beats a lower id across words: g110 (word 1) holds
	// blocks 10-29 of g039's run, g159 (word 2) all of it.
	want = []messages.RemoteRun{{Group: "g039", FromBlock: 10, Blocks: 29, Alternates: []string{"g159", "g110"}}}
	if runs, end := x.RemoteRuns(a, "g130", 0, 40, []string{"g110", "g159", "g039"}, nil); !reflect.DeepEqual(runs, want) || end != 39 {
		t.Errorf("RemoteRuns from a partial and a whole holder = %+v, %d; want %+v, 39", runs, end, want)
	}

	// A plan of g170 (id 170, the third word) counts for it and, as a
	// saver's, for others.
	x.Plan("g170", a, time.Now().Add(time.Minute))
	id170, _ := x.GroupID("g170")
	if pm := x.PrefixMatch(a, nil); pm[id170] != 40 {
		t.Errorf("prefix of g170 with its plan = %d, want 40", pm[id170])
	}
	want = []messages.RemoteRun{{Group: "g170", FromBlock: 0, Blocks: 40, Saving: true}}
	if runs, end := x.RemoteRuns(a, "g000", 0, 40, []string{"g170"}, []string{"g170"}); !reflect.DeepEqual(runs, want) || end != 40 {
		t.Errorf("RemoteRuns from the saver g170 = %+v, %d; want %+v, 40", runs, end, want)
	}

	// Forgetting groups of every word leaves the others as they were.
	x.Forget("g039", "g079", "g119", "g159", "g170", "g199")
	for _, g := range []string{"g039", "g079", "g119", "g159", "g170", "g199"} {
		if _, ok := x.GroupID(g); ok {
			t.Errorf("%s still indexed", g)
		}
	}
	if x.Plans() != 0 {
		t.Errorf("%d plans left of a forgotten group", x.Plans())
	}
	if _, full := x.Size(); full != 38 {
		t.Errorf("%d full blocks after forgetting every group holding block 38, want 38", full)
	}
	pm = x.PrefixMatch(a, nil)
	for _, g := range []string{"g000", "g038", "g078", "g118", "g158", "g198"} {
		id, _ := x.GroupID(g)
		var i int
		fmt.Sscanf(g, "g%d", &i)
		if pm[id] != i%40 {
			t.Errorf("prefix of %s after the forgetting = %d, want %d", g, pm[id], i%40)
		}
	}
	// Their ids are reused by new groups, which start empty.
	x2 := []string{"n0", "n1"}
	for _, g := range x2 {
		x.ObserveRank(g, 0, 1, 1, 0)
		x.ApplyDump(g, 0, kvDump(g, 0, 0))
	}
	pm = x.PrefixMatch(a, nil)
	for _, g := range x2 {
		id, ok := x.GroupID(g)
		if !ok || pm[id] != 0 {
			t.Errorf("new group %s: id %d (%v), prefix %d; want an indexed empty group", g, id, ok, pm[id])
		}
	}
}

// distinct returns n block hashes of their own, from first on.
func distinct(first, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(first+i)*0x9e3779b97f4a7c15 | 1
	}
	return out
}

// rankHeld is what the index records for a rank.
func rankHeld(x *KVIndex, group string, rank int) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.groups[group].ranks[rank].held
}

// TestKVIndexForgedRankIsBounded: a rank that streams stores of blocks it
// never removes (a forged one: without auth anyone may publish a rank's
// KV events and heartbeats) is recorded up to its bound and no further,
// whatever capacity it says; its removals still apply. Before, 20 batches
// of 50,000 stores left 1,000,000 entries, and every further batch more.
func TestKVIndexForgedRankIsBounded(t *testing.T) {
	const bound, batch, batches = 100_000, 50_000, 20
	for _, tt := range []struct {
		name     string
		capacity int64
		limit    int
	}{
		{"capacity unknown: the fixed bound", 0, bound},
		{"a capacity larger than the fixed bound: the fixed bound", 1 << 40, bound},
		{"a small capacity: twice it and the slack", 1_000, 2*1_000 + rankSlackBlocks},
	} {
		t.Run(tt.name, func(t *testing.T) {
			x := NewKVIndex()
			x.maxRankBlocks = 300_000 // above the small capacity's limit
			if tt.limit == bound {
				x.maxRankBlocks = bound
			}
			x.ObserveRank("f0", 0, 1, 1, tt.capacity)
			x.ApplyDump("f0", 0, kvDump("f0", 0, 0))
			var first []uint64
			for k := range batches {
				h := distinct(k*batch, batch)
				if k == 0 {
					first = h
				}
				if x.Apply(kvBatch("f0", 0, uint64(k+1), stored(h...))) {
					t.Fatalf("batch %d asked for a dump", k+1)
				}
			}
			entries, _ := x.Size()
			if held := rankHeld(x, "f0", 0); held != tt.limit || entries != tt.limit {
				t.Errorf("after %d stores: rank holds %d, index %d entries; want both %d", batches*batch, held, entries, tt.limit)
			}
			if got, want := x.Refused(), uint64(batches*batch-tt.limit); got != want {
				t.Errorf("Refused = %d, want %d", got, want)
			}
			// Its removals apply, and free room for as many stores.
			seq := uint64(batches + 1)
			x.Apply(kvBatch("f0", 0, seq, removed(first[:10]...)))
			x.Apply(kvBatch("f0", 0, seq+1, stored(distinct(1<<30, 20)...)))
			if held := rankHeld(x, "f0", 0); held != tt.limit {
				t.Errorf("after 10 removals and 20 stores: rank holds %d, want %d", held, tt.limit)
			}
			// The same rank's capacity, said again, needs no write lock;
			// another is taken at once.
			x.ObserveRank("f0", 0, 1, 1, tt.capacity)
			x.mu.RLock()
			capacity := x.groups["f0"].ranks[0].capacity
			x.mu.RUnlock()
			if capacity != tt.capacity {
				t.Errorf("capacity %d, want %d", capacity, tt.capacity)
			}
		})
	}
}

// TestKVIndexGenuineRankAtCapacityIsNotCut: a rank that holds all its
// store's capacity stores a request's blocks in one batch, and the removal
// of the blocks that put evicted comes in the next (the events race): the
// index counts more than the capacity for a moment, within the bound, and
// records every block the rank holds.
func TestKVIndexGenuineRankAtCapacityIsNotCut(t *testing.T) {
	const capacity = 4_000
	x := readyIndex(t, 2, "g0")
	for r := range 2 {
		x.ObserveRank("g0", r, 2, 1, capacity)
	}
	held := distinct(0, capacity)
	seq := uint64(1)
	for r := range 2 {
		x.Apply(kvBatch("g0", r, seq, stored(held...)))
	}
	// Ten turns, each a put of a whole store's worth of new blocks that
	// evicts all the old ones, its removal one batch late.
	for turn := range 10 {
		next := distinct((turn+1)*capacity, capacity)
		seq++
		for r := range 2 {
			x.Apply(kvBatch("g0", r, seq, stored(next...)))
		}
		seq++
		for r := range 2 {
			x.Apply(kvBatch("g0", r, seq, removed(held...)))
		}
		held = next
	}
	if got := x.Refused(); got != 0 {
		t.Errorf("Refused = %d, want 0: a genuine rank's stores were cut", got)
	}
	if got := x.GroupBlocks("g0"); got != capacity {
		t.Errorf("GroupBlocks = %d, want %d", got, capacity)
	}
	if got := prefixOn(x, "g0", held); got != capacity {
		t.Errorf("prefix of the last turn's blocks = %d, want %d", got, capacity)
	}
}

// TestKVIndexDumpIsCutToTheBound: a dump of more blocks than a rank's
// bound records the bound; the rest is counted, reported once a minute.
func TestKVIndexDumpIsCutToTheBound(t *testing.T) {
	const capacity = 1_000
	limit := 2*capacity + rankSlackBlocks
	x := NewKVIndex()
	x.ObserveRank("f0", 0, 1, 1, capacity)
	x.ApplyDump("f0", 0, kvDump("f0", 0, 7, distinct(0, limit+5_000)...))
	if held, _ := x.Size(); rankHeld(x, "f0", 0) != limit || held != limit {
		t.Errorf("after the dump: rank holds %d, index %d entries; want %d", rankHeld(x, "f0", 0), held, limit)
	}
	if got := x.Refused(); got != 5_000 {
		t.Errorf("Refused = %d, want 5000", got)
	}
	now := time.Now()
	o, ok := x.OverBound("f0", 0, now)
	want := OverBound{Held: limit, Limit: limit, CapacityBlocks: capacity, Refused: 5_000, Entries: limit, MaxEntries: MaxIndexEntries}
	if !ok || o != want || o.IndexFull() {
		t.Errorf("OverBound = %+v, %v; want %+v, true (the rank's bound)", o, ok, want)
	}
	// Another dump as large: counted, reported only after a minute.
	x.ApplyDump("f0", 0, kvDump("f0", 0, 8, distinct(0, limit+5_000)...))
	if _, ok := x.OverBound("f0", 0, now.Add(30*time.Second)); ok {
		t.Error("reported twice within a minute")
	}
	if o, ok := x.OverBound("f0", 0, now.Add(61*time.Second)); !ok || o.Refused != 5_000 {
		t.Errorf("a minute later: OverBound = %+v, %v; want 5000 refused, true", o, ok)
	}
	if _, ok := x.OverBound("f0", 0, now.Add(3*time.Minute)); ok {
		t.Error("reported with nothing refused since")
	}
}

// TestKVIndexEntriesAreBounded: forged ranks of many groups, each within
// its own bound, fill the index to MaxIndexEntries and no further; a block
// another rank of the group already has an entry for still counts, and a
// forgotten group's entries make room.
func TestKVIndexEntriesAreBounded(t *testing.T) {
	const maxEntries = 10_000
	x := readyIndex(t, 2, "f0", "f1", "g0")
	x.maxEntries = maxEntries
	x.Apply(kvBatch("g0", 0, 1, stored(distinct(0, 100)...)))
	x.Apply(kvBatch("f0", 0, 1, stored(distinct(1_000, 6_000)...)))
	x.Apply(kvBatch("f1", 0, 1, stored(distinct(10_000, 6_000)...)))
	if entries, _ := x.Size(); entries != maxEntries {
		t.Errorf("%d entries, want %d", entries, maxEntries)
	}
	if got := x.Refused(); got != 2_100 {
		t.Errorf("Refused = %d, want 2100", got)
	}
	if o, ok := x.OverBound("f1", 0, time.Now()); !ok || !o.IndexFull() || o.Refused != 2_100 {
		t.Errorf("OverBound(f1) = %+v, %v; want the index full, 2100 refused", o, ok)
	}
	// g0's rank 1 stores what rank 0 holds: no new entry, recorded.
	x.Apply(kvBatch("g0", 1, 1, stored(distinct(0, 100)...)))
	if got := x.GroupBlocks("g0"); got != 100 {
		t.Errorf("GroupBlocks(g0) = %d, want 100", got)
	}
	x.Forget("f0", "f1")
	if entries, _ := x.Size(); entries != 100 {
		t.Errorf("after forgetting f0 and f1: %d entries, want 100", entries)
	}
	x.Apply(kvBatch("g0", 0, 2, stored(distinct(100, 100)...)))
	x.Apply(kvBatch("g0", 1, 2, stored(distinct(100, 100)...)))
	if got := x.GroupBlocks("g0"); got != 200 {
		t.Errorf("GroupBlocks(g0) after the forgetting = %d, want 200", got)
	}
}
