package messages

import (
	"bytes"
	"fmt"
	"sync"

	"github.com/tinylib/msgp/msgp"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// maxArgsDepth bounds the nesting of free-form maps such as
// sampling_params.extra_args, so that a hostile message cannot exhaust the
// stack of a decoder.
const maxArgsDepth = 16

// ArgsDepthOK reports whether m nests no deeper than a decoder of Args
// accepts (values more than 16 maps or arrays deep): a producer checks it
// before sending what every receiver would refuse.
func ArgsDepthOK(m map[string]any) bool { return argsDepthOK(m, 0) }

func argsDepthOK(v any, depth int) bool {
	if depth > maxArgsDepth {
		return false
	}
	switch v := v.(type) {
	case map[string]any:
		for _, e := range v {
			if !argsDepthOK(e, depth+1) {
				return false
			}
		}
	case []any:
		for _, e := range v {
			if !argsDepthOK(e, depth+1) {
				return false
			}
		}
	}
	return true
}

// Args is a free-form map carried through the pipeline untouched, such as
// vLLM's sampling_params.extra_args or kv_transfer_params. Values are the
// JSON-like types nil, bool, int64, uint64, float64, string, []byte, []any
// and map[string]any.
type Args map[string]any

var _ msgpack.CustomDecoder = (*Args)(nil)

// DecodeMsgpack implements msgpack.CustomDecoder with a depth limit.
func (a *Args) DecodeMsgpack(dec *msgpack.Decoder) error {
	v, err := decodeArgValue(dec, 0)
	if err != nil {
		return err
	}
	switch m := v.(type) {
	case nil:
		*a = nil
	case map[string]any:
		*a = m
	default:
		return fmt.Errorf("%w: expected a map, got %T", ErrMalformed, v)
	}
	return nil
}

func decodeArgValue(dec *msgpack.Decoder, depth int) (any, error) {
	if depth > maxArgsDepth {
		return nil, fmt.Errorf("%w: nested deeper than %d levels", ErrMalformed, maxArgsDepth)
	}
	code, err := dec.PeekCode()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	switch {
	case msgpcode.IsFixedMap(code) || code == msgpcode.Map16 || code == msgpcode.Map32:
		n, err := dec.DecodeMapLen()
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
		}
		m := make(map[string]any, min(n, 64))
		for range n {
			k, err := dec.DecodeString()
			if err != nil {
				return nil, fmt.Errorf("%w: map key: %v", ErrMalformed, err)
			}
			v, err := decodeArgValue(dec, depth+1)
			if err != nil {
				return nil, err
			}
			m[k] = v
		}
		return m, nil
	case msgpcode.IsFixedArray(code) || code == msgpcode.Array16 || code == msgpcode.Array32:
		n, err := dec.DecodeArrayLen()
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
		}
		s := make([]any, 0, min(n, 64))
		for range n {
			v, err := decodeArgValue(dec, depth+1)
			if err != nil {
				return nil, err
			}
			s = append(s, v)
		}
		return s, nil
	case code == msgpcode.Bin8 || code == msgpcode.Bin16 || code == msgpcode.Bin32:
		// DecodeInterfaceLoose would turn a bin into a string, which a
		// re-encode then sends as a str that need not be UTF-8.
		b, err := dec.DecodeBytes()
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
		}
		return b, nil
	default:
		v, err := dec.DecodeInterfaceLoose()
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
		}
		return v, nil
	}
}

// String returns the value of key if it is a string, like vLLM's
// _session_id_from_request: anything else counts as absent.
func (a Args) String(key string) (string, bool) {
	s, ok := a[key].(string)
	return s, ok
}

// argsEncoders write free-form Args with sorted keys.
var argsEncoders = sync.Pool{New: func() any {
	enc := msgpack.NewEncoder(nil)
	enc.SetSortMapKeys(true) // deterministic bytes for free-form maps
	return enc
}}

var (
	_ msgp.Marshaler   = Args(nil)
	_ msgp.Unmarshaler = (*Args)(nil)
)

// MarshalMsg implements msgp.Marshaler: a map with its keys sorted, so that
// equal Args are equal bytes. Free-form values are rare and small; the
// reflection-based encoder writes them.
func (a Args) MarshalMsg(b []byte) ([]byte, error) {
	enc := argsEncoders.Get().(*msgpack.Encoder)
	defer argsEncoders.Put(enc)
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
