package workers

import (
	"slices"
	"testing"
)

func TestMemStoreEvictSession(t *testing.T) {
	var evicted []string
	s, err := NewMemStore(MemStoreConfig{Capacity: 50, Evict: EvictSession, OnEvict: func(key string, _ uint64, _ string) {
		evicted = append(evicted, key)
	}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	put := func(key, group string) {
		t.Helper()
		if errs := s.BatchPut(ctx, []Object{{Key: key, Value: make([]byte, 10), Group: group}}); errs[0] != nil {
			t.Fatal(errs[0])
		}
	}
	put("a1", "sess-a")
	put("b1", "sess-b")
	put("a2", "sess-a")
	put("u1", "") // untagged: evicted alone
	put("u2", "")
	// Full (50 bytes). The least recently used is a1: its whole session goes.
	put("c1", "sess-c")
	slices.Sort(evicted)
	if !slices.Equal(evicted, []string{"a1", "a2"}) {
		t.Fatalf("evicted %v, want the whole session a: [a1 a2]", evicted)
	}
	if got := s.BatchIsExist(ctx, []string{"a1", "a2", "b1", "u1", "u2", "c1"}); !slices.Equal(got, []bool{false, false, true, true, true, true}) {
		t.Fatalf("exist = %v", got)
	}
	evicted = nil
	put("c2", "sess-c") // room for one: b1 is now the oldest, alone in its session
	put("c3", "sess-c") // full again: b1 goes... then u1
	if !slices.Equal(evicted, []string{"b1"}) {
		t.Fatalf("evicted %v, want [b1]", evicted)
	}
	evicted = nil
	put("d1", "sess-d")
	if !slices.Equal(evicted, []string{"u1"}) {
		t.Fatalf("untagged objects go one by one: evicted %v, want [u1]", evicted)
	}
	if _, err := NewMemStore(MemStoreConfig{Capacity: 1, Evict: "fifo"}); err == nil {
		t.Fatal("unknown eviction policy accepted")
	}
}

func TestPayloadModes(t *testing.T) {
	const size = 512 << 10
	for _, mode := range []string{PayloadBytes, PayloadAccounting} {
		value, charged := blockObject(mode, 42, 1, size)
		if charged != size {
			t.Errorf("%s: charged %d, want %d", mode, charged, size)
		}
		wantLen := size
		if mode == PayloadAccounting {
			wantLen = 8 // a digest per block
		}
		if len(value) != wantLen {
			t.Errorf("%s: value of %d bytes, want %d", mode, len(value), wantLen)
		}
		if !verifyBlock(mode, value, 42, 1, size) {
			t.Errorf("%s: own block does not verify", mode)
		}
		if verifyBlock(mode, value, 43, 1, size) || verifyBlock(mode, value, 42, 2, size) {
			t.Errorf("%s: another block's value verifies", mode)
		}
	}
	// Accounting charges the full size against capacity while holding 8 bytes.
	s, err := NewMemStore(MemStoreConfig{Capacity: 2 * size})
	if err != nil {
		t.Fatal(err)
	}
	for h := range uint64(3) {
		v, c := blockObject(PayloadAccounting, h, 0, size)
		s.BatchPut(t.Context(), []Object{{Key: StoreKey("m", 0, h), Hash: h, Value: v, Size: c}})
	}
	if used, _, n := s.Usage(); used != 2*size || n != 2 {
		t.Fatalf("usage %d bytes in %d objects, want %d in 2", used, n, 2*size)
	}
}
