package workers

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/zeebo/xxh3"
)

// ModelProfile describes a model's KV cache shape, from its public config.
type ModelProfile struct {
	Name       string
	Layers     int
	KVHeads    int
	HeadDim    int
	DTypeBytes int
}

// ModelProfiles are the built-in profiles, by name.
var modelProfiles = map[string]ModelProfile{
	// meta-llama/Llama-3.1-8B config.json: num_hidden_layers 32,
	// num_key_value_heads 8, head_dim 128 (4096/32), bf16.
	"llama-3.1-8b": {Name: "llama-3.1-8b", Layers: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2},
	// meta-llama/Llama-3.1-70B config.json: num_hidden_layers 80,
	// num_key_value_heads 8, head_dim 128 (8192/64), bf16.
	"llama-3.1-70b": {Name: "llama-3.1-70b", Layers: 80, KVHeads: 8, HeadDim: 128, DTypeBytes: 2},
	// tiny is for tests: 64 bytes per token before TP.
	"tiny": {Name: "tiny", Layers: 1, KVHeads: 4, HeadDim: 4, DTypeBytes: 2},
}

// LookupModelProfile returns a built-in profile by name.
func LookupModelProfile(name string) (ModelProfile, error) {
	p, ok := modelProfiles[name]
	if !ok {
		names := make([]string, 0, len(modelProfiles))
		for n := range modelProfiles {
			names = append(names, n)
		}
		sort.Strings(names)
		return ModelProfile{}, fmt.Errorf("workers: unknown model profile %q: give --model-profile one of %s", name, strings.Join(names, ", "))
	}
	return p, nil
}

// Validate checks that every dimension is positive.
func (p ModelProfile) Validate() error {
	if p.Layers <= 0 || p.KVHeads <= 0 || p.HeadDim <= 0 || p.DTypeBytes <= 0 {
		return fmt.Errorf("workers: model profile %q: layers, kv heads, head dim and dtype bytes must all be positive", p.Name)
	}
	return nil
}

// BytesPerTokenPerRank is 2 (K and V) × layers × kv_heads/tp × head_dim ×
// dtype bytes. KV heads are replicated when tp exceeds them, as in vLLM.
func (p ModelProfile) BytesPerTokenPerRank(tpSize int) int {
	heads := max(1, p.KVHeads/max(1, tpSize))
	return 2 * p.Layers * heads * p.HeadDim * p.DTypeBytes
}

// StoreKey is the Mooncake store key of a block on a rank:
// <model>@tp_rank:<t>@<block-hash hex>.
func StoreKey(model string, tpRank int, hash uint64) string {
	// One allocation (the string): every rank builds a key per block of
	// every request.
	var stack [96]byte
	b := append(stack[:0], model...)
	b = append(b, "@tp_rank:"...)
	b = strconv.AppendInt(b, int64(tpRank), 10)
	b = append(b, '@')
	const hexDigits = "0123456789abcdef"
	for shift := 60; shift >= 0; shift -= 4 {
		b = append(b, hexDigits[hash>>uint(shift)&0xf])
	}
	return string(b)
}

// BlockPayload returns the deterministic bytes of a block on a rank, so that
// a load can verify what it read: a splitmix64 stream seeded by the block
// hash and the rank, payloadPeriod bytes long and repeated to size. The
// stream alone made 1.1–1.9 GB/s here: a 512 KiB block (Llama-3.1-8B's at
// TP 4) took 270–470 µs of a rank's CPU, and the bytes a turn stored were
// most of a multi-turn request's CPU; repeated, the rest is a memory copy.
func BlockPayload(hash uint64, tpRank, size int) []byte {
	out := make([]byte, size)
	n := min(size, payloadPeriod)
	x := payloadSeed(hash, tpRank)
	i := 0
	for ; i+8 <= n; i += 8 {
		x = splitmix64(x)
		binary.LittleEndian.PutUint64(out[i:], x)
	}
	if i < n {
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], splitmix64(x))
		copy(out[i:n], tail[:])
	}
	for filled := n; filled < size; filled *= 2 {
		copy(out[filled:], out[:filled])
	}
	return out
}

// payloadPeriod is the length of a block payload's own stream: a multiple
// of 8, above the 64 bytes VerifyPayload reads.
const payloadPeriod = 4 << 10

// Payload modes: what a rank keeps per block.
const (
	// PayloadBytes keeps the block's full deterministic bytes.
	PayloadBytes = "bytes"
	// PayloadAccounting keeps an 8-byte digest per block while charging the
	// block's full size against capacity, so long traces fit in memory.
	PayloadAccounting = "accounting"
)

// blockObject returns the value to store for a block and the size charged.
func blockObject(mode string, hash uint64, tpRank, size int) (value []byte, charged int64) {
	if mode == PayloadAccounting {
		return binary.LittleEndian.AppendUint64(nil, payloadSeed(hash, tpRank)), int64(size)
	}
	return BlockPayload(hash, tpRank, size), int64(size)
}

// verifyBlock reports whether a loaded value is the block's, in either mode.
func verifyBlock(mode string, b []byte, hash uint64, tpRank, size int) bool {
	if mode == PayloadAccounting {
		return len(b) == 8 && binary.LittleEndian.Uint64(b) == payloadSeed(hash, tpRank)
	}
	return VerifyPayload(b, hash, tpRank, size)
}

// ParseCapacity parses a per-rank KV capacity: a byte size (64GiB, 512MB,
// 1048576) or a number of tokens (4Mtok, 512ktok or 512Ktok, 100000tok), which is
// converted with bytesPerToken.
func ParseCapacity(s string, bytesPerToken int) (int64, error) {
	in := strings.TrimSpace(s)
	units := []struct {
		suffix string
		mult   float64
	}{
		{"Gtok", 1e9 * float64(bytesPerToken)}, {"Mtok", 1e6 * float64(bytesPerToken)}, {"ktok", 1e3 * float64(bytesPerToken)},
		{"Ktok", 1e3 * float64(bytesPerToken)}, // as in KiB and KB
		{"tok", float64(bytesPerToken)},
		{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10},
		{"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"B", 1},
	}
	num, mult := in, 1.0
	for _, u := range units {
		if strings.HasSuffix(in, u.suffix) {
			num, mult = strings.TrimSpace(strings.TrimSuffix(in, u.suffix)), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(num, 64)
	total := v * mult
	if err != nil || !(total >= 1) || total > 1<<62 {
		return 0, fmt.Errorf("workers: bad capacity %q: want a size such as 64GiB or a token count such as 4Mtok or 512ktok", s)
	}
	return int64(total), nil
}

// VerifyPayload reports whether b is the payload of the block on the rank.
// It checks the length and the first 64 bytes (all of a shorter payload),
// which is enough to tell a block from any other and costs little on 512 KiB
// blocks.
func VerifyPayload(b []byte, hash uint64, tpRank, size int) bool {
	if len(b) != size {
		return false
	}
	if size < 64 {
		return bytes.Equal(b, BlockPayload(hash, tpRank, size))
	}
	x := payloadSeed(hash, tpRank)
	n := size / 8
	for i := range min(n, 8) {
		x = splitmix64(x)
		if binary.LittleEndian.Uint64(b[8*i:]) != x {
			return false
		}
	}
	return true
}

func payloadSeed(hash uint64, tpRank int) uint64 {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:], hash)
	binary.LittleEndian.PutUint64(b[8:], uint64(tpRank))
	return xxh3.Hash(b[:])
}

func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	z := x
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}
