package saltforge

import (
	"testing"

	"github.com/zeebo/xxh3"
)

func TestSalt8HashesToItsTarget(t *testing.T) {
	for _, seed := range []uint64{0, 1, xxh3.HashString("m"), 0xffffffffffffffff} {
		for _, target := range []uint64{0, 1, xxh3.HashString("n"), 0xdeadbeefcafef00d} {
			if got := xxh3.HashStringSeed(Salt8(seed, target), seed); got != target {
				t.Errorf("seed %#x: the salt forged for %#x hashes to %#x", seed, target, got)
			}
		}
	}
}
