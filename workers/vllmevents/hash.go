package vllmevents

import (
	"encoding/hex"
	"strconv"
)

// MaxHashBytes bounds the length of a bytes block hash (vLLM's are 32-byte
// sha256 digests).
const MaxHashBytes = 64

type hashKind uint8

const (
	hashNone  hashKind = iota
	hashUint           // a non-negative integer
	hashNeg            // a negative integer (Python's hash() in old vLLM)
	hashBytes          // raw bytes (sha256 digests)
)

// Hash is an engine block hash: vLLM's ExternalBlockHash, `bytes | int`.
// It is comparable, so it can key a map; two hashes are equal when they
// have the same kind and value (the integer 5 and the bytes "\x05" differ).
// The zero Hash is no hash.
type Hash struct {
	kind hashKind
	n    uint64 // the integer, two's complement for hashNeg
	b    string // the bytes, for hashBytes
}

// HashFromUint64 returns the integer hash v.
func HashFromUint64(v uint64) Hash { return Hash{kind: hashUint, n: v} }

// HashFromInt64 returns the integer hash v, which may be negative.
func HashFromInt64(v int64) Hash {
	if v < 0 {
		return Hash{kind: hashNeg, n: uint64(v)}
	}
	return Hash{kind: hashUint, n: uint64(v)}
}

// HashFromBytes returns the bytes hash b (copied).
func HashFromBytes(b []byte) Hash { return Hash{kind: hashBytes, b: string(b)} }

// IsZero reports whether h is the zero Hash.
func (h Hash) IsZero() bool { return h.kind == hashNone }

// Int64 returns an integer hash as a signed value (a hash above
// math.MaxInt64 wraps); ok is false for a bytes hash.
func (h Hash) Int64() (v int64, ok bool) {
	return int64(h.n), h.kind == hashUint || h.kind == hashNeg
}

// Uint64 returns a non-negative integer hash; ok is false otherwise.
func (h Hash) Uint64() (v uint64, ok bool) { return h.n, h.kind == hashUint }

// Bytes returns a copy of a bytes hash; ok is false otherwise.
func (h Hash) Bytes() (b []byte, ok bool) {
	if h.kind != hashBytes {
		return nil, false
	}
	return []byte(h.b), true
}

// String returns "int:<decimal>", "bytes:<hex>" or "none", a stable key
// for logs and maps outside this package.
func (h Hash) String() string {
	switch h.kind {
	case hashUint:
		return "int:" + strconv.FormatUint(h.n, 10)
	case hashNeg:
		return "int:" + strconv.FormatInt(int64(h.n), 10)
	case hashBytes:
		return "bytes:" + hex.EncodeToString([]byte(h.b))
	}
	return "none"
}
