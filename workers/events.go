package workers

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// mediumKVPool is the medium of kvbus's KV events: the rank's block store.
const mediumKVPool = "kvpool"

// eventLog publishes a rank's KV events with a monotonic seq and keeps the
// set of block hashes those events say the rank holds, which is what a dump
// returns. Safe for concurrent use.
type eventLog struct {
	nc      *nats.Conn
	subject string
	group   string
	rank    int
	log     *slog.Logger
	// started is the process's started_unix_ms, sent in every batch (set
	// once, before the rank runs).
	started int64

	// exists reports whether the rank's store holds each key (see
	// publishStored); required, set once before the rank runs.
	exists func(keys []string) []bool

	mu   sync.Mutex
	seq  uint64
	held map[uint64]struct{}

	evMu    sync.Mutex
	removed []evictedBlock // evicted since they were last published
}

type evictedBlock struct {
	key  string
	hash uint64
}

func newEventLog(nc *nats.Conn, subject, group string, rank int, log *slog.Logger) *eventLog {
	return &eventLog{nc: nc, subject: subject, group: group, rank: rank, log: log, held: map[uint64]struct{}{}}
}

// heldBlocks is how many blocks the published events say the rank holds.
func (l *eventLog) heldBlocks() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.held)
}

// evicted is the block store's EvictFunc.
func (l *eventLog) evicted(key string, hash uint64, _ string) {
	l.evMu.Lock()
	l.removed = append(l.removed, evictedBlock{key, hash})
	l.evMu.Unlock()
}

// publishStored publishes what a thread stored (BlockStored events of
// model's blocks), then the blocks the store evicted since the last batch,
// each block only if its event is still true when the batch goes out. The
// store, load and hand-off threads put and evict concurrently: a block one
// stored could be evicted by another's put, and that removal published,
// before the first thread's BlockStored — which then told the index of a
// block nobody holds, for good. Checking under the lock that orders the
// batches makes every mention of a block agree with the store at the moment
// its batch goes out; any change after that check publishes after it.
func (l *eventLog) publishStored(model string, stored []messages.KVEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.evMu.Lock()
	removed := l.removed
	l.removed = nil
	l.evMu.Unlock()
	var keys []string
	for _, ev := range stored {
		for _, h := range ev.BlockHashes {
			keys = append(keys, StoreKey(model, l.rank, h))
		}
	}
	for _, b := range removed {
		keys = append(keys, b.key)
	}
	if len(keys) == 0 {
		return
	}
	present := l.exists(keys)
	var events []messages.KVEvent
	i := 0
	for _, ev := range stored {
		events = append(events, presentRuns(ev, present[i:i+len(ev.BlockHashes)])...)
		i += len(ev.BlockHashes)
	}
	var gone messages.BlockHashes
	for j, b := range removed {
		if !present[i+j] {
			gone = append(gone, b.hash)
		}
	}
	if len(gone) > 0 {
		events = append(events, messages.KVEvent{Type: messages.EventBlockRemoved, BlockHashes: gone, Medium: mediumKVPool})
	}
	l.publishLocked(events)
}

// presentRuns returns ev (a BlockStored) cut to the runs of its blocks that
// are present, each with its own tokens and parent.
func presentRuns(ev messages.KVEvent, present []bool) []messages.KVEvent {
	if !slices.Contains(present, false) {
		return []messages.KVEvent{ev}
	}
	var out []messages.KVEvent
	for a := 0; a < len(present); {
		if !present[a] {
			a++
			continue
		}
		b := a
		for b < len(present) && present[b] {
			b++
		}
		run := ev
		run.BlockHashes = ev.BlockHashes[a:b]
		if bs := ev.BlockSize; bs > 0 && len(ev.TokenIDs) >= b*bs {
			run.TokenIDs = ev.TokenIDs[a*bs : b*bs]
		}
		if a > 0 && len(ev.TokenIDs) > 0 { // a chain's run: its parent is the block before it
			parent := ev.BlockHashes[a-1]
			run.ParentBlockHash = &parent
		}
		out = append(out, run)
		a = b
	}
	return out
}

// storedEvents describes newly stored blocks (indexes into meta's blocks,
// ascending) as one BlockStored per contiguous run, with its parent hash and
// tokens, like vLLM's events.
func storedEvents(meta *messages.ReqMeta, blocks []int) []messages.KVEvent {
	var out []messages.KVEvent
	for len(blocks) > 0 {
		n := 1
		for n < len(blocks) && blocks[n] == blocks[0]+n {
			n++
		}
		first, bs := blocks[0], meta.BlockSize
		ev := messages.KVEvent{
			Type:        messages.EventBlockStored,
			BlockHashes: slices.Clone(meta.BlockHashes[first : first+n]),
			TokenIDs:    slices.Clone(meta.TokenIDs[first*bs : (first+n)*bs]),
			BlockSize:   bs,
			Medium:      mediumKVPool,
		}
		if first > 0 {
			parent := meta.BlockHashes[first-1]
			ev.ParentBlockHash = &parent
		}
		out = append(out, ev)
		blocks = blocks[n:]
	}
	return out
}

// publish sends one batch with the next seq and applies it to the held set.
// Publishing under the lock keeps seq order on the wire. For events that are
// not the rank's own stores (a cleared store, a model server's events).
func (l *eventLog) publish(events []messages.KVEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.publishLocked(events)
}

func (l *eventLog) publishLocked(events []messages.KVEvent) {
	if len(events) == 0 {
		return
	}
	for _, ev := range events {
		switch ev.Type {
		case messages.EventBlockStored:
			for _, h := range ev.BlockHashes {
				l.held[h] = struct{}{}
			}
		case messages.EventBlockRemoved:
			for _, h := range ev.BlockHashes {
				delete(l.held, h)
			}
		case messages.EventAllBlocksCleared:
			clear(l.held)
		}
	}
	l.seq++
	data, err := messages.Marshal(&messages.KVEventBatch{
		TS: float64(time.Now().UnixMicro()) / 1e6, Seq: l.seq, Group: l.group, Rank: l.rank, Events: events, StartedUnixMs: l.started,
	})
	if err == nil {
		err = l.nc.Publish(l.subject, data)
	}
	if err != nil {
		// The scheduler sees the gap in seq and asks for a dump.
		l.log.Error("cannot publish KV events", "seq", l.seq, "err", err)
	}
}

// onDump answers kvbus.ctl.dump.<group>.<rank> with everything the rank
// holds, at the current seq, so that events after it continue from that
// seq: AllBlocksCleared then BlockStored, in as many chunks (KVEventBatches
// with DumpChunk/DumpChunks) as the connection's max payload needs. A rank
// with millions of blocks resyncs against a default 1 MiB server.
func (l *eventLog) onDump(_ context.Context, m *nats.Msg) error {
	l.mu.Lock()
	hashes := make(messages.BlockHashes, 0, len(l.held))
	for h := range l.held {
		hashes = append(hashes, h)
	}
	seq := l.seq
	l.mu.Unlock()
	chunks := dumpChunks(hashes, dumpHashesPerChunk(busLimit(l.nc)))
	ts := float64(time.Now().UnixMicro()) / 1e6
	for i, part := range chunks {
		batch := &messages.KVEventBatch{TS: ts, Seq: seq, Group: l.group, Rank: l.rank, DumpChunk: i, DumpChunks: len(chunks),
			StartedUnixMs: l.started}
		if i == 0 {
			batch.Events = append(batch.Events, messages.KVEvent{Type: messages.EventAllBlocksCleared})
		}
		if len(part) > 0 {
			batch.Events = append(batch.Events, messages.KVEvent{Type: messages.EventBlockStored, BlockHashes: part, Medium: mediumKVPool})
		}
		data, err := messages.Marshal(batch)
		if err != nil {
			return err
		}
		if err := m.Respond(data); err != nil {
			return fmt.Errorf("answer dump request (chunk %d of %d): %w", i+1, len(chunks), err)
		}
	}
	return nil
}

// dumpHashesPerChunk is how many 8-byte hashes fit one message of at most
// maxPayload bytes, with room for the batch's other fields.
func dumpHashesPerChunk(maxPayload int64) int {
	const overhead = 1024
	if maxPayload <= 0 {
		maxPayload = 1 << 20 // nats-server's default
	}
	return max(int(maxPayload-overhead)/8, 1)
}

// dumpChunks splits hashes into parts of at most per hashes; an empty set
// is one empty part.
func dumpChunks(hashes messages.BlockHashes, per int) []messages.BlockHashes {
	if len(hashes) == 0 {
		return []messages.BlockHashes{nil}
	}
	var out []messages.BlockHashes
	for len(hashes) > 0 {
		n := min(per, len(hashes))
		out = append(out, hashes[:n])
		hashes = hashes[n:]
	}
	return out
}
