package fakeengine_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv/fakeengine"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// recorder collects what a vllmevents.Subscriber delivers and reports.
type recorder struct {
	mu      sync.Mutex
	seqs    []uint64
	batches []*vllmevents.Batch
	gaps    [][2]uint64
	got     chan struct{}
}

func newRecorder() *recorder { return &recorder{got: make(chan struct{}, 1000)} }

func (r *recorder) handle(seq uint64, b *vllmevents.Batch) error {
	r.mu.Lock()
	r.seqs = append(r.seqs, seq)
	r.batches = append(r.batches, b)
	r.mu.Unlock()
	r.got <- struct{}{}
	return nil
}

func (r *recorder) onGap(from, to uint64) {
	r.mu.Lock()
	r.gaps = append(r.gaps, [2]uint64{from, to})
	r.mu.Unlock()
}

// wait waits for n more deliveries and returns everything delivered.
func (r *recorder) wait(t *testing.T, n int) ([]uint64, []*vllmevents.Batch, [][2]uint64) {
	t.Helper()
	for range n {
		select {
		case <-r.got:
		case <-time.After(10 * time.Second):
			r.mu.Lock()
			defer r.mu.Unlock()
			t.Fatalf("timed out; delivered %v, gaps %v", r.seqs, r.gaps)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.seqs), slices.Clone(r.batches), slices.Clone(r.gaps)
}

// subscribe runs a vllmevents.Subscriber until the test ends.
func subscribe(t *testing.T, cfg vllmevents.Config, rec *recorder) *vllmevents.Subscriber {
	t.Helper()
	cfg.Logger = slog.New(slog.DiscardHandler)
	cfg.OnGap = rec.onGap
	s, err := vllmevents.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, rec.handle) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Run did not return")
		}
	})
	return s
}

func waitSubscribed(t *testing.T, e *fakeengine.Engine) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.WaitSubscribed(ctx); err != nil {
		t.Fatal(err)
	}
}

// toHashes converts fakeengine.BlockHashes to vllmevents hashes.
func toHashes(hs []any) []vllmevents.Hash {
	out := make([]vllmevents.Hash, len(hs))
	for i, h := range hs {
		switch h := h.(type) {
		case uint64:
			out[i] = vllmevents.HashFromUint64(h)
		case []byte:
			out[i] = vllmevents.HashFromBytes(h)
		}
	}
	return out
}

// computed returns the tokens whose KV the last request computed: its
// prompt and its output tokens but the last.
func computed(t *testing.T, e *fakeengine.Engine, replyTokens int) []uint32 {
	t.Helper()
	reqs := e.Requests()
	prompt := reqs[len(reqs)-1].PromptTokens
	_, ids := fakeengine.Reply(prompt, replyTokens)
	return append(slices.Clone(prompt), ids...) // the reply's words; the EOT is last
}

// tokenPrompt returns n token ids from base.
func tokenPrompt(base, n int) []int {
	p := make([]int, n)
	for i := range p {
		p[i] = base + i*7919%200_000 + 100
	}
	return p
}

// chained is kvbus's hash of the model's blocks, for a Translator.
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

// TestKVEventsDecoded: vllmevents' Subscriber and Decode read the fake's
// batches, in both event forms, with both hash kinds, whether the fake
// binds (as vLLM) or connects (as llm-d's simulator); a Translator indexes
// them without error; Reset publishes AllBlocksCleared and SkipSeq makes a
// gap.
func TestKVEventsDecoded(t *testing.T) {
	const bs = 16
	const topic = "kv@fake-0@fake/model"
	for _, tc := range []struct {
		form      fakeengine.EventForm
		connect   bool
		hashBytes bool
	}{
		{fakeengine.EventFormArray, false, false},
		{fakeengine.EventFormMap, false, true},
		{fakeengine.EventFormArray, true, true},
		{fakeengine.EventFormMap, true, false},
	} {
		name := fmt.Sprintf("%s/connect=%v/bytes=%v", tc.form, tc.connect, tc.hashBytes)
		t.Run(name, func(t *testing.T) {
			rec := newRecorder()
			kv := &fakeengine.KVEventsConfig{Endpoint: "tcp://127.0.0.1:0", Topic: topic, EventForm: tc.form}
			if tc.connect {
				s := subscribe(t, vllmevents.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, Topic: topic}, rec)
				deadline := time.Now().Add(10 * time.Second)
				for s.Addr() == nil {
					if time.Now().After(deadline) {
						t.Fatal("the Subscriber did not bind")
					}
					time.Sleep(5 * time.Millisecond)
				}
				kv.Endpoint, kv.Connect = "tcp://"+s.Addr().String(), true
			}
			e := newEngine(t, fakeengine.Config{BlockSize: bs, HashBytes: tc.hashBytes, KVEvents: kv})
			if !tc.connect {
				subscribe(t, vllmevents.Config{Endpoint: e.KVEventsAddr(), Topic: topic}, rec)
			}
			waitSubscribed(t, e)
			tr, err := vllmevents.NewTranslator(vllmevents.TranslatorConfig{BlockSize: bs, Hash: chained("fake/model")})
			if err != nil {
				t.Fatal(err)
			}
			translate := func(b *vllmevents.Batch) []messages.KVEvent {
				t.Helper()
				evs, err := tr.Translate(b)
				if err != nil {
					t.Fatalf("Translate: %v", err)
				}
				return evs
			}

			// A: 40 prompt tokens; 48 computed (8 reply words), 3 blocks.
			post(t, e, "/v1/completions", map[string]any{"prompt": tokenPrompt(1, 40)})
			compA := computed(t, e, fakeengine.DefaultReplyTokens)
			hashesA := toHashes(fakeengine.BlockHashes(compA, bs, tc.hashBytes))
			seqs, batches, _ := rec.wait(t, 1)
			if !slices.Equal(seqs, []uint64{0}) || len(batches[0].Events) != 1 || batches[0].DPRank != 0 ||
				time.Since(time.Unix(int64(batches[0].TS), 0)) > time.Minute {
				t.Fatalf("seqs %v, batch %+v", seqs, batches[0])
			}
			ev := batches[0].Events[0]
			if ev.Type != messages.EventBlockStored || !slices.Equal(ev.BlockHashes, hashesA) || ev.Parent != nil ||
				!slices.Equal(ev.TokenIDs, compA[:3*bs]) || ev.BlockSize != bs || ev.LoRAID != nil ||
				ev.LoRAName != nil || ev.Medium != "GPU" || ev.ExtraKeys != nil || ev.GroupIdx != nil {
				t.Fatalf("event %+v, want hashes %v", ev, hashesA)
			}
			if kevs := translate(batches[0]); len(kevs) != 1 || len(kevs[0].BlockHashes) != 3 {
				t.Fatalf("translated %+v", kevs)
			}

			// B extends A's computed tokens: cached 48 (3 blocks), stores
			// the rest chained from A's last block.
			promptB := make([]int, 0, 70)
			for _, tok := range compA {
				promptB = append(promptB, int(tok))
			}
			promptB = append(promptB, tokenPrompt(5000, 22)...)
			resp := post(t, e, "/v1/completions", map[string]any{"prompt": promptB})
			if _, _, _, cached := usageOf(t, resp); cached != 3*bs {
				t.Fatalf("B cached %d", cached)
			}
			compB := computed(t, e, fakeengine.DefaultReplyTokens) // 78 tokens: 4 blocks
			hashesB := toHashes(fakeengine.BlockHashes(compB, bs, tc.hashBytes))
			_, batches, _ = rec.wait(t, 1)
			ev = batches[1].Events[0]
			if len(batches[1].Events) != 1 || ev.Type != messages.EventBlockStored || ev.Parent == nil ||
				*ev.Parent != hashesA[2] || !slices.Equal(ev.BlockHashes, hashesB[3:]) ||
				!slices.Equal(ev.TokenIDs, compB[3*bs:4*bs]) {
				t.Fatalf("B's event %+v", ev)
			}
			if !slices.Equal(hashesB[:3], hashesA) {
				t.Fatal("B's first blocks do not hash as A's")
			}
			translate(batches[1])
			if tr.Len() != 4 {
				t.Fatalf("the Translator indexes %d blocks", tr.Len())
			}

			// C shares A's first block only: chained from it.
			promptC := make([]int, 0, 40)
			for _, tok := range compA[:bs] {
				promptC = append(promptC, int(tok))
			}
			promptC = append(promptC, tokenPrompt(7000, 20)...)
			post(t, e, "/v1/completions", map[string]any{"prompt": promptC})
			compC := computed(t, e, fakeengine.DefaultReplyTokens) // 44 tokens: 2 blocks
			hashesC := toHashes(fakeengine.BlockHashes(compC, bs, tc.hashBytes))
			_, batches, _ = rec.wait(t, 1)
			if ev = batches[2].Events[0]; ev.Parent == nil || *ev.Parent != hashesA[0] ||
				!slices.Equal(ev.BlockHashes, hashesC[1:]) {
				t.Fatalf("C's event %+v", ev)
			}
			translate(batches[2])

			// A's prompt with a cache_salt shares none of A's blocks, and
			// its first block's extra keys hold the salt: the Translator,
			// which cannot hash them, indexes none of its blocks.
			resp = post(t, e, "/v1/completions", map[string]any{"prompt": tokenPrompt(1, 40), "cache_salt": "tenant-a"})
			if _, _, _, cached := usageOf(t, resp); cached != 0 {
				t.Fatalf("the salted prompt found %d cached tokens of the unsalted one's", cached)
			}
			_, batches, _ = rec.wait(t, 1)
			if ev = batches[3].Events[0]; ev.Parent != nil || len(ev.BlockHashes) != 3 || slices.Contains(hashesA, ev.BlockHashes[0]) ||
				!slices.Equal(ev.ExtraKeys, []bool{true, false, false}) {
				t.Fatalf("the salted prompt's event %+v", ev)
			}
			translate(batches[3])
			if tr.Len() != 5 {
				t.Fatalf("the Translator indexes %d blocks after the salted prompt, want A's, B's and C's 5", tr.Len())
			}

			// A request that fills no block publishes nothing.
			post(t, e, "/v1/completions", map[string]any{"prompt": "hi"})
			if e.NextSeq() != 4 {
				t.Fatalf("NextSeq %d after a request storing nothing", e.NextSeq())
			}

			// Reset: AllBlocksCleared, over HTTP as vLLM's endpoint.
			if resp, b := do(t, http.MethodPost, e.URL()+"/reset_prefix_cache", nil, nil); resp.StatusCode != 200 {
				t.Fatalf("/reset_prefix_cache: %d %s", resp.StatusCode, b)
			}
			seqs, batches, _ = rec.wait(t, 1)
			if seqs[4] != 4 || len(batches[4].Events) != 1 || batches[4].Events[0].Type != messages.EventAllBlocksCleared {
				t.Fatalf("seq %d batch %+v", seqs[4], batches[4])
			}
			translate(batches[4])
			if tr.Len() != 0 {
				t.Fatalf("the Translator indexes %d blocks after AllBlocksCleared", tr.Len())
			}

			// SkipSeq: the subscriber sees a gap.
			e.SkipSeq(3)
			post(t, e, "/v1/completions", map[string]any{"prompt": tokenPrompt(9000, 30)})
			seqs, _, gaps := rec.wait(t, 1)
			if !slices.Equal(seqs, []uint64{0, 1, 2, 3, 4, 8}) || !slices.Equal(gaps, [][2]uint64{{5, 8}}) {
				t.Fatalf("seqs %v, gaps %v", seqs, gaps)
			}
		})
	}
}

// TestKVEventsEviction: a full cache evicts the least recently used
// blocks, a request's tail first, each a BlockRemoved before the
// BlockStored that needed the room.
func TestKVEventsEviction(t *testing.T) {
	const bs = 4
	e := newEngine(t, fakeengine.Config{MaxModelLen: 64, BlockSize: bs, CacheBlocks: 16,
		KVEvents: &fakeengine.KVEventsConfig{Endpoint: "tcp://127.0.0.1:0", EventForm: fakeengine.EventFormArray}})
	rec := newRecorder()
	subscribe(t, vllmevents.Config{Endpoint: e.KVEventsAddr()}, rec)
	waitSubscribed(t, e)

	// Each request: 30 prompt tokens, 38 computed, 9 blocks.
	post(t, e, "/v1/completions", map[string]any{"prompt": tokenPrompt(1, 30)})
	h1 := toHashes(fakeengine.BlockHashes(computed(t, e, fakeengine.DefaultReplyTokens), bs, false))
	post(t, e, "/v1/completions", map[string]any{"prompt": tokenPrompt(3000, 30)})
	h2 := toHashes(fakeengine.BlockHashes(computed(t, e, fakeengine.DefaultReplyTokens), bs, false))
	_, batches, _ := rec.wait(t, 2)
	if len(h1) != 9 || e.CachedBlocks() != 16 {
		t.Fatalf("%d blocks per request, %d cached", len(h1), e.CachedBlocks())
	}
	// 18 blocks do not fit in 16: the first request's last two go.
	want := []struct {
		typ    string
		hashes []vllmevents.Hash
	}{
		{messages.EventBlockRemoved, h1[8:9]},
		{messages.EventBlockRemoved, h1[7:8]},
		{messages.EventBlockStored, h2},
	}
	evs := batches[1].Events
	if len(evs) != len(want) {
		t.Fatalf("events %+v", evs)
	}
	for i, w := range want {
		if evs[i].Type != w.typ || !slices.Equal(evs[i].BlockHashes, w.hashes) || evs[i].Medium != "GPU" {
			t.Fatalf("event %d: %+v, want %s %v", i, evs[i], w.typ, w.hashes)
		}
	}
	// The first prompt again: 7 blocks (28 tokens) cached, the last two
	// stored again, evicting the second request's tail.
	resp := post(t, e, "/v1/completions", map[string]any{"prompt": tokenPrompt(1, 30)})
	if _, _, _, cached := usageOf(t, resp); cached != 28 {
		t.Fatalf("cached %d, want 28", cached)
	}
	_, batches, _ = rec.wait(t, 1)
	evs = batches[2].Events
	if len(evs) != 3 || evs[0].Type != messages.EventBlockRemoved || evs[0].BlockHashes[0] != h2[8] ||
		evs[1].BlockHashes[0] != h2[7] || evs[2].Type != messages.EventBlockStored ||
		!slices.Equal(evs[2].BlockHashes, h1[7:]) || *evs[2].Parent != h1[6] {
		t.Fatalf("events %+v", evs)
	}
	// A Translator follows the evictions.
	tr, err := vllmevents.NewTranslator(vllmevents.TranslatorConfig{BlockSize: bs, Hash: chained("fake/model")})
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range batches {
		if _, err := tr.Translate(b); err != nil {
			t.Fatal(err)
		}
	}
	if tr.Len() != 16 {
		t.Fatalf("the Translator indexes %d blocks, the engine %d", tr.Len(), e.CachedBlocks())
	}
}

// TestKVEventsReplay: batches the PUB dropped are replayed from the
// replay ROUTER by vllmevents' client; batches never numbered (SkipSeq)
// cannot be, and are reported as a gap.
func TestKVEventsReplay(t *testing.T) {
	e := newEngine(t, fakeengine.Config{KVEvents: &fakeengine.KVEventsConfig{
		Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 3}})
	rec := newRecorder()
	s := subscribe(t, vllmevents.Config{Endpoint: e.KVEventsAddr(), ReplayEndpoint: e.ReplayAddr()}, rec)
	waitSubscribed(t, e)
	request := func(i int) {
		post(t, e, "/v1/completions", map[string]any{"prompt": tokenPrompt(1000*i, 20)})
	}
	request(1)
	rec.wait(t, 1)
	e.DropNext(2)
	request(2) // seq 1, dropped
	request(3) // seq 2, dropped
	request(4) // seq 3: the subscriber replays 1 and 2 first
	seqs, batches, gaps := rec.wait(t, 3)
	if !slices.Equal(seqs, []uint64{0, 1, 2, 3}) || len(gaps) != 0 || s.Stats().Replayed != 2 {
		t.Fatalf("seqs %v, gaps %v, stats %+v", seqs, gaps, s.Stats())
	}
	for i, b := range batches {
		if len(b.Events) != 1 || b.Events[0].Type != messages.EventBlockStored {
			t.Fatalf("batch %d: %+v", i, b)
		}
	}
	// Seqs 4 and 5 were never published: replay cannot fill them.
	e.SkipSeq(2)
	request(5)
	seqs, _, gaps = rec.wait(t, 1)
	if !slices.Equal(seqs, []uint64{0, 1, 2, 3, 6}) || !slices.Equal(gaps, [][2]uint64{{4, 6}}) {
		t.Fatalf("seqs %v, gaps %v", seqs, gaps)
	}
	// The buffer keeps the last BufferSteps (3) batches: with 7, 8 and 9
	// dropped, when 10 arrives it holds 8, 9 and 10; 7 is lost.
	e.DropNext(3)
	request(6)
	request(7)
	request(8)
	request(9)
	seqs, _, gaps = rec.wait(t, 3)
	if !slices.Equal(seqs, []uint64{0, 1, 2, 3, 6, 8, 9, 10}) || !slices.Equal(gaps, [][2]uint64{{4, 6}, {7, 8}}) {
		t.Fatalf("seqs %v, gaps %v", seqs, gaps)
	}
	if st := s.Stats(); st.Replayed != 4 || st.Gaps != 2 {
		t.Fatalf("stats %+v", st)
	}
}

// TestKVEventsWire checks the raw messages with a plain ZeroMQ SUB socket:
// three frames (topic, 8-byte big-endian seq, payload) and msgspec's
// shapes: the batch an array [float64 ts, events, dp rank], each event an
// array in the array form and a map with "type" first in the map form.
func TestKVEventsWire(t *testing.T) {
	for _, form := range []fakeengine.EventForm{fakeengine.EventFormArray, fakeengine.EventFormMap} {
		t.Run(string(form), func(t *testing.T) {
			e := newEngine(t, fakeengine.Config{MaxModelLen: 64, BlockSize: 4, CacheBlocks: 16, HashBytes: form == fakeengine.EventFormMap,
				KVEvents: &fakeengine.KVEventsConfig{Endpoint: "tcp://127.0.0.1:0", Topic: "t", EventForm: form, DataParallelRank: 2}})
			ctx, cancel := context.WithCancel(context.Background())
			sub := zmq4.NewSub(ctx)
			defer func() {
				cancel()
				_ = sub.Close()
			}()
			if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
				t.Fatal(err)
			}
			if err := sub.Dial(e.KVEventsAddr()); err != nil {
				t.Fatal(err)
			}
			waitSubscribed(t, e)
			post(t, e, "/v1/completions", map[string]any{"prompt": tokenPrompt(1, 20)})  // 7 blocks
			post(t, e, "/v1/completions", map[string]any{"prompt": tokenPrompt(50, 40)}) // 12 more: evicts 3
			if err := e.Reset(); err != nil {
				t.Fatal(err)
			}
			wantTags := [][]string{{"BlockStored"}, {"BlockRemoved", "BlockRemoved", "BlockRemoved", "BlockStored"},
				{"AllBlocksCleared"}}
			for seq, tags := range wantTags {
				msg, err := sub.Recv()
				if err != nil {
					t.Fatal(err)
				}
				f := msg.Frames
				if len(f) != 3 || string(f[0]) != "t" || len(f[1]) != 8 || binary.BigEndian.Uint64(f[1]) != uint64(seq) {
					t.Fatalf("frames %q", f)
				}
				checkBatch(t, f[2], form, tags)
			}
		})
	}
}

// checkBatch checks a payload's msgpack shape.
func checkBatch(t *testing.T, payload []byte, form fakeengine.EventForm, tags []string) {
	t.Helper()
	if payload[0] != 0x93 || payload[1] != msgpcode.Double { // fixarray of 3, float64 ts
		t.Fatalf("batch header % x", payload[:2])
	}
	var batch []any
	if err := msgpack.Unmarshal(payload, &batch); err != nil {
		t.Fatal(err)
	}
	if rank, ok := batch[2].(int8); !ok || rank != 2 {
		t.Fatalf("data_parallel_rank %v (%T)", batch[2], batch[2])
	}
	evs := batch[1].([]any)
	if len(evs) != len(tags) {
		t.Fatalf("%d events, want %v", len(evs), tags)
	}
	fields := map[string][]string{
		"BlockStored":      {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"},
		"BlockRemoved":     {"type", "block_hashes", "medium"},
		"AllBlocksCleared": {"type"},
	}
	// The map form's key order, read from the raw payload: the tag first.
	dec := msgpack.NewDecoder(bytes.NewReader(payload))
	_, _ = dec.DecodeArrayLen()
	_, _ = dec.DecodeFloat64()
	_, _ = dec.DecodeArrayLen()
	for i, ev := range evs {
		want := fields[tags[i]]
		if form == fakeengine.EventFormArray {
			a, ok := ev.([]any)
			if !ok || len(a) != len(want) || a[0] != tags[i] {
				t.Fatalf("event %d: %v, want an array of %d starting with %s", i, ev, len(want), tags[i])
			}
			_ = dec.Skip()
			continue
		}
		n, err := dec.DecodeMapLen()
		if err != nil || n != len(want) {
			t.Fatalf("event %d: map of %d (%v), want %v", i, n, err, want)
		}
		for _, k := range want {
			key, err := dec.DecodeString()
			if err != nil || key != k {
				t.Fatalf("event %d: key %q (%v), want %q", i, key, err, k)
			}
			if k == "type" {
				if tag, _ := dec.DecodeString(); tag != tags[i] {
					t.Fatalf("event %d: type %q, want %s", i, tag, tags[i])
				}
				continue
			}
			if k == "block_hashes" {
				hs, err := dec.DecodeSlice()
				if err != nil || len(hs) == 0 {
					t.Fatalf("event %d: block_hashes %v %v", i, hs, err)
				}
				if b, ok := hs[0].([]byte); !ok || len(b) != 32 {
					t.Fatalf("event %d: hash %v (%T), want 32 bytes", i, hs[0], hs[0])
				}
				continue
			}
			_ = dec.Skip()
		}
	}
}
