package scheduler

import (
	"slices"
	"time"

	"github.com/kvbus/kvbus/messages"
)

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
	rs.setPending(nil)
	rs.resyncing, rs.synced = false, true
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
			rs.setPending(pending[i:])
			return true
		}
	}
	return false
}

// rankReportEvery is how often OverBound reports one rank.
const rankReportEvery = time.Minute

// OverBound describes a rank's stores the index did not record.
type OverBound struct {
	// Held is what the index records for the rank, Limit its bound
	// (limitOf), CapacityBlocks its heartbeats' capacity (0: unknown).
	Held, Limit    int
	CapacityBlocks int64
	// Refused counts the stores not recorded since the last report.
	Refused int
	// Entries is the index's entries, MaxEntries its bound: at it the
	// index, not the rank, was full.
	Entries, MaxEntries int
}

// IndexFull reports whether the stores went unrecorded because the index
// holds MaxIndexEntries, not because the rank holds its bound.
func (o OverBound) IndexFull() bool { return o.Held < o.Limit && o.Entries >= o.MaxEntries }

// OverBound reports the stores of a rank the index did not record since it
// last reported that rank, at most once per rankReportEvery per rank; ok
// is false when there is nothing to report yet.
func (x *KVIndex) OverBound(group string, rank int, now time.Time) (o OverBound, ok bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	g := x.groups[group]
	if g == nil || g.ranks[rank] == nil {
		return o, false
	}
	rs := g.ranks[rank]
	if rs.refused == 0 || (rs.saidAt != 0 && now.UnixNano()-rs.saidAt < int64(rankReportEvery)) {
		return o, false
	}
	o = OverBound{Held: rs.held, Limit: x.limitOf(rs), CapacityBlocks: rs.capacity, Refused: rs.refused,
		Entries: x.entries, MaxEntries: x.maxEntries}
	rs.refused, rs.saidAt = 0, now.UnixNano()
	return o, true
}

// NoteRefused counts n stores of a rank that did not reach the index: the
// hashes of a dump cut to RankLimit as its chunks arrived.
func (x *KVIndex) NoteRefused(group string, rank, n int) {
	if n <= 0 {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if g := x.groups[group]; g != nil && g.ranks[rank] != nil {
		g.ranks[rank].refused += n
	}
	x.refused.Add(uint64(n))
}

// RankLimit is the most blocks the index records for a rank (limitOf); a
// dump is cut to it as it arrives.
func (x *KVIndex) RankLimit(group string, rank int) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if g := x.groups[group]; g != nil && g.ranks[rank] != nil {
		return x.limitOf(g.ranks[rank])
	}
	return x.maxRankBlocks
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

// ObserveRank records a rank's heartbeat: the group's world size, the
// rank's process start time and its store's capacity in blocks (0:
// unknown), which bounds what the index records for it (limitOf). It
// returns true when the rank restarted (its start time changed) and needs a
// resync.
func (x *KVIndex) ObserveRank(group string, rank, worldSize int, startedUnixMs, capacityBlocks int64) (needDump bool) {
	if rank < 0 || rank >= 64 || worldSize > 64 {
		return false
	}
	capacityBlocks = max(capacityBlocks, 0)
	// Most heartbeats change nothing: they take no write lock, which
	// would hold up the lookups of the requests being placed.
	x.mu.RLock()
	if g := x.groups[group]; g != nil && g.worldSize == worldSize {
		if rs := g.ranks[rank]; rs != nil && rs.started == startedUnixMs && rs.capacity == capacityBlocks {
			g.touched.Store(time.Now().UnixNano())
			x.mu.RUnlock()
			return false
		}
	}
	x.mu.RUnlock()
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
	rs.capacity = capacityBlocks
	if rs.started == startedUnixMs {
		return false
	}
	if rs.started != 0 {
		// A restart: a dump asked of the old process is stale, and the
		// group's plans go, as at the new process's AllBlocksCleared
		// (which may be lost): it lost what the old one was saving.
		rs.epoch++
		rs.synced = false
		x.lostCacheLocked(g)
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
			if rs.resyncing && (g.worldSize == 0 || r < g.worldSize) { // not a rank of a larger group it was
				out[name] = append(out[name], r)
			}
		}
	}
	return out
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

// ForgetIdle forgets the groups not heard of (no heartbeat, KV batch or
// save plan) for after, counted from since when they were heard of before
// it (this replica was cut off from NATS until since: their silence was
// its own), and returns their names. See Forget.
func (x *KVIndex) ForgetIdle(now time.Time, after time.Duration, since time.Time) []string {
	idle := func() (names []string) {
		for name, g := range x.groups {
			if now.UnixNano()-max(g.touched.Load(), since.UnixNano()) > int64(after) {
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
			x.entries -= len(g.entries)
			delete(x.groups, name)
			x.byID[g.id] = nil
			x.free = append(x.free, g.id)
		}
	}
}
