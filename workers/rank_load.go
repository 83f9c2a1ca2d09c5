package workers

import (
	"context"
	"slices"
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
	keys := make([]string, n)
	for i := range n {
		keys[i] = StoreKey(meta.Model, r.cfg.TPRank, meta.BlockHashes[i])
	}
	// What this rank holds of the prefix is read first: the read makes it
	// the most recently used, so the copies below evict other blocks, not
	// the local part of this very prefix (they evicted it whenever the
	// prefix was close to the store's capacity, and nothing was loaded).
	// Runs held by other groups are copied in (global pool); what was read
	// or copied counts as loaded even if the store has evicted it since —
	// a prefix longer than the store's capacity evicts its own first
	// copies — as a load into the engine's memory would; then the whole
	// prefix is read locally again, for blocks saved meanwhile. Without
	// remote runs, that one read is all.
	var copied []int
	fetched := make([][]byte, n)
	if len(ls.Remote) > 0 {
		held := r.getPrefix(rr, keys)
		copied, fetched = r.copyRemoteRuns(rr, ls.Remote, n)
		for i, v := range held {
			if fetched[i] == nil {
				fetched[i] = v
			}
		}
	}
	size := r.blockBytes(meta.BlockSize)
	vals := r.getPrefix(rr, keys)
	fill := func(from int) {
		for i := from; i < n; i++ {
			if vals[i] == nil {
				vals[i] = fetched[i]
			}
		}
	}
	fill(0)
	ok, waited := 0, 0
	checked := -1 // the block last read again after no save was found for it
	deadline := start.Add(r.cfg.SaveWait)
	for ok < n {
		if verifyBlock(r.cfg.Payload, vals[ok], meta.BlockHashes[ok], r.cfg.TPRank, size) {
			ok++
			continue
		}
		// Missing: an earlier request may still be saving it (waited
		// for), or a save ended between the read above and this check
		// (the store thread puts, then settles), and a read after the
		// check finds the block. Read again: still missing, the next
		// request saving it (if it came before this one) is waited for;
		// with no save found, the block is read once more, then
		// recomputed.
		if r.waitForSave(rr, keys[ok], deadline) {
			waited++
		} else if checked == ok {
			break
		} else {
			checked = ok
		}
		copy(vals[ok:], r.getPrefix(rr, keys[ok:]))
		fill(ok)
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

// getPrefix reads the blocks of keys, a prefix in order, for rr, touching
// them from the last to the first at rr's recency: the first block ends the
// most recently used, so the store evicts a prefix from its end, where it
// is worth least (see storeBlocks).
func (r *Rank) getPrefix(rr *rankReq, keys []string) [][]byte {
	rev := slices.Clone(keys)
	slices.Reverse(rev)
	vals := r.store.BatchGet(rr.ctx, rev, rr.recency())
	slices.Reverse(vals)
	return vals
}

// poolReadBytes bounds the bytes one PoolRead asks for. A long run read in
// one PoolRead (a few thousand tokens of an 8B model are hundreds of MiB
// per rank) had the source publish it all at once: past the server's
// pending limit for the reader (64 MiB by default) the server cut the
// reader off as a slow consumer, and a read still short at its deadline
// lost every block, those received included. Read in pieces of this size,
// a run keeps what arrived in time.
const poolReadBytes = 16 << 20

// poolReadBlocks is how many blocks of valueBytes each one PoolRead asks
// for: within poolReadBytes, at least one, at most maxPoolReadBlocks.
func poolReadBlocks(valueBytes int) int {
	return min(max(poolReadBytes/max(valueBytes, 1), 1), maxPoolReadBlocks)
}

// maxPoolReadBlocks bounds a PoolRead's hash list (8 bytes a hash), however
// small the blocks (--kv-payload accounting).
const maxPoolReadBlocks = 4096

// copyRemoteRuns reads the LoadSpec's remote runs from the same tp_rank of
// their source groups (the pool), keeps verified blocks as local copies
// (evicted by LRU like any other, announced in KV events) and returns the
// indexes of the blocks copied, and every block's value verified, by index
// in the prefix (nil: not copied). A run is read within SaveWait: from its
// group, and from its alternates in turn for what is left when a read fails
// (the source stopped, or did not answer in its share of the time) or the
// source no longer holds a block. A run that no source gave whole ends the
// copy: its missing block and the rest are prefilled, and the runs after it
// are not read (the prefix loaded ends there).
func (r *Rank) copyRemoteRuns(rr *rankReq, runs []messages.RemoteRun, n int) (copied []int, fetched [][]byte) {
	fetched = make([][]byte, n)
	meta := rr.meta
	for _, run := range runs {
		end := min(run.FromBlock+run.Blocks, n)
		if run.FromBlock >= end {
			continue
		}
		sources := append([]string{run.Group}, run.Alternates...)
		deadline := time.Now().Add(r.cfg.SaveWait)
		next := run.FromBlock // the first block of the run not copied yet
		for k, source := range sources {
			// Each source left gets an equal share of the time left: a
			// source that hangs leaves time for the others.
			ctx, cancel := context.WithDeadline(rr.ctx, time.Now().Add(time.Until(deadline)/time.Duration(len(sources)-k)))
			// Only the run's own source was planned as saving it.
			got, err := r.copyRun(ctx, rr, source, next, end, fetched, k == 0 && run.Saving)
			cancel()
			copied = append(copied, got...)
			next += len(got)
			if next == end {
				break
			}
			then := "the rest of the run will be recomputed"
			if k+1 < len(sources) && rr.ctx.Err() == nil {
				then = "reading the rest of the run from " + sources[k+1]
			}
			if err != nil {
				r.log.Warn("load thread: pool read failed; "+then, "req_id", meta.ReqID, "session_id", meta.SessionID,
					"source_group", source, "blocks", end-run.FromBlock, "copied", next-run.FromBlock, "err", err)
			} else {
				r.log.Warn("load thread: source group holds no more of the run; "+then, "req_id", meta.ReqID,
					"session_id", meta.SessionID, "source_group", source, "blocks", end-run.FromBlock, "copied", next-run.FromBlock)
			}
			if rr.ctx.Err() != nil {
				break
			}
		}
		if next < end {
			return copied, fetched // the prefix loaded ends in this run
		}
	}
	return copied, fetched
}

// copyRun reads blocks [from, end) of the request's prefix from rank
// TPRank of group source, in pieces of poolReadBlocks, and keeps each
// verified block as a local copy and in fetched. It returns the blocks
// copied, from and on in order: the first read that fails (err) or block
// the source no longer holds ends them. saving asks the source to wait for
// the save that the scheduler planned the run from (PoolRead.Saving).
func (r *Rank) copyRun(ctx context.Context, rr *rankReq, source string, from, end int, fetched [][]byte, saving bool) (got []int, err error) {
	meta := rr.meta
	size := r.blockBytes(meta.BlockSize)
	valueBytes := r.valueBytes(meta.BlockSize)
	group := ""
	if meta.SessionID != "" {
		group = messages.SessionKey(meta.SessionID)
	}
	start := time.Now()
	defer func() {
		r.cfg.Metrics.remote.WithLabelValues(source, r.cfg.Group, r.labels[1]).Add(float64(len(got)))
		r.cfg.Metrics.remoteBytes.WithLabelValues(source, r.cfg.Group, r.labels[1]).Add(float64(len(got) * size)) // charged: with --kv-payload accounting only a digest moves
		r.cfg.Metrics.remoteSec.WithLabelValues(source, r.cfg.Group, r.labels[1]).Observe(time.Since(start).Seconds())
	}()
	defer r.loadReading.Store(nil)
	for at := from; at < end; {
		piece := meta.BlockHashes[at:min(at+poolReadBlocks(valueBytes), end)]
		r.loadReading.Store(&loadReading{source: source, id: rr.id, since: time.Now()})
		vals, err := r.pool.Read(ctx, source, r.cfg.TPRank, &messages.PoolRead{ReqID: meta.ReqID, Group: r.cfg.Group, Model: meta.Model, TPRank: r.cfg.TPRank, BlockHashes: piece, Saving: saving},
			valueBytes)
		if err != nil {
			return got, err
		}
		var objs []Object
		var blocks []int
		for i, v := range vals {
			if !verifyBlock(r.cfg.Payload, v, piece[i], r.cfg.TPRank, size) {
				break
			}
			objs = append(objs, Object{Key: StoreKey(meta.Model, r.cfg.TPRank, piece[i]), Hash: piece[i], Value: v, Size: int64(size), Group: group, Recency: rr.recency()})
			blocks = append(blocks, at+i)
			fetched[at+i] = v
		}
		kept := blocks[:0:0]
		for i, err := range r.store.BatchPut(rr.ctx, objs) {
			if err == nil {
				kept = append(kept, blocks[i])
			}
		}
		r.events.publishStored(meta.Model, storedEvents(meta, kept))
		// Copied: read and verified, whether or not the store kept it.
		got = append(got, blocks...)
		if len(blocks) < len(piece) {
			return got, nil
		}
		at += len(piece)
	}
	return got, nil
}
