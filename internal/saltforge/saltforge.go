// Package saltforge builds, for tests, the cache_salt a client would pick
// to land a salted prompt's block hash seed on a seed it knows: xxh3-64's
// path for inputs of 4 to 8 bytes is the input xored with a constant of
// the seed, then rrmxmx, a bijection, so it runs backwards. Tests use it
// to check that no salt, however chosen, stands for another seed.
package saltforge

import (
	"encoding/binary"
	"math/bits"
)

// xxh3's default secret at offsets 8 and 16 (github.com/zeebo/xxh3's
// key64_008 and key64_016).
const key008, key016 = 0x1cad21f72c81017c, 0xdb979083e96dd4de

// Salt8 returns the 8-byte string s whose xxh3-64 seeded with seed is
// target (xxh3.HashStringSeed(s, seed) == target). It may not be valid
// UTF-8 (about 1 in 100 is).
func Salt8(seed, target uint64) string {
	const mul = 0x9fb21c651e98df25
	inv := uint64(mul) // Newton's iteration: mul*inv = 1 mod 2^64
	for range 6 {
		inv *= 2 - mul*inv
	}
	h := target
	h ^= h>>28 ^ h>>56
	h *= inv
	h ^= (h >> 35) + 8 // bits 30 and up are h's: h>>35 is known
	h *= inv
	// h ^= rotl49(h) ^ rotl24(h) multiplies by p = 1+x^24+x^49 in
	// GF(2)[x]/(x^64-1), where p^64 = 1: its inverse p^63 is the product
	// of p^(2^k) for k < 6.
	for k := range 6 {
		h ^= bits.RotateLeft64(h, (24<<k)%64) ^ bits.RotateLeft64(h, (49<<k)%64)
	}
	seed ^= uint64(bits.ReverseBytes32(uint32(seed))) << 32
	in := h ^ (key008 ^ key016 - seed)
	var s [8]byte
	binary.LittleEndian.PutUint32(s[:4], uint32(in>>32))
	binary.LittleEndian.PutUint32(s[4:], uint32(in))
	return string(s[:])
}
