package scheduler

import (
	"slices"
	"time"
)

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

// lostCacheLocked records that a rank of g lost what it held (it restarted,
// or cleared its store): the group's save plans go, and so does the credit
// of session bindings made before now (LostCacheSince).
func (x *KVIndex) lostCacheLocked(g *indexGroup) {
	g.lostAt.Store(time.Now().UnixMilli())
	x.dropPlansLocked(g)
}

// LostCacheSince reports whether a rank of group lost what it held after
// unixMs (see lostCacheLocked): what a session's previous turn stored there
// then may be gone. Safe for concurrent use.
func (x *KVIndex) LostCacheSince(group string, unixMs int64) bool {
	x.mu.RLock()
	g := x.groups[group]
	x.mu.RUnlock()
	return g != nil && g.lostAt.Load() > unixMs
}

// dropPlansLocked forgets every save plan of g.
func (x *KVIndex) dropPlansLocked(g *indexGroup) {
	for k := range x.planExp {
		if k.gid == g.id {
			x.unplanLocked(k)
		}
	}
}

type planItem struct {
	key rankKey
	exp int64
}

type rankKey struct {
	hash uint64
	gid  groupID
}
