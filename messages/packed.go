package messages

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"unsafe"

	"github.com/tinylib/msgp/msgp"
)

// TokenIDs is a list of token ids. On the wire it is one msgpack bin of
// little-endian uint32 values: about ten times cheaper to encode and decode
// than a msgpack array of integers.
type TokenIDs []uint32

// BlockHashes is a list of KV block hashes. On the wire it is one msgpack bin
// of little-endian uint64 values.
type BlockHashes []uint64

var (
	_ msgp.Marshaler   = TokenIDs(nil)
	_ msgp.Unmarshaler = (*TokenIDs)(nil)
	_ msgp.Marshaler   = BlockHashes(nil)
	_ msgp.Unmarshaler = (*BlockHashes)(nil)
)

// hostLittleEndian reports whether this machine stores integers in the wire
// order; then a packed list is copied to and from the wire as it is in
// memory, otherwise it is converted value by value.
var hostLittleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// packable are the element types of packed lists.
type packable interface{ uint32 | uint64 }

// asBytes returns the memory of s as bytes, without copying.
func asBytes[E packable](s []E) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*int(unsafe.Sizeof(E(0))))
}

func putLE[E packable](b []byte, v E) {
	if unsafe.Sizeof(v) == 4 {
		binary.LittleEndian.PutUint32(b, uint32(v))
	} else {
		binary.LittleEndian.PutUint64(b, uint64(v))
	}
}

func getLE[E packable](b []byte) E {
	if unsafe.Sizeof(E(0)) == 4 {
		return E(binary.LittleEndian.Uint32(b))
	}
	return E(binary.LittleEndian.Uint64(b))
}

// appendPacked appends s as one bin of little-endian values (nil as nil).
// native copies the values as they are in memory (a little-endian host).
func appendPacked[E packable](b []byte, s []E, native bool) []byte {
	if s == nil {
		return msgp.AppendNil(b)
	}
	w := int(unsafe.Sizeof(E(0)))
	b = msgp.AppendBytesHeader(b, uint32(w*len(s)))
	if native {
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
// array of at most MaxArrayLen integers (what other producers may send).
// what names the list in errors; native is appendPacked's.
func readPacked[E packable](b []byte, what string, native bool) ([]E, []byte, error) {
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
		if n > MaxArrayLen { // as every typed array (an element takes 8 bytes here, 1 on the wire)
			return nil, b, fmt.Errorf("%w: %s: array of %d elements (limit %d)", ErrMalformed, what, n, MaxArrayLen)
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
		if native {
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
func (t TokenIDs) MarshalMsg(b []byte) ([]byte, error) {
	return appendPacked(b, t, hostLittleEndian), nil
}

// UnmarshalMsg implements msgp.Unmarshaler. It accepts a bin (the kvbus
// encoding), nil, or a plain array of integers.
func (t *TokenIDs) UnmarshalMsg(b []byte) ([]byte, error) {
	v, o, err := readPacked[uint32](b, "token_ids", hostLittleEndian)
	*t = v
	return o, err
}

// Msgsize implements msgp.Sizer.
func (t TokenIDs) Msgsize() int { return 5 + 4*len(t) }

// IsZero reports an empty list: an omitempty field is left out.
func (t TokenIDs) IsZero() bool { return len(t) == 0 }

// MarshalMsg implements msgp.Marshaler.
func (h BlockHashes) MarshalMsg(b []byte) ([]byte, error) {
	return appendPacked(b, h, hostLittleEndian), nil
}

// UnmarshalMsg implements msgp.Unmarshaler, accepting bin, nil or an array
// of integers.
func (h *BlockHashes) UnmarshalMsg(b []byte) ([]byte, error) {
	v, o, err := readPacked[uint64](b, "block_hashes", hostLittleEndian)
	*h = v
	return o, err
}

// Msgsize implements msgp.Sizer.
func (h BlockHashes) Msgsize() int { return 5 + 8*len(h) }

// IsZero reports an empty list: an omitempty field is left out.
func (h BlockHashes) IsZero() bool { return len(h) == 0 }
