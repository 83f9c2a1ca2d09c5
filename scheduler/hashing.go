package scheduler

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// HashSeed is hash_{-1}, the seed of a model's block hash chain: the xxh3-64
// of the model name, so that two models never share blocks.
func HashSeed(model string) uint64 { return xxh3.HashString(model) }

// PromptSeed is hash_{-1} of a prompt: HashSeed(model) without a cache
// salt; with one (vLLM's cache_salt), the xxh3-64 of the salt seeded with
// HashSeed(model), so that a salted prompt's blocks match only those of
// prompts of the same model and salt, as vLLM keys its first block with
// the salt.
func PromptSeed(model, cacheSalt string) uint64 {
	if cacheSalt == "" {
		return HashSeed(model)
	}
	return xxh3.HashStringSeed(cacheSalt, HashSeed(model))
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
