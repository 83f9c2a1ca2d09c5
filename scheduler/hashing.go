package scheduler

import (
	"crypto/sha256"
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// HashSeed is hash_{-1}, the seed of a model's block hash chain: the xxh3-64
// of the model name, so that two models never share blocks.
func HashSeed(model string) uint64 { return xxh3.HashString(model) }

// promptSeedTag opens what PromptSeed hashes, so that its input is never
// another hash's.
const promptSeedTag = "kvbus prompt seed v2\x00"

// PromptSeed is hash_{-1} of a prompt: HashSeed(model) for the base model
// without a cache salt. With a LoRA adapter (loraName) or a salt (vLLM's
// cache_salt), it is the first 8 bytes (little-endian) of the SHA-256 of
// promptSeedTag and the model, the adapter and the salt, each preceded by
// its length: a prompt's blocks match only those of prompts of the same
// model, adapter and salt, as vLLM keys an adapter's blocks with its name
// and a salted prompt's first block with the salt.
//
// Not xxh3: the salt is the client's, and xxh3 of a short input runs
// backwards (for 4 to 8 bytes it is an xor with a constant of the seed and
// a bijection), so a client could pick a salt whose seed is one it knows —
// the model's unsalted seed, an adapter's, a block of a known prompt — and
// share those blocks (saltforge). A SHA-256 preimage cannot be picked.
func PromptSeed(model, loraName, cacheSalt string) uint64 {
	if loraName == "" && cacheSalt == "" {
		return HashSeed(model)
	}
	b := make([]byte, 0, len(promptSeedTag)+3*8+len(model)+len(loraName)+len(cacheSalt))
	b = append(b, promptSeedTag...)
	for _, f := range [...]string{model, loraName, cacheSalt} {
		b = binary.LittleEndian.AppendUint64(b, uint64(len(f)))
		b = append(b, f...)
	}
	sum := sha256.Sum256(b)
	return binary.LittleEndian.Uint64(sum[:8])
}

// HashBlocks appends to dst the hashes of the full blocks of tokens:
// hash_i = xxh3-64(hash_{i-1} ‖ tokens of block i as little-endian u32),
// with hash_{-1} = seed. A trailing partial block is not hashed (vLLM's
// rule: only full blocks are cached).
func HashBlocks(dst []uint64, seed uint64, tokens []uint32, blockSize int) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	n := len(tokens) / blockSize
	buf := make([]byte, 8+4*blockSize)
	prev := seed
	for i := range n {
		binary.LittleEndian.PutUint64(buf, prev)
		blk := tokens[i*blockSize : (i+1)*blockSize]
		for j, t := range blk {
			binary.LittleEndian.PutUint32(buf[8+4*j:], t)
		}
		prev = xxh3.Hash(buf)
		dst = append(dst, prev)
	}
	return dst
}
