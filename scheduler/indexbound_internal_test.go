package scheduler

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/internal/logbuf"
	"github.com/kvbus/kvbus/messages"
)

// TestForgedRankAnsweringDumpsIsBounded: a forged rank (auth off) sends a
// heartbeat saying a capacity of 1,000 blocks, answers the dump request it
// causes with 8 chunks of 200,000 hashes, then streams batches of 100,000
// stores, through the scheduler's own handlers over an embedded server.
// The dump is cut to the rank's bound as its chunks arrive and the index
// records the bound, no more; the rest is counted and said once.
func TestForgedRankAnsweringDumpsIsBounded(t *testing.T) {
	nc := embeddedConn(t)
	var logs logbuf.Buffer
	s, err := New(Config{Conn: nc, ID: "s0", Policy: KVPolicy{}, HeartbeatTimeout: time.Second, DumpTimeout: 5 * time.Second,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	const (
		capacity = 1_000
		chunks   = 8
		perChunk = 200_000
	)
	limit := 2*capacity + rankSlackBlocks
	sub, err := nc.Subscribe(s.cfg.Subjects.Dump("f0", 0), func(m *nats.Msg) {
		for i := range chunks {
			data, err := messages.Marshal(&messages.KVEventBatch{Group: "f0", Rank: 0, Seq: 1, DumpChunk: i, DumpChunks: chunks,
				Events: []messages.KVEvent{clearedAll(), stored(distinct(i*perChunk, perChunk)...)}})
			if err == nil {
				_ = m.Respond(data)
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	hb, err := messages.Marshal(&messages.Heartbeat{Group: "f0", TPRank: 0, WorldSize: 1, StartedUnixMs: 1, CapacityBlocks: capacity})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.onHeartbeat(t.Context(), &nats.Msg{Subject: s.cfg.Subjects.Heartbeat("f0", 0), Data: hb}); err != nil {
		t.Fatal(err)
	}
	s.dumps.Wait() // the dump the heartbeat asked for
	if !s.index.Synced("f0") {
		t.Fatalf("not synced from the forged rank's dump; log:\n%s", logs.String())
	}
	entries, _ := s.index.Size()
	if held := rankHeld(s.index, "f0", 0); held != limit || entries != limit {
		t.Errorf("after a dump of %d blocks: rank holds %d, index %d entries; want %d", chunks*perChunk, held, entries, limit)
	}
	if got, want := s.index.Refused(), uint64(chunks*perChunk-limit); got != want {
		t.Errorf("Refused after the dump = %d, want %d", got, want)
	}
	for k := range 10 {
		data, err := messages.Marshal(kvBatch("f0", 0, uint64(k+2), stored(distinct((chunks+k)*perChunk, 100_000)...)))
		if err != nil {
			t.Fatal(err)
		}
		if err := s.onKVEvents(t.Context(), &nats.Msg{Subject: s.cfg.Subjects.KV("f0", 0), Data: data}); err != nil {
			t.Fatalf("batch %d: %v", k+2, err)
		}
	}
	entries, _ = s.index.Size()
	if held := rankHeld(s.index, "f0", 0); held != limit || entries != limit {
		t.Errorf("after 1,000,000 stores more: rank holds %d, index %d entries; want %d", held, entries, limit)
	}
	if got, want := s.index.Refused(), uint64(chunks*perChunk+1_000_000-limit); got != want {
		t.Errorf("Refused = %d, want %d", got, want)
	}
	// The dump itself is cut as its chunks arrive, not only in the index.
	dump, got, err := s.fetchDump(t.Context(), "f0", 0)
	if err != nil || dumpBlocks(dump) != limit || got.cut != chunks*perChunk-limit || got.chunks != chunks {
		t.Errorf("fetchDump = %d blocks, %+v, %v; want %d blocks, %d cut of %d chunks", dumpBlocks(dump), got, err, limit, chunks*perChunk-limit, chunks)
	}
	said := strings.Count(logs.String(), "a rank says it holds more blocks than its bound")
	if said != 1 || !strings.Contains(logs.String(), "group=f0 tp_rank=0") || !strings.Contains(logs.String(), "Who may do what on the bus") {
		t.Errorf("the bound was said %d times, want once, naming f0/0 and auth; log:\n%s", said, logs.String())
	}
}
