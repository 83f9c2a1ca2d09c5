package vllmevents_test

import (
	"errors"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

const (
	testModel = "Qwen/Qwen3-8B"
	testBS    = 4
)

// chained is the HashFunc a caller builds from scheduler.HashBlocks.
func chained(model string) vllmevents.HashFunc {
	seed := scheduler.HashSeed(model)
	return func(parent *uint64, tokens []uint32) uint64 {
		prev := seed
		if parent != nil {
			prev = *parent
		}
		return scheduler.HashBlocks(nil, prev, tokens, len(tokens))[0]
	}
}

// TestChainedHashMatchesHashBlocks: hashing block by block, each chained
// from the previous block's hash, gives what HashBlocks gives over the
// whole prompt, so that a Translator can continue a chain from a parent
// hash alone.
func TestChainedHashMatchesHashBlocks(t *testing.T) {
	h := chained(testModel)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, bs := range []int{1, 4, 16} {
		tokens := make([]uint32, 40*bs+bs/2)
		for i := range tokens {
			tokens[i] = rng.Uint32()
		}
		want := scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), tokens, bs)
		var got []uint64
		var parent *uint64
		for i := 0; i+bs <= len(tokens); i += bs {
			v := h(parent, tokens[i:i+bs])
			got = append(got, v)
			parent = &v
		}
		if !slices.Equal(got, want) {
			t.Fatalf("block size %d: chained %x, HashBlocks %x", bs, got, want)
		}
	}
}

func newTranslator(t *testing.T, cfg vllmevents.TranslatorConfig) *vllmevents.Translator {
	t.Helper()
	if cfg.BlockSize == 0 {
		cfg.BlockSize = testBS
	}
	if cfg.Hash == nil {
		cfg.Hash = chained(testModel)
	}
	tr, err := vllmevents.NewTranslator(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// translate encodes events in form, decodes them and translates them.
func translate(t *testing.T, tr *vllmevents.Translator, f form, events ...vEvent) ([]messages.KVEvent, error) {
	t.Helper()
	b, err := vllmevents.Decode(encodeBatch(t, f, 1, events, 0))
	if err != nil {
		t.Fatal(err)
	}
	return tr.Translate(b)
}

func kvHashes(tokens []uint32) []uint64 {
	return scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), tokens, testBS)
}

// TestTranslateChaining: a second batch continuing the first's last block
// gets the hashes HashBlocks gives over the concatenated tokens.
func TestTranslateChaining(t *testing.T) {
	sha := func(b byte) []byte {
		return []byte{b, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}
	}
	for _, f := range forms {
		for _, kind := range []string{"int", "bytes"} {
			t.Run(f.String()+"/"+kind, func(t *testing.T) {
				hash := func(i byte) any {
					if kind == "bytes" {
						return sha(i)
					}
					return uint64(1)<<63 + uint64(i) // above MaxInt64, as vLLM's are
				}
				tr := newTranslator(t, vllmevents.TranslatorConfig{})
				tokens := seq(100, 5*testBS)
				want := kvHashes(tokens)

				out1, err := translate(t, tr, f, vStored{
					Hashes: []any{hash(1), hash(2), hash(3)}, Tokens: tokens[:3*testBS], BlockSize: testBS, Medium: "GPU",
				}.event())
				if err != nil {
					t.Fatal(err)
				}
				out2, err := translate(t, tr, f, vStored{
					Hashes: []any{hash(4), hash(5)}, Parent: hash(3), Tokens: tokens[3*testBS:], BlockSize: testBS, Medium: "GPU",
				}.event())
				if err != nil {
					t.Fatal(err)
				}
				wantOut1 := []messages.KVEvent{{
					Type: messages.EventBlockStored, BlockHashes: want[:3], TokenIDs: tokens[:3*testBS],
					BlockSize: testBS, Medium: "GPU",
				}}
				wantOut2 := []messages.KVEvent{{
					Type: messages.EventBlockStored, BlockHashes: want[3:], ParentBlockHash: &want[2],
					TokenIDs: tokens[3*testBS:], BlockSize: testBS, Medium: "GPU",
				}}
				if !reflect.DeepEqual(out1, wantOut1) || !reflect.DeepEqual(out2, wantOut2) {
					t.Fatalf("got\n%+v\n%+v\nwant\n%+v\n%+v", out1, out2, wantOut1, wantOut2)
				}
				if tr.Len() != 5 {
					t.Fatalf("Len = %d, want 5", tr.Len())
				}
				// A fork from block 1 chains from its kvbus hash too.
				fork := append(slices.Clone(tokens[:testBS]), seq(900, testBS)...)
				out3, err := translate(t, tr, f, vStored{
					Hashes: []any{hash(6)}, Parent: hash(1), Tokens: fork[testBS:], BlockSize: testBS,
				}.event())
				if err != nil || len(out3) != 1 || out3[0].BlockHashes[0] != kvHashes(fork)[1] {
					t.Fatalf("fork: %+v, %v", out3, err)
				}
			})
		}
	}
}

// TestTranslateRemoval maps engine removals to kvbus ones; a hash stored
// twice (two physical blocks, which vLLM does not deduplicate) is removed
// with its last block.
func TestTranslateRemoval(t *testing.T) {
	for _, f := range forms {
		t.Run(f.String(), func(t *testing.T) {
			tr := newTranslator(t, vllmevents.TranslatorConfig{})
			tokens := seq(0, 3*testBS)
			want := kvHashes(tokens)
			stored := vStored{Hashes: ints(11, 12, 13), Tokens: tokens, BlockSize: testBS, Medium: "GPU"}.event()
			if _, err := translate(t, tr, f, stored, stored); err != nil {
				t.Fatal(err)
			}
			out, err := translate(t, tr, f,
				vRemoved{Hashes: ints(13, 12), Medium: "GPU"}.event(), // one of two copies
				vRemoved{Hashes: ints(13, 99), Medium: "GPU"}.event(), // 99: never stored
			)
			if err != nil {
				t.Fatal(err)
			}
			wantOut := []messages.KVEvent{{Type: messages.EventBlockRemoved, BlockHashes: []uint64{want[2]}, Medium: "GPU"}}
			if !reflect.DeepEqual(out, wantOut) {
				t.Fatalf("got %+v, want %+v", out, wantOut)
			}
			if tr.Len() != 2 {
				t.Fatalf("Len = %d, want 2", tr.Len())
			}
			st := tr.Stats()
			if st.Stored != 6 || st.Removed != 1 || st.UnknownRemoved != 1 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

func TestTranslateAllBlocksCleared(t *testing.T) {
	tr := newTranslator(t, vllmevents.TranslatorConfig{})
	if _, err := translate(t, tr, formMapEvents, vStored{Hashes: ints(1), Tokens: seq(0, testBS), BlockSize: testBS}.event()); err != nil {
		t.Fatal(err)
	}
	out, err := translate(t, tr, formMapEvents, cleared(),
		vStored{Hashes: ints(2), Parent: uint64(1), Tokens: seq(0, testBS), BlockSize: testBS}.event())
	if !reflect.DeepEqual(out, []messages.KVEvent{{Type: messages.EventAllBlocksCleared}}) {
		t.Fatalf("got %+v", out)
	}
	// Block 1 went with the clear: its child cannot be chained.
	if !errors.Is(err, vllmevents.ErrUnknownParent) || tr.Len() != 0 {
		t.Fatalf("err = %v, Len = %d", err, tr.Len())
	}
	if got := tr.Reset(); !reflect.DeepEqual(got, []messages.KVEvent{{Type: messages.EventAllBlocksCleared}}) {
		t.Fatalf("Reset = %+v", got)
	}
}

// TestTranslateUnknownParent skips a chain whose start it did not see, and
// the chain's continuations, and reports it.
func TestTranslateUnknownParent(t *testing.T) {
	tr := newTranslator(t, vllmevents.TranslatorConfig{})
	out, err := translate(t, tr, formArray,
		vStored{Hashes: ints(2, 3), Parent: uint64(1), Tokens: seq(0, 2*testBS), BlockSize: testBS}.event(),
		vStored{Hashes: ints(4), Parent: uint64(3), Tokens: seq(0, testBS), BlockSize: testBS}.event(),
		vStored{Hashes: ints(5), Tokens: seq(0, testBS), BlockSize: testBS}.event(), // a new root is fine
	)
	if !errors.Is(err, vllmevents.ErrUnknownParent) || !strings.Contains(err.Error(), "int:1") || !strings.Contains(err.Error(), "(2 events)") {
		t.Fatalf("err = %v", err)
	}
	if len(out) != 1 || out[0].BlockHashes[0] != kvHashes(seq(0, testBS))[0] || tr.Stats().UnknownParent != 2 {
		t.Fatalf("out = %+v, stats %+v", out, tr.Stats())
	}
}

// TestTranslateZeroParentStartsAPrompt: llm-d's simulator sends
// parent_block_hash 0 (its legacy array form; llm-d's indexer reads vLLM's
// None as 0) for the first blocks of a prompt. They are a root, chained on
// as any other; a 0 that is a block the translator heard of stays a parent.
func TestTranslateZeroParentStartsAPrompt(t *testing.T) {
	tokens := seq(0, 3*testBS)
	want := kvHashes(tokens)
	tr := newTranslator(t, vllmevents.TranslatorConfig{})
	out, err := translate(t, tr, formArray,
		vStored{Hashes: ints(7, 8), Parent: uint64(0), Tokens: tokens[:2*testBS], BlockSize: testBS}.event(),
		vStored{Hashes: ints(9), Parent: uint64(8), Tokens: tokens[2*testBS:], BlockSize: testBS}.event(),
	)
	if err != nil || len(out) != 2 || tr.Stats().UnknownParent != 0 {
		t.Fatalf("out = %+v, err = %v, stats %+v", out, err, tr.Stats())
	}
	got := append(append([]uint64(nil), out[0].BlockHashes...), out[1].BlockHashes...)
	if !reflect.DeepEqual(got, want) || out[0].ParentBlockHash != nil {
		t.Fatalf("hashes %v (parent %v), want %v from no parent", got, out[0].ParentBlockHash, want)
	}

	// Block 0 heard of: a chain from 0 continues it.
	tr = newTranslator(t, vllmevents.TranslatorConfig{})
	out, err = translate(t, tr, formArray,
		vStored{Hashes: ints(0), Tokens: tokens[:testBS], BlockSize: testBS}.event(),
		vStored{Hashes: ints(5), Parent: uint64(0), Tokens: tokens[testBS : 2*testBS], BlockSize: testBS}.event(),
	)
	if err != nil || len(out) != 2 || out[1].BlockHashes[0] != want[1] {
		t.Fatalf("out = %+v, err = %v; want block 1 hashed %d from block 0", out, err, want[1])
	}
}

func TestTranslateBlockSizeMismatch(t *testing.T) {
	tr := newTranslator(t, vllmevents.TranslatorConfig{BlockSize: 16})
	out, err := translate(t, tr, formMapEvents,
		vStored{Hashes: ints(1), Tokens: seq(0, testBS), BlockSize: testBS}.event(),
		vStored{Hashes: ints(2), Tokens: seq(0, testBS), BlockSize: testBS}.event())
	if !errors.Is(err, vllmevents.ErrBlockSize) || len(out) != 0 {
		t.Fatalf("out = %+v, err = %v", out, err)
	}
	for _, s := range []string{"engine's block size is 4", "kvbus's is 16", "--block-size to 4", "(2 events)"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q lacks %q", err, s)
		}
	}
}

// TestTranslateTokenCount rejects a BlockStored whose tokens do not fill
// its blocks.
func TestTranslateTokenCount(t *testing.T) {
	tr := newTranslator(t, vllmevents.TranslatorConfig{})
	out, err := translate(t, tr, formArray, vStored{Hashes: ints(1, 2), Tokens: seq(0, testBS), BlockSize: testBS}.event())
	if !errors.Is(err, vllmevents.ErrMalformed) || len(out) != 0 || tr.Len() != 0 {
		t.Fatalf("out = %+v, err = %v", out, err)
	}
}

// TestTranslateKeyed skips blocks vLLM hashed with more than their tokens.
func TestTranslateKeyed(t *testing.T) {
	tr := newTranslator(t, vllmevents.TranslatorConfig{})
	tokens := seq(0, 3*testBS)
	out, err := translate(t, tr, formMapEvents,
		// An image in block 1: block 0 is indexable, 1 and 2 are not.
		vStored{Hashes: ints(1, 2, 3), Tokens: tokens, BlockSize: testBS,
			ExtraKeys: []any{nil, []any{[]any{"img", 0}}, nil}}.event(),
		vStored{Hashes: ints(4), Tokens: seq(0, testBS), BlockSize: testBS, LoRAName: "adapter"}.event(),
		vStored{Hashes: ints(5), Tokens: seq(0, testBS), BlockSize: testBS, LoRAID: 3}.event(),
	)
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != 1 || !slices.Equal(out[0].BlockHashes, kvHashes(tokens)[:1]) || len(out[0].TokenIDs) != testBS {
		t.Fatalf("got %+v", out)
	}
	if st := tr.Stats(); st.Keyed != 4 || tr.Len() != 1 {
		t.Fatalf("stats %+v, Len %d", st, tr.Len())
	}
}

// TestTranslateOtherMedia ignores another medium's and another KV cache
// group's events, which would otherwise remove GPU blocks.
func TestTranslateOtherMedia(t *testing.T) {
	tr := newTranslator(t, vllmevents.TranslatorConfig{})
	if _, err := translate(t, tr, formMapEvents, vStored{Hashes: ints(1), Tokens: seq(0, testBS), BlockSize: testBS, Medium: "GPU"}.event()); err != nil {
		t.Fatal(err)
	}
	out, err := translate(t, tr, formMapEvents,
		vRemoved{Hashes: ints(1), Medium: "CPU"}.event(),
		vRemoved{Hashes: ints(1), Medium: "GPU", GroupIdx: 1}.event(),
		vStored{Hashes: ints(2), Tokens: seq(0, testBS), BlockSize: 64, Medium: "CPU"}.event())
	if err != nil || len(out) != 0 || tr.Len() != 1 || tr.Stats().Ignored != 3 {
		t.Fatalf("out %+v, err %v, Len %d, stats %+v", out, err, tr.Len(), tr.Stats())
	}
	// A translator of the CPU medium takes them.
	cpu := newTranslator(t, vllmevents.TranslatorConfig{Medium: "CPU"})
	out, err = translate(t, cpu, formMapEvents, vStored{Hashes: ints(2), Tokens: seq(0, testBS), BlockSize: testBS, Medium: "CPU"}.event())
	if err != nil || len(out) != 1 || out[0].Medium != "CPU" {
		t.Fatalf("CPU: %+v, %v", out, err)
	}
}

// TestTranslateBound forgets blocks past MaxBlocks and removes them from
// kvbus, after the store that made room.
func TestTranslateBound(t *testing.T) {
	tr := newTranslator(t, vllmevents.TranslatorConfig{MaxBlocks: 2})
	tokens := seq(0, 3*testBS)
	want := kvHashes(tokens)
	out, err := translate(t, tr, formArray, vStored{Hashes: ints(1, 2, 3), Tokens: tokens, BlockSize: testBS}.event())
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != 2 || out[0].Type != messages.EventBlockStored || !slices.Equal(out[0].BlockHashes, want) ||
		out[1].Type != messages.EventBlockRemoved || len(out[1].BlockHashes) != 1 || !slices.Contains(want[:2], out[1].BlockHashes[0]) {
		t.Fatalf("got %+v", out)
	}
	if tr.Len() != 2 || tr.Stats().Evicted != 1 {
		t.Fatalf("Len %d, stats %+v", tr.Len(), tr.Stats())
	}
}

func TestNewTranslatorValidates(t *testing.T) {
	h := chained(testModel)
	for _, cfg := range []vllmevents.TranslatorConfig{
		{BlockSize: 0, Hash: h},
		{BlockSize: 16},
		{BlockSize: 16, Hash: h, MaxBlocks: -1},
	} {
		if _, err := vllmevents.NewTranslator(cfg); !errors.Is(err, vllmevents.ErrConfig) {
			t.Errorf("%+v: err = %v", cfg, err)
		}
	}
}
