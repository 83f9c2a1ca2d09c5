package vllmevents_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// fuzzSeeds are valid batches of every form plus the malformed cases.
func fuzzSeeds(f *testing.F) {
	sha := bytes.Repeat([]byte{0xcd}, 32)
	events := []vEvent{
		vStored{Hashes: []any{uint64(1) << 63, sha}, Tokens: seq(0, 8), BlockSize: 4, Medium: "GPU",
			ExtraKeys: []any{nil, nil}, GroupIdx: 0, SpecKind: "full_attention"}.event(),
		vStored{Hashes: ints(3), Parent: sha, Tokens: seq(8, 4), BlockSize: 4, LoRAID: 1, Medium: "GPU", LoRAName: "a"}.event(),
		vRemoved{Hashes: []any{int64(-5), sha}, Medium: "CPU", GroupIdx: 1}.event(),
		cleared(),
		{tag: "Unknown", fields: []vField{{"x", 1, false}}},
	}
	for _, fm := range forms {
		f.Add(encodeBatch(f, fm, 1.25, events, 2))
		f.Add(encodeBatch(f, fm, 0, nil, nil))
	}
	for _, p := range malformedPayloads(f) {
		if len(p) <= 4096 {
			f.Add(p)
		}
	}
}

// FuzzDecode: Decode never panics, fails only with the package's errors,
// and what it decodes is consistent.
func FuzzDecode(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := vllmevents.Decode(payload)
		if err != nil {
			if b != nil {
				t.Fatal("a batch with an error")
			}
			if !errors.Is(err, vllmevents.ErrMalformed) && !errors.Is(err, vllmevents.ErrTooLarge) {
				t.Fatalf("error %v wraps neither ErrMalformed nor ErrTooLarge", err)
			}
			return
		}
		hashes := 0
		for _, ev := range b.Events {
			switch ev.Type {
			case messages.EventBlockStored, messages.EventBlockRemoved, messages.EventAllBlocksCleared:
			default:
				t.Fatalf("event type %q", ev.Type)
			}
			if ev.ExtraKeys != nil && len(ev.ExtraKeys) != len(ev.BlockHashes) {
				t.Fatalf("%d extra keys for %d blocks", len(ev.ExtraKeys), len(ev.BlockHashes))
			}
			for _, h := range ev.BlockHashes {
				if h.IsZero() {
					t.Fatal("a zero hash")
				}
			}
			hashes += len(ev.BlockHashes)
		}
		if hashes > vllmevents.MaxHashesPerBatch || len(b.UnknownTags) > b.Skipped || len(b.UnknownTags) > 8 {
			t.Fatalf("batch %+v", b)
		}
	})
}

// FuzzTranslate: whatever decodes translates without panicking, into
// well-formed kvbus events, and the Translator stays within its bound.
func FuzzTranslate(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := vllmevents.Decode(payload)
		if err != nil {
			return
		}
		tr, err := vllmevents.NewTranslator(vllmevents.TranslatorConfig{BlockSize: 4, Hash: chained(testModel), MaxBlocks: 8})
		if err != nil {
			t.Fatal(err)
		}
		for range 2 { // again, now with the first pass's blocks mapped
			out, err := tr.Translate(b)
			if err != nil && !errors.Is(err, vllmevents.ErrBlockSize) && !errors.Is(err, vllmevents.ErrUnknownParent) && !errors.Is(err, vllmevents.ErrMalformed) {
				t.Fatalf("error %v", err)
			}
			for _, ev := range out {
				if ev.Type == messages.EventBlockStored && len(ev.TokenIDs) != 4*len(ev.BlockHashes) {
					t.Fatalf("stored %d blocks with %d tokens", len(ev.BlockHashes), len(ev.TokenIDs))
				}
			}
			if _, err := messages.Marshal(&messages.KVEventBatch{Events: out}); err != nil {
				t.Fatal(err)
			}
			if tr.Len() > 8 {
				t.Fatalf("Len %d above MaxBlocks", tr.Len())
			}
		}
	})
}
