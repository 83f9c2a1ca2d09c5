package workers

import (
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// TestPoolPartsFitMaxPayload: every encoded part fits the connection's max
// payload, the pieces' own fields counted — small values (8-byte digests
// with --kv-payload accounting) are mostly overhead — and large values are
// split in order.
func TestPoolPartsFitMaxPayload(t *testing.T) {
	const maxPayload = 64 << 10
	for _, tc := range []struct {
		name          string
		values, bytes int
	}{
		{"digests", 4000, 8},
		{"512-byte blocks", 1000, 512},
		{"blocks larger than a reply", 3, 200 << 10},
	} {
		values := make([][]byte, tc.values)
		for i := range values {
			values[i] = make([]byte, tc.bytes)
		}
		values[1] = nil // absent: not sent
		parts := poolParts(values, maxPayload-poolPartOverhead)
		next := make([]int, len(values)) // the next offset of each value
		for i := range parts {
			parts[i].Part, parts[i].Parts = i, len(parts)
			data, err := messages.Marshal(&parts[i])
			if err != nil {
				t.Fatal(err)
			}
			if len(data) > maxPayload {
				t.Errorf("%s: part %d of %d is %d bytes (%d pieces), over the max payload %d", tc.name, i, len(parts), len(data), len(parts[i].Pieces), maxPayload)
			}
			for _, p := range parts[i].Pieces {
				if p.Offset != next[p.Index] {
					t.Fatalf("%s: value %d: piece at %d, want %d", tc.name, p.Index, p.Offset, next[p.Index])
				}
				next[p.Index] += len(p.Data)
			}
		}
		for i, n := range next {
			if want := len(values[i]); n != want {
				t.Errorf("%s: value %d: %d bytes sent, want %d", tc.name, i, n, want)
			}
		}
	}
}

// TestSavingReadSeesACopyArrive: a read the scheduler planned from a
// rank's save (Saving) may name blocks that rank is copying from another
// group (a LoadSpec's remote run, stored by BatchPut), not saving from a
// ReqMeta of its own: no ReqMeta comes for them. The wait sees the copy
// land and ends then, with the block, instead of waiting out its deadline.
func TestSavingReadSeesACopyArrive(t *testing.T) {
	store, _ := newTestStore(t, 1<<20)
	r := &Rank{store: store, saving: map[string]*rankReq{}, savingAfter: map[string][]*rankReq{}}
	keys := []string{"copied", "absent"}
	values := make([][]byte, len(keys))
	const copyAfter, deadline = 100 * time.Millisecond, 3 * time.Second
	time.AfterFunc(copyAfter, func() {
		store.BatchPut(t.Context(), []Object{{Key: "copied", Value: []byte("block"), Size: 5}})
	})
	start := time.Now()
	r.awaitUnreceivedSaves(t.Context(), "", keys, values, []int{0}, start.Add(deadline))
	if took := time.Since(start); took >= deadline/2 {
		t.Errorf("the wait took %v; want it over once the copy landed (%v), well before its deadline (%v)", took, copyAfter, deadline)
	}
	if string(values[0]) != "block" || values[1] != nil {
		t.Errorf("values = %q; want the copied block, and nothing for the block not waited for", values)
	}
}
