package scheduler

import (
	"math/bits"
	"slices"

	"github.com/kvbus/kvbus/messages"
)

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
// for it (such a run is Saving). sources are as PoolPrefix's.
// One source is kept while it holds the next block (fewer, longer reads).
// Each run names as alternates the other such groups that hold the longest
// start of it (see alternatesLocked): a rank whose source stopped since
// reads from them.
// end is the block after the last one readable; the prefix stops at the
// first block no group can give.
func (x *KVIndex) RemoteRuns(hashes []uint64, group string, from, limit int, sources, savers []string) (runs []messages.RemoteRun, end int) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	self := x.maskLocked([]string{group})
	fullOK, planOK := x.maskLocked(sources), x.maskLocked(savers)
	var srcs []int // each run's source
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
				runs[len(runs)-1].Saving = runs[len(runs)-1].Saving || !x.full.has(groupID(src), h)
				continue
			}
		}
		src = x.firstLocked(h, fullOK, planOK)
		if src < 0 {
			break
		}
		runs = append(runs, messages.RemoteRun{Group: x.byID[src].name, FromBlock: i, Blocks: 1, Saving: !x.full.has(groupID(src), h)})
		srcs = append(srcs, src)
	}
	for r := range runs {
		runs[r].Alternates = x.alternatesLocked(hashes[runs[r].FromBlock:runs[r].FromBlock+runs[r].Blocks], srcs[r], fullOK, planOK)
	}
	return runs, max(i, from)
}

// alternatesLocked returns up to messages.MaxRunAlternates groups, other
// than src, that hold in full (among fullOK) or are saving (among planOK)
// the longest start of hashes (at least its first block): those that hold
// all of it first, then by how much, ties lowest id first; nil if none. A
// rank reads from an alternate what it holds and goes on to the next, so
// one that holds part of the run still saves that part's prefill. The
// lengths are the groups' own, across index words.
func (x *KVIndex) alternatesLocked(hashes []uint64, src int, fullOK, planOK groupMask) []string {
	type held struct{ id, blocks int }
	var best [messages.MaxRunAlternates]held // longest first
	found := 0
	offer := func(id, blocks int) {
		at := found
		for at > 0 && (blocks > best[at-1].blocks || blocks == best[at-1].blocks && id < best[at-1].id) {
			at--
		}
		if at == len(best) {
			return
		}
		found = min(found+1, len(best))
		copy(best[at+1:found], best[at:found-1])
		best[at] = held{id, blocks}
	}
	srcWord, srcBit := wordBit(groupID(src))
	for w := range max(len(fullOK), len(planOK)) {
		if found == len(best) && best[found-1].blocks == len(hashes) {
			break // a later word's ids would lose every tie
		}
		m := fullOK.word(w) | planOK.word(w)
		if w == srcWord {
			m &^= srcBit
		}
		for i, h := range hashes {
			if m == 0 {
				break
			}
			still := m & x.wordLocked(w, h, fullOK, planOK)
			if i > 0 {
				for gone := m &^ still; gone != 0; gone &= gone - 1 {
					offer(w*64+bits.TrailingZeros64(gone), i)
				}
			}
			m = still
		}
		for ; m != 0; m &= m - 1 {
			offer(w*64+bits.TrailingZeros64(m), len(hashes))
		}
	}
	if found == 0 {
		return nil
	}
	alts := make([]string, found)
	for i := range alts {
		alts[i] = x.byID[best[i].id].name
	}
	return alts
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
