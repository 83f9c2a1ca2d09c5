package frontend

import (
	"fmt"
	"runtime"
	"testing"
)

// TestTokenCacheWeighsWhatItHolds: the tokenizer cache's weights are what
// its entries take of the heap (within 20%), so tokenCacheBytes bounds its
// memory. Without the per-entry cost, short messages took 246 bytes of
// heap each while weighing 131, and a soak run's cache held 123 MB under a
// 64 MiB bound.
func TestTokenCacheWeighsWhatItHolds(t *testing.T) {
	tok, err := NewBPETokenizer()
	if err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	const n = 50_000 // well under the bound: nothing is evicted
	for i := range n {
		if _, err := tok.encodeCached(nil, fmt.Sprintf("Conversation %d, question %d: tell me about topic %d.", i, i%7, i*31)); err != nil {
			t.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	weight := tok.cache.WeightedSize()
	held := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d entries weigh %d bytes and hold %d bytes of heap (%.2f)", tok.cache.EstimatedSize(), weight, held, float64(held)/float64(weight))
	if tok.cache.EstimatedSize() != n {
		t.Fatalf("%d entries cached, want %d", tok.cache.EstimatedSize(), n)
	}
	if float64(held) > 1.2*float64(weight) {
		t.Errorf("the cache's %d entries hold %d bytes of heap and weigh %d: its bound does not bound its memory", n, held, weight)
	}
}
