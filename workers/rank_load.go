package workers

import (
	"time"
)

// loadLoop is the rank's load thread: it reads the blocks of each request's
// LoadSpec from the store and verifies them.
func (r *Rank) loadLoop() {
	for rr := range r.loadQ {
		r.load(rr)
		if r.IsDriver() {
			r.drivers.Go(func() { r.drive(rr) })
			continue
		}
		r.pushStore(rr)
	}
}

func (r *Rank) load(rr *rankReq) {
	meta := rr.meta
	ls := meta.LoadSpec
	if ls == nil || !ls.CanLoad || ls.KVPoolCachedTokens == 0 || rr.ctx.Err() != nil {
		return
	}
	start := time.Now()
	n := min(ls.KVPoolCachedTokens/meta.BlockSize, len(meta.BlockHashes))
	keys := make([]string, n)
	for i := range n {
		keys[i] = StoreKey(meta.Model, r.cfg.TPRank, meta.BlockHashes[i])
	}
	size := r.blockBytes(meta.BlockSize)
	vals := r.store.BatchGet(rr.ctx, keys)
	ok, waited := 0, 0
	deadline := start.Add(r.cfg.SaveWait)
	for ok < n {
		if verifyBlock(r.cfg.Payload, vals[ok], meta.BlockHashes[ok], r.cfg.TPRank, size) {
			ok++
			continue
		}
		// Missing: an earlier request may still be saving it.
		if !r.waitForSave(rr, keys[ok], deadline) {
			break
		}
		waited++
		copy(vals[ok:], r.store.BatchGet(rr.ctx, keys[ok:]))
		if !verifyBlock(r.cfg.Payload, vals[ok], meta.BlockHashes[ok], r.cfg.TPRank, size) {
			break
		}
	}
	if waited > 0 {
		r.cfg.Metrics.blocks.WithLabelValues(r.labels[0], r.labels[1], "waited_for_save").Add(float64(waited))
		r.log.Debug("load thread: waited for saves in flight", "req_id", meta.ReqID, "session_id", meta.SessionID,
			"waits", waited, "wait_us", time.Since(start).Microseconds())
	}
	rr.loaded = ok * meta.BlockSize
	rr.loadFail = n - ok
	rr.loadUs = time.Since(start).Microseconds()
	r.cfg.Metrics.loadSec.WithLabelValues(r.labels...).Observe(time.Since(start).Seconds())
	r.cfg.Metrics.blocks.WithLabelValues(r.labels[0], r.labels[1], "loaded").Add(float64(ok))
	if rr.loadFail > 0 {
		r.cfg.Metrics.blocks.WithLabelValues(r.labels[0], r.labels[1], "load_failed").Add(float64(rr.loadFail))
		r.log.Warn("load thread: blocks missing, they will be recomputed", "req_id", meta.ReqID,
			"session_id", meta.SessionID, "wanted_blocks", n, "failed_blocks", rr.loadFail)
	}
}

func (r *Rank) blockBytes(blockSize int) int {
	return blockSize * r.cfg.Profile.BytesPerTokenPerRank(r.cfg.TPSize)
}
