package fakeengine

import (
	"crypto/sha256"
	"encoding/binary"
)

// blockHash is a block's full sha256 hash. Events carry it whole (bytes
// hashes) or its low 64 bits (integer hashes), as vLLM does.
type blockHash [32]byte

// noneHash returns the parent hash of a prompt's first block (vLLM's
// NONE_HASH, which is random unless PYTHONHASHSEED is set; fixed here, so
// that every fake engine hashes alike).
func noneHash() blockHash {
	return sha256.Sum256([]byte("kvbus/testenv/fakeengine NONE_HASH"))
}

// chainHash hashes one block of tokens chained from parent: sha256 over the
// parent's 32 bytes and the tokens as 4-byte big-endian integers (vLLM
// hashes (parent, tokens, extra_keys) with sha256 of a serialization; the
// fake's serialization is its own).
func chainHash(parent blockHash, tokens []uint32) blockHash {
	h := sha256.New()
	h.Write(parent[:])
	var b [4]byte
	for _, t := range tokens {
		binary.BigEndian.PutUint32(b[:], t)
		h.Write(b[:])
	}
	var out blockHash
	h.Sum(out[:0])
	return out
}

// intHash is vLLM's integer form of a hash,
// int.from_bytes(hash, "big") & ((1 << 64) - 1): its last 8 bytes.
func intHash(h blockHash) uint64 { return binary.BigEndian.Uint64(h[24:]) }

// BlockHashes returns the chained hashes of the full blocks of tokens, as
// the fake engine computes them, in the form its KV events carry: []byte
// sha256 digests when hashBytes, else uint64 (the digests' low 64 bits).
func BlockHashes(tokens []uint32, blockSize int, hashBytes bool) []any {
	hs := blockHashes(tokens, blockSize)
	out := make([]any, len(hs))
	for i, h := range hs {
		if hashBytes {
			out[i] = append([]byte(nil), h[:]...)
		} else {
			out[i] = intHash(h)
		}
	}
	return out
}

func blockHashes(tokens []uint32, blockSize int) []blockHash {
	return keyedBlockHashes(tokens, blockSize, "", "")
}

// keyedBlockHashes is blockHashes of a prompt of LoRA adapter lora with
// cache_salt salt (none when empty): its chain starts from a root of its
// own, so that its blocks match no other adapter's or salt's, or the
// model's unsalted ones (vLLM mixes the adapter's name into every block's
// hash, and the salt into the first's, as extra keys).
func keyedBlockHashes(tokens []uint32, blockSize int, lora, salt string) []blockHash {
	n := len(tokens) / blockSize
	out := make([]blockHash, n)
	parent := noneHash()
	if lora != "" {
		parent = sha256.Sum256(append(parent[:], "lora:"+lora...))
	}
	if salt != "" {
		parent = sha256.Sum256(append(parent[:], "salt:"+salt...))
	}
	for i := range n {
		parent = chainHash(parent, tokens[i*blockSize:(i+1)*blockSize])
		out[i] = parent
	}
	return out
}

// cacheEntry is a cached block in the recency list.
type cacheEntry struct {
	hash       blockHash
	prev, next *cacheEntry
}

// prefixCache is the fake engine's prefix cache: full blocks keyed by
// their chained hash, evicted least recently used first. It is owned by
// its caller (the Engine, under its lock).
type prefixCache struct {
	blockSize int
	capacity  int
	blocks    map[blockHash]*cacheEntry
	// head.next is the most recently used block, head.prev the next to
	// be evicted.
	head cacheEntry
}

func newPrefixCache(blockSize, capacity int) *prefixCache {
	c := &prefixCache{blockSize: blockSize, capacity: capacity, blocks: make(map[blockHash]*cacheEntry)}
	c.head.prev, c.head.next = &c.head, &c.head
	return c
}

func (c *prefixCache) unlink(e *cacheEntry) {
	e.prev.next, e.next.prev = e.next, e.prev
}

func (c *prefixCache) pushFront(e *cacheEntry) {
	e.prev, e.next = &c.head, c.head.next
	c.head.next.prev = e
	c.head.next = e
}

// admission is what one request did to the cache.
type admission struct {
	// cachedTokens are the prompt tokens found in the cache.
	cachedTokens int
	// removed are the blocks evicted to make room, in eviction order.
	removed []blockHash
	// stored are the blocks stored after the hit, in chain order; parent
	// is the block they chain from (nil for a prompt's first block) and
	// tokens are theirs.
	stored []blockHash
	parent *blockHash
	tokens []uint32
}

// admit runs one request through the cache, as vLLM's KV cache manager
// does: the prompt's longest cached prefix of full blocks is a hit, but at
// most (len(prompt)-1)/blockSize blocks, since the last prompt token is
// always computed (vLLM's get_computed_blocks caps the hit at
// num_tokens - 1); then every full block of computed (the prompt and the
// output tokens whose KV was computed, i.e. all but the last one) after the
// hit is stored, evicting the least recently used blocks of other requests
// to make room. Blocks stored again (a hash already cached beyond the hit)
// are stored again, as vLLM, which does not deduplicate, reports them. The
// request's blocks end most recently used, its first block most and its
// last block least, as vLLM frees a request's blocks tail first.
// len(computed) must not exceed capacity*blockSize.
func (c *prefixCache) admit(prompt, computed []uint32, lora, salt string) admission {
	var a admission
	hashes := keyedBlockHashes(computed, c.blockSize, lora, salt)
	maxHit := 0
	if len(prompt) > 0 {
		maxHit = min((len(prompt)-1)/c.blockSize, len(hashes))
	}
	hit := 0
	for hit < maxHit && c.blocks[hashes[hit]] != nil {
		hit++
	}
	a.cachedTokens = hit * c.blockSize

	// Keep the request's cached blocks from eviction: they go first.
	newBlocks := 0
	for _, h := range hashes {
		if e := c.blocks[h]; e != nil {
			c.unlink(e)
			c.pushFront(e)
		} else {
			newBlocks++
		}
	}
	for len(c.blocks)+newBlocks > c.capacity && c.head.prev != &c.head {
		e := c.head.prev
		c.unlink(e)
		delete(c.blocks, e.hash)
		a.removed = append(a.removed, e.hash)
	}
	for _, h := range hashes {
		if c.blocks[h] == nil {
			e := &cacheEntry{hash: h}
			c.blocks[h] = e
			c.pushFront(e)
		}
	}
	// Recency: first block most recent, last block least.
	for i := len(hashes) - 1; i >= 0; i-- {
		e := c.blocks[hashes[i]]
		c.unlink(e)
		c.pushFront(e)
	}
	if hit < len(hashes) {
		a.stored = hashes[hit:]
		if hit > 0 {
			p := hashes[hit-1]
			a.parent = &p
		}
		a.tokens = computed[hit*c.blockSize : len(hashes)*c.blockSize]
	}
	return a
}

// lookup returns the number of leading full blocks of tokens in the cache,
// without touching them.
func (c *prefixCache) lookup(tokens []uint32) int {
	n := 0
	for _, h := range blockHashes(tokens, c.blockSize) {
		if c.blocks[h] == nil {
			break
		}
		n++
	}
	return n
}

// reset empties the cache.
func (c *prefixCache) reset() {
	clear(c.blocks)
	c.head.prev, c.head.next = &c.head, &c.head
}

func (c *prefixCache) len() int { return len(c.blocks) }
