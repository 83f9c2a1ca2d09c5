package workers

import (
	"slices"
	"time"
)

// Saves in flight. A conversation's next turn can reach a rank while the
// rank is still saving the previous turn's blocks (its store thread is
// behind, or the driver answered before this rank stored). The scheduler
// counts those blocks in the LoadSpec, so the load must not miss them: each
// request registers, when its ReqMeta arrives, the keys it will save, and a
// later request's load of such a key waits for that save (bounded by
// SaveWait) instead of reporting it missing.

// registerSavesLocked records the keys rr will save. Called with r.mu
// held, in ReqMeta arrival order. A key an earlier request is saving is
// recorded after it: should that one not save it after all (aborted,
// superseded, failed), rr's save is the one to wait for. Keys the store
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
			r.savingAfter[k] = append(r.savingAfter[k], rr)
		} else {
			r.saving[k] = rr
		}
		rr.saveKeys = append(rr.saveKeys, k)
	}
}

// settleSaves ends rr's registrations: its blocks are saved, or will not be
// (it failed, was aborted or skipped its save); the next request saving a
// key, if any, is waited for from then on. Waiters wake up and read the
// store. Safe to call more than once.
func (r *Rank) settleSaves(rr *rankReq) {
	r.mu.Lock()
	keys := rr.saveKeys
	rr.saveKeys = nil
	for _, k := range keys {
		after := r.savingAfter[k]
		switch {
		case r.saving[k] != rr:
			after = slices.DeleteFunc(after, func(o *rankReq) bool { return o == rr })
		case len(after) > 0:
			r.saving[k], after = after[0], after[1:]
		default:
			delete(r.saving, k)
		}
		if len(after) == 0 {
			delete(r.savingAfter, k)
		} else {
			r.savingAfter[k] = after
		}
	}
	r.mu.Unlock()
	rr.settle.Do(func() { close(rr.saved) })
}

// savingOwner returns the earliest request saving key, nil when none. One
// that settled is never registered (settleSaves deregisters, then
// closes saved); should one be, it is no owner, and no wait spins on it.
func (r *Rank) savingOwner(key string) *rankReq {
	r.mu.Lock()
	defer r.mu.Unlock()
	owner := r.saving[key]
	if owner != nil {
		select {
		case <-owner.saved:
			return nil
		default:
		}
	}
	return owner
}

// awaitSave waits until every request saving key (if any) has settled,
// deadline passes, or stop(owner) reports that the save owner makes is not
// to be waited for (asked every millisecond while waiting; nil: never); it
// reports false when it stopped so, true otherwise.
func (r *Rank) awaitSave(key string, deadline time.Time, stop func(owner *rankReq) bool) bool {
	t := time.NewTimer(max(time.Until(deadline), 0))
	defer t.Stop()
	var tick <-chan time.Time
	if stop != nil {
		ticker := time.NewTicker(time.Millisecond)
		defer ticker.Stop()
		tick = ticker.C
	}
	for {
		owner := r.savingOwner(key)
		if owner == nil {
			return true
		}
		if stop != nil && stop(owner) {
			return false
		}
		select {
		case <-owner.saved: // settled: the next one, if any, is the owner now
		case <-tick:
		case <-t.C:
			return true
		}
	}
}

// waitForSave waits until the earliest request saving key, when it arrived
// before rr, has settled, rr ends, or deadline passes. It reports whether
// there was such a save and it settled in time; the caller reads the store
// again, and asks again while the key is missing (the request after it
// may be saving it too).
func (r *Rank) waitForSave(rr *rankReq, key string, deadline time.Time) bool {
	owner := r.savingOwner(key)
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
