package scheduler

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/kvbus/kvbus/internal/saltforge"
)

// refHashBlocks is the block hash chain spelled out: hash_i =
// xxh3-64(hash_{i-1} as u64 LE ‖ the block's tokens as u32 LE).
func refHashBlocks(seed uint64, tokens []uint32, blockSize int) []uint64 {
	var out []uint64
	prev := seed
	for start := 0; start+blockSize <= len(tokens); start += blockSize {
		b := binary.LittleEndian.AppendUint64(nil, prev)
		for _, tok := range tokens[start : start+blockSize] {
			b = binary.LittleEndian.AppendUint32(b, tok)
		}
		prev = xxh3.Hash(b)
		out = append(out, prev)
	}
	return out
}

func randomTokens(r *rand.Rand, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = r.Uint32()
	}
	return t
}

func TestHashBlocksMatchesReference(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	seed := HashSeed("llama-3.1-8b")
	tests := []struct {
		tokens, blockSize int
	}{
		{0, 16}, {15, 16}, {16, 16}, {17, 16}, {1000, 16}, {8192, 16},
		{7, 1}, {100, 3}, {2048, 512}, {513, 512},
	}
	for _, tt := range tests {
		tokens := randomTokens(r, tt.tokens)
		got := HashBlocks(nil, seed, tokens, tt.blockSize)
		want := refHashBlocks(seed, tokens, tt.blockSize)
		if len(got) != tt.tokens/tt.blockSize {
			t.Errorf("%d tokens, block size %d: %d hashes, want %d (full blocks only)", tt.tokens, tt.blockSize, len(got), tt.tokens/tt.blockSize)
		}
		if !slices.Equal(got, want) {
			t.Errorf("%d tokens, block size %d: hashes differ from the reference", tt.tokens, tt.blockSize)
		}
	}
}

func TestHashBlocksChain(t *testing.T) {
	const bs = 16
	r := rand.New(rand.NewPCG(3, 4))
	tokens := randomTokens(r, 10*bs+5)
	seed := HashSeed("m")
	base := HashBlocks(nil, seed, tokens, bs)

	// Changing token 0 changes every block's hash.
	t0 := slices.Clone(tokens)
	t0[0]++
	for i, h := range HashBlocks(nil, seed, t0, bs) {
		if h == base[i] {
			t.Errorf("token 0 changed, hash %d did not", i)
		}
	}
	// Changing a token of block 5 leaves blocks 0..4 alone and changes 5..9.
	t5 := slices.Clone(tokens)
	t5[5*bs+7] ^= 0x5a5a
	got := HashBlocks(nil, seed, t5, bs)
	for i := range got {
		if (got[i] == base[i]) != (i < 5) {
			t.Errorf("token in block 5 changed: hash %d equal=%v", i, got[i] == base[i])
		}
	}
	// The partial block is not hashed: changing it changes nothing.
	tail := slices.Clone(tokens)
	tail[len(tail)-1]++
	if !slices.Equal(HashBlocks(nil, seed, tail, bs), base) {
		t.Error("a token of the trailing partial block changed the hashes")
	}
	// A prefix of the prompt has a prefix of the hashes.
	if !slices.Equal(HashBlocks(nil, seed, tokens[:3*bs+1], bs), base[:3]) {
		t.Error("hashes of a prefix are not a prefix of the hashes")
	}
	// Equal blocks at different positions hash differently.
	rep := make([]uint32, 4*bs) // four all-zero blocks
	h := HashBlocks(nil, seed, rep, bs)
	if len(h) != 4 || h[0] == h[1] || h[1] == h[2] {
		t.Errorf("equal blocks at different positions: %x", h)
	}
	// Token order within a block matters (little-endian u32, not a sum).
	sw := slices.Clone(tokens)
	sw[0], sw[1] = sw[1], sw[0]
	if sw[0] != sw[1] && HashBlocks(nil, seed, sw, bs)[0] == base[0] {
		t.Error("swapping two tokens of block 0 kept its hash")
	}
}

func TestHashSeed(t *testing.T) {
	for _, m := range []string{"", "m", "llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct"} {
		if got := HashSeed(m); got != xxh3.HashString(m) {
			t.Errorf("HashSeed(%q) = %#x, want xxh3 %#x", m, got, xxh3.HashString(m))
		}
	}
	if HashSeed("model-a") == HashSeed("model-b") {
		t.Fatal("two models share a hash seed")
	}
	tokens := make([]uint32, 64)
	a := HashBlocks(nil, HashSeed("model-a"), tokens, 16)
	b := HashBlocks(nil, HashSeed("model-b"), tokens, 16)
	for i := range a {
		if a[i] == b[i] {
			t.Errorf("block %d: same hash under two models", i)
		}
	}
}

func TestPromptSeed(t *testing.T) {
	if PromptSeed("m", "", "") != HashSeed("m") {
		t.Error("PromptSeed of the base model without a salt is not HashSeed")
	}
	seeds := map[uint64]string{}
	for _, c := range [][3]string{{"m", "", ""}, {"m", "", "salt-a"}, {"m", "", "salt-b"}, {"n", "", ""}, {"n", "", "salt-a"},
		// An adapter's prompts share nothing with the base model's, another
		// adapter's, or a salt spelled as the adapter's name.
		{"m", "sql-lora", ""}, {"m", "chat-lora", ""}, {"m", "sql-lora", "salt-a"}, {"m", "", "sql-lora"}, {"m", "", "\x00lora:sql-lora"}} {
		s := PromptSeed(c[0], c[1], c[2])
		if prev, dup := seeds[s]; dup {
			t.Errorf("model %q adapter %q salt %q has the seed of %s", c[0], c[1], c[2], prev)
		}
		seeds[s] = fmt.Sprintf("model %q adapter %q salt %q", c[0], c[1], c[2])
	}
}

// TestNoSaltStandsForAnotherSeed: a cache_salt a client picks by running
// the seed's hash backwards (saltforge) lands on no seed it aimed at: not
// the model's unsalted one, not an adapter's, not another salt's, not a
// block of a prompt it knows. When the salt was hashed with xxh3 seeded
// with the model's seed, each of these 8-byte salts hit its target.
func TestNoSaltStandsForAnotherSeed(t *testing.T) {
	model := "m"
	targets := map[string]uint64{
		"the model's unsalted seed":     PromptSeed(model, "", ""),
		"an adapter's seed":             PromptSeed(model, "sql-lora", ""),
		"another salt's seed":           PromptSeed(model, "", "tenant-b-secret"),
		"block 3 of an unsalted prompt": HashBlocks(nil, HashSeed(model), make([]uint32, 64), 16)[3],
	}
	for what, target := range targets {
		for _, base := range []uint64{HashSeed(model), PromptSeed(model, "sql-lora", "")} {
			salt := saltforge.Salt8(base, target)
			for _, lora := range []string{"", "sql-lora"} {
				if PromptSeed(model, lora, salt) == target {
					t.Errorf("adapter %q: the salt %q forged for %s has its seed", lora, salt, what)
				}
			}
		}
	}
}

func TestHashBlocksDst(t *testing.T) {
	tokens := make([]uint32, 48)
	seed := HashSeed("m")
	want := refHashBlocks(seed, tokens, 16)

	// Appends after what dst holds.
	dst := []uint64{1, 2}
	got := HashBlocks(dst, seed, tokens, 16)
	if !slices.Equal(got, append([]uint64{1, 2}, want...)) {
		t.Errorf("HashBlocks(dst) = %x", got)
	}
	// Reuses dst's storage when it is large enough.
	buf := make([]uint64, 0, 8)
	got = HashBlocks(buf, seed, tokens, 16)
	if &got[0] != &buf[:1][0] {
		t.Error("HashBlocks did not append into dst's capacity")
	}
	// A non-positive block size returns dst unchanged.
	for _, bs := range []int{0, -1, -16} {
		if got := HashBlocks(dst, seed, tokens, bs); !slices.Equal(got, dst) || len(got) != 2 {
			t.Errorf("block size %d: HashBlocks = %v, want dst unchanged", bs, got)
		}
		if got := HashBlocks(nil, seed, tokens, bs); got != nil {
			t.Errorf("block size %d: HashBlocks(nil) = %v, want nil", bs, got)
		}
	}
}

func BenchmarkHashBlocks8192(b *testing.B) {
	const (
		n  = 8192
		bs = 16
	)
	tokens := randomTokens(rand.New(rand.NewPCG(5, 6)), n)
	seed := HashSeed("llama-3.1-8b")
	dst := make([]uint64, 0, n/bs)
	b.SetBytes(4 * n)
	b.ReportAllocs()
	for b.Loop() {
		dst = HashBlocks(dst[:0], seed, tokens, bs)
	}
	if len(dst) != n/bs {
		b.Fatalf("%d hashes", len(dst))
	}
}
