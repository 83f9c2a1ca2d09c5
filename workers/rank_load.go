package workers

import (
	"context"
	"time"

	"github.com/kvbus/kvbus/messages"
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
	if ls == nil || !ls.CanLoad || ls.KVPoolCachedTokens == 0 || rr.ctx.Err() != nil || r.cfg.EngineCache {
		return // a model server loads its own cache
	}
	start := time.Now()
	n := min(ls.KVPoolCachedTokens/meta.BlockSize, len(meta.BlockHashes))
	// Runs held by other groups are copied in first (global pool); then
	// the whole prefix is read locally, copies included.
	copied := r.copyRemoteRuns(rr, ls.Remote, n)
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
		r.series.waitedForSave.Add(float64(waited))
		r.log.Debug("load thread: waited for saves in flight", "req_id", meta.ReqID, "session_id", meta.SessionID,
			"waits", waited, "wait_us", time.Since(start).Microseconds())
	}
	rr.loaded = ok * meta.BlockSize
	// Remote are the copies within the prefix loaded: one past a block
	// that failed is not part of it.
	for _, b := range copied {
		if b < ok {
			rr.remote += meta.BlockSize
		}
	}
	rr.loadFail = n - ok
	rr.loadUs = time.Since(start).Microseconds()
	r.series.loadSec.Observe(time.Since(start).Seconds())
	r.series.loaded.Add(float64(ok))
	if rr.loadFail > 0 {
		r.series.loadFailed.Add(float64(rr.loadFail))
		r.log.Warn("load thread: blocks missing, they will be recomputed", "req_id", meta.ReqID,
			"session_id", meta.SessionID, "wanted_blocks", n, "failed_blocks", rr.loadFail)
	}
}

func (r *Rank) blockBytes(blockSize int) int {
	return blockSize * r.cfg.Profile.BytesPerTokenPerRank(r.cfg.TPSize)
}

// valueBytes is the length of a stored block's value: its bytes, or its
// 8-byte digest with --kv-payload accounting.
func (r *Rank) valueBytes(blockSize int) int {
	if r.cfg.Payload == PayloadAccounting {
		return 8
	}
	return r.blockBytes(blockSize)
}

// copyRemoteRuns reads the LoadSpec's remote runs from the same tp_rank of
// their source groups (the pool), keeps verified blocks as local copies
// (evicted by LRU like any other, announced in KV events) and returns the
// indexes of the blocks copied. A run stops at its first block the source
// no longer holds: that block and the rest are prefilled.
func (r *Rank) copyRemoteRuns(rr *rankReq, runs []messages.RemoteRun, n int) (copied []int) {
	meta := rr.meta
	size := r.blockBytes(meta.BlockSize)
	group := ""
	if meta.SessionID != "" {
		group = messages.SessionKey(meta.SessionID)
	}
	for _, run := range runs {
		end := min(run.FromBlock+run.Blocks, n)
		if run.FromBlock >= end {
			continue
		}
		hashes := meta.BlockHashes[run.FromBlock:end]
		ctx, cancel := context.WithTimeout(rr.ctx, r.cfg.SaveWait)
		start := time.Now()
		vals, err := r.pool.Read(ctx, run.Group, r.cfg.TPRank, &messages.PoolRead{ReqID: meta.ReqID, Model: meta.Model, TPRank: r.cfg.TPRank, BlockHashes: hashes},
			r.valueBytes(meta.BlockSize))
		cancel()
		if err != nil {
			r.log.Warn("load thread: pool read failed, the run will be recomputed", "req_id", meta.ReqID, "session_id", meta.SessionID,
				"source_group", run.Group, "blocks", len(hashes), "err", err)
			continue
		}
		var objs []Object
		var blocks []int
		bytes := 0
		for i, v := range vals {
			if !verifyBlock(r.cfg.Payload, v, hashes[i], r.cfg.TPRank, size) {
				break
			}
			objs = append(objs, Object{Key: StoreKey(meta.Model, r.cfg.TPRank, hashes[i]), Hash: hashes[i], Value: v, Size: int64(size), Group: group})
			blocks = append(blocks, run.FromBlock+i)
			bytes += size // charged: with --kv-payload accounting only a digest moves
		}
		stored := blocks[:0:0]
		for i, err := range r.store.BatchPut(rr.ctx, objs) {
			if err == nil {
				stored = append(stored, blocks[i])
			}
		}
		r.events.publishStored(meta.Model, storedEvents(meta, stored))
		copied = append(copied, stored...)
		r.cfg.Metrics.remote.WithLabelValues(run.Group, r.cfg.Group, r.labels[1]).Add(float64(len(stored)))
		r.cfg.Metrics.remoteBytes.WithLabelValues(run.Group, r.cfg.Group, r.labels[1]).Add(float64(bytes))
		r.cfg.Metrics.remoteSec.WithLabelValues(run.Group, r.cfg.Group, r.labels[1]).Observe(time.Since(start).Seconds())
		if len(stored) < len(hashes) {
			r.log.Warn("load thread: source group no longer holds part of a run, it will be recomputed", "req_id", meta.ReqID,
				"session_id", meta.SessionID, "source_group", run.Group, "blocks", len(hashes), "copied", len(stored))
		}
	}
	return copied
}
