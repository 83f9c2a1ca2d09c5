package scheduler

import (
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// MaxIndexedGroups is how many worker groups one KV index tracks at once
// (a forgotten group's id is reused); groups beyond it are placed as if
// they held nothing. 1,024 groups of 4 ranks are 4,096 GPUs.
const MaxIndexedGroups = messages.MaxGroups

// maxPendingBatches bounds the batches held back per rank during a resync.
const maxPendingBatches = 4096

// MaxSeqJump is how far past the last seq the index knows for a rank a
// batch's seq may be. A rank publishes one batch per store or eviction, so a
// larger jump is not a gap but a corrupted, replayed or forged batch: it is
// dropped and counted (Rejected), and causes no resync.
const MaxSeqJump = 1 << 17

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
	// maxGroups is MaxIndexedGroups (tests lower it).
	maxGroups int
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
}

type planItem struct {
	key rankKey
	exp int64
}

type rankKey struct {
	hash uint64
	gid  groupID
}

// groupID numbers a group in the index: bit id%64 of word id/64 in a
// groupMask or a wordMaps value.
type groupID = uint16

func wordBit(id groupID) (word int, bit uint64) { return int(id >> 6), 1 << (id & 63) }

// groupMask is a set of group ids, a bitmask per word of 64 ids.
type groupMask []uint64

func (m groupMask) has(id groupID) bool {
	w, bit := wordBit(id)
	return w < len(m) && m[w]&bit != 0
}

// word returns the ids of word w (0 past the end).
func (m groupMask) word(w int) uint64 {
	if w < len(m) {
		return m[w]
	}
	return 0
}

func (m *groupMask) add(id groupID) {
	w, bit := wordBit(id)
	for len(*m) <= w {
		*m = append(*m, 0)
	}
	(*m)[w] |= bit
}

// wordMaps maps a block hash to a set of group ids: one map per word of 64
// ids, so that up to 64 groups a lookup is one map access per block, and
// each further 64 groups add one.
type wordMaps []map[uint64]uint64

func (wm wordMaps) has(id groupID, h uint64) bool {
	w, bit := wordBit(id)
	return w < len(wm) && wm[w][h]&bit != 0
}

// add puts id into h's set and reports whether h was in no set before.
func (wm *wordMaps) add(id groupID, h uint64) (first bool) {
	w, bit := wordBit(id)
	for len(*wm) <= w {
		*wm = append(*wm, map[uint64]uint64{})
	}
	m := (*wm)[w]
	old, ok := m[h]
	m[h] = old | bit
	return !ok && !wm.inOthers(w, h)
}

// remove takes the ids in bits of word w out of h's set and reports
// whether h is in no set any more (having been in one).
func (wm wordMaps) remove(w int, h uint64, bits uint64) (last bool) {
	if w >= len(wm) {
		return false
	}
	m := wm[w]
	old, ok := m[h]
	if !ok {
		return false
	}
	if f := old &^ bits; f != 0 {
		m[h] = f
		return false
	}
	delete(m, h)
	return !wm.inOthers(w, h)
}

// inOthers reports whether h is in a set of a word other than w.
func (wm wordMaps) inOthers(w int, h uint64) bool {
	for i, m := range wm {
		if i != w {
			if _, ok := m[h]; ok {
				return true
			}
		}
	}
	return false
}

type indexGroup struct {
	name      string
	id        groupID
	worldSize int
	blocks    int   // blocks every rank holds
	touched   int64 // unix nanos of the group's last heartbeat, batch or plan
	ranks     map[int]*rankState
	// entries maps a block hash to the bitmask of the ranks holding it: a
	// rank's restart or the group's resize scans only its own group.
	entries map[uint64]uint64
}

type rankState struct {
	seq     uint64 // last applied
	started int64  // started_unix_ms of the rank's process
	held    int    // blocks this rank holds
	// synced: seq is the rank's real seq (learnt from a dump or from its
	// stream since its restart), so an impossible jump can be told.
	synced    bool
	resyncing bool
	// epoch counts the rank's restarts seen: a dump asked for before one is
	// stale.
	epoch   uint64
	pending []*messages.KVEventBatch
}

// NewKVIndex returns an empty index of MaxIndexedGroups groups.
func NewKVIndex() *KVIndex { return newKVIndex(MaxIndexedGroups) }

func newKVIndex(maxGroups int) *KVIndex {
	return &KVIndex{
		groups: map[string]*indexGroup{}, maxGroups: maxGroups, planExp: map[rankKey]int64{},
	}
}

// Rejected returns how many batches were dropped for an impossible seq.
func (x *KVIndex) Rejected() uint64 { return x.rejected.Load() }

// group returns the group's state, creating it, and marks it heard of;
// nil when the index is full.
func (x *KVIndex) group(name string) *indexGroup {
	now := time.Now().UnixNano()
	if g := x.groups[name]; g != nil {
		g.touched = now
		return g
	}
	g := &indexGroup{name: name, touched: now, ranks: map[int]*rankState{}, entries: map[uint64]uint64{}}
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

// ForgetIdle forgets the groups not heard of (no heartbeat, KV batch or
// save plan) for after, and returns their names. See Forget.
func (x *KVIndex) ForgetIdle(now time.Time, after time.Duration) []string {
	idle := func() (names []string) {
		for name, g := range x.groups {
			if now.UnixNano()-g.touched > int64(after) {
				names = append(names, name)
			}
		}
		return names
	}
	// Called every sweep: lookups are not stopped unless a group goes.
	x.mu.RLock()
	names := idle()
	x.mu.RUnlock()
	if len(names) == 0 {
		return nil
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	names = idle() // heard of again in between: kept
	x.forgetLocked(names)
	return names
}

// Forget drops groups: their blocks, their save plans and their ranks'
// seqs, and frees their ids for other groups. For groups gone for good
// (scaled in, renamed); one that comes back is new to the index, and
// resyncs from its ranks' dumps. One scan of every entry, however many
// groups go: rare.
func (x *KVIndex) Forget(names ...string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.forgetLocked(names)
}

func (x *KVIndex) forgetLocked(names []string) {
	var gone groupMask
	for _, name := range names {
		if g := x.groups[name]; g != nil {
			gone.add(g.id)
		}
	}
	if gone == nil {
		return
	}
	for k := range x.planExp {
		if gone.has(k.gid) {
			x.unplanLocked(k)
		}
	}
	for _, name := range names {
		if g := x.groups[name]; g != nil {
			for h := range g.entries {
				x.clearFull(g.id, h)
			}
			delete(x.groups, name)
			x.byID[g.id] = nil
			x.free = append(x.free, g.id)
		}
	}
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
		rs.pending, rs.resyncing, rs.synced = nil, false, true
		rs.epoch++
	case rs.synced && b.Seq > rs.seq+MaxSeqJump:
		x.rejected.Add(1)
		return false
	case rs.resyncing:
		if len(rs.pending) >= maxPendingBatches {
			rs.pending = rs.pending[:0] // the dump covers them; a gap after it asks again
		}
		rs.pending = append(rs.pending, b)
		return false
	case b.Seq == rs.seq+1:
		rs.synced = true // contiguous from the rank's first batch or a dump
	case b.Seq <= rs.seq && rs.seq != 0:
		return false // a duplicate of what was applied
	default: // a gap, or a rank first seen mid-stream
		rs.resyncing = true
		rs.pending = append(rs.pending, b)
		return true
	}
	x.applyLocked(g, b.Rank, rs, b, false)
	return false
}

// applyLocked applies a batch of a rank's events; in a dump (keepPlans) its
// AllBlocksCleared keeps the group's plans (see clearRankLocked).
func (x *KVIndex) applyLocked(g *indexGroup, rank int, rs *rankState, b *messages.KVEventBatch, keepPlans bool) {
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
	rs.seq = b.Seq
}

func (x *KVIndex) storeLocked(g *indexGroup, rank int, rs *rankState, h uint64) {
	m := g.entries[h]
	bit := uint64(1) << rank
	if m&bit != 0 {
		return
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

func (x *KVIndex) removeLocked(g *indexGroup, rank int, rs *rankState, h uint64) {
	if x.dropLocked(g, rank, rs, h) {
		x.unplanLocked(rankKey{h, g.id}) // a rank evicted it: a plan for it is stale
	}
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
		x.dropPlansLocked(g)
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

// dropPlansLocked forgets every save plan of g.
func (x *KVIndex) dropPlansLocked(g *indexGroup) {
	for k := range x.planExp {
		if k.gid == g.id {
			x.unplanLocked(k)
		}
	}
}

// ApplyDump replaces a rank's entries by a dump (a full KVEventBatch of what
// it holds at dump.Seq), then replays the batches that arrived after it. It
// returns true when the replay found another gap.
func (x *KVIndex) ApplyDump(group string, rank int, dump *messages.KVEventBatch) (needDump bool) {
	return x.ApplyDumpOf(group, rank, x.Epoch(group, rank), dump)
}

// Epoch returns the number of restarts the index has seen of a rank; a
// dump asked for at one epoch is applied with ApplyDumpOf at that epoch.
func (x *KVIndex) Epoch(group string, rank int) uint64 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if g := x.groups[group]; g != nil && g.ranks[rank] != nil {
		return g.ranks[rank].epoch
	}
	return 0
}

// ApplyDumpOf is ApplyDump for a dump asked for at epoch: if the rank
// restarted since, the dump describes a process that is gone and is
// ignored. Batches held back with a seq the dump covers are discarded;
// those with an impossible seq past it are dropped and counted (Rejected).
func (x *KVIndex) ApplyDumpOf(group string, rank int, epoch uint64, dump *messages.KVEventBatch) (needDump bool) {
	if rank < 0 || rank >= 64 {
		return false
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	g := x.groups[group]
	if g == nil {
		return false // forgotten while its dump was on the way
	}
	rs := g.rank(rank)
	if rs.epoch != epoch {
		return false
	}
	x.clearRankLocked(g, rank, rs, true)
	x.applyLocked(g, rank, rs, dump, true)
	pending := rs.pending
	rs.pending, rs.resyncing, rs.synced = nil, false, true
	slices.SortFunc(pending, func(a, b *messages.KVEventBatch) int { return cmpUint(a.Seq, b.Seq) })
	for i, b := range pending {
		switch {
		case b.Seq <= rs.seq:
			continue // superseded by the dump
		case b.Seq > rs.seq+MaxSeqJump:
			x.rejected.Add(uint64(len(pending) - i)) // sorted: the rest are impossible too
			return false
		case b.Seq == rs.seq+1:
			x.applyLocked(g, rank, rs, b, false)
		default:
			rs.resyncing = true
			rs.pending = pending[i:]
			return true
		}
	}
	return false
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// ObserveRank records a rank's heartbeat: the group's world size and the
// rank's process start time. It returns true when the rank restarted (its
// start time changed) and needs a resync.
func (x *KVIndex) ObserveRank(group string, rank, worldSize int, startedUnixMs int64) (needDump bool) {
	if rank < 0 || rank >= 64 || worldSize > 64 {
		return false
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	g := x.group(group)
	if g == nil {
		return false
	}
	if g.worldSize != worldSize {
		x.setWorldSizeLocked(g, worldSize)
	}
	rs := g.rank(rank)
	if rs.started == startedUnixMs {
		return false
	}
	if rs.started != 0 {
		// A restart: a dump asked of the old process is stale, and the
		// group's plans go, as at the new process's AllBlocksCleared
		// (which may be lost): it lost what the old one was saving.
		rs.epoch++
		rs.synced = false
		x.dropPlansLocked(g)
	}
	rs.started = startedUnixMs
	// A restart, or a rank first heard of before any of its events (this
	// scheduler started after it): learn what it holds from a dump.
	if !rs.resyncing {
		rs.resyncing = true
		return true
	}
	return false
}

// setWorldSizeLocked recomputes which blocks are full for a group whose size
// changed (or became known).
func (x *KVIndex) setWorldSizeLocked(g *indexGroup, ws int) {
	g.worldSize = ws
	g.blocks = 0
	for h, m := range g.entries {
		if g.isFull(m) {
			x.markFull(g.id, h)
			g.blocks++
		} else {
			x.clearFull(g.id, h)
		}
	}
}

// Resyncing returns the ranks of a group waiting for a dump.
func (x *KVIndex) Resyncing() map[string][]int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	out := map[string][]int{}
	for name, g := range x.groups {
		for r, rs := range g.ranks {
			if rs.resyncing {
				out[name] = append(out[name], r)
			}
		}
	}
	return out
}

// PrefixMatch returns, for each group id, how many leading blocks of hashes
// every rank of that group holds, into dst (grown to the number of groups).
// It does one map lookup per block until no group matches.
func (x *KVIndex) PrefixMatch(hashes []uint64, dst []int) []int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.prefixMatchLocked(hashes, dst)
}

func (x *KVIndex) prefixMatchLocked(hashes []uint64, dst []int) []int {
	n := len(x.byID)
	dst = slices.Grow(dst[:0], n)[:n]
	clear(dst)
	for w := 0; w*64 < n; w++ { // each word of 64 groups on its own
		base := w * 64
		alive := ^uint64(0)
		if k := n - base; k < 64 {
			alive = uint64(1)<<k - 1
		}
		var full, planned map[uint64]uint64
		if w < len(x.full) {
			full = x.full[w]
		}
		if w < len(x.planned) {
			planned = x.planned[w]
		}
		for i, h := range hashes {
			m := (full[h] | planned[h]) & alive
			for dropped := alive &^ m; dropped != 0; dropped &= dropped - 1 {
				dst[base+bits.TrailingZeros64(dropped)] = i
			}
			if alive = m; alive == 0 {
				break
			}
		}
		for ; alive != 0; alive &= alive - 1 {
			dst[base+bits.TrailingZeros64(alive)] = len(hashes)
		}
	}
	return dst
}

// Synced reports whether the index knows what every rank of a group holds:
// each of its world-size ranks was heard of and none waits for a dump.
func (x *KVIndex) Synced(group string) bool {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.syncedLocked(x.groups[group])
}

// Placeable reports whether a request may be placed on group from what the
// index says: its ranks are synced, or the index is full and does not
// track it, so it is placed as if it held nothing.
func (x *KVIndex) Placeable(group string) bool {
	return len(x.placeable([]GroupState{{Name: group}})) == 1
}

// placeable returns the groups that Placeable allows, under one lock.
func (x *KVIndex) placeable(groups []GroupState) []GroupState {
	x.mu.RLock()
	defer x.mu.RUnlock()
	full := len(x.free) == 0 && len(x.byID) >= x.maxGroups
	out := make([]GroupState, 0, len(groups))
	for _, g := range groups {
		if ig := x.groups[g.Name]; (ig == nil && full) || x.syncedLocked(ig) {
			out = append(out, g)
		}
	}
	return out
}

func (x *KVIndex) syncedLocked(g *indexGroup) bool {
	if g == nil || g.worldSize == 0 {
		return false
	}
	for r := range g.worldSize {
		rs := g.ranks[r]
		if rs == nil || rs.resyncing || !rs.synced {
			return false
		}
	}
	return true
}

// Plan records that group will store hashes (a request just dispatched
// there saves its prefix): until every rank's events confirm a block, a
// rank evicts it, or expires passes, lookups count it as the group's. This
// is what lets the next turn of a conversation, placed while the previous
// turn's blocks are still being saved, load all of them: the ranks wait for
// a save in flight.
func (x *KVIndex) Plan(group string, hashes []uint64, expires time.Time) {
	if len(hashes) == 0 {
		return
	}
	exp := expires.UnixNano()
	x.mu.Lock()
	defer x.mu.Unlock()
	x.expirePlansLocked(time.Now().UnixNano())
	g := x.group(group)
	if g == nil {
		return
	}
	for _, h := range hashes {
		k := rankKey{h, g.id}
		if x.full.has(g.id, h) {
			continue // already held by every rank
		}
		if old, ok := x.planExp[k]; ok && old >= exp {
			continue
		}
		x.planned.add(g.id, h)
		x.planExp[k] = exp
		x.planQ = append(x.planQ, planItem{k, exp})
	}
}

// ExpirePlans drops the plans that expired by now.
func (x *KVIndex) ExpirePlans(now time.Time) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.expirePlansLocked(now.UnixNano())
}

// expirePlansLocked pops expired plans off the queue. Plans are queued in
// the order they were made; with one TTL per scheduler that is close to
// expiry order, and a plan renewed later is skipped when its old item
// comes up.
func (x *KVIndex) expirePlansLocked(now int64) {
	n := 0
	for n < len(x.planQ) && x.planQ[n].exp <= now {
		it := x.planQ[n]
		if exp, ok := x.planExp[it.key]; ok && exp == it.exp {
			x.unplanLocked(it.key)
		}
		n++
	}
	if n > 0 {
		x.planQ = x.planQ[n:]
		if cap(x.planQ) > 1024 && len(x.planQ) < cap(x.planQ)/4 {
			x.planQ = slices.Clone(x.planQ)
		}
	}
}

func (x *KVIndex) unplanLocked(k rankKey) {
	if _, ok := x.planExp[k]; !ok {
		return
	}
	delete(x.planExp, k)
	w, bit := wordBit(k.gid)
	x.planned.remove(w, k.hash, bit)
}

// Plans returns the number of (group, block) plans not yet confirmed.
func (x *KVIndex) Plans() int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return len(x.planExp)
}

// Match sets, for each group, IndexBlocks: how many leading blocks of
// hashes every rank of the group holds. One read lock, one PrefixMatch.
func (x *KVIndex) Match(hashes []uint64, groups []GroupState) {
	var buf [64]int // more groups: one allocation
	x.mu.RLock()
	defer x.mu.RUnlock()
	// One lock for the walk and the names: a forgotten group's id may be
	// another group's between two.
	prefix := x.prefixMatchLocked(hashes, buf[:0])
	for i := range groups {
		groups[i].IndexBlocks = 0
		if g, ok := x.groups[groups[i].Name]; ok && int(g.id) < len(prefix) {
			groups[i].IndexBlocks = prefix[g.id]
		}
	}
}

// PoolPrefix returns how many leading blocks of hashes are held in full by
// at least one of the groups in sources, or being saved by one of the groups
// in savers: what a request can read from the KV pool as a whole. sources
// are the groups whose segments answer reads (alive, draining or not): a
// group that stopped sending heartbeats is in the index until its blocks
// are cleared, but nobody would answer a read from it.
func (x *KVIndex) PoolPrefix(hashes []uint64, sources, savers []string) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	fullOK, planOK := x.maskLocked(sources), x.maskLocked(savers)
	for i, h := range hashes {
		if !x.anyLocked(h, fullOK, planOK) {
			return i
		}
	}
	return len(hashes)
}

// anyLocked reports whether a group of fullOK holds h in full or one of
// planOK is saving it.
func (x *KVIndex) anyLocked(h uint64, fullOK, planOK groupMask) bool {
	for w := range max(len(fullOK), len(planOK)) {
		if x.wordLocked(w, h, fullOK, planOK) != 0 {
			return true
		}
	}
	return false
}

// wordLocked returns the groups of word w that hold h in full (among
// fullOK) or are saving it (among planOK).
func (x *KVIndex) wordLocked(w int, h uint64, fullOK, planOK groupMask) uint64 {
	var m uint64
	if f := fullOK.word(w); f != 0 && w < len(x.full) {
		m = x.full[w][h] & f
	}
	if p := planOK.word(w); p != 0 && w < len(x.planned) {
		m |= x.planned[w][h] & p
	}
	return m
}

// RemoteRuns returns where blocks [from, limit) of hashes can be read
// from: the group's own segments where it holds (or is saving) a block,
// else consecutive runs from other groups in sources whose ranks all hold
// them, or that are saving them if listed in savers — groups whose prefill
// queue is empty, so the save is imminent and the source's pool read waits
// for it. sources are as PoolPrefix's.
// One source is kept while it holds the next block (fewer, longer reads).
// end is the block after the last one readable; the prefix stops at the
// first block no group can give.
func (x *KVIndex) RemoteRuns(hashes []uint64, group string, from, limit int, sources, savers []string) (runs []messages.RemoteRun, end int) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	self := x.maskLocked([]string{group})
	fullOK, planOK := x.maskLocked(sources), x.maskLocked(savers)
	src := -1
	i := from
	for ; i < min(limit, len(hashes)); i++ {
		h := hashes[i]
		if x.anyLocked(h, self, self) {
			src = -1 // local
			continue
		}
		if src >= 0 {
			if w, bit := wordBit(groupID(src)); x.wordLocked(w, h, fullOK, planOK)&bit != 0 {
				runs[len(runs)-1].Blocks++
				continue
			}
		}
		src = x.firstLocked(h, fullOK, planOK)
		if src < 0 {
			return runs, i
		}
		runs = append(runs, messages.RemoteRun{Group: x.byID[src].name, FromBlock: i, Blocks: 1})
	}
	return runs, max(i, from)
}

// firstLocked returns the lowest group id that holds h in full (among
// fullOK) or is saving it (among planOK), or -1.
func (x *KVIndex) firstLocked(h uint64, fullOK, planOK groupMask) int {
	for w := range max(len(fullOK), len(planOK)) {
		if m := x.wordLocked(w, h, fullOK, planOK); m != 0 {
			return w*64 + bits.TrailingZeros64(m)
		}
	}
	return -1
}

// maskLocked returns the set of the named groups' ids.
func (x *KVIndex) maskLocked(names []string) groupMask {
	var m groupMask
	for _, n := range names {
		if g := x.groups[n]; g != nil {
			m.add(g.id)
		}
	}
	return m
}

// GroupID returns a group's id in PrefixMatch results.
func (x *KVIndex) GroupID(name string) (int, bool) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	g, ok := x.groups[name]
	if !ok {
		return 0, false
	}
	return int(g.id), true
}

// GroupBlocks returns how many blocks every rank of the group holds.
func (x *KVIndex) GroupBlocks(name string) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if g, ok := x.groups[name]; ok {
		return g.blocks
	}
	return 0
}

// Size returns the number of distinct (group, block) entries and of blocks
// held in full by at least one group.
func (x *KVIndex) Size() (entries, fullBlocks int) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	for _, g := range x.groups {
		entries += len(g.entries)
	}
	return entries, x.fullBlocks
}
