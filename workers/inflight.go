package workers

import (
	"time"
)

// Saves in flight. A conversation's next turn can reach a rank while the
// rank is still saving the previous turn's blocks (its store thread is
// behind, or the driver answered before this rank stored). The scheduler
// counts those blocks in the LoadSpec, so the load must not miss them: each
// request registers, when its ReqMeta arrives, the keys it will save, and a
// later request's load of such a key waits for that save (bounded by
// SaveWait) instead of reporting it missing.

// registerSavesLocked records the keys rr will save that no earlier request
// is saving. Called with r.mu held, in ReqMeta arrival order. Keys the store
// already holds are registered too: only a load that misses a key waits,
// so no store lookup is needed under the rank's lock.
func (r *Rank) registerSavesLocked(rr *rankReq) {
	meta := rr.meta
	if !meta.CanSave || meta.SaveFromBlock >= len(meta.BlockHashes) || r.cfg.EngineCache {
		return
	}
	for _, h := range meta.BlockHashes[meta.SaveFromBlock:] {
		k := StoreKey(meta.Model, r.cfg.TPRank, h)
		if _, busy := r.saving[k]; busy {
			continue
		}
		r.saving[k] = rr
		rr.saveKeys = append(rr.saveKeys, k)
	}
}

// settleSaves ends rr's registrations: its blocks are saved, or will not be
// (it failed, was aborted or skipped its save). Waiters wake up and read the
// store. Safe to call more than once.
func (r *Rank) settleSaves(rr *rankReq) {
	r.mu.Lock()
	keys := rr.saveKeys
	rr.saveKeys = nil
	for _, k := range keys {
		if r.saving[k] == rr {
			delete(r.saving, k)
		}
	}
	r.mu.Unlock()
	rr.settle.Do(func() { close(rr.saved) })
}

// awaitSave waits until the request saving key (if any) has settled or
// deadline passes; it reports whether it settled in time.
func (r *Rank) awaitSave(key string, deadline time.Time) bool {
	r.mu.Lock()
	owner := r.saving[key]
	r.mu.Unlock()
	if owner == nil {
		return false
	}
	t := time.NewTimer(max(time.Until(deadline), 0))
	defer t.Stop()
	select {
	case <-owner.saved:
		return true
	case <-t.C:
		return false
	}
}

// waitForSave waits until the request that arrived before rr and is saving
// key has settled, rr ends, or deadline passes. It reports whether there was
// such a save and it settled in time.
func (r *Rank) waitForSave(rr *rankReq, key string, deadline time.Time) bool {
	r.mu.Lock()
	owner := r.saving[key]
	r.mu.Unlock()
	if owner == nil || owner.id >= rr.id {
		return false
	}
	wait := time.Until(deadline)
	if wait <= 0 {
		return false
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-owner.saved:
		return true
	case <-t.C:
	case <-rr.ctx.Done():
	}
	return false
}
