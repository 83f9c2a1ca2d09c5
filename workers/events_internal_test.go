package workers

import (
	"log/slog"
	"maps"
	"slices"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// busConn starts an embedded NATS server and connects to it, both closed
// at the test's end (testenv, which imports this package, cannot be used
// here).
func busConn(t *testing.T) *nats.Conn {
	t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// TestStoredEventsAgreeWithTheStore: two threads put into one store, and one
// thread's put evicts what the other just stored, before that thread
// published it. Whatever the order of their batches, what the events say
// the rank holds (the index's view, and what a dump returns) is what the
// store holds.
func TestStoredEventsAgreeWithTheStore(t *testing.T) {
	nc := busConn(t)
	const model = "m"
	setup := func(t *testing.T) (*eventLog, *MemStore) {
		l := newEventLog(nc, "kvbus.kv.g0.0", "g0", 0, slog.New(slog.DiscardHandler))
		// Room for two blocks of one byte.
		store, err := NewMemStore(MemStoreConfig{Capacity: 2, OnEvict: l.evicted})
		if err != nil {
			t.Fatal(err)
		}
		l.exists = func(keys []string) []bool { return store.BatchIsExist(t.Context(), keys) }
		return l, store
	}
	put := func(t *testing.T, s *MemStore, hashes ...uint64) {
		t.Helper()
		for _, h := range hashes {
			if err := s.BatchPut(t.Context(), []Object{{Key: StoreKey(model, 0, h), Hash: h, Value: []byte{1}, Size: 1}})[0]; err != nil {
				t.Fatal(err)
			}
		}
	}
	stored := func(hashes ...uint64) []messages.KVEvent {
		return []messages.KVEvent{{Type: messages.EventBlockStored, BlockHashes: hashes, Medium: mediumKVPool}}
	}
	check := func(t *testing.T, l *eventLog, s *MemStore, want ...uint64) {
		t.Helper()
		var holds []uint64
		for _, h := range []uint64{1, 2, 3} {
			if s.BatchIsExist(t.Context(), []string{StoreKey(model, 0, h)})[0] {
				holds = append(holds, h)
			}
		}
		said := slices.Sorted(maps.Keys(l.held))
		if !slices.Equal(said, holds) || !slices.Equal(holds, want) {
			t.Errorf("the events say the rank holds %v, the store holds %v; want %v", said, holds, want)
		}
	}

	t.Run("evicted before its store was published", func(t *testing.T) {
		l, s := setup(t)
		put(t, s, 1)                         // thread A stores 1 ...
		put(t, s, 2, 3)                      // ... thread B stores 2 and 3, evicting 1,
		l.publishStored(model, stored(2, 3)) // and publishes first: 2, 3 stored, 1 removed;
		l.publishStored(model, stored(1))    // then A: 1 is gone, not announced.
		check(t, l, s, 2, 3)
	})
	t.Run("stored again before its eviction was published", func(t *testing.T) {
		l, s := setup(t)
		put(t, s, 1)
		l.publishStored(model, stored(1))
		put(t, s, 2, 3)                      // B evicts 1 (not published yet) ...
		put(t, s, 1)                         // ... A stores 1 again, evicting 2,
		l.publishStored(model, stored(1))    // and publishes first: 1 is held, 2 removed;
		l.publishStored(model, stored(2, 3)) // then B: 2 is gone, 3 held.
		check(t, l, s, 1, 3)
	})
}

// TestPresentRuns: a BlockStored cut around an absent block keeps, for each
// run, its own tokens and its parent, as vLLM's events have them.
func TestPresentRuns(t *testing.T) {
	parent := uint64(9)
	ev := messages.KVEvent{Type: messages.EventBlockStored, BlockHashes: []uint64{10, 11, 12, 13}, ParentBlockHash: &parent,
		TokenIDs: []uint32{0, 1, 2, 3, 4, 5, 6, 7}, BlockSize: 2}
	got := presentRuns(ev, []bool{true, false, true, true})
	if len(got) != 2 {
		t.Fatalf("%d runs, want 2: %+v", len(got), got)
	}
	a, b := got[0], got[1]
	if !slices.Equal(a.BlockHashes, []uint64{10}) || !slices.Equal(a.TokenIDs, []uint32{0, 1}) || *a.ParentBlockHash != 9 {
		t.Errorf("first run %+v", a)
	}
	if !slices.Equal(b.BlockHashes, []uint64{12, 13}) || !slices.Equal(b.TokenIDs, []uint32{4, 5, 6, 7}) || *b.ParentBlockHash != 11 {
		t.Errorf("second run %+v", b)
	}
	handed := messages.KVEvent{Type: messages.EventBlockStored, BlockHashes: []uint64{10, 11, 12}} // no chain: a hand-off's
	if got := presentRuns(handed, []bool{true, false, true}); len(got) != 2 || got[1].ParentBlockHash != nil {
		t.Errorf("a hand-off's blocks got a parent: %+v", got)
	}
	if got := presentRuns(ev, []bool{false, false, false, false}); len(got) != 0 {
		t.Errorf("no block present: %+v", got)
	}
	if got := presentRuns(ev, []bool{true, true, true, true}); len(got) != 1 || len(got[0].BlockHashes) != 4 {
		t.Errorf("all present: %+v", got)
	}
}
