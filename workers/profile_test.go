package workers

import (
	"bytes"
	"strings"
	"testing"
)

func TestBytesPerTokenPerRank(t *testing.T) {
	llama8b, err := LookupModelProfile("llama-3.1-8b")
	if err != nil {
		t.Fatal(err)
	}
	tiny, err := LookupModelProfile("tiny")
	if err != nil {
		t.Fatal(err)
	}
	// By hand, 2 (K and V) × layers × kv_heads per rank × head_dim × dtype bytes.
	// llama-3.1-8b: 32 layers, 8 KV heads, head_dim 128, bf16 (2 bytes):
	//   tp 1:  2 × 32 × 8 × 128 × 2 = 131072 (128 KiB per token)
	//   tp 4:  2 × 32 × 2 × 128 × 2 =  32768
	//   tp 8:  2 × 32 × 1 × 128 × 2 =  16384
	//   tp 16: 8 heads over 16 ranks are replicated, 1 head per rank:
	//          2 × 32 × 1 × 128 × 2 =  16384
	// tiny: 1 layer, 4 KV heads, head_dim 4, 2 bytes:
	//   tp 1:  2 × 1 × 4 × 4 × 2 = 64;  tp 2: 32;  tp 8: 1 head per rank, 16.
	tests := []struct {
		profile ModelProfile
		tp      int
		want    int
	}{
		{llama8b, 1, 131072},
		{llama8b, 4, 32768},
		{llama8b, 8, 16384},
		{llama8b, 16, 16384},
		{llama8b, 0, 131072}, // a nonsensical tp size counts as 1
		{tiny, 1, 64},
		{tiny, 2, 32},
		{tiny, 8, 16},
	}
	for _, tt := range tests {
		if got := tt.profile.BytesPerTokenPerRank(tt.tp); got != tt.want {
			t.Errorf("%s.BytesPerTokenPerRank(%d) = %d, want %d", tt.profile.Name, tt.tp, got, tt.want)
		}
	}
}

func TestLookupModelProfile(t *testing.T) {
	for _, name := range []string{"llama-3.1-8b", "llama-3.1-70b", "tiny"} {
		p, err := LookupModelProfile(name)
		if err != nil || p.Name != name || p.Layers <= 0 || p.KVHeads <= 0 || p.HeadDim <= 0 || p.DTypeBytes <= 0 {
			t.Errorf("LookupModelProfile(%q) = %+v, %v", name, p, err)
		}
	}
	_, err := LookupModelProfile("gpt-5")
	if err == nil {
		t.Fatal("LookupModelProfile(unknown) succeeded")
	}
	for _, want := range []string{`"gpt-5"`, "llama-3.1-8b", "llama-3.1-70b", "tiny"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}
}

func TestStoreKey(t *testing.T) {
	tests := []struct {
		model string
		rank  int
		hash  uint64
		want  string
	}{
		{"m", 2, 0xab, "m@tp_rank:2@00000000000000ab"},
		{"m", 0, 0, "m@tp_rank:0@0000000000000000"},
		{"llama-3.1-8b", 15, 0xffffffffffffffff, "llama-3.1-8b@tp_rank:15@ffffffffffffffff"},
		{"x", 3, 0x0123456789abcdef, "x@tp_rank:3@0123456789abcdef"},
		{strings.Repeat("long-model-name/", 8), 1, 1, strings.Repeat("long-model-name/", 8) + "@tp_rank:1@0000000000000001"},
	}
	for _, tt := range tests {
		if got := StoreKey(tt.model, tt.rank, tt.hash); got != tt.want {
			t.Errorf("StoreKey(%q, %d, %#x) = %q, want %q", tt.model, tt.rank, tt.hash, got, tt.want)
		}
	}
}

func TestBlockPayload(t *testing.T) {
	for _, size := range []int{0, 1, 7, 8, 9, 63, 64, 65, 100, 4096, 512 << 10} {
		a := BlockPayload(0xfeed, 1, size)
		if len(a) != size {
			t.Fatalf("BlockPayload(size %d) has %d bytes", size, len(a))
		}
		if b := BlockPayload(0xfeed, 1, size); !bytes.Equal(a, b) {
			t.Errorf("size %d: BlockPayload is not deterministic", size)
		}
		if size == 0 {
			continue
		}
		if bytes.Equal(a, BlockPayload(0xfeee, 1, size)) {
			t.Errorf("size %d: same payload for another hash", size)
		}
		if bytes.Equal(a, BlockPayload(0xfeed, 2, size)) {
			t.Errorf("size %d: same payload for another rank", size)
		}
	}
	// A shorter payload is a prefix of a longer one whole words at a time,
	// so sizes that are not a multiple of 8 are filled, not zero-padded.
	long := BlockPayload(42, 0, 64)
	if short := BlockPayload(42, 0, 56); !bytes.Equal(short, long[:56]) {
		t.Errorf("56-byte payload is not a prefix of the 64-byte one")
	}
	if odd := BlockPayload(42, 0, 61); !bytes.Equal(odd, long[:61]) {
		t.Errorf("61-byte payload is not a prefix of the 64-byte one: tail %x vs %x", odd[56:], long[56:61])
	}
	// A longer payload is its first payloadPeriod bytes, the stream of a
	// payload of that size, repeated, to its last byte.
	period := BlockPayload(42, 0, payloadPeriod)
	for _, size := range []int{payloadPeriod + 1, 3*payloadPeriod + 13, 512 << 10} {
		p := BlockPayload(42, 0, size)
		for j := 0; j < size; j += payloadPeriod {
			if end := min(j+payloadPeriod, size); !bytes.Equal(p[j:end], period[:end-j]) {
				t.Fatalf("size %d: bytes %d to %d are not the payload's first %d repeated", size, j, end, end-j)
			}
		}
	}
}

func TestVerifyPayload(t *testing.T) {
	const hash, rank = uint64(0xabcdef), 3
	for _, size := range []int{8, 13, 64, 100, 16 << 10} {
		p := BlockPayload(hash, rank, size)
		tests := []struct {
			name string
			b    []byte
			hash uint64
			rank int
			size int
			want bool
		}{
			{"right payload", p, hash, rank, size, true},
			{"other hash", p, hash + 1, rank, size, false},
			{"other rank", p, hash, rank + 1, size, false},
			{"truncated", p[:size-1], hash, rank, size, false},
			{"wrong expected size", p, hash, rank, size + 1, false},
			{"nil", nil, hash, rank, size, false},
			{"payload of another block", BlockPayload(hash^1, rank, size), hash, rank, size, false},
			{"zeroes", make([]byte, size), hash, rank, size, false},
		}
		for _, tt := range tests {
			if got := VerifyPayload(tt.b, tt.hash, tt.rank, tt.size); got != tt.want {
				t.Errorf("size %d, %s: VerifyPayload = %v, want %v", size, tt.name, got, tt.want)
			}
		}
	}
}

func BenchmarkBlockPayload512KiB(b *testing.B) {
	const size = 512 << 10
	b.SetBytes(size)
	b.ReportAllocs()
	var h uint64
	for b.Loop() {
		if p := BlockPayload(h, 1, size); len(p) != size {
			b.Fatal(len(p))
		}
		h++
	}
}

// TestVerifyPayloadShortBlocks documents a bug: VerifyPayload compares only
// whole 8-byte words, so for a block shorter than 8 bytes it checks nothing
// but the length and accepts any bytes. Built-in profiles never make blocks
// that small (at least 16 bytes per token), but a custom ModelProfile can.
func TestVerifyPayloadShortBlocks(t *testing.T) {
	for size := 1; size < 8; size++ {
		if VerifyPayload(BlockPayload(2, 0, size), 1, 0, size) {
			t.Errorf("size %d: the payload of block 2 verifies as block 1", size)
		}
	}
}
