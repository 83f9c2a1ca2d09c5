package vllmevents_test

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

func ptr[T any](v T) *T { return &v }

// TestDecodeForms decodes the same batch in every shape vLLM has sent.
func TestDecodeForms(t *testing.T) {
	sha := bytes.Repeat([]byte{0xab}, 32)
	events := []vEvent{
		vStored{
			Hashes: []any{uint64(math.MaxUint64), sha}, Parent: int64(-42),
			Tokens: seq(1, 8), BlockSize: 4, LoRAID: nil, Medium: "GPU", LoRAName: nil,
			ExtraKeys: []any{nil, []any{"salt"}}, GroupIdx: 0, SpecKind: "full_attention",
		}.event(),
		vRemoved{Hashes: ints(7), Medium: "GPU"}.event(),
		cleared(),
	}
	want := &vllmevents.Batch{
		TS: 1789095808.8378847,
		Events: []vllmevents.Event{
			{
				Type:        messages.EventBlockStored,
				BlockHashes: []vllmevents.Hash{vllmevents.HashFromUint64(math.MaxUint64), vllmevents.HashFromBytes(sha)},
				Parent:      ptr(vllmevents.HashFromInt64(-42)),
				TokenIDs:    seq(1, 8), BlockSize: 4, Medium: "GPU", GroupIdx: ptr(0),
				ExtraKeys: []bool{false, true},
			},
			{Type: messages.EventBlockRemoved, BlockHashes: []vllmevents.Hash{vllmevents.HashFromUint64(7)}, Medium: "GPU"},
			{Type: messages.EventAllBlocksCleared},
		},
		DPRank: 3,
	}
	for _, f := range forms {
		t.Run(f.String(), func(t *testing.T) {
			got, err := vllmevents.Decode(encodeBatch(t, f, want.TS, events, 3))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("got  %+v\nwant %+v", got, want)
			}
		})
	}
}

// TestDecodeOldVersions decodes events of vLLM versions with fewer fields:
// v0.9 (BlockStored up to lora_id, BlockRemoved with hashes only, no
// data_parallel_rank) and v0.10 (medium added).
func TestDecodeOldVersions(t *testing.T) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(enc.EncodeArrayLen(2))
	must(enc.EncodeFloat64(1.5))
	must(enc.Encode([]any{
		[]any{"BlockStored", []any{uint64(1), uint64(2)}, nil, []any{1, 2, 3, 4}, 2, nil},
		[]any{"BlockStored", []any{uint64(3)}, uint64(2), []any{5, 6}, 2, 7, "GPU"},
		[]any{"BlockRemoved", []any{uint64(1)}},
	}))
	b, err := vllmevents.Decode(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	want := []vllmevents.Event{
		{Type: "BlockStored", BlockHashes: []vllmevents.Hash{vllmevents.HashFromUint64(1), vllmevents.HashFromUint64(2)}, TokenIDs: seq(1, 4), BlockSize: 2},
		{Type: "BlockStored", BlockHashes: []vllmevents.Hash{vllmevents.HashFromUint64(3)}, Parent: ptr(vllmevents.HashFromUint64(2)), TokenIDs: seq(5, 2), BlockSize: 2, LoRAID: ptr(7), Medium: "GPU"},
		{Type: "BlockRemoved", BlockHashes: []vllmevents.Hash{vllmevents.HashFromUint64(1)}},
	}
	if !reflect.DeepEqual(b.Events, want) || b.TS != 1.5 || b.DPRank != 0 {
		t.Fatalf("got %+v", b)
	}
}

// TestDecodeExtraFields accepts and ignores fields a newer vLLM appends,
// in the batch and in events, in every form.
func TestDecodeExtraFields(t *testing.T) {
	ev := vStored{
		Hashes: ints(1), Tokens: seq(0, 4), BlockSize: 4, Medium: "GPU",
		Trailing: []vField{
			{"kv_cache_spec_sliding_window", 128, true},
			{"locality", "LOCAL", true},
			{"session_id", "s", true},
			{"future", map[string]any{"nested": []any{1, "x"}}, true},
		},
	}.event()
	for _, f := range forms {
		t.Run(f.String(), func(t *testing.T) {
			b, err := vllmevents.Decode(encodeBatch(t, f, 1, []vEvent{ev}, 0))
			if err != nil {
				t.Fatal(err)
			}
			if len(b.Events) != 1 || len(b.Events[0].TokenIDs) != 4 {
				t.Fatalf("got %+v", b)
			}
		})
	}
	// A longer batch array and an unknown batch map key.
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	if err := enc.Encode([]any{1.0, []any{[]any{"AllBlocksCleared", "later field"}}, 0, "later batch field"}); err != nil {
		t.Fatal(err)
	}
	if b, err := vllmevents.Decode(buf.Bytes()); err != nil || len(b.Events) != 1 {
		t.Fatalf("longer arrays: %+v, %v", b, err)
	}
	buf.Reset()
	if err := enc.Encode(map[string]any{"ts": 2, "events": []any{}, "publisher_epoch": "e"}); err != nil {
		t.Fatal(err)
	}
	if b, err := vllmevents.Decode(buf.Bytes()); err != nil || b.TS != 2 {
		t.Fatalf("map batch with an unknown key: %+v, %v", b, err)
	}
}

// TestDecodeUnknownTags skips events with unknown tags, and counts them.
func TestDecodeUnknownTags(t *testing.T) {
	events := []vEvent{
		{tag: "BlockUpdated", fields: []vField{{"block_hashes", "not a list", false}, {"x", []any{1}, false}}},
		cleared(),
		{tag: "BlockUpdated"},
		{tag: "CacheStoreCreated", fields: []vField{{"a", 1, false}}},
	}
	for _, f := range forms {
		t.Run(f.String(), func(t *testing.T) {
			b, err := vllmevents.Decode(encodeBatch(t, f, 1, events, nil))
			if err != nil {
				t.Fatal(err)
			}
			if len(b.Events) != 1 || b.Events[0].Type != "AllBlocksCleared" || b.Skipped != 3 ||
				!reflect.DeepEqual(b.UnknownTags, []string{"BlockUpdated", "CacheStoreCreated"}) {
				t.Fatalf("got %+v", b)
			}
		})
	}
}

// TestDecodeMapTagAnywhere accepts a map event whose type is not its first
// key (msgspec writes it first; other encoders need not).
func TestDecodeMapTagAnywhere(t *testing.T) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.SetSortMapKeys(true) // "block_hashes" < "medium" < "type"
	if err := enc.Encode(map[string]any{"ts": 1.0, "events": []any{
		map[string]any{"block_hashes": []any{uint64(9)}, "medium": nil, "type": "BlockRemoved"},
	}}); err != nil {
		t.Fatal(err)
	}
	b, err := vllmevents.Decode(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 1 || b.Events[0].Type != "BlockRemoved" || b.Events[0].BlockHashes[0] != vllmevents.HashFromUint64(9) {
		t.Fatalf("got %+v", b)
	}
}

func TestHashKinds(t *testing.T) {
	cases := []struct {
		h    vllmevents.Hash
		want string
	}{
		{vllmevents.HashFromUint64(math.MaxUint64), "int:18446744073709551615"},
		{vllmevents.HashFromInt64(-1), "int:-1"},
		{vllmevents.HashFromInt64(5), "int:5"},
		{vllmevents.HashFromBytes([]byte{1, 0xff}), "bytes:01ff"},
		{vllmevents.Hash{}, "none"},
	}
	for _, c := range cases {
		if got := c.h.String(); got != c.want {
			t.Errorf("String() = %q, want %q", got, c.want)
		}
	}
	if vllmevents.HashFromInt64(-1) == vllmevents.HashFromUint64(math.MaxUint64) {
		t.Error("-1 and 2^64-1 are distinct hashes")
	}
	if vllmevents.HashFromInt64(5) != vllmevents.HashFromUint64(5) {
		t.Error("5 is 5, signed or not")
	}
	if vllmevents.HashFromBytes([]byte{5}) == vllmevents.HashFromUint64(5) {
		t.Error("bytes and integers are distinct hashes")
	}
	if b, ok := vllmevents.HashFromBytes([]byte{7}).Bytes(); !ok || !bytes.Equal(b, []byte{7}) {
		t.Error("Bytes")
	}
	if v, ok := vllmevents.HashFromUint64(7).Uint64(); !ok || v != 7 {
		t.Error("Uint64")
	}
	if v, ok := vllmevents.HashFromInt64(-7).Int64(); !ok || v != -7 {
		t.Error("Int64")
	}
	if _, ok := vllmevents.HashFromInt64(-7).Uint64(); ok {
		t.Error("Uint64 of a negative hash")
	}
}

// malformedPayloads are payloads Decode must reject; fuzzing seeds them
// too.
func malformedPayloads(t testing.TB) map[string][]byte {
	t.Helper()
	enc := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	good := encodeBatch(t, formArray, 1, []vEvent{vStored{Hashes: ints(1), Tokens: seq(0, 4), BlockSize: 4}.event()}, 0)
	deep := bytes.Repeat([]byte{0x91}, 100000) // 100k nested arrays
	return map[string][]byte{
		"empty":              {},
		"nil":                enc(nil),
		"int":                enc(5),
		"truncated":          good[:len(good)-1],
		"short batch":        enc([]any{1.0}),
		"ts not a number":    enc([]any{"now", []any{}}),
		"events not a list":  enc([]any{1.0, "x"}),
		"map without events": enc(map[string]any{"ts": 1.0}),
		"event not a list":   enc([]any{1.0, []any{5}}),
		"empty event":        enc([]any{1.0, []any{[]any{}}}),
		"tag not a string":   enc([]any{1.0, []any{[]any{5}}}),
		"short stored":       enc([]any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{1}}}}),
		"short removed":      enc([]any{1.0, []any{[]any{"BlockRemoved"}}}),
		"hash a float":       enc([]any{1.0, []any{[]any{"BlockRemoved", []any{1.5}}}}),
		"hash a list":        enc([]any{1.0, []any{[]any{"BlockRemoved", []any{[]any{}}}}}),
		"empty bytes hash":   enc([]any{1.0, []any{[]any{"BlockRemoved", []any{[]byte{}}}}}),
		"huge bytes hash":    enc([]any{1.0, []any{[]any{"BlockRemoved", []any{make([]byte, 65)}}}}),
		"negative token":     enc([]any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{-1}, 1}}}),
		"token above u32":    enc([]any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{uint64(1) << 32}, 1}}}),
		"negative size":      enc([]any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{1}, -1}}}),
		"size a string":      enc([]any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{1}, "1"}}}),
		"medium an int":      enc([]any{1.0, []any{[]any{"BlockRemoved", []any{1}, 5}}}),
		"lora name a map":    enc([]any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{1}, 1, nil, "GPU", map[string]any{"cache_salt": "x"}}}}),
		"extra keys an int":  enc([]any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{1}, 1, nil, "GPU", nil, 5}}}),
		"dp rank a string":   enc([]any{1.0, []any{}, "0"}),
		"dp rank too big":    enc([]any{1.0, []any{}, uint64(1) << 40}),
		"map without type":   enc([]any{1.0, []any{map[string]any{"block_hashes": []any{}}}}),
		"map type an int":    enc([]any{1.0, []any{map[string]any{"type": 1}}}),
		"map key an int":     enc([]any{1.0, []any{map[int]any{1: 1}}}),
		"stored w/o tokens":  enc([]any{1.0, []any{map[string]any{"type": "BlockStored", "block_hashes": []any{}}}}),
		"removed w/o hashes": enc([]any{1.0, []any{map[string]any{"type": "BlockRemoved"}}}),
		"too deep":           append([]byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0}, deep...),
		"too large":          append(enc([]any{1.0, []any{}}), make([]byte, messages.MaxMessageBytes)...),
		"array32 claim":      {0x92, 0x01, 0xdd, 0xff, 0xff, 0xff, 0xff},
		"bin32 claim":        {0x92, 0x01, 0x91, 0x92, 0xac, 'B', 'l', 'o', 'c', 'k', 'R', 'e', 'm', 'o', 'v', 'e', 'd', 0x91, 0xc6, 0xff, 0xff, 0xff, 0xff},
		"duplicate map key":  append(append([]byte{0x92, 0x01, 0x91, 0x82, 0xa4, 't', 'y', 'p', 'e', 0xb0}, "AllBlocksCleared"...), 0xa4, 't', 'y', 'p', 'e', 0xa1, 'y'),
	}
}

func TestDecodeMalformed(t *testing.T) {
	for name, payload := range malformedPayloads(t) {
		t.Run(name, func(t *testing.T) {
			b, err := vllmevents.Decode(payload)
			if err == nil {
				t.Fatalf("decoded %+v", b)
			}
			if !errors.Is(err, vllmevents.ErrMalformed) && !errors.Is(err, vllmevents.ErrTooLarge) {
				t.Fatalf("error %v wraps neither ErrMalformed nor ErrTooLarge", err)
			}
			if !strings.HasPrefix(err.Error(), "vllmevents: ") {
				t.Errorf("error %q lacks the package prefix", err)
			}
		})
	}
}

// TestDecodeTooManyHashes bounds what a batch of one-byte hashes costs.
func TestDecodeTooManyHashes(t *testing.T) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	n := vllmevents.MaxHashesPerBatch/2 + 1
	for _, err := range []error{enc.EncodeArrayLen(2), enc.EncodeFloat64(1), enc.EncodeArrayLen(2)} {
		if err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if err := errors.Join(enc.EncodeArrayLen(2), enc.EncodeString("BlockRemoved"), enc.EncodeArrayLen(n)); err != nil {
			t.Fatal(err)
		}
		buf.Write(bytes.Repeat([]byte{0x01}, n))
	}
	if _, err := vllmevents.Decode(buf.Bytes()); !errors.Is(err, vllmevents.ErrTooLarge) {
		t.Fatalf("err = %v, want ErrTooLarge", err)
	}
}

func ExampleDecode() {
	// A batch as vLLM 0.26 sends it: positional batch, tagged-map event.
	payload, _ := msgpack.Marshal([]any{1.5, []any{map[string]any{
		"type": "BlockRemoved", "block_hashes": []any{uint64(15760518052499183552)}, "medium": "GPU",
	}}, 0})
	b, err := vllmevents.Decode(payload)
	if err != nil {
		panic(err)
	}
	ev := b.Events[0]
	fmt.Println(ev.Type, ev.BlockHashes[0], ev.Medium)
	// Output: BlockRemoved int:15760518052499183552 GPU
}
