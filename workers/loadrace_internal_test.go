package workers

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/messages"
)

// nthGetStore runs hook once, right after the nth BatchGet that asks for
// hookKey returns: what another thread of the rank does between a read
// and what the reader does next.
type nthGetStore struct {
	BlockStore
	hookKey string
	n       int
	mu      sync.Mutex
	seen    int
	hook    func()
}

func (s *nthGetStore) BatchGet(ctx context.Context, keys []string, at Recency) [][]byte {
	vals := s.BlockStore.BatchGet(ctx, keys, at)
	for _, k := range keys {
		if k == s.hookKey {
			s.mu.Lock()
			s.seen++
			fire := s.seen == s.n
			s.mu.Unlock()
			if fire {
				s.hook()
			}
		}
	}
	return vals
}

// TestLoadFindsASaveThatSettledAfterItsRead: a conversation's next turn
// reaches a rank whose store thread is still saving the previous turn's
// blocks. Its load reads the store (the last block is not there yet), and
// before it asks who is saving that block, the store thread puts it and
// settles the save. The block is in the store: the load must load it, not
// report it missing for the turn to recompute (seen in `kvbus serve
// --groups 2` under a multi-turn load: a rank loaded 8 of 13 blocks and
// its store thread skipped the 5 others as held, in the same millisecond).
func TestLoadFindsASaveThatSettledAfterItsRead(t *testing.T) {
	r, hashes := rankSettlingASaveAfterItsRead(t)
	next, _ := newRankReq(&messages.ReqMeta{ReqID: "next", Model: raceModel, BlockSize: 1, BlockHashes: hashes,
		LoadSpec: &messages.LoadSpec{CanLoad: true, KVPoolCachedTokens: len(hashes)}})
	next.id = 2
	r.load(next)
	if next.loadFail != 0 || next.loaded != len(hashes) {
		t.Errorf("loaded %d tokens, %d blocks failed; want all %d loaded: the last block's save settled between the load's read and its check, and the block was in the store",
			next.loaded, next.loadFail, len(hashes))
	}
}

// TestPoolReadFindsASaveThatSettledAfterItsRead: the same, for another
// group's read of the blocks over the pool: it answered without the last
// block, which the reader then recomputed.
func TestPoolReadFindsASaveThatSettledAfterItsRead(t *testing.T) {
	r, hashes := rankSettlingASaveAfterItsRead(t)
	r.cfg.Conn = busConn(t)
	if sent := poolReadSent(t, r, hashes); len(sent) != len(hashes) {
		t.Errorf("the pool read was sent %d of its %d blocks; want all: the last block's save settled between the read and its check, and the block was in the store",
			len(sent), len(hashes))
	}
}

// rankSettlingASaveAfterItsRead returns a rank whose previous turn saves
// three blocks: two are in its store, and the third is put and its save
// settled right after the first read that asks for it returns.
func rankSettlingASaveAfterItsRead(t *testing.T) (*Rank, []uint64) {
	mem, _ := newTestStore(t, 1<<20)
	hashes, keys, objects := raceBlocks()
	r := raceRank()
	prev, _ := newRankReq(&messages.ReqMeta{ReqID: "prev", Model: raceModel, BlockSize: 1, BlockHashes: hashes, CanSave: true})
	prev.id = 1
	r.mu.Lock()
	r.registerSavesLocked(prev)
	r.mu.Unlock()
	mem.BatchPut(t.Context(), objects[:2])
	store := &nthGetStore{BlockStore: mem, hookKey: keys[2], n: 1}
	store.hook = func() {
		mem.BatchPut(context.Background(), objects[2:])
		r.settleSaves(prev)
	}
	r.store = store
	return r, hashes
}

// raceModel is the model of raceBlocks.
const raceModel = "m"

// raceBlocks returns three blocks of raceModel on rank 0: their hashes,
// store keys and objects (--kv-payload accounting).
func raceBlocks() (hashes []uint64, keys []string, objects []Object) {
	hashes = []uint64{11, 12, 13}
	for _, h := range hashes {
		k := StoreKey(raceModel, 0, h)
		v, size := blockObject(PayloadAccounting, h, 0, 8)
		keys, objects = append(keys, k), append(objects, Object{Key: k, Hash: h, Value: v, Size: size})
	}
	return hashes, keys, objects
}

// raceRank returns a rank with what its load and pool-read paths need,
// but no store, connection or intake.
func raceRank() *Rank {
	return &Rank{
		cfg:         RankConfig{Payload: PayloadAccounting, SaveWait: 2 * time.Second},
		log:         slog.New(slog.NewTextHandler(io.Discard, nil)),
		saving:      map[string]*rankReq{},
		savingAfter: map[string][]*rankReq{},
		series:      NewMetrics(prometheus.NewRegistry()).forRank("g0", "0"),
	}
}

// TestPoolReadWaitsForAReqMetaHandledDuringItsReadAgain: a pool read
// misses a block no save is registered for, while the rank's intake is
// handling the ReqMeta that saves it. That ReqMeta was received before
// the read, so the read is to wait for the intake and then for the save.
// Its handler registers the save and returns while the read reads the
// missing block once more: the read must still wait for that save, not
// take the intake, caught up by then, for one that had nothing for it.
func TestPoolReadWaitsForAReqMetaHandledDuringItsReadAgain(t *testing.T) {
	mem, _ := newTestStore(t, 1<<20)
	hashes, keys, objects := raceBlocks()
	mem.BatchPut(t.Context(), objects[:2])
	nc := busConn(t)
	r := raceRank()
	r.cfg.Conn, r.poolWaits = nc, newOffloader(poolWaitSlots)
	t.Cleanup(r.poolWaits.close)
	// The ReqMeta that saves the third block, received and in its handler.
	saver, _ := newRankReq(&messages.ReqMeta{ReqID: "saver", Model: raceModel, BlockSize: 1, BlockHashes: hashes, SaveFromBlock: 2, CanSave: true})
	saver.id = 1
	inHandler, release := make(chan struct{}), make(chan struct{})
	metaSub, err := nc.Subscribe("kvbus.meta.g0.test", func(*nats.Msg) {
		close(inHandler)
		<-release
		r.mu.Lock()
		r.registerSavesLocked(saver)
		r.mu.Unlock()
		r.metaHandled.Add(1)
	})
	if err != nil {
		t.Fatal(err)
	}
	r.metaSub = metaSub
	if err := nc.Publish("kvbus.meta.g0.test", nil); err != nil {
		t.Fatal(err)
	}
	<-inHandler
	// The read's second read of the third block: the handler finishes
	// meanwhile; the save it registered settles 50 ms later.
	store := &nthGetStore{BlockStore: mem, hookKey: keys[2], n: 2}
	store.hook = func() {
		close(release)
		for pending, _, _ := metaSub.Pending(); pending > 0; pending, _, _ = metaSub.Pending() {
			time.Sleep(100 * time.Microsecond)
		}
		go func() {
			time.Sleep(50 * time.Millisecond)
			mem.BatchPut(context.Background(), objects[2:])
			r.settleSaves(saver)
		}()
	}
	r.store = store
	if sent := poolReadSent(t, r, hashes); len(sent) != len(hashes) {
		t.Errorf("the pool read was sent %d of its %d blocks; want all: the ReqMeta saving the last was received before the read, and its save settled within SaveWait",
			len(sent), len(hashes))
	}
}

// poolReadSent sends r a pool read of hashes (rank 0's blocks of
// raceModel) and returns the indexes of the blocks its answer carried.
func poolReadSent(t *testing.T, r *Rank, hashes []uint64) map[int]bool {
	t.Helper()
	replies, err := r.cfg.Conn.SubscribeSync(nats.NewInbox())
	if err != nil {
		t.Fatal(err)
	}
	data, err := messages.Marshal(&messages.PoolRead{Model: raceModel, TPRank: 0, BlockHashes: hashes})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.onPoolRead(t.Context(), &nats.Msg{Subject: "kvbus.pool.g0.0", Reply: replies.Subject, Data: data}); err != nil {
		t.Fatal(err)
	}
	sent := map[int]bool{}
	for more := true; more; {
		m, err := replies.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("the pool read's answer: %v", err)
		}
		part, err := messages.DecodePoolPart(m.Data)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range part.Pieces {
			sent[p.Index] = true
		}
		more = part.Part+1 < part.Parts
	}
	return sent
}
