package scheduler

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// HashSeed is hash_{-1}, the seed of a model's block hash chain: the xxh3-64
// of the model name, so that two models never share blocks.
func HashSeed(model string) uint64 { return xxh3.HashString(model) }

// loraDomain sets an adapter's seed apart from a salt's (PromptSeed).
const loraDomain = 0x6c6f72615f6e616d // "lora_nam"

// PromptSeed is hash_{-1} of a prompt: HashSeed(model) for the base model
// without a cache salt. A LoRA adapter (loraName) is mixed in first, then a
// salt (vLLM's cache_salt), each as the xxh3-64 of it seeded with what came
// before (the adapter's seed xored with loraDomain, so that no salt stands
// for an adapter): a prompt's blocks match only those of prompts of the
// same model, adapter and salt, as vLLM keys an adapter's blocks with its
// name and a salted prompt's first block with the salt.
func PromptSeed(model, loraName, cacheSalt string) uint64 {
	seed := HashSeed(model)
	if loraName != "" {
		seed = xxh3.HashStringSeed(loraName, seed^loraDomain)
	}
	if cacheSalt != "" {
		seed = xxh3.HashStringSeed(cacheSalt, seed)
	}
	return seed
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
