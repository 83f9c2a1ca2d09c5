package messages

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func ptrTo[T any](v T) *T { return &v }

// Fixtures. Each call returns a fresh, fully populated value, so that a test
// can marshal one copy (Marshal sets V) and compare with another.

func sampleRequest() *Request {
	return &Request{
		RequestID:      "req-0001",
		SessionID:      "sess-alpha",
		Model:          "meta-llama/Llama-3.1-8B-Instruct",
		FrontendID:     "fe-0",
		ArrivalUnixMs:  1_700_000_000_123,
		DeadlineUnixMs: 1_700_000_030_123,
		PromptTokenIDs: TokenIDs{0, 1, 128000, 42, math.MaxUint32},
		SamplingParams: SamplingParams{
			MaxTokens:   128,
			MinTokens:   2,
			Temperature: 0.7,
			TopP:        0.95,
			Seed:        ptrTo(int64(-7)),
			Stop:        []string{"\n\n", "</s>"},
			IgnoreEOS:   true,
			ExtraArgs:   Args{ExtraArgSessionID: "sess-alpha", "priority": int64(3)},
		},
		Stream: true,
		KVTransferParams: Args{
			"do_remote_prefill": true,
			"remote_block_ids":  []any{int64(1), int64(2), uint64(math.MaxUint64)},
			"remote_engine":     map[string]any{"host": "10.0.0.7", "port": int64(5557), "weight": 0.5},
			"opaque":            []byte{0xff, 0x00, 0x80},
			"none":              nil,
		},
		Endpoint: EndpointChat,
		AgainOf:  "req-0000",
	}
}

func sampleReqMeta() *ReqMeta {
	return &ReqMeta{
		ReqID:       "req-0001",
		SessionID:   "sess-alpha",
		Model:       "meta-llama/Llama-3.1-8B-Instruct",
		Group:       "g0",
		TokenLen:    10,
		TokenIDs:    TokenIDs{10, 11, 12, 13, 14, 15, 16, 17, 18, math.MaxUint32},
		BlockSize:   4,
		BlockHashes: BlockHashes{0x0123456789abcdef, math.MaxUint64},
		LoadSpec: &LoadSpec{
			VLLMCachedTokens:   4,
			KVPoolCachedTokens: 8,
			CanLoad:            true,
		},
		CanSave:         true,
		SaveFromBlock:   1,
		IsLastChunk:     true,
		NumPromptTokens: 10,
		SamplingParams: SamplingParams{
			MaxTokens:   64,
			Temperature: 1,
			TopP:        1,
			Seed:        ptrTo(int64(42)),
			ExtraArgs:   Args{ExtraArgSessionID: "sess-alpha", "tenant": "acme"},
		},
		FrontendID:     "fe-0",
		ResultSubject:  "kvbus.done.sched-0",
		Attempt:        2,
		DeadlineUnixMs: 1_700_000_030_123,
	}
}

func sampleRankResult() *RankResult {
	return &RankResult{
		ReqID:            "req-0001",
		Group:            "g0",
		TPRank:           2,
		EPRank:           2,
		Attempt:          1,
		LoadedTokens:     512,
		StoredBlocks:     7,
		SkippedBlocks:    3,
		FailedBlocks:     1,
		LoadUs:           1234,
		StoreUs:          5678,
		CompletionTokens: 64,
		Error:            "store: 1 block failed",
	}
}

func sampleOutputFinal() *Output {
	return &Output{
		ReqID:        "req-0001",
		Index:        7,
		Text:         "Hello, wörld",
		TokenIDs:     TokenIDs{9906, 11, 1917},
		FinishReason: "stop",
		Usage:        &Usage{PromptTokens: 10, CompletionTokens: 3, CachedTokens: 8},
	}
}

func sampleOutputError() *Output {
	return &Output{
		ReqID: "req-0002",
		Index: 0,
		Usage: &Usage{PromptTokens: 10},
		Error: &OutputError{Code: "no_ready_group", Message: "no worker group is ready"},
	}
}

func sampleKVEventBatch() *KVEventBatch {
	return &KVEventBatch{
		TS:    1_700_000_000.25,
		Seq:   math.MaxUint64 - 1,
		Group: "g0",
		Rank:  3,
		Events: []KVEvent{
			{
				Type:            EventBlockStored,
				BlockHashes:     BlockHashes{1, 2},
				ParentBlockHash: ptrTo(uint64(0xfeedfacecafebeef)),
				TokenIDs:        TokenIDs{1, 2, 3, 4, 5, 6, 7, 8},
				BlockSize:       4,
				Medium:          "cpu",
			},
			{Type: EventBlockStored, BlockHashes: BlockHashes{3}, ParentBlockHash: ptrTo(uint64(0)), TokenIDs: TokenIDs{9, 10, 11, 12}, BlockSize: 4},
			{Type: EventBlockRemoved, BlockHashes: BlockHashes{1, 2, 3}, Medium: "cpu"},
			{Type: EventAllBlocksCleared},
		},
	}
}

func sampleHeartbeat() *Heartbeat {
	return &Heartbeat{
		Group:          "g0",
		TPRank:         3,
		EPRank:         3,
		WorldSize:      4,
		Model:          "meta-llama/Llama-3.1-8B-Instruct",
		CapacityBlocks: 1 << 20,
		UsedBlocks:     12345,
		QueueDepth:     2,
		StartedUnixMs:  1_700_000_000_000,
	}
}

func sampleAbort() *Abort {
	return &Abort{ReqID: "req-0001", Reason: "client disconnected"}
}

// codecCase ties a fixture to its decoder.
type codecCase struct {
	name   string
	mk     func() Message
	decode func([]byte) (Message, error)
}

func decodeAs[T Message](f func([]byte) (T, error)) func([]byte) (Message, error) {
	return func(b []byte) (Message, error) { return f(b) }
}

var (
	decRequest      = decodeAs(DecodeRequest)
	decReqMeta      = decodeAs(DecodeReqMeta)
	decRankResult   = decodeAs(DecodeRankResult)
	decOutput       = decodeAs(DecodeOutput)
	decKVEventBatch = decodeAs(DecodeKVEventBatch)
	decHeartbeat    = decodeAs(DecodeHeartbeat)
	decAbort        = decodeAs(DecodeAbort)
)

// allDecoders lists every decode function, for tests that must hold for all.
var allDecoders = []struct {
	name   string
	decode func([]byte) (Message, error)
}{
	{"Request", decRequest},
	{"ReqMeta", decReqMeta},
	{"RankResult", decRankResult},
	{"Output", decOutput},
	{"KVEventBatch", decKVEventBatch},
	{"Heartbeat", decHeartbeat},
	{"Abort", decAbort},
}

func codecCases() []codecCase {
	return []codecCase{
		{"Request", func() Message { return sampleRequest() }, decRequest},
		{"Request/minimal", func() Message {
			return &Request{RequestID: "r", FrontendID: "f", Endpoint: EndpointCompletions}
		}, decRequest},
		{"Request/empty-tokens", func() Message {
			return &Request{RequestID: "r", FrontendID: "f", PromptTokenIDs: TokenIDs{}}
		}, decRequest},
		{"ReqMeta", func() Message { return sampleReqMeta() }, decReqMeta},
		{"ReqMeta/no-load-spec", func() Message {
			m := sampleReqMeta()
			m.LoadSpec = nil
			m.SessionID = ""
			m.SamplingParams.ExtraArgs = nil
			return m
		}, decReqMeta},
		{"RankResult", func() Message { return sampleRankResult() }, decRankResult},
		{"Output/final", func() Message { return sampleOutputFinal() }, decOutput},
		{"Output/error", func() Message { return sampleOutputError() }, decOutput},
		{"Output/delta", func() Message {
			return &Output{ReqID: "r", Index: 1, Text: " world", TokenIDs: TokenIDs{1917}}
		}, decOutput},
		{"KVEventBatch", func() Message { return sampleKVEventBatch() }, decKVEventBatch},
		{"KVEventBatch/no-events", func() Message {
			return &KVEventBatch{Seq: 1, Group: "g1", Rank: 0, Events: []KVEvent{}}
		}, decKVEventBatch},
		{"Heartbeat", func() Message { return sampleHeartbeat() }, decHeartbeat},
		{"Abort", func() Message { return sampleAbort() }, decAbort},
		{"Abort/no-reason", func() Message { return &Abort{ReqID: "r"} }, decAbort},
		{"Resend", func() Message { return &Resend{ReqID: "r", Attempt: 1, FromIndex: 7} }, decodeAs(DecodeResend)},
		{"Resend/from 0", func() Message { return &Resend{ReqID: "r"} }, decodeAs(DecodeResend)},
		{"ResendReply", func() Message { return &ResendReply{Resent: 3, Done: true} }, decodeAs(DecodeResendReply)},
		{"ResendReply/error", func() Message { return &ResendReply{Error: "no longer kept"} }, decodeAs(DecodeResendReply)},
		{"ResendReply/a scheduler's", func() Message { return &ResendReply{Group: "g0", Error: "ask g0"} }, decodeAs(DecodeResendReply)},
	}
}

func TestRoundTrip(t *testing.T) {
	for _, tc := range codecCases() {
		t.Run(tc.name, func(t *testing.T) {
			in := tc.mk()
			want := tc.mk()
			want.setVersion()
			data, err := Marshal(in)
			if err != nil {
				t.Fatalf("Marshal: %v", err)
			}
			if !reflect.DeepEqual(in, want) {
				t.Fatalf("Marshal changed its input beyond the version:\n got %#v\nwant %#v", in, want)
			}
			got, err := tc.decode(data)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("round trip mismatch:\n got %#v\nwant %#v", got, want)
			}
			// Encoding is deterministic: the decoded value encodes to the
			// same bytes.
			again, err := Marshal(got)
			if err != nil {
				t.Fatalf("Marshal again: %v", err)
			}
			if !bytes.Equal(again, data) {
				t.Errorf("re-encoding differs:\n got %x\nwant %x", again, data)
			}
		})
	}
}

func TestMarshalSetsVersion(t *testing.T) {
	for _, tc := range codecCases() {
		t.Run(tc.name, func(t *testing.T) {
			in := tc.mk()
			reflect.ValueOf(in).Elem().FieldByName("V").SetInt(99)
			data, err := Marshal(in)
			if err != nil {
				t.Fatal(err)
			}
			raw := rawMap(t, data)
			if v, ok := asInt(raw["v"]); !ok || v != Version {
				t.Errorf("v = %#v, want %d", raw["v"], Version)
			}
		})
	}
}

// rawMap decodes data with plain msgpack, the way a foreign consumer sees it.
func rawMap(t testing.TB, data []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := msgpack.Unmarshal(data, &m); err != nil {
		t.Fatalf("msgpack.Unmarshal: %v", err)
	}
	return m
}

func asInt(v any) (int64, bool) {
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return rv.Int(), true
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return int64(rv.Uint()), true
	}
	return 0, false
}

func mustMarshal(t testing.TB, m Message) []byte {
	t.Helper()
	b, err := Marshal(m)
	if err != nil {
		t.Fatalf("Marshal: %v", err)
	}
	return b
}

func mustMsgpack(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatalf("msgpack.Marshal: %v", err)
	}
	return b
}

func TestPackedAsBin(t *testing.T) {
	req := sampleRequest()
	raw := rawMap(t, mustMarshal(t, req))
	b, ok := raw["prompt_token_ids"].([]byte)
	if !ok {
		t.Fatalf("prompt_token_ids is %T, want []byte (msgpack bin)", raw["prompt_token_ids"])
	}
	if len(b) != 4*len(req.PromptTokenIDs) {
		t.Fatalf("prompt_token_ids: %d bytes, want %d", len(b), 4*len(req.PromptTokenIDs))
	}
	for i, id := range req.PromptTokenIDs {
		if got := binary.LittleEndian.Uint32(b[4*i:]); got != id {
			t.Errorf("token %d: %d, want %d (little-endian u32)", i, got, id)
		}
	}

	meta := sampleReqMeta()
	raw = rawMap(t, mustMarshal(t, meta))
	if b, ok := raw["token_ids"].([]byte); !ok || len(b) != 4*len(meta.TokenIDs) {
		t.Errorf("token_ids = %T len %d, want []byte len %d", raw["token_ids"], len(b), 4*len(meta.TokenIDs))
	}
	h, ok := raw["block_hashes"].([]byte)
	if !ok || len(h) != 8*len(meta.BlockHashes) {
		t.Fatalf("block_hashes = %T len %d, want []byte len %d", raw["block_hashes"], len(h), 8*len(meta.BlockHashes))
	}
	for i, v := range meta.BlockHashes {
		if got := binary.LittleEndian.Uint64(h[8*i:]); got != v {
			t.Errorf("hash %d: %#x, want %#x (little-endian u64)", i, got, v)
		}
	}

	batch := sampleKVEventBatch()
	raw = rawMap(t, mustMarshal(t, batch))
	events := raw["events"].([]any)
	ev0 := events[0].(map[string]any)
	if b, ok := ev0["block_hashes"].([]byte); !ok || len(b) != 8*len(batch.Events[0].BlockHashes) {
		t.Errorf("events[0].block_hashes = %T len %d", ev0["block_hashes"], len(b))
	}
	if b, ok := ev0["token_ids"].([]byte); !ok || len(b) != 4*len(batch.Events[0].TokenIDs) {
		t.Errorf("events[0].token_ids = %T len %d", ev0["token_ids"], len(b))
	}

	out := sampleOutputFinal()
	raw = rawMap(t, mustMarshal(t, out))
	if b, ok := raw["token_ids"].([]byte); !ok || len(b) != 4*len(out.TokenIDs) {
		t.Errorf("output token_ids = %T len %d", raw["token_ids"], len(b))
	}
}

func TestPackedAcceptsArrays(t *testing.T) {
	data := mustMsgpack(t, map[string]any{
		"request_id":       "r",
		"frontend_id":      "f",
		"prompt_token_ids": []any{0, 1, 300, 70000, int64(math.MaxUint32)},
	})
	req, err := DecodeRequest(data)
	if err != nil {
		t.Fatal(err)
	}
	if want := (TokenIDs{0, 1, 300, 70000, math.MaxUint32}); !reflect.DeepEqual(req.PromptTokenIDs, want) {
		t.Errorf("prompt_token_ids = %v, want %v", req.PromptTokenIDs, want)
	}

	data = mustMsgpack(t, map[string]any{
		"req_id":         "r",
		"group":          "g0",
		"token_len":      8,
		"token_ids":      []uint32{1, 2, 3, 4, 5, 6, 7, 8},
		"block_size":     4,
		"block_hashes":   []any{uint64(math.MaxUint64), 7},
		"frontend_id":    "f",
		"result_subject": "kvbus.done.s",
	})
	meta, err := DecodeReqMeta(data)
	if err != nil {
		t.Fatal(err)
	}
	if want := (TokenIDs{1, 2, 3, 4, 5, 6, 7, 8}); !reflect.DeepEqual(meta.TokenIDs, want) {
		t.Errorf("token_ids = %v, want %v", meta.TokenIDs, want)
	}
	if want := (BlockHashes{math.MaxUint64, 7}); !reflect.DeepEqual(meta.BlockHashes, want) {
		t.Errorf("block_hashes = %v, want %v", meta.BlockHashes, want)
	}

	// Python's hash() gives signed 64-bit block hashes; they are taken as
	// their two's complement.
	data = mustMsgpack(t, map[string]any{
		"events": []any{map[string]any{"type": EventBlockRemoved, "block_hashes": []int64{-1, math.MinInt64}}},
	})
	batch, err := DecodeKVEventBatch(data)
	if err != nil {
		t.Fatal(err)
	}
	if want := (BlockHashes{math.MaxUint64, 1 << 63}); !reflect.DeepEqual(batch.Events[0].BlockHashes, want) {
		t.Errorf("block_hashes = %v, want %v", batch.Events[0].BlockHashes, want)
	}

	// An empty array is an empty, non-nil list.
	data = mustMsgpack(t, map[string]any{"request_id": "r", "frontend_id": "f", "prompt_token_ids": []any{}})
	req, err = DecodeRequest(data)
	if err != nil {
		t.Fatal(err)
	}
	if req.PromptTokenIDs == nil || len(req.PromptTokenIDs) != 0 {
		t.Errorf("prompt_token_ids = %#v, want empty non-nil", req.PromptTokenIDs)
	}
}

func TestPackedNil(t *testing.T) {
	data := mustMarshal(t, &Request{RequestID: "r", FrontendID: "f"})
	raw := rawMap(t, data)
	if v, ok := raw["prompt_token_ids"]; !ok || v != nil {
		t.Errorf("raw prompt_token_ids = %#v (present %v), want msgpack nil", v, ok)
	}
	req, err := DecodeRequest(data)
	if err != nil {
		t.Fatal(err)
	}
	if req.PromptTokenIDs != nil {
		t.Errorf("prompt_token_ids = %#v, want nil", req.PromptTokenIDs)
	}

	meta := sampleReqMeta()
	meta.TokenIDs, meta.TokenLen, meta.BlockHashes, meta.SaveFromBlock, meta.LoadSpec = nil, 0, nil, 0, nil
	got, err := DecodeReqMeta(mustMarshal(t, meta))
	if err != nil {
		t.Fatal(err)
	}
	if got.TokenIDs != nil || got.BlockHashes != nil || got.LoadSpec != nil {
		t.Errorf("token_ids %#v, block_hashes %#v, load_spec %#v: want all nil", got.TokenIDs, got.BlockHashes, got.LoadSpec)
	}

	// An explicit msgpack nil also decodes to nil.
	data = mustMsgpack(t, map[string]any{"request_id": "r", "frontend_id": "f", "prompt_token_ids": nil})
	if req, err := DecodeRequest(data); err != nil || req.PromptTokenIDs != nil {
		t.Errorf("explicit nil: %#v, %v", req.PromptTokenIDs, err)
	}
}

func TestPackedMalformed(t *testing.T) {
	tests := []struct {
		name   string
		fields map[string]any
		decode func([]byte) (Message, error)
	}{
		{"token bin not multiple of 4", map[string]any{"request_id": "r", "frontend_id": "f", "prompt_token_ids": []byte{1, 2, 3, 4, 5, 6}}, decRequest},
		{"token bin of 1 byte", map[string]any{"req_id": "r", "index": 0, "token_ids": []byte{1}}, decOutput},
		{"hash bin not multiple of 8", map[string]any{"events": []any{map[string]any{"type": EventBlockRemoved, "block_hashes": make([]byte, 12)}}}, decKVEventBatch},
		{"token ids as string", map[string]any{"request_id": "r", "frontend_id": "f", "prompt_token_ids": "1,2,3"}, decRequest},
		{"token ids as map", map[string]any{"request_id": "r", "frontend_id": "f", "prompt_token_ids": map[string]any{"0": 1}}, decRequest},
		{"token id array with string", map[string]any{"request_id": "r", "frontend_id": "f", "prompt_token_ids": []any{1, "two"}}, decRequest},
		{"token id above u32", map[string]any{"request_id": "r", "frontend_id": "f", "prompt_token_ids": []any{1, uint64(1) << 32}}, decRequest},
		{"negative token id", map[string]any{"request_id": "r", "frontend_id": "f", "prompt_token_ids": []any{-1}}, decRequest},
		{"hash array with float", map[string]any{"events": []any{map[string]any{"type": EventBlockRemoved, "block_hashes": []any{1.5}}}}, decKVEventBatch},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.decode(mustMsgpack(t, tc.fields))
			if !errors.Is(err, ErrMalformed) {
				t.Errorf("err = %v, want ErrMalformed", err)
			}
		})
	}
}

func TestUnknownKeysIgnored(t *testing.T) {
	future := []any{1, "x", map[string]any{"deep": []any{nil, true, 2.5}}}
	tests := []struct {
		name   string
		fields map[string]any
		decode func([]byte) (Message, error)
		want   Message
	}{
		{
			name: "Request",
			fields: map[string]any{
				"v":                2,
				"request_id":       "r1",
				"session_id":       "s1",
				"model":            "m",
				"frontend_id":      "fe",
				"arrival_unix_ms":  5,
				"prompt_token_ids": []byte{1, 0, 0, 0, 2, 0, 0, 0},
				"sampling_params": map[string]any{
					"max_tokens":     16,
					"extra_args":     map[string]any{"session_id": "s1"},
					"repetition_pen": 1.1,
				},
				"endpoint":     "chat",
				"future_field": future,
				"future_map":   map[string]any{"a": future},
				"future_bin":   []byte{1, 2, 3},
			},
			decode: decRequest,
			want: &Request{
				V: 2, RequestID: "r1", SessionID: "s1", Model: "m", FrontendID: "fe", ArrivalUnixMs: 5,
				PromptTokenIDs: TokenIDs{1, 2},
				SamplingParams: SamplingParams{MaxTokens: 16, ExtraArgs: Args{"session_id": "s1"}},
				Endpoint:       "chat",
			},
		},
		{
			name: "ReqMeta",
			fields: map[string]any{
				"v": 1, "req_id": "r1", "group": "g0", "token_len": 4, "token_ids": []int{5, 6, 7, 8},
				"block_size": 4, "block_hashes": []uint64{99},
				"load_spec":      map[string]any{"vllm_cached_tokens": 0, "kvpool_cached_tokens": 4, "can_load": true, "future": future},
				"frontend_id":    "fe",
				"result_subject": "kvbus.done.s",
				"future_field":   future,
			},
			decode: decReqMeta,
			want: &ReqMeta{
				V: 1, ReqID: "r1", Group: "g0", TokenLen: 4, TokenIDs: TokenIDs{5, 6, 7, 8}, BlockSize: 4,
				BlockHashes: BlockHashes{99}, LoadSpec: &LoadSpec{KVPoolCachedTokens: 4, CanLoad: true},
				FrontendID: "fe", ResultSubject: "kvbus.done.s",
			},
		},
		{
			name: "KVEventBatch",
			fields: map[string]any{
				"v": 1, "seq": 3, "group": "g0", "rank": 1, "future_field": future,
				"events": []any{
					map[string]any{"type": EventAllBlocksCleared, "lora_id": nil, "future": future},
				},
			},
			decode: decKVEventBatch,
			want:   &KVEventBatch{V: 1, Seq: 3, Group: "g0", Rank: 1, Events: []KVEvent{{Type: EventAllBlocksCleared}}},
		},
		{
			name:   "Output",
			fields: map[string]any{"req_id": "r", "index": 2, "text": "hi", "logprobs": future, "usage": map[string]any{"prompt_tokens": 1, "x": future}},
			decode: decOutput,
			want:   &Output{ReqID: "r", Index: 2, Text: "hi", Usage: &Usage{PromptTokens: 1}},
		},
		{
			name:   "Abort",
			fields: map[string]any{"req_id": "r", "future_field": future},
			decode: decAbort,
			want:   &Abort{ReqID: "r"},
		},
		{
			name:   "Heartbeat",
			fields: map[string]any{"group": "g0", "world_size": 1, "gpu": map[string]any{"name": "none"}},
			decode: decHeartbeat,
			want:   &Heartbeat{Group: "g0", WorldSize: 1},
		},
		{
			name:   "RankResult",
			fields: map[string]any{"req_id": "r", "tp_rank": 1, "future_field": future},
			decode: decRankResult,
			want:   &RankResult{ReqID: "r", TPRank: 1},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.decode(mustMsgpack(t, tc.fields))
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got  %#v\nwant %#v", got, tc.want)
			}
		})
	}
}

func TestValidation(t *testing.T) {
	tests := []struct {
		name   string
		msg    Message
		decode func([]byte) (Message, error)
	}{
		{"Request/no request_id", func() Message { m := sampleRequest(); m.RequestID = ""; return m }(), decRequest},
		{"Request/no frontend_id", func() Message { m := sampleRequest(); m.FrontendID = ""; return m }(), decRequest},
		{"Request/frontend_id not a token", func() Message { m := sampleRequest(); m.FrontendID = "fe.0"; return m }(), decRequest},
		{"Request/negative max_tokens", func() Message { m := sampleRequest(); m.SamplingParams.MaxTokens = -1; return m }(), decRequest},
		// The scheduler copies it into the ReqMeta, which every rank refuses.
		{"Request/unknown endpoint", func() Message { m := sampleRequest(); m.Endpoint = "embeddings"; return m }(), decRequest},
		// A session id the frontend would refuse (too long, a control
		// character) is refused from any other publisher too.
		{"Request/session_id too long", func() Message { m := sampleRequest(); m.SessionID = strings.Repeat("s", MaxSessionIDBytes+1); return m }(), decRequest},
		{"Request/extra_args session_id with a control character", func() Message {
			m := sampleRequest()
			m.SamplingParams.ExtraArgs = Args{ExtraArgSessionID: "a\nb"}
			return m
		}(), decRequest},
		{"Request/cache_salt too long", func() Message { m := sampleRequest(); m.CacheSalt = strings.Repeat("s", MaxCacheSaltBytes+1); return m }(), decRequest},
		{"Request/lora_name too long", func() Message { m := sampleRequest(); m.LoRAName = strings.Repeat("l", MaxLoRANameBytes+1); return m }(), decRequest},
		{"ReqMeta/no req_id", func() Message { m := sampleReqMeta(); m.ReqID = ""; return m }(), decReqMeta},
		{"ReqMeta/bad group", func() Message { m := sampleReqMeta(); m.Group = "g.0"; return m }(), decReqMeta},
		{"ReqMeta/no group", func() Message { m := sampleReqMeta(); m.Group = ""; return m }(), decReqMeta},
		{"ReqMeta/negative attempt", func() Message { m := sampleReqMeta(); m.Attempt = -1; return m }(), decReqMeta},
		{"ReqMeta/zero block_size", func() Message { m := sampleReqMeta(); m.BlockSize = 0; return m }(), decReqMeta},
		{"ReqMeta/token_len mismatch", func() Message { m := sampleReqMeta(); m.TokenLen++; return m }(), decReqMeta},
		{"ReqMeta/too many block hashes", func() Message {
			m := sampleReqMeta()
			m.BlockHashes = append(m.BlockHashes, 3)
			return m
		}(), decReqMeta},
		{"ReqMeta/save_from_block too big", func() Message { m := sampleReqMeta(); m.SaveFromBlock = 3; return m }(), decReqMeta},
		{"ReqMeta/negative save_from_block", func() Message { m := sampleReqMeta(); m.SaveFromBlock = -1; return m }(), decReqMeta},
		{"ReqMeta/kvpool_cached_tokens above token_len", func() Message {
			m := sampleReqMeta()
			m.LoadSpec.KVPoolCachedTokens = m.TokenLen + 1
			return m
		}(), decReqMeta},
		// A rank loads the blocks of its block hashes, but counts every
		// kvpool_cached_tokens as loaded in its queue and prefill counters.
		{"ReqMeta/kvpool_cached_tokens beyond block_hashes", func() Message {
			m := sampleReqMeta()
			m.BlockHashes, m.SaveFromBlock = m.BlockHashes[:1], 1
			return m
		}(), decReqMeta},
		{"ReqMeta/negative kvpool_cached_tokens", func() Message {
			m := sampleReqMeta()
			m.LoadSpec.KVPoolCachedTokens = -1
			return m
		}(), decReqMeta},
		{"ReqMeta/frontend_id not a token", func() Message { m := sampleReqMeta(); m.FrontendID = "a>b"; return m }(), decReqMeta},
		{"ReqMeta/no result_subject", func() Message { m := sampleReqMeta(); m.ResultSubject = ""; return m }(), decReqMeta},
		{"RankResult/no req_id", &RankResult{Group: "g0"}, decRankResult},
		// A scheduler adds these to its counters: a negative one panicked
		// its result handler.
		{"RankResult/remote_tokens above loaded_tokens", &RankResult{ReqID: "r", RemoteTokens: 16}, decRankResult},
		{"RankResult/negative loaded_tokens", &RankResult{ReqID: "r", LoadedTokens: -16}, decRankResult},
		{"RankResult/negative completion_tokens", &RankResult{ReqID: "r", CompletionTokens: -1}, decRankResult},
		{"RankResult/negative tp_rank", &RankResult{ReqID: "r", TPRank: -1}, decRankResult},
		{"Output/no req_id", &Output{Text: "x"}, decOutput},
		// The frontend orders chunks by index and follows the newest attempt.
		{"Output/negative index", &Output{ReqID: "r", Index: -1, Text: "x"}, decOutput},
		{"Output/negative attempt", &Output{ReqID: "r", Attempt: -2, Text: "x"}, decOutput},
		// A frontend adds these to its Prometheus counters: a negative one
		// panicked its HTTP handler, and the client's connection was cut.
		{"Output/negative prompt_tokens", &Output{ReqID: "r", FinishReason: "stop", Usage: &Usage{PromptTokens: -1}}, decOutput},
		{"Output/negative completion_tokens", &Output{ReqID: "r", FinishReason: "stop", Usage: &Usage{CompletionTokens: -1}}, decOutput},
		{"Output/negative cached_tokens", &Output{ReqID: "r", FinishReason: "stop", Usage: &Usage{CachedTokens: -16}}, decOutput},
		{"Output/negative remote_cached_tokens", &Output{ReqID: "r", FinishReason: "stop", Usage: &Usage{RemoteCachedTokens: -16}}, decOutput},
		{"KVEventBatch/unknown event type", func() Message {
			m := sampleKVEventBatch()
			m.Events = append(m.Events, KVEvent{Type: "BlockUpdated"})
			return m
		}(), decKVEventBatch},
		{"KVEventBatch/empty event type", &KVEventBatch{Group: "g0", Events: []KVEvent{{}}}, decKVEventBatch},
		// A receiver allocates by the chunk count: 1<<62 made a scheduler's
		// resync panic.
		{"KVEventBatch/dump_chunks above MaxDumpChunks", &KVEventBatch{Group: "g0", DumpChunks: 1 << 62}, decKVEventBatch},
		{"KVEventBatch/dump_chunk not below dump_chunks", &KVEventBatch{Group: "g0", DumpChunk: 2, DumpChunks: 2}, decKVEventBatch},
		{"Heartbeat/bad group", func() Message { m := sampleHeartbeat(); m.Group = "g 0"; return m }(), decHeartbeat},
		{"Heartbeat/zero world_size", func() Message { m := sampleHeartbeat(); m.WorldSize, m.TPRank = 0, 0; return m }(), decHeartbeat},
		{"Heartbeat/tp_rank = world_size", func() Message { m := sampleHeartbeat(); m.TPRank = m.WorldSize; return m }(), decHeartbeat},
		{"Heartbeat/negative tp_rank", func() Message { m := sampleHeartbeat(); m.TPRank = -1; return m }(), decHeartbeat},
		{"Abort/no req_id", &Abort{Reason: "x"}, decAbort},
		{"Resend/no req_id", &Resend{FromIndex: 1}, decodeAs(DecodeResend)},
		{"Resend/negative from_index", &Resend{ReqID: "r", FromIndex: -1}, decodeAs(DecodeResend)},
		{"Resend/negative attempt", &Resend{ReqID: "r", Attempt: -1}, decodeAs(DecodeResend)},
		{"ResendReply/negative resent", &ResendReply{Resent: -1}, decodeAs(DecodeResendReply)},
		{"ResendReply/a group no subject can name", &ResendReply{Group: "g0.>"}, decodeAs(DecodeResendReply)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.decode(mustMarshal(t, tc.msg))
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("err = %v, want ErrInvalid", err)
			}
			if errors.Is(err, ErrMalformed) {
				t.Errorf("err = %v also wraps ErrMalformed", err)
			}
		})
	}
}

func TestTooLarge(t *testing.T) {
	big := make([]byte, MaxMessageBytes+1)
	for _, d := range allDecoders {
		t.Run(d.name, func(t *testing.T) {
			if _, err := d.decode(big); !errors.Is(err, ErrTooLarge) {
				t.Errorf("err = %v, want ErrTooLarge", err)
			}
		})
	}

	// A real message just over the limit: 2M+ token ids.
	req := &Request{RequestID: "r", FrontendID: "f", PromptTokenIDs: make(TokenIDs, MaxMessageBytes/4)}
	if _, err := DecodeRequest(mustMarshal(t, req)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversized request: err = %v, want ErrTooLarge", err)
	}
	// One just under the limit decodes.
	req.PromptTokenIDs = make(TokenIDs, MaxMessageBytes/4-64)
	if _, err := DecodeRequest(mustMarshal(t, req)); err != nil {
		t.Errorf("request just under the limit: %v", err)
	}
}

// nested returns a value nested depth levels deep, alternating maps and
// arrays, with a string at the bottom.
func nested(depth int) any {
	var v any = "bottom"
	for i := range depth {
		if i%2 == 0 {
			v = []any{v}
		} else {
			v = map[string]any{"k": v}
		}
	}
	return v
}

func TestDeepNesting(t *testing.T) {
	base := func() map[string]any {
		return map[string]any{"request_id": "r", "frontend_id": "f"}
	}
	tests := []struct {
		name   string
		fields map[string]any
		ok     bool
	}{
		{"extra_args 100 levels", func() map[string]any {
			m := base()
			m["sampling_params"] = map[string]any{"extra_args": map[string]any{"x": nested(100)}}
			return m
		}(), false},
		{"extra_args 20 levels (Args limit)", func() map[string]any {
			m := base()
			m["sampling_params"] = map[string]any{"extra_args": map[string]any{"x": nested(maxArgsDepth + 4)}}
			return m
		}(), false},
		{"extra_args at the Args limit", func() map[string]any {
			m := base()
			m["sampling_params"] = map[string]any{"extra_args": map[string]any{"x": nested(maxArgsDepth - 1)}}
			return m
		}(), true},
		{"kv_transfer_params 1000 levels", func() map[string]any {
			m := base()
			m["kv_transfer_params"] = map[string]any{"x": nested(1000)}
			return m
		}(), false},
		{"unknown key 1000 levels", func() map[string]any {
			m := base()
			m["future"] = nested(1000)
			return m
		}(), false},
		{"unknown key at the nesting limit", func() map[string]any {
			m := base()
			m["future"] = nested(maxNesting - 1) // the message map is level 1
			return m
		}(), true},
		{"unknown key one above the nesting limit", func() map[string]any {
			m := base()
			m["future"] = nested(maxNesting)
			return m
		}(), false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeRequest(mustMsgpack(t, tc.fields))
			switch {
			case tc.ok && err != nil:
				t.Errorf("err = %v, want nil", err)
			case !tc.ok && !errors.Is(err, ErrMalformed):
				t.Errorf("err = %v, want ErrMalformed", err)
			}
			// A producer's check agrees with the decoder on Args.
			for _, key := range []string{"kv_transfer_params", "sampling_params"} {
				args, ok := tc.fields[key].(map[string]any)
				if key == "sampling_params" && ok {
					args, ok = args["extra_args"].(map[string]any)
				}
				if ok && ArgsDepthOK(args) != tc.ok {
					t.Errorf("ArgsDepthOK(%s) = %v, want %v", key, !tc.ok, tc.ok)
				}
			}
		})
	}
}

// TestDeepUnknownKeyNoStackOverflow is the regression test for a fatal
// stack overflow: msgpack skips unknown keys recursively, so ~8M levels of
// nested arrays under an unknown key (a payload within MaxMessageBytes)
// exceeded Go's 1 GB stack limit, which recover cannot catch.
func TestDeepUnknownKeyNoStackOverflow(t *testing.T) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	for _, err := range []error{
		enc.EncodeMapLen(3),
		enc.EncodeString("request_id"), enc.EncodeString("r"),
		enc.EncodeString("frontend_id"), enc.EncodeString("f"),
		enc.EncodeString("future"),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	depth := MaxMessageBytes - buf.Len() - 1
	buf.Write(bytes.Repeat([]byte{0x91}, depth)) // fixarray of one element
	buf.WriteByte(0xc0)
	data := buf.Bytes()
	if len(data) > MaxMessageBytes {
		t.Fatalf("payload %d bytes, above the limit", len(data))
	}
	for _, d := range allDecoders {
		if _, err := d.decode(data); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err = %v, want ErrMalformed", d.name, err)
		}
	}
}

func TestGarbage(t *testing.T) {
	valid := mustMarshal(t, sampleRequest())
	inputs := map[string][]byte{
		"nil":               nil,
		"empty":             {},
		"reserved code":     {0xc1},
		"text":              []byte("hello, world"),
		"json":              []byte(`{"request_id":"r","frontend_id":"f"}`),
		"msgpack string":    mustMsgpack(t, "request"),
		"msgpack int":       {0x05},
		"array of strings":  mustMsgpack(t, []string{"a", "b"}),
		"truncated":         valid[:len(valid)-1],
		"truncated half":    valid[:len(valid)/2],
		"header only":       valid[:1],
		"map32 huge count":  {0xdf, 0xff, 0xff, 0xff, 0xff},
		"array32 huge":      {0xdd, 0x7f, 0xff, 0xff, 0xff, 0x00},
		"bin32 huge length": {0x81, 0xa1, 'x', 0xc6, 0x7f, 0xff, 0xff, 0xff},
		"int as key":        {0x81, 0x01, 0xa1, 'x'},
	}
	for name, in := range inputs {
		for _, d := range allDecoders {
			t.Run(name+"/"+d.name, func(t *testing.T) {
				if _, err := d.decode(in); !errors.Is(err, ErrMalformed) {
					t.Errorf("err = %v, want ErrMalformed", err)
				}
			})
		}
	}

	// Wrong types for known fields.
	wrong := []map[string]any{
		{"request_id": 5, "frontend_id": "f"},
		{"request_id": "r", "frontend_id": "f", "sampling_params": "hot"},
		{"request_id": "r", "frontend_id": "f", "sampling_params": map[string]any{"extra_args": []any{1}}},
		{"request_id": "r", "frontend_id": "f", "sampling_params": map[string]any{"extra_args": map[int]any{1: "x"}}},
		{"request_id": "r", "frontend_id": "f", "kv_transfer_params": "x"},
		{"request_id": "r", "frontend_id": "f", "stream": map[string]any{}},
		{"request_id": "r", "frontend_id": "f", "kv_transfer_params": map[string]any{"x": msgpack.RawMessage{0xd4, 0x42, 0x00}}},
	}
	for i, fields := range wrong {
		if _, err := DecodeRequest(mustMsgpack(t, fields)); !errors.Is(err, ErrMalformed) {
			t.Errorf("wrong types %d: err = %v, want ErrMalformed", i, err)
		}
	}
}

func TestSessionInExtraArgs(t *testing.T) {
	req := &Request{
		RequestID: "r", FrontendID: "f", SessionID: "conv-42 ünïcode",
		SamplingParams: SamplingParams{ExtraArgs: Args{ExtraArgSessionID: "conv-42 ünïcode", "other": int64(1)}},
	}
	got, err := DecodeRequest(mustMarshal(t, req))
	if err != nil {
		t.Fatal(err)
	}
	if s := got.SamplingParams.SessionFromExtraArgs(); s != "conv-42 ünïcode" {
		t.Errorf("SessionFromExtraArgs = %q", s)
	}
	if got.SessionID != got.SamplingParams.SessionFromExtraArgs() {
		t.Errorf("session_id %q != extra_args session_id %q", got.SessionID, got.SamplingParams.SessionFromExtraArgs())
	}

	for _, v := range []any{int64(42), true, nil, []any{"s"}, map[string]any{"id": "s"}, 1.5, []byte("s")} {
		req := &Request{RequestID: "r", FrontendID: "f", SamplingParams: SamplingParams{ExtraArgs: Args{ExtraArgSessionID: v}}}
		got, err := DecodeRequest(mustMarshal(t, req))
		if err != nil {
			t.Fatalf("%#v: %v", v, err)
		}
		if s := got.SamplingParams.SessionFromExtraArgs(); s != "" {
			t.Errorf("session_id %#v: SessionFromExtraArgs = %q, want \"\"", v, s)
		}
	}

	// No extra_args at all, and extra_args without the key.
	if s := (SamplingParams{}).SessionFromExtraArgs(); s != "" {
		t.Errorf("no extra_args: %q", s)
	}
	if s := (SamplingParams{ExtraArgs: Args{"x": "y"}}).SessionFromExtraArgs(); s != "" {
		t.Errorf("no session key: %q", s)
	}
	// The frontend puts the key only when there is a session: it is absent
	// on the wire when ExtraArgs is nil.
	raw := rawMap(t, mustMarshal(t, &Request{RequestID: "r", FrontendID: "f"}))
	sp := raw["sampling_params"].(map[string]any)
	if _, ok := sp["extra_args"]; ok {
		t.Errorf("extra_args present without a session: %#v", sp)
	}
}

// TestArgsValueTypes checks that Args keeps the documented value types
// across a round trip; in particular a bin stays []byte and is not turned
// into a (possibly non-UTF-8) string.
func TestArgsValueTypes(t *testing.T) {
	in := Args{
		"nil":    nil,
		"bool":   true,
		"int":    int64(-5),
		"uint":   uint64(math.MaxUint64),
		"float":  2.5,
		"string": "s",
		"bytes":  []byte{0xff, 0xfe, 0},
		"empty":  []byte{},
		"list":   []any{int64(1), "a", []byte{1}},
		"map":    map[string]any{"a": map[string]any{"b": []any{}}},
	}
	req := &Request{RequestID: "r", FrontendID: "f", KVTransferParams: in}
	got, err := DecodeRequest(mustMarshal(t, req))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got.KVTransferParams, in) {
		t.Errorf("got  %#v\nwant %#v", got.KVTransferParams, in)
	}
	raw := rawMap(t, mustMarshal(t, got))
	if b, ok := raw["kv_transfer_params"].(map[string]any)["bytes"].([]byte); !ok || !bytes.Equal(b, []byte{0xff, 0xfe, 0}) {
		t.Errorf("re-encoded bytes = %#v, want bin", raw["kv_transfer_params"].(map[string]any)["bytes"])
	}
}

func TestCheckNesting(t *testing.T) {
	valid := mustMarshal(t, sampleKVEventBatch())
	if err := checkNesting(valid, maxNesting); err != nil {
		t.Errorf("valid message: %v", err)
	}
	// Trailing bytes after the message are not read, as by msgpack.
	if err := checkNesting(append(bytes.Clone(valid), 0xc1), maxNesting); err != nil {
		t.Errorf("trailing byte: %v", err)
	}
	// Every strict prefix is truncated.
	for n := range len(valid) {
		if err := checkNesting(valid[:n], maxNesting); !errors.Is(err, ErrMalformed) {
			t.Fatalf("prefix of %d bytes: err = %v, want ErrMalformed", n, err)
		}
	}
	// Every scalar kind is walked over correctly.
	scalars := []any{
		nil, true, false, 0, 127, -32, -33, 200, 40000, 1 << 20, uint64(1) << 40, int8(-100), int16(-1000),
		int32(-100000), int64(math.MinInt64), float32(1.5), 2.5, "", "short", strings.Repeat("x", 40),
		strings.Repeat("y", 300), strings.Repeat("z", 70000), []byte{}, make([]byte, 300), make([]byte, 70000),
		make([]any, 20), make([]any, 70000), map[string]any{}, map[string]any{"a": 1},
	}
	m := map[string]any{}
	for i, s := range scalars {
		m[strings.Repeat("k", i+1)] = s
	}
	for _, v := range []any{scalars, m} {
		data := mustMsgpack(t, v)
		if err := checkNesting(data, maxNesting); err != nil {
			t.Errorf("%v", err)
		}
		if err := checkNesting(data[:len(data)-1], maxNesting); !errors.Is(err, ErrMalformed) {
			t.Errorf("truncated: err = %v", err)
		}
	}
	// Extensions: fixext 1, 2, 4, 8, 16 and ext 8, 16, 32.
	exts := [][]byte{
		{0xd4, 1, 0}, {0xd5, 1, 0, 0}, {0xd6, 1, 0, 0, 0, 0}, {0xd7, 1, 0, 0, 0, 0, 0, 0, 0, 0},
		append([]byte{0xd8, 1}, make([]byte, 16)...),
		{0xc7, 2, 1, 0, 0}, {0xc8, 0, 2, 1, 0, 0}, {0xc9, 0, 0, 0, 2, 1, 0, 0},
	}
	for _, e := range exts {
		data := append([]byte{0x92}, e...)
		data = append(data, 0xc0)
		if err := checkNesting(data, maxNesting); err != nil {
			t.Errorf("%x: %v", data, err)
		}
		if err := checkNesting(data[:len(data)-2], maxNesting); !errors.Is(err, ErrMalformed) {
			t.Errorf("%x truncated: err = %v", data, err)
		}
	}
	// Depth: maxDepth levels pass, one more fails.
	deep := func(n int) []byte { return append(bytes.Repeat([]byte{0x91}, n), 0xc0) }
	if err := checkNesting(deep(4), 4); err != nil {
		t.Errorf("depth 4 of 4: %v", err)
	}
	if err := checkNesting(deep(5), 4); !errors.Is(err, ErrMalformed) {
		t.Errorf("depth 5 of 4: err = %v", err)
	}
	// A declared element count larger than the payload is rejected before
	// anything is allocated for it.
	if err := checkNesting([]byte{0xdd, 0, 1, 0, 0, 1, 2, 3}, maxNesting); !errors.Is(err, ErrMalformed) {
		t.Errorf("array32 count above payload: err = %v", err)
	}
}

// TestPackedPortablePath runs the conversion used on big-endian hosts (here
// on a little-endian one) and checks it gives the same bytes and values as
// the in-memory copy.
func TestPackedPortablePath(t *testing.T) {
	tokens := benchTokens(3005)
	hashes := benchHashes(1539)
	encode := func(native bool) []byte {
		return appendPacked(appendPacked(nil, tokens, native), hashes, native)
	}
	portable, native := encode(false), encode(true)
	if !bytes.Equal(portable, native) {
		t.Fatal("portable encoding differs from the in-memory one")
	}
	for _, nativeDecode := range []bool{false, true} {
		gotT, rest, err := readPacked[uint32](portable, "token_ids", nativeDecode)
		if err != nil || !reflect.DeepEqual(gotT, []uint32(tokens)) {
			t.Fatalf("native=%v: token ids differ (%v)", nativeDecode, err)
		}
		gotH, rest, err := readPacked[uint64](rest, "block_hashes", nativeDecode)
		if err != nil || !reflect.DeepEqual(gotH, []uint64(hashes)) || len(rest) != 0 {
			t.Fatalf("native=%v: block hashes differ (%v, %d bytes left)", nativeDecode, err, len(rest))
		}
		if _, _, err := readPacked[uint32](portable[:1000], "token_ids", nativeDecode); !errors.Is(err, ErrMalformed) { // inside the token ids
			t.Errorf("native=%v: truncated: err = %v, want ErrMalformed", nativeDecode, err)
		}
	}
}

// TestReqMetaRemoteRuns: a LoadSpec's remote runs must lie in order within
// the blocks to load, each from a valid group.
func TestReqMetaRemoteRuns(t *testing.T) {
	tests := []struct {
		name string
		runs []RemoteRun
		ok   bool
	}{
		{"none", nil, true},
		{"one run", []RemoteRun{{Group: "g1", FromBlock: 2, Blocks: 3}}, true},
		{"two runs in order", []RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 2}, {Group: "g2", FromBlock: 2, Blocks: 3}}, true},
		{"past the blocks to load", []RemoteRun{{Group: "g1", FromBlock: 4, Blocks: 2}}, false},
		{"overlapping", []RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 3}, {Group: "g2", FromBlock: 2, Blocks: 1}}, false},
		{"empty run", []RemoteRun{{Group: "g1", FromBlock: 1, Blocks: 0}}, false},
		{"bad group", []RemoteRun{{Group: "g.1", FromBlock: 1, Blocks: 1}}, false},
		{"negative start", []RemoteRun{{Group: "g1", FromBlock: -1, Blocks: 2}}, false},
		{"alternates", []RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 2, Alternates: []string{"g3", "g2"}}}, true},
		{"too many alternates", []RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 2, Alternates: []string{"g2", "g3", "g4"}}}, false},
		{"alternate is the source", []RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 2, Alternates: []string{"g1"}}}, false},
		{"alternate twice", []RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 2, Alternates: []string{"g2", "g2"}}}, false},
		{"bad alternate", []RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 2, Alternates: []string{"g>"}}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := sampleReqMeta()
			m.BlockSize = 16
			m.TokenIDs = make(TokenIDs, 5*16+1)
			m.TokenLen, m.BlockHashes, m.SaveFromBlock = len(m.TokenIDs), make(BlockHashes, 5), 5
			m.LoadSpec = &LoadSpec{KVPoolCachedTokens: 5 * 16, CanLoad: true, Remote: tt.runs}
			data, err := Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			got, err := DecodeReqMeta(data)
			if (err == nil) != tt.ok {
				t.Fatalf("decode error %v, want ok=%v", err, tt.ok)
			}
			if tt.ok && !reflect.DeepEqual(got.LoadSpec.Remote, tt.runs) {
				t.Errorf("runs %+v, want %+v", got.LoadSpec.Remote, tt.runs)
			}
		})
	}
}

// TestDeclaredLengthsAreBounded: a decoder allocates by the lengths a
// message declares, so an array declared longer than the generated
// codec's limit is malformed before anything is allocated for it. An 8 MiB
// KVEventBatch of 8M one-byte events made its decoder allocate 768 MiB.
func TestDeclaredLengthsAreBounded(t *testing.T) {
	events := func(n int) []byte {
		var buf bytes.Buffer
		enc := msgpack.NewEncoder(&buf)
		for _, err := range []error{enc.EncodeMapLen(2), enc.EncodeString("group"), enc.EncodeString("g0"), enc.EncodeString("events"), enc.EncodeArrayLen(n)} {
			if err != nil {
				t.Fatal(err)
			}
		}
		buf.Write(bytes.Repeat([]byte{0x80}, n)) // empty maps: one byte each
		return buf.Bytes()
	}
	if _, err := DecodeKVEventBatch(events(300_000)); !errors.Is(err, ErrMalformed) {
		t.Errorf("300,000 events: err = %v, want ErrMalformed", err)
	}
	huge := events(MaxMessageBytes - 64)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := DecodeKVEventBatch(huge)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrMalformed) {
		t.Errorf("8M events: err = %v, want ErrMalformed", err)
	}
	if n := after.TotalAlloc - before.TotalAlloc; n > 16<<20 {
		t.Errorf("decoding an 8 MiB batch of empty events allocated %d MiB", n>>20)
	}
}

// TestLargeByteFields: a byte string up to the message bound decodes. The
// array limit once applied to them too, and a pool read of 512 KiB blocks
// (one piece each) failed with "reader limit exceeded".
func TestLargeByteFields(t *testing.T) {
	big := bytes.Repeat([]byte{7}, 512<<10)
	part := &PoolPart{Part: 0, Parts: 1, Pieces: []PoolPiece{{Index: 0, Size: len(big), Data: big}}}
	data, err := Marshal(part)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodePoolPart(data)
	if err != nil || !bytes.Equal(got.Pieces[0].Data, big) {
		t.Fatalf("a 512 KiB piece: err %v", err)
	}
	big = []byte(`{"prompt":"` + strings.Repeat("a", 512<<10) + `"}`) // a body is a JSON object
	req := &Request{RequestID: "r", Model: "m", FrontendID: "f", PromptTokenIDs: []uint32{1}, Body: big}
	if data, err = Marshal(req); err != nil {
		t.Fatal(err)
	}
	if r, err := DecodeRequest(data); err != nil || !bytes.Equal(r.Body, big) {
		t.Fatalf("a 512 KiB engine body: err %v", err)
	}
	out := &Output{ReqID: "r", Raw: big}
	if data, err = Marshal(out); err != nil {
		t.Fatal(err)
	}
	if o, err := DecodeOutput(data); err != nil || !bytes.Equal(o.Raw, big) {
		t.Fatalf("a 512 KiB raw engine answer: err %v", err)
	}
}

// TestArrayLimit: MaxArrayLen is the decoders' limit on a typed array (the
// //msgp:limit directive): a request with that many stop strings decodes,
// one more does not.
func TestArrayLimit(t *testing.T) {
	for _, n := range []int{MaxArrayLen, MaxArrayLen + 1} {
		req := &Request{RequestID: "r", Model: "m", FrontendID: "f", PromptTokenIDs: []uint32{1},
			SamplingParams: SamplingParams{Stop: make([]string, n)}}
		data, err := Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		_, err = DecodeRequest(data)
		if ok := err == nil; ok != (n <= MaxArrayLen) {
			t.Errorf("%d stop strings: decode error %v", n, err)
		}
	}
}

// TestPackedArraysAreBounded: a packed list sent as a plain array (what
// other producers may send) is bounded by MaxArrayLen like every typed
// array. An 8 MiB ReqMeta whose block_hashes were 8M one-byte integers made
// its decoder allocate 64 MiB before validation refused it.
func TestPackedArraysAreBounded(t *testing.T) {
	hashes := func(n int) []byte {
		var buf bytes.Buffer
		enc := msgpack.NewEncoder(&buf)
		for _, err := range []error{enc.EncodeMapLen(2), enc.EncodeString("req_id"), enc.EncodeString("r"), enc.EncodeString("block_hashes"), enc.EncodeArrayLen(n)} {
			if err != nil {
				t.Fatal(err)
			}
		}
		buf.Write(bytes.Repeat([]byte{0x01}, n)) // positive fixints: one byte each
		return buf.Bytes()
	}
	if _, err := DecodeReqMeta(hashes(MaxArrayLen + 1)); !errors.Is(err, ErrMalformed) {
		t.Errorf("%d block hashes in an array: err = %v, want ErrMalformed", MaxArrayLen+1, err)
	}
	huge := hashes(MaxMessageBytes - 64)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := DecodeReqMeta(huge)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrMalformed) {
		t.Errorf("8M block hashes in an array: err = %v, want ErrMalformed", err)
	}
	if n := after.TotalAlloc - before.TotalAlloc; n > 16<<20 {
		t.Errorf("decoding an 8 MiB array of block hashes allocated %d MiB", n>>20)
	}
}
