package workers

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"
)

type evicted struct{ key, group string }

// newTestStore returns a MemStore that records its evictions.
func newTestStore(t *testing.T, capacity int64) (*MemStore, func() []evicted) {
	t.Helper()
	var (
		mu  sync.Mutex
		got []evicted
	)
	s, err := NewMemStore(MemStoreConfig{Capacity: capacity, OnEvict: func(key string, _ uint64, group string) {
		mu.Lock()
		got = append(got, evicted{key, group})
		mu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	return s, func() []evicted {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
}

func val(n int, b byte) []byte { return bytes.Repeat([]byte{b}, n) }

func checkUsage(t *testing.T, s *MemStore, wantUsed, wantCap int64, wantObjs int) {
	t.Helper()
	used, capacity, objs := s.Usage()
	if used != wantUsed || capacity != wantCap || objs != wantObjs {
		t.Fatalf("Usage() = (%d, %d, %d), want (%d, %d, %d)", used, capacity, objs, wantUsed, wantCap, wantObjs)
	}
}

func TestNewMemStoreRejectsNonPositiveCapacity(t *testing.T) {
	for _, capacity := range []int64{0, -1} {
		if s, err := NewMemStore(MemStoreConfig{Capacity: capacity}); err == nil {
			t.Errorf("NewMemStore(%d) = %v, nil; want an error", capacity, s)
		}
	}
}

func TestMemStoreRoundTrip(t *testing.T) {
	ctx := t.Context()
	s, evictions := newTestStore(t, 1<<20)
	objs := []Object{
		{Key: "a", Value: []byte("alpha"), Group: "s1"},
		{Key: "b", Value: []byte("bravo!"), Group: "s1"},
		{Key: "c", Value: []byte{}, Group: "s2"}, // an empty value is still an object
	}
	for i, err := range s.BatchPut(ctx, objs) {
		if err != nil {
			t.Fatalf("BatchPut[%d]: %v", i, err)
		}
	}
	keys := []string{"a", "missing", "b", "c"}
	if got, want := s.BatchIsExist(ctx, keys), []bool{true, false, true, true}; !slices.Equal(got, want) {
		t.Errorf("BatchIsExist(%q) = %v, want %v", keys, got, want)
	}
	got := s.BatchGet(ctx, keys, RecencyNow)
	if len(got) != len(keys) {
		t.Fatalf("BatchGet returned %d values for %d keys", len(got), len(keys))
	}
	for i, want := range [][]byte{[]byte("alpha"), nil, []byte("bravo!"), {}} {
		if !bytes.Equal(got[i], want) || (want == nil) != (got[i] == nil) {
			t.Errorf("BatchGet[%q] = %q, want %q", keys[i], got[i], want)
		}
	}
	if got := s.BatchGet(ctx, nil, RecencyNow); len(got) != 0 {
		t.Errorf("BatchGet(nil) = %v", got)
	}
	if got := s.BatchIsExist(ctx, nil); len(got) != 0 {
		t.Errorf("BatchIsExist(nil) = %v", got)
	}
	checkUsage(t, s, 11, 1<<20, 3)
	if ev := evictions(); len(ev) != 0 {
		t.Errorf("evictions without pressure: %v", ev)
	}
}

func TestMemStoreRemove(t *testing.T) {
	ctx := t.Context()
	s, evictions := newTestStore(t, 100)
	s.BatchPut(ctx, []Object{{Key: "a", Value: val(10, 1)}, {Key: "b", Value: val(20, 2)}})
	if err := s.Remove(ctx, "absent"); err != nil {
		t.Errorf("Remove(absent) = %v, want nil", err)
	}
	checkUsage(t, s, 30, 100, 2)
	if err := s.Remove(ctx, "a"); err != nil {
		t.Fatalf("Remove(a) = %v", err)
	}
	checkUsage(t, s, 20, 100, 1)
	if got := s.BatchIsExist(ctx, []string{"a", "b"}); !slices.Equal(got, []bool{false, true}) {
		t.Errorf("after Remove(a): BatchIsExist = %v", got)
	}
	if err := s.Remove(ctx, "a"); err != nil {
		t.Errorf("second Remove(a) = %v, want nil", err)
	}
	checkUsage(t, s, 20, 100, 1)
	// Remove is reported once (the rank turns it into a BlockRemoved event);
	// removing an absent key reports nothing.
	if ev := evictions(); len(ev) != 1 || ev[0].key != "a" {
		t.Errorf("Remove must be reported once, got %v", ev)
	}
}

func TestMemStoreCapacityAndLRU(t *testing.T) {
	ctx := t.Context()
	// Four 25-byte objects fill 100 bytes exactly.
	s, evictions := newTestStore(t, 100)
	for i, k := range []string{"k0", "k1", "k2", "k3"} {
		if errs := s.BatchPut(ctx, []Object{{Key: k, Value: val(25, byte(i)), Group: "g" + k}}); errs[0] != nil {
			t.Fatal(errs[0])
		}
	}
	checkUsage(t, s, 100, 100, 4)
	if ev := evictions(); len(ev) != 0 {
		t.Fatalf("a full but not overfull store evicted %v", ev)
	}
	// Recency now (most recent first): k3 k2 k1 k0. Touch k0 and k1 so that
	// k2 becomes the least recently used, then k3.
	s.BatchGet(ctx, []string{"k0", "k1"}, RecencyNow)
	// BatchIsExist must not refresh recency.
	s.BatchIsExist(ctx, []string{"k2", "k3"})

	errs := s.BatchPut(ctx, []Object{{Key: "k4", Value: val(30, 4), Group: "gk4"}})
	if errs[0] != nil {
		t.Fatal(errs[0])
	}
	// 30 new bytes need two 25-byte evictions: k2, then k3.
	if got, want := evictions(), []evicted{{"k2", "gk2"}, {"k3", "gk3"}}; !slices.Equal(got, want) {
		t.Fatalf("evictions = %v, want %v", got, want)
	}
	checkUsage(t, s, 80, 100, 3)
	if got := s.BatchIsExist(ctx, []string{"k0", "k1", "k2", "k3", "k4"}); !slices.Equal(got, []bool{true, true, false, false, true}) {
		t.Fatalf("BatchIsExist after eviction = %v", got)
	}
	// Within one batch, later objects may evict earlier ones of the same
	// batch: the store never exceeds its capacity.
	errs = s.BatchPut(ctx, []Object{{Key: "big1", Value: val(60, 5)}, {Key: "big2", Value: val(60, 6)}})
	for i, err := range errs {
		if err != nil {
			t.Fatalf("BatchPut[%d]: %v", i, err)
		}
	}
	used, capacity, _ := s.Usage()
	if used > capacity {
		t.Fatalf("used %d > capacity %d", used, capacity)
	}
	checkUsage(t, s, 60, 100, 1)
	if got := s.BatchGet(ctx, []string{"big2"}, RecencyNow)[0]; !bytes.Equal(got, val(60, 6)) {
		t.Fatalf("big2 = %v", got)
	}
}

// TestMemStoreEvictIdle: an evicted block's idle time runs from its last
// put or read, not from its first put nor from an existence check; a block
// removed (not evicted for room) is not counted.
func TestMemStoreEvictIdle(t *testing.T) {
	ctx := t.Context()
	var idle []time.Duration
	s, err := NewMemStore(MemStoreConfig{Capacity: 20, EvictIdle: func(d time.Duration) { idle = append(idle, d) }})
	if err != nil {
		t.Fatal(err)
	}
	s.BatchPut(ctx, []Object{{Key: "read", Value: val(10, 1)}, {Key: "checked", Value: val(10, 2)}})
	time.Sleep(200 * time.Millisecond)
	s.BatchGet(ctx, []string{"read"}, RecencyNow)
	s.BatchIsExist(ctx, []string{"checked"})
	s.BatchPut(ctx, []Object{{Key: "new1", Value: val(10, 3)}}) // evicts "checked", 200 ms idle
	s.BatchPut(ctx, []Object{{Key: "new2", Value: val(10, 4)}}) // evicts "read", just read
	if err := s.Remove(ctx, "new1"); err != nil {
		t.Fatal(err)
	}
	if len(idle) != 2 {
		t.Fatalf("%d idle times observed, want 2 (the two evictions): %v", len(idle), idle)
	}
	if idle[0] < 200*time.Millisecond || idle[1] >= 200*time.Millisecond {
		t.Errorf("idle times %v: want the checked block's >= 200ms (a check is no use), the read block's below it", idle)
	}
}

func TestMemStoreObjectTooLarge(t *testing.T) {
	ctx := t.Context()
	s, evictions := newTestStore(t, 64)
	s.BatchPut(ctx, []Object{{Key: "old", Value: val(40, 9)}})
	errs := s.BatchPut(ctx, []Object{
		{Key: "small", Value: val(10, 1)},
		{Key: "huge", Value: val(65, 2)},
		{Key: "exact", Value: val(64, 3)}, // exactly the capacity fits
	})
	if len(errs) != 3 {
		t.Fatalf("BatchPut returned %d errors for 3 objects", len(errs))
	}
	if errs[0] != nil || errs[2] != nil {
		t.Errorf("errors for fitting objects: %v, %v", errs[0], errs[2])
	}
	if !errors.Is(errs[1], ErrObjectTooLarge) {
		t.Errorf("error for a 65-byte object in a 64-byte store = %v, want ErrObjectTooLarge", errs[1])
	}
	// The too-large object evicted nothing on its own; "exact" evicted the rest.
	if got, want := evictions(), []evicted{{"old", ""}, {"small", ""}}; !slices.Equal(got, want) {
		t.Errorf("evictions = %v, want %v", got, want)
	}
	if got := s.BatchIsExist(ctx, []string{"huge", "exact"}); !slices.Equal(got, []bool{false, true}) {
		t.Errorf("BatchIsExist(huge, exact) = %v", got)
	}
	checkUsage(t, s, 64, 64, 1)
}

func TestMemStoreReplaceDoesNotDoubleCount(t *testing.T) {
	ctx := t.Context()
	s, evictions := newTestStore(t, 100)
	tests := []struct {
		name     string
		value    []byte
		wantUsed int64
	}{
		{"first put", val(40, 1), 40},
		{"same size", val(40, 2), 40},
		{"smaller", val(10, 3), 10},
		{"larger", val(90, 4), 90},
		{"whole capacity", val(100, 5), 100},
	}
	for _, tt := range tests {
		if errs := s.BatchPut(ctx, []Object{{Key: "k", Value: tt.value, Group: "g"}}); errs[0] != nil {
			t.Fatalf("%s: %v", tt.name, errs[0])
		}
		used, _, objs := s.Usage()
		if used != tt.wantUsed || objs != 1 {
			t.Errorf("%s: used %d bytes in %d objects, want %d in 1", tt.name, used, objs, tt.wantUsed)
		}
		if got := s.BatchGet(ctx, []string{"k"}, RecencyNow)[0]; !bytes.Equal(got, tt.value) {
			t.Errorf("%s: value not replaced", tt.name)
		}
	}
	// Replacing a key is not an eviction (the object still exists).
	if ev := evictions(); len(ev) != 0 {
		t.Errorf("replacing a key reported evictions %v", ev)
	}
}

func TestMemStoreConcurrent(t *testing.T) {
	ctx := t.Context()
	const (
		workers = 8
		rounds  = 300
		size    = 64
	)
	// Room for a fraction of the keys, so that eviction runs concurrently
	// with puts and gets.
	capacity := int64(workers * 20 * size)
	s, _ := newTestStore(t, capacity)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range rounds {
				key := fmt.Sprintf("w%d-k%d", w, i%50)
				want := val(size, byte(w))
				if errs := s.BatchPut(ctx, []Object{{Key: key, Value: want, Group: "g"}}); errs[0] != nil {
					t.Error(errs[0])
					return
				}
				got := s.BatchGet(ctx, []string{key, fmt.Sprintf("w%d-k%d", (w+1)%workers, i%50)}, RecencyNow)
				// Our own key may already be evicted by another worker, but a
				// value found is never torn or someone else's.
				if got[0] != nil && !bytes.Equal(got[0], want) {
					t.Errorf("worker %d read a foreign value for %s", w, key)
					return
				}
				s.BatchIsExist(ctx, []string{key})
				if i%7 == 0 {
					_ = s.Remove(ctx, key)
				}
				if used, c, _ := s.Usage(); used > c {
					t.Errorf("used %d > capacity %d", used, c)
					return
				}
			}
		})
	}
	wg.Wait()
	used, _, objs := s.Usage()
	if used != int64(objs)*size {
		t.Errorf("used %d bytes for %d objects of %d bytes", used, objs, size)
	}
}

// BenchmarkMemStorePutGet is one op = a BatchPut of 16 4 KiB blocks and a
// BatchGet of them, at the recency of one request as a rank does (values
// are not copied, so no bytes/s figure).
func BenchmarkMemStorePutGet(b *testing.B) {
	ctx := b.Context()
	const (
		batch = 16
		size  = 4 << 10
	)
	// Room for 64 batches: puts evict once the store is warm.
	s, err := NewMemStore(MemStoreConfig{Capacity: 64 * batch * size})
	if err != nil {
		b.Fatal(err)
	}
	values := make([][]byte, batch)
	for i := range values {
		values[i] = BlockPayload(uint64(i), 0, size)
	}
	keysets := make([][]string, 256)
	for n := range keysets {
		keysets[n] = make([]string, batch)
		for i := range batch {
			keysets[n][i] = StoreKey("bench", 0, uint64(n*batch+i))
		}
	}
	objs := make([]Object, batch)
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		keys := keysets[n%len(keysets)]
		for i := range objs {
			objs[i] = Object{Key: keys[i], Value: values[i], Group: "bench", Recency: Recency(n + 1)}
		}
		for _, err := range s.BatchPut(ctx, objs) {
			if err != nil {
				b.Fatal(err)
			}
		}
		if got := s.BatchGet(ctx, keys, Recency(n+1)); got[batch-1] == nil {
			b.Fatal("just-put block missing")
		}
		n++
	}
}

// TestMemStoreOrdersByRecencyWhateverTheInterleaving: two stores given the
// same requests' operations in different orders, as two ranks of a group
// whose load and store threads interleave differently, evict the same
// objects: those of the least recency first, and among one recency's the
// least recently used. A read at RecencyKept (another group's) changes no
// order.
func TestMemStoreOrdersByRecencyWhateverTheInterleaving(t *testing.T) {
	ctx := t.Context()
	put := func(s *MemStore, at Recency, keys ...string) func() {
		return func() {
			objs := make([]Object, len(keys))
			for i, k := range keys {
				objs[i] = Object{Key: k, Value: val(10, 1), Group: "s-" + k[:1], Recency: at}
			}
			for _, err := range s.BatchPut(ctx, objs) {
				if err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	get := func(s *MemStore, at Recency, keys ...string) func() {
		return func() { s.BatchGet(ctx, keys, at) }
	}
	for _, evict := range []string{EvictLRU, EvictSession} {
		var held [2][]bool
		var recent [2][]string // the eviction order, last first
		for n, order := range [][]int{{0, 1, 6, 2, 3, 4, 5}, {0, 2, 3, 1, 4, 6, 5}} {
			var gone []string
			s, err := NewMemStore(MemStoreConfig{Capacity: 60, Evict: evict, OnEvict: func(key string, _ uint64, _ string) { gone = append(gone, key) }})
			if err != nil {
				t.Fatal(err)
			}
			// Requests 1-3 each save two blocks of their session (a, b, c);
			// request 3 also reads a's first block, request 2 is read by
			// another group; request 4 saves two blocks of d, which evicts.
			// The second order has request 2's save and request 1's touch of
			// a1 come after request 3's read and save, as a rank's store
			// thread lagging behind its load thread: a1 stays at recency 3
			// either way.
			ops := []func(){
				put(s, 1, "a1", "a2"),
				put(s, 2, "b1", "b2"),
				get(s, 3, "a1"),
				put(s, 3, "c1", "c2"),
				get(s, RecencyKept, "b1", "b2"),
				put(s, 4, "d1", "d2"),
				get(s, 1, "a1"), // request 1's store thread touching its prefix, behind request 3's load
			}
			for _, i := range order {
				ops[i]()
			}
			if ev := len(gone); ev == 0 {
				t.Fatalf("%s, order %v: nothing evicted", evict, order)
			}
			held[n] = s.BatchIsExist(ctx, []string{"a1", "a2", "b1", "b2", "c1", "c2", "d1", "d2"})
			for _, o := range s.Recent(1 << 20) {
				recent[n] = append(recent[n], o.Key)
			}
		}
		if !slices.Equal(recent[0], recent[1]) {
			t.Errorf("%s: the two interleavings order what they hold %v and %v (most recent first)", evict, recent[0], recent[1])
		}
		if !slices.Equal(held[0], held[1]) {
			t.Errorf("%s: the two interleavings hold %v and %v", evict, held[0], held[1])
		}
		// LRU: a2 (recency 1), then b1, the least recently used of
		// recency 2; session: a's whole session, a2 being the least recent.
		want := map[string][]bool{
			EvictLRU:     {true, false, false, true, true, true, true, true},
			EvictSession: {false, false, true, true, true, true, true, true},
		}[evict]
		if !slices.Equal(held[0], want) {
			t.Errorf("%s: holds %v of a1 a2 b1 b2 c1 c2 d1 d2, want %v", evict, held[0], want)
		}
	}
}
