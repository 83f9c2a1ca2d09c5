package vllmevents_test

import (
	"bytes"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a goroutine (a ZeroMQ connection
// reader, a reaper, a replay socket) outlives them. go-zeromq's PUB socket,
// which only the tests' publishers use, never stops its writer goroutine
// (pubSocket.Close does not close its pubMWriter, in v0.17.0).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// form is how a test publisher encodes a batch, as versions of vLLM do
// (see the package documentation).
type form int

const (
	// formArray: array batch, array events (vLLM before PR #42892).
	formArray form = iota
	// formMapEvents: array batch, tagged-map events (vLLM 0.26 on).
	formMapEvents
	// formMap: map batch, map events (vLLM at 0181ea3173e5, llm-d's
	// simulator).
	formMap
)

var forms = []form{formArray, formMapEvents, formMap}

func (f form) String() string {
	return [...]string{"array", "map-events", "map"}[f]
}

// vField is one field of a vLLM event struct: its name, value, and
// whether it has a default (msgspec's omit_defaults drops it when its
// value is the default, None).
type vField struct {
	name       string
	value      any
	hasDefault bool
}

// vEvent is a vLLM event: its tag and its fields in declaration order.
type vEvent struct {
	tag    string
	fields []vField
}

// vStored is vLLM's BlockStored, with the fields of its newest version.
type vStored struct {
	Hashes    []any // uint64, int64 or []byte each
	Parent    any
	Tokens    []uint32
	BlockSize int
	LoRAID    any
	Medium    any
	LoRAName  any
	ExtraKeys any // nil or []any with nil or a tuple ([]any) per block
	GroupIdx  any
	SpecKind  any
	// Trailing are more defaulted fields, as later versions append.
	Trailing []vField
}

func (s vStored) event() vEvent {
	return vEvent{tag: "BlockStored", fields: append([]vField{
		{"block_hashes", s.Hashes, false},
		{"parent_block_hash", s.Parent, false},
		{"token_ids", s.Tokens, false},
		{"block_size", s.BlockSize, false},
		{"lora_id", s.LoRAID, false},
		{"medium", s.Medium, false},
		{"lora_name", s.LoRAName, false},
		{"extra_keys", s.ExtraKeys, true},
		{"group_idx", s.GroupIdx, true},
		{"kv_cache_spec_kind", s.SpecKind, true},
	}, s.Trailing...)}
}

// vRemoved is vLLM's BlockRemoved.
type vRemoved struct {
	Hashes   []any
	Medium   any
	GroupIdx any
}

func (r vRemoved) event() vEvent {
	return vEvent{tag: "BlockRemoved", fields: []vField{
		{"block_hashes", r.Hashes, false},
		{"medium", r.Medium, false},
		{"group_idx", r.GroupIdx, true},
	}}
}

func cleared() vEvent { return vEvent{tag: "AllBlocksCleared"} }

// encodeBatch encodes a batch the way msgspec encodes vLLM's
// KVEventBatch: floats as float64, integers in their shortest form, bytes
// as bin, structs as arrays (array_like, trailing defaults omitted) or
// maps (tag first under "type", defaults omitted).
func encodeBatch(t testing.TB, f form, ts float64, events []vEvent, dpRank any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	encodeEvents := func() {
		must(enc.EncodeArrayLen(len(events)))
		for _, ev := range events {
			fields := ev.fields
			if f == formArray {
				for len(fields) > 0 && fields[len(fields)-1].hasDefault && fields[len(fields)-1].value == nil {
					fields = fields[:len(fields)-1]
				}
				must(enc.EncodeArrayLen(1 + len(fields)))
				must(enc.EncodeString(ev.tag))
				for _, fd := range fields {
					encodeValue(t, enc, fd.value)
				}
				continue
			}
			var kept []vField
			for _, fd := range fields {
				if !fd.hasDefault || fd.value != nil {
					kept = append(kept, fd)
				}
			}
			must(enc.EncodeMapLen(1 + len(kept)))
			must(enc.EncodeString("type"))
			must(enc.EncodeString(ev.tag))
			for _, fd := range kept {
				must(enc.EncodeString(fd.name))
				encodeValue(t, enc, fd.value)
			}
		}
	}
	if f == formMap {
		n := 2
		if dpRank != nil {
			n++
		}
		must(enc.EncodeMapLen(n))
		must(enc.EncodeString("ts"))
		must(enc.EncodeFloat64(ts))
		must(enc.EncodeString("events"))
		encodeEvents()
		if dpRank != nil {
			must(enc.EncodeString("data_parallel_rank"))
			encodeValue(t, enc, dpRank)
		}
		return buf.Bytes()
	}
	n := 2
	if dpRank != nil {
		n++
	}
	must(enc.EncodeArrayLen(n))
	must(enc.EncodeFloat64(ts))
	encodeEvents()
	if dpRank != nil {
		encodeValue(t, enc, dpRank)
	}
	return buf.Bytes()
}

func encodeValue(t testing.TB, enc *msgpack.Encoder, v any) {
	t.Helper()
	var err error
	switch v := v.(type) {
	case nil:
		err = enc.EncodeNil()
	case uint64:
		err = enc.EncodeUint(v)
	case int:
		err = enc.EncodeInt(int64(v))
	case int64:
		err = enc.EncodeInt(v)
	case float64:
		err = enc.EncodeFloat64(v)
	case string:
		err = enc.EncodeString(v)
	case []byte:
		err = enc.EncodeBytes(v)
	case []uint32:
		if err = enc.EncodeArrayLen(len(v)); err == nil {
			for _, x := range v {
				if err = enc.EncodeUint(uint64(x)); err != nil {
					break
				}
			}
		}
	case []any:
		if err = enc.EncodeArrayLen(len(v)); err == nil {
			for _, x := range v {
				encodeValue(t, enc, x)
			}
		}
	case map[string]any:
		err = enc.Encode(v)
	default:
		t.Fatalf("encodeValue: %T", v)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// ints returns hashes as the []any of integer hashes vLLM sends.
func ints(hs ...uint64) []any {
	out := make([]any, len(hs))
	for i, h := range hs {
		out[i] = h
	}
	return out
}

// seq returns the tokens from, from+1, ..., from+n-1.
func seq(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}
