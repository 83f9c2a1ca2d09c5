package workers

import (
	"context"
	"slices"
	"time"

	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/messages"
)

func (r *Rank) pushStore(rr *rankReq) {
	select {
	case r.storeQ <- rr:
	default:
		// The store queue is full: skip saving; the request still completes.
		r.log.Warn("store queue full: not saving this request's blocks", "req_id", rr.meta.ReqID, "session_id", rr.meta.SessionID)
		rr.result.Error, rr.result.ErrorCode = "store queue full: the prompt's new blocks were not saved", messages.RankErrStoreSkipped
		r.settleSaves(rr)
		r.finishStore(rr)
	}
}

// storeLoop is the rank's store thread: it saves a request's new full blocks,
// skipping those the store already holds (like vLLM's
// KVCacheStoreSendingThread).
func (r *Rank) storeLoop() {
	for rr := range r.storeQ {
		if r.cfg.StoreDelay > 0 {
			time.Sleep(r.cfg.StoreDelay)
		}
		// Before storeBlocks reads the request's context: an Abort that
		// finds this unset has cancelled it already, and nothing is saved.
		r.mu.Lock()
		rr.storing = true
		r.mu.Unlock()
		r.storeBlocks(rr)
		r.settleSaves(rr)
		r.finishStore(rr)
	}
}

// storeBatchBytes bounds the block payloads the store thread makes before
// putting them: what a rank holds beyond its store while saving.
const storeBatchBytes = 64 << 20

func (r *Rank) storeBlocks(rr *rankReq) {
	meta := rr.meta
	start := time.Now()
	// The store thread's line names the request and the session; its
	// attributes are passed, not bound with With, which would format them
	// twice.
	if err := context.Cause(rr.ctx); err != nil {
		r.log.Info("store thread", "req_id", meta.ReqID, "session_id", meta.SessionID, "skipped", "request ended", "cause", err)
		return
	}
	if r.cfg.EngineCache {
		r.log.Info("store thread", "req_id", meta.ReqID, "session_id", meta.SessionID, "skipped", "the engine keeps its own KV cache", "token_len", meta.TokenLen)
		return
	}
	// Save the new blocks, and those of the prefix that failed to load: they
	// were recomputed, and the next turn will want them.
	from := meta.SaveFromBlock
	if rr.loadFail > 0 {
		from = min(from, rr.loaded/meta.BlockSize)
	}
	// A rank's store holds at most capacity/size blocks, and a prefix is
	// usable only from its first block: blocks past that many could only
	// push out the prefix's own start.
	size := r.blockBytes(meta.BlockSize)
	limit := len(meta.BlockHashes)
	if _, capacity, _ := r.store.Usage(); size > 0 && capacity > 0 {
		limit = min(limit, int(capacity/int64(size)))
	}
	var stored []int // block indexes
	if meta.CanSave && from < limit {
		hashes := meta.BlockHashes[from:limit]
		keys := make([]string, len(hashes))
		for i, h := range hashes {
			keys[i] = StoreKey(meta.Model, r.cfg.TPRank, h)
		}
		exist := r.store.BatchIsExist(rr.ctx, keys)
		group := ""
		if meta.SessionID != "" {
			group = messages.SessionKey(meta.SessionID)
		}
		// In batches of at most storeBatchBytes of payload: a 40k-token
		// prompt is 1.2 GiB per rank of a Llama-8B at TP 4, and every rank
		// making all of it at once went far past --kv-capacity.
		per := max(1, storeBatchBytes/max(size, 1))
		objs := make([]Object, 0, min(per, len(keys)))
		blocks := make([]int, 0, cap(objs))
		put := func() {
			if len(objs) == 0 {
				return
			}
			for i, err := range r.store.BatchPut(rr.ctx, objs) {
				if err != nil {
					rr.result.FailedBlocks++
					r.log.Warn("store thread: put failed", "req_id", meta.ReqID, "session_id", meta.SessionID, "key", objs[i].Key, "err", err)
					continue
				}
				stored = append(stored, blocks[i])
				rr.result.StoredBlocks++
			}
			clear(objs) // the payloads are the store's now
			objs, blocks = objs[:0], blocks[:0]
		}
		// A block held already is skipped, and used by this request as a
		// put would: left at the recency of the request that saved it, the
		// next save evicted it on a rank whose store thread came to this
		// request first (a driver's takes requests as their prefills end)
		// and kept it on the others, and the ranks held different blocks.
		var held []string
		touch := func() {
			if len(held) > 0 {
				r.store.BatchGet(rr.ctx, held, rr.recency())
				held = held[:0]
			}
		}
		// Last block first, and the prefix before them touched last, from
		// its end to its start (getPrefix): the store evicts the least
		// recently used, and a prefix is worth only what it holds from its
		// first block on. Put in order, a prompt near the store's size
		// pushed out its own first blocks, and no later turn could use the
		// rest.
		for i := len(keys) - 1; i >= 0; i-- {
			if exist[i] {
				rr.result.SkippedBlocks++
				put() // in this order
				held = append(held, keys[i])
				continue
			}
			touch()
			value, charged := blockObject(r.cfg.Payload, hashes[i], r.cfg.TPRank, size)
			objs = append(objs, Object{Key: keys[i], Hash: hashes[i], Value: value, Size: charged, Group: group, Recency: rr.recency()})
			blocks = append(blocks, from+i)
			if len(objs) == per {
				put()
			}
		}
		put()
		touch()
		slices.Sort(stored)
		if from > 0 {
			head := make([]string, from)
			for i, h := range meta.BlockHashes[:from] {
				head[i] = StoreKey(meta.Model, r.cfg.TPRank, h)
			}
			r.getPrefix(rr, head)
		}
	}
	// KV events: what was stored, then what the puts evicted (possibly some
	// of the blocks just stored, when the store is tiny).
	r.events.publishStored(meta.Model, storedEvents(meta, stored))
	rr.result.StoreUs = time.Since(start).Microseconds()
	r.series.storeSec.Observe(time.Since(start).Seconds())
	r.series.stored.Add(float64(rr.result.StoredBlocks))
	r.series.skipped.Add(float64(rr.result.SkippedBlocks))
	r.series.storeFailed.Add(float64(rr.result.FailedBlocks))
	used, _, _ := r.store.Usage()
	r.series.usedBytes.Set(float64(used))
	logsink.Info(r.log, "store thread", "req_id", meta.ReqID, "session_id", meta.SessionID, "stored_blocks", rr.result.StoredBlocks, "skipped_blocks", rr.result.SkippedBlocks,
		"loaded_tokens", rr.loaded, "token_len", meta.TokenLen)
}

// finishStore ends the store part of a request: a non-driver rank reports
// its RankResult now; the driver reports after generation.
func (r *Rank) finishStore(rr *rankReq) {
	close(rr.storeDone)
	if !r.IsDriver() {
		r.report(rr)
	}
}
