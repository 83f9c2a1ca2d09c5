package scheduler

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// MaxIndexedGroups is how many worker groups one KV index tracks at once
// (a forgotten group's id is reused); groups beyond it are placed as if
// they held nothing. 1,024 groups of 4 ranks are 4,096 GPUs.
const MaxIndexedGroups = messages.MaxGroups

// maxPendingBatches and maxPendingBytes bound the batches held back per
// rank during a resync, by number and by the size of their hashes and
// token ids: one batch may carry 8 MiB of them, and 4,096 batches of a
// forged rank that never answers a dump held 32 GiB.
const (
	maxPendingBatches = 4096
	maxPendingBytes   = 64 << 20
)

// MaxSeqJump is how far past the last seq the index knows for a rank a
// batch's seq may be. A rank publishes one batch per store or eviction, so a
// larger jump is not a gap but a corrupted, replayed or forged batch: it is
// dropped and counted (Rejected), and causes no resync.
const MaxSeqJump = 1 << 17

// MaxRankBlocks is the most blocks the index records for one rank: the
// bound of a rank whose heartbeats do not say its store's capacity
// (capacity_blocks 0: a rank whose engine keeps its own cache, or one not
// heard of yet) and the most any rank's capacity raises its bound to (a
// forged rank says what capacity it likes). 4,194,304 blocks are 2 TiB of
// 512 KiB blocks (Llama-3.1-8B at TP 4: a rank with 1 TiB of DRAM holds 2M
// of them) or 64M tokens of 16-token blocks (--kv-payload accounting with
// --kv-capacity 64Mtok), about 300 MB of index at the ~75 bytes a block
// BenchmarkIndexMemoryPerBlock measures. A rank that holds more is indexed
// in part: placement misses the rest, nothing wrong is loaded.
const MaxRankBlocks = 1 << 22

// rankSlackBlocks is what a rank's bound allows past twice its capacity: a
// rank's events race (one thread's put evicts blocks whose removal goes
// out in the batch after the one that says what the put stored), so the
// index may briefly count more than the store holds; one put stores at most
// one request's blocks, at most messages.MaxArrayLen of them.
const rankSlackBlocks = messages.MaxArrayLen

// MaxIndexEntries bounds the (group, block) entries of the whole index, what
// its memory grows with (~75 bytes an entry, ~10 GB at the bound): a forger
// with auth off can claim every rank of MaxIndexedGroups groups, and 64 ranks
// of 1,024 groups at MaxRankBlocks each are 2^38 blocks. 134M entries hold
// 256 groups whose ranks each keep 256 GiB of 512 KiB blocks (a GPU's share
// of an 8-GPU host with 2 TiB of DRAM). Past it no new entry is recorded,
// whichever rank stores it.
const MaxIndexEntries = 1 << 27

// KVIndex knows, from the ranks' own KV events, which blocks each worker
// group holds. A block counts for a group only when every rank of the group
// holds it. Safe for concurrent use; lookups take a read lock only.
//
// Each rank's events carry a seq that increases by one per batch. A gap, a
// rank first seen in the middle of its stream, or a restart marks the rank
// for resync: its batches are held back until a dump of what it holds
// arrives (ApplyDump), then replayed.
type KVIndex struct {
	mu     sync.RWMutex
	groups map[string]*indexGroup
	byID   []*indexGroup // nil where a forgotten group's id is free
	free   []groupID     // ids of forgotten groups, reused first
	// maxGroups is MaxIndexedGroups, maxRankBlocks MaxRankBlocks and
	// maxEntries MaxIndexEntries (tests lower them).
	maxGroups, maxRankBlocks, maxEntries int
	// entries counts the (group, block) entries of every group.
	entries int
	// full maps a block hash to the group ids where every rank holds it
	// (each group's entries say which of its ranks hold which blocks).
	full wordMaps
	// fullBlocks counts the hashes in full (held in full by some group).
	fullBlocks int

	// Save plans: blocks a request just dispatched to a group will store.
	// planned maps a hash to the groups that plan it; planExp
	// holds each plan's expiry (unix nanos) and planQ the plans in order of
	// expiry, so expiring them is O(1) amortized.
	planned wordMaps
	planExp map[rankKey]int64
	planQ   []planItem

	rejected atomic.Uint64 // batches dropped for an impossible seq
	refused  atomic.Uint64 // stores not recorded: past a rank's bound or MaxIndexEntries
}

type indexGroup struct {
	name      string
	id        groupID
	worldSize int
	blocks    int          // blocks every rank holds
	touched   atomic.Int64 // unix nanos of the group's last heartbeat, batch or plan
	// lostAt is when (unix ms) the group last lost what a rank held: a
	// rank's process restarted, or cleared its store (an engine that
	// restarted); 0: not since this index knew the group.
	lostAt atomic.Int64
	ranks  map[int]*rankState
	// entries maps a block hash to the bitmask of the ranks holding it: a
	// rank's restart or the group's resize scans only its own group.
	entries map[uint64]uint64
}

type rankState struct {
	seq     uint64 // last applied
	started int64  // started_unix_ms of the rank's process
	held    int    // blocks this rank holds
	// capacity is the capacity_blocks of the rank's last heartbeat (0:
	// unknown); its bound on held is limitOf.
	capacity int64
	// refused counts the rank's stores not recorded since OverBound last
	// reported them, at saidAt (unix nanos).
	refused int
	saidAt  int64
	// synced: seq is the rank's real seq (learnt from a dump or from its
	// stream since its restart), so an impossible jump can be told.
	synced    bool
	resyncing bool
	// epoch counts the rank's restarts seen: a dump asked for before one is
	// stale.
	epoch   uint64
	pending []*messages.KVEventBatch
	// pendingBytes is the batchBytes of pending.
	pendingBytes int
}

// hold holds b back until the rank's dump arrives. Past maxPendingBatches
// or maxPendingBytes, what was held goes: the dump covers it, and a gap
// after the dump asks again.
func (rs *rankState) hold(b *messages.KVEventBatch) {
	n := batchBytes(b)
	if len(rs.pending) >= maxPendingBatches || rs.pendingBytes+n > maxPendingBytes {
		clear(rs.pending)
		rs.pending, rs.pendingBytes = rs.pending[:0], 0
	}
	rs.pending = append(rs.pending, b)
	rs.pendingBytes += n
}

// setPending replaces what is held back.
func (rs *rankState) setPending(pending []*messages.KVEventBatch) {
	rs.pending, rs.pendingBytes = pending, 0
	for _, b := range pending {
		rs.pendingBytes += batchBytes(b)
	}
}

// batchBytes is about what a decoded batch holds: its hashes and token ids.
func batchBytes(b *messages.KVEventBatch) int {
	n := 0
	for i := range b.Events {
		n += 8*len(b.Events[i].BlockHashes) + 4*len(b.Events[i].TokenIDs)
	}
	return n
}

// NewKVIndex returns an empty index of MaxIndexedGroups groups.
func NewKVIndex() *KVIndex { return newKVIndex(MaxIndexedGroups) }

func newKVIndex(maxGroups int) *KVIndex {
	return &KVIndex{
		groups: map[string]*indexGroup{}, maxGroups: maxGroups, maxRankBlocks: MaxRankBlocks, maxEntries: MaxIndexEntries,
		planExp: map[rankKey]int64{},
	}
}

// Rejected returns how many batches were dropped for an impossible seq.
func (x *KVIndex) Rejected() uint64 { return x.rejected.Load() }

// Refused returns how many stores of blocks were not recorded: the rank
// already held its bound (limitOf), or the index MaxIndexEntries.
func (x *KVIndex) Refused() uint64 { return x.refused.Load() }

// limitOf is the most blocks the index records for a rank: twice the
// capacity its heartbeats say, plus rankSlackBlocks, at most maxRankBlocks;
// maxRankBlocks when the capacity is unknown.
func (x *KVIndex) limitOf(rs *rankState) int {
	if c := rs.capacity; c > 0 && c < int64(x.maxRankBlocks) {
		return min(2*int(c)+rankSlackBlocks, x.maxRankBlocks)
	}
	return x.maxRankBlocks
}

// group returns the group's state, creating it, and marks it heard of;
// nil when the index is full.
func (x *KVIndex) group(name string) *indexGroup {
	now := time.Now().UnixNano()
	if g := x.groups[name]; g != nil {
		g.touched.Store(now)
		return g
	}
	g := &indexGroup{name: name, ranks: map[int]*rankState{}, entries: map[uint64]uint64{}}
	g.touched.Store(now)
	switch {
	case len(x.free) > 0:
		g.id = x.free[len(x.free)-1]
		x.free = x.free[:len(x.free)-1]
		x.byID[g.id] = g
	case len(x.byID) < x.maxGroups:
		g.id = groupID(len(x.byID))
		x.byID = append(x.byID, g)
	default:
		return nil
	}
	x.groups[name] = g
	return g
}

func (g *indexGroup) rank(r int) *rankState {
	rs := g.ranks[r]
	if rs == nil {
		rs = &rankState{}
		g.ranks[r] = rs
	}
	return rs
}

// Apply ingests one batch of a rank's events. It returns true when the rank
// needs a resync: the caller should ask it for a dump and call ApplyDump.
func (x *KVIndex) Apply(b *messages.KVEventBatch) (needDump bool) {
	if b.Rank < 0 || b.Rank >= 64 {
		return false
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	g := x.group(b.Group)
	if g == nil {
		return false
	}
	rs := g.rank(b.Rank)
	restart := b.Seq == 1 && len(b.Events) > 0 && b.Events[0].Type == messages.EventAllBlocksCleared
	switch {
	case restart:
		// The rank's process (re)started and says it holds nothing: whatever
		// a resync was waiting for is moot, and a dump asked of the old
		// process is stale.
		x.clearRankLocked(g, b.Rank, rs, false)
		rs.setPending(nil)
		rs.resyncing, rs.synced = false, true
		rs.epoch++
	case rs.synced && b.Seq > rs.seq+MaxSeqJump:
		x.rejected.Add(1)
		return false
	case rs.resyncing:
		rs.hold(b)
		return false
	case b.Seq == rs.seq+1:
		rs.synced = true // contiguous from the rank's first batch or a dump
	case b.Seq <= rs.seq && rs.seq != 0:
		return false // a duplicate of what was applied
	default: // a gap, or a rank first seen mid-stream
		rs.resyncing = true
		rs.hold(b)
		return true
	}
	x.applyLocked(g, b.Rank, rs, b, false)
	return false
}

// applyLocked applies a batch of a rank's events; in a dump (keepPlans) its
// AllBlocksCleared keeps the group's plans (see clearRankLocked).
func (x *KVIndex) applyLocked(g *indexGroup, rank int, rs *rankState, b *messages.KVEventBatch, keepPlans bool) {
	refused := rs.refused
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Type {
		case messages.EventBlockStored:
			for _, h := range ev.BlockHashes {
				x.storeLocked(g, rank, rs, h)
			}
		case messages.EventBlockRemoved:
			for _, h := range ev.BlockHashes {
				x.removeLocked(g, rank, rs, h)
			}
		case messages.EventAllBlocksCleared:
			x.clearRankLocked(g, rank, rs, keepPlans)
		}
	}
	if rs.refused != refused {
		x.refused.Add(uint64(rs.refused - refused))
	}
	rs.seq = b.Seq
}

func (x *KVIndex) storeLocked(g *indexGroup, rank int, rs *rankState, h uint64) {
	m := g.entries[h]
	bit := uint64(1) << rank
	if m&bit != 0 {
		return
	}
	// Past its bound a rank's stores are not recorded (its removals still
	// apply): a forged rank streaming stores grew the index by ~40 MB per
	// 8 MiB batch, without end.
	if rs.held >= x.limitOf(rs) || (m == 0 && x.entries >= x.maxEntries) {
		rs.refused++
		return
	}
	if m == 0 {
		x.entries++
	}
	g.entries[h] = m | bit
	rs.held++
	if !g.isFull(m) && g.isFull(m|bit) {
		x.markFull(g.id, h)
		g.blocks++
		x.unplanLocked(rankKey{h, g.id}) // confirmed by every rank
	}
}

// isFull reports whether the ranks in mask include every rank of the group
// (ranks beyond the world size, left by a group that shrank, do not count).
func (g *indexGroup) isFull(mask uint64) bool {
	if g.worldSize <= 0 {
		return false
	}
	all := uint64(1)<<g.worldSize - 1
	if g.worldSize == 64 {
		all = ^uint64(0)
	}
	return mask&all == all
}

// removeLocked applies a rank's BlockRemoved of h. A plan for h is stale
// whether or not the index knew the rank held it: a rank's put can evict a
// block another of its threads just saved before that thread says so, and
// then the rank publishes only the removal (workers' publishStored). Kept,
// that plan counted h as the group's until it expired, and the next turn
// was told to load a block the rank did not have.
func (x *KVIndex) removeLocked(g *indexGroup, rank int, rs *rankState, h uint64) {
	x.dropLocked(g, rank, rs, h)
	x.unplanLocked(rankKey{h, g.id}) // a rank evicted it: a plan for it is stale
}

// dropLocked forgets that rank holds h; it reports whether it did.
func (x *KVIndex) dropLocked(g *indexGroup, rank int, rs *rankState, h uint64) bool {
	m, ok := g.entries[h]
	bit := uint64(1) << rank
	if !ok || m&bit == 0 {
		return false
	}
	if g.isFull(m) && !g.isFull(m&^bit) {
		x.unfullLocked(g, h)
	}
	rs.held--
	if m &^= bit; m == 0 {
		delete(g.entries, h)
		x.entries--
	} else {
		g.entries[h] = m
	}
	return true
}

func (x *KVIndex) unfullLocked(g *indexGroup, h uint64) {
	x.clearFull(g.id, h)
	g.blocks--
}

// markFull records that every rank of group id holds h; clearFull that
// they do not.
func (x *KVIndex) markFull(id groupID, h uint64) {
	if x.full.add(id, h) {
		x.fullBlocks++
	}
}

func (x *KVIndex) clearFull(id groupID, h uint64) {
	w, bit := wordBit(id)
	if x.full.remove(w, h, bit) {
		x.fullBlocks--
	}
}

// clearRankLocked forgets every block of one rank: a scan of the group's
// entries, which happens only at a restart, a clear or a resync. At a
// restart or a clear the rank lost what it was saving too, and the group's
// plans go; a resync's dump (keepPlans) only replaces what the index knows
// the rank holds: the rank is still saving what it was.
func (x *KVIndex) clearRankLocked(g *indexGroup, rank int, rs *rankState, keepPlans bool) {
	if !keepPlans {
		x.lostCacheLocked(g)
	}
	if rs.held == 0 {
		return
	}
	for h, m := range g.entries {
		if m&(1<<rank) != 0 {
			x.dropLocked(g, rank, rs, h)
		}
	}
	rs.held = 0
}
