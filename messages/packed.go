package messages

import (
	"encoding/binary"
	"fmt"
	"math"
	"sync"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// TokenIDs is a list of token ids. On the wire it is one msgpack bin of
// little-endian uint32 values: about ten times cheaper to encode and decode
// than a msgpack array of integers.
type TokenIDs []uint32

// BlockHashes is a list of KV block hashes. On the wire it is one msgpack bin
// of little-endian uint64 values.
type BlockHashes []uint64

var (
	_ msgpack.CustomEncoder = TokenIDs(nil)
	_ msgpack.CustomDecoder = (*TokenIDs)(nil)
	_ msgpack.CustomEncoder = BlockHashes(nil)
	_ msgpack.CustomDecoder = (*BlockHashes)(nil)
)

// hostLittleEndian reports whether this machine stores integers in the wire
// order; then a packed list is copied to and from the wire as it is in
// memory, otherwise it is converted through a small scratch buffer.
var hostLittleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// scratchSize is the size of the buffers the portable path converts
// through, so that it allocates no temporary copy of the whole list.
const scratchSize = 4096

var scratchPool = sync.Pool{New: func() any { return new([scratchSize]byte) }}

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

// encodePacked writes s as one bin of little-endian values.
func encodePacked[E packable](enc *msgpack.Encoder, s []E, native bool) error {
	if s == nil {
		return enc.EncodeNil()
	}
	w := int(unsafe.Sizeof(E(0)))
	if err := enc.EncodeBytesLen(w * len(s)); err != nil {
		return err
	}
	if native {
		_, err := enc.Writer().Write(asBytes(s))
		return err
	}
	sp := scratchPool.Get().(*[scratchSize]byte)
	defer scratchPool.Put(sp)
	for len(s) > 0 {
		n := min(len(s), scratchSize/w)
		buf := sp[:w*n]
		for i, v := range s[:n] {
			putLE(buf[w*i:], v)
		}
		if _, err := enc.Writer().Write(buf); err != nil {
			return err
		}
		s = s[n:]
	}
	return nil
}

// decodePacked reads a packed list written by encodePacked, nil, or a plain
// msgpack array of integers (what other producers may send). what names the
// list in errors.
func decodePacked[E packable](dec *msgpack.Decoder, what string, native bool) ([]E, error) {
	w := int(unsafe.Sizeof(E(0)))
	n, isArray, err := packedLen(dec, w)
	if err != nil || n < 0 {
		return nil, err
	}
	out := make([]E, n)
	if isArray {
		for i := range out {
			// DecodeUint32 would silently truncate a larger or a negative value;
			// block hashes accept negative numbers as two's complement (Python's
			// hash() is signed).
			v, err := dec.DecodeUint64()
			if err != nil {
				return nil, fmt.Errorf("%w: %s[%d]: %v", ErrMalformed, what, i, err)
			}
			if w == 4 && v > math.MaxUint32 {
				return nil, fmt.Errorf("%w: %s[%d] out of uint32 range", ErrMalformed, what, i)
			}
			out[i] = E(v)
		}
		return out, nil
	}
	if native {
		if err := dec.ReadFull(asBytes(out)); err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrMalformed, what, err)
		}
		return out, nil
	}
	sp := scratchPool.Get().(*[scratchSize]byte)
	defer scratchPool.Put(sp)
	for rest := out; len(rest) > 0; {
		k := min(len(rest), scratchSize/w)
		buf := sp[:w*k]
		if err := dec.ReadFull(buf); err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrMalformed, what, err)
		}
		for i := range rest[:k] {
			rest[i] = getLE[E](buf[w*i:])
		}
		rest = rest[k:]
	}
	return out, nil
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (t TokenIDs) EncodeMsgpack(enc *msgpack.Encoder) error {
	return encodePacked(enc, t, hostLittleEndian)
}

// DecodeMsgpack implements msgpack.CustomDecoder. It accepts a bin (the
// kvbus encoding), nil, or a plain array of integers.
func (t *TokenIDs) DecodeMsgpack(dec *msgpack.Decoder) error {
	v, err := decodePacked[uint32](dec, "token_ids", hostLittleEndian)
	*t = v
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (h BlockHashes) EncodeMsgpack(enc *msgpack.Encoder) error {
	return encodePacked(enc, h, hostLittleEndian)
}

// DecodeMsgpack implements msgpack.CustomDecoder, accepting bin, nil or an
// array of integers.
func (h *BlockHashes) DecodeMsgpack(dec *msgpack.Decoder) error {
	v, err := decodePacked[uint64](dec, "block_hashes", hostLittleEndian)
	*h = v
	return err
}

// packedLen reads the header of a packed list: the element count (-1 for
// nil) and whether the elements follow as a msgpack array instead of a bin.
func packedLen(dec *msgpack.Decoder, width int) (n int, isArray bool, err error) {
	code, err := dec.PeekCode()
	if err != nil {
		return 0, false, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	switch {
	case code == msgpcode.Nil:
		return -1, false, dec.DecodeNil()
	case msgpcode.IsFixedArray(code) || code == msgpcode.Array16 || code == msgpcode.Array32:
		n, err := dec.DecodeArrayLen()
		if err != nil {
			return 0, false, fmt.Errorf("%w: %v", ErrMalformed, err)
		}
		if n > MaxMessageBytes {
			return 0, false, fmt.Errorf("%w: array of %d elements", ErrMalformed, n)
		}
		return n, true, nil
	case code == msgpcode.Bin8 || code == msgpcode.Bin16 || code == msgpcode.Bin32:
		size, err := dec.DecodeBytesLen()
		if err != nil {
			return 0, false, fmt.Errorf("%w: %v", ErrMalformed, err)
		}
		if size%width != 0 || size > MaxMessageBytes {
			return 0, false, fmt.Errorf("%w: packed list of %d bytes is not a whole number of %d-byte values", ErrMalformed, size, width)
		}
		return size / width, false, nil
	default:
		return 0, false, fmt.Errorf("%w: packed list: unexpected msgpack code 0x%02x", ErrMalformed, code)
	}
}
