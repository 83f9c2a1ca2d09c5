package messages

import (
	"bytes"
	"fmt"
	"math"
	"slices"
	"unsafe"

	"github.com/tinylib/msgp/msgp"
	"github.com/vmihailenco/msgpack/v5"
)

// The wire types are encoded and decoded by code that tinylib/msgp generates
// from types.go (types_gen.go: run `go generate ./messages` after changing a
// type); the three types below, which the generator does not know, give it
// the same methods by hand. Messages are maps keyed by the msgpack tags, as
// before; the generated code reads them without reflection, about ten times
// faster, which matters because every request crosses the bus a dozen
// times.

var (
	_ msgp.Marshaler   = TokenIDs(nil)
	_ msgp.Unmarshaler = (*TokenIDs)(nil)
	_ msgp.Marshaler   = BlockHashes(nil)
	_ msgp.Unmarshaler = (*BlockHashes)(nil)
	_ msgp.Marshaler   = Args(nil)
	_ msgp.Unmarshaler = (*Args)(nil)
)

// appendPacked appends s as one bin of little-endian values (nil as nil).
func appendPacked[E packable](b []byte, s []E) []byte {
	if s == nil {
		return msgp.AppendNil(b)
	}
	w := int(unsafe.Sizeof(E(0)))
	b = msgp.AppendBytesHeader(b, uint32(w*len(s)))
	if hostLittleEndian {
		return append(b, asBytes(s)...)
	}
	n := len(b)
	b = slices.Grow(b, w*len(s))[:n+w*len(s)]
	for i, v := range s {
		putLE(b[n+w*i:], v)
	}
	return b
}

// readPacked reads a list written by appendPacked, nil, or a plain msgpack
// array of integers (what other producers may send). what names the list in
// errors.
func readPacked[E packable](b []byte, what string) ([]E, []byte, error) {
	w := int(unsafe.Sizeof(E(0)))
	switch msgp.NextType(b) {
	case msgp.NilType:
		o, err := msgp.ReadNilBytes(b)
		return nil, o, err
	case msgp.ArrayType:
		n, o, err := msgp.ReadArrayHeaderBytes(b)
		if err != nil {
			return nil, b, err
		}
		if int(n) > len(o) { // every element takes at least one byte
			return nil, b, fmt.Errorf("%w: %s: array of %d elements in %d bytes", ErrMalformed, what, n, len(o))
		}
		out := make([]E, n)
		for i := range out {
			// Block hashes accept negative numbers as two's complement
			// (Python's hash() is signed); token ids must fit in uint32.
			var v uint64
			if msgp.NextType(o) == msgp.IntType {
				var x int64
				x, o, err = msgp.ReadInt64Bytes(o)
				v = uint64(x)
			} else {
				v, o, err = msgp.ReadUint64Bytes(o)
			}
			if err != nil {
				return nil, b, fmt.Errorf("%w: %s[%d]: %v", ErrMalformed, what, i, err)
			}
			if w == 4 && v > math.MaxUint32 {
				return nil, b, fmt.Errorf("%w: %s[%d] out of uint32 range", ErrMalformed, what, i)
			}
			out[i] = E(v)
		}
		return out, o, nil
	case msgp.BinType:
		size, o, err := msgp.ReadBytesHeader(b)
		if err != nil {
			return nil, b, err
		}
		if int(size)%w != 0 || int(size) > len(o) {
			return nil, b, fmt.Errorf("%w: %s: packed list of %d bytes is not a whole number of %d-byte values in the message", ErrMalformed, what, size, w)
		}
		out := make([]E, int(size)/w)
		if hostLittleEndian {
			copy(asBytes(out), o[:size])
		} else {
			for i := range out {
				out[i] = getLE[E](o[w*i:])
			}
		}
		return out, o[size:], nil
	default:
		return nil, b, fmt.Errorf("%w: %s: a packed list cannot start with msgpack type %s", ErrMalformed, what, msgp.NextType(b))
	}
}

// MarshalMsg implements msgp.Marshaler.
func (t TokenIDs) MarshalMsg(b []byte) ([]byte, error) { return appendPacked(b, t), nil }

// UnmarshalMsg implements msgp.Unmarshaler. It accepts a bin (the kvbus
// encoding), nil, or a plain array of integers.
func (t *TokenIDs) UnmarshalMsg(b []byte) ([]byte, error) {
	v, o, err := readPacked[uint32](b, "token_ids")
	*t = v
	return o, err
}

// Msgsize implements msgp.Sizer.
func (t TokenIDs) Msgsize() int { return 5 + 4*len(t) }

// IsZero reports an empty list: an omitempty field is left out.
func (t TokenIDs) IsZero() bool { return len(t) == 0 }

// MarshalMsg implements msgp.Marshaler.
func (h BlockHashes) MarshalMsg(b []byte) ([]byte, error) { return appendPacked(b, h), nil }

// UnmarshalMsg implements msgp.Unmarshaler, accepting bin, nil or an array
// of integers.
func (h *BlockHashes) UnmarshalMsg(b []byte) ([]byte, error) {
	v, o, err := readPacked[uint64](b, "block_hashes")
	*h = v
	return o, err
}

// Msgsize implements msgp.Sizer.
func (h BlockHashes) Msgsize() int { return 5 + 8*len(h) }

// IsZero reports an empty list: an omitempty field is left out.
func (h BlockHashes) IsZero() bool { return len(h) == 0 }

// MarshalMsg implements msgp.Marshaler: a map with its keys sorted, so that
// equal Args are equal bytes. Free-form values are rare and small; the
// reflection-based encoder writes them.
func (a Args) MarshalMsg(b []byte) ([]byte, error) {
	enc := encoderPool.Get().(*msgpack.Encoder)
	defer encoderPool.Put(enc)
	buf := bytes.NewBuffer(b)
	enc.ResetWriter(buf) // keeps SetSortMapKeys
	err := enc.Encode(map[string]any(a))
	enc.ResetWriter(nil)
	return buf.Bytes(), err
}

// UnmarshalMsg implements msgp.Unmarshaler with Args' depth limit.
func (a *Args) UnmarshalMsg(b []byte) ([]byte, error) {
	r := bytes.NewReader(b)
	dec := msgpack.GetDecoder()
	defer msgpack.PutDecoder(dec)
	dec.Reset(r)
	if err := a.DecodeMsgpack(dec); err != nil {
		return b, err
	}
	return b[len(b)-r.Len():], nil
}

// Msgsize implements msgp.Sizer (an estimate).
func (a Args) Msgsize() int { return 16 + 48*len(a) }

// IsZero reports an empty map: an omitempty field is left out.
func (a Args) IsZero() bool { return len(a) == 0 }
