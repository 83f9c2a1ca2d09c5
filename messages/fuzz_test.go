package messages

import (
	"bytes"
	"fmt"
	"math"
	"reflect"
	"testing"

	"github.com/zeebo/xxh3"
)

// corruptVariants returns valid and a few damaged copies of it: truncated,
// with flipped bytes, with a field's value replaced by the reserved code,
// and with trailing garbage.
func corruptVariants(valid []byte) [][]byte {
	out := [][]byte{valid, nil, {0x80}, {0xc0}, {0xc1}}
	if len(valid) > 0 {
		out = append(out, valid[:len(valid)/2], valid[:len(valid)-1], valid[1:])
		flipped := bytes.Clone(valid)
		flipped[len(flipped)/3] ^= 0xff
		out = append(out, flipped)
		reserved := bytes.Clone(valid)
		reserved[len(reserved)-1] = 0xc1
		out = append(out, reserved)
		out = append(out, append(bytes.Clone(valid), 0xde, 0xad, 0xbe, 0xef))
		// A map header that claims more fields than follow.
		grown := bytes.Clone(valid)
		if grown[0]&0xf0 == 0x80 && grown[0] < 0x8f {
			grown[0]++
			out = append(out, grown)
		}
	}
	return out
}

func addSeeds(f *testing.F, msgs ...Message) {
	for _, m := range msgs {
		data, err := Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		for _, v := range corruptVariants(data) {
			f.Add(v)
		}
	}
}

// fuzzDecode checks that decode does not panic and that a message it
// accepts survives Marshal and a second decode unchanged. The re-encoding
// must also be a fixed point: encoding the second decode gives the same
// bytes.
func fuzzDecode[T Message](t *testing.T, data []byte, decode func([]byte) (T, error)) {
	first, err := decode(data)
	if err != nil {
		return
	}
	enc1, err := Marshal(first) // sets first's V to Version
	if err != nil {
		t.Fatalf("Marshal of a decoded message: %v", err)
	}
	second, err := decode(enc1)
	if err != nil {
		t.Fatalf("decode of the re-encoded message: %v\nfirst:  %#v\nbytes:  %x", err, first, enc1)
	}
	if !wireEqual(reflect.ValueOf(first), reflect.ValueOf(second)) {
		t.Fatalf("round trip changed the message:\nfirst:  %#v\nsecond: %#v", first, second)
	}
	enc2, err := Marshal(second)
	if err != nil {
		t.Fatalf("Marshal of the second decode: %v", err)
	}
	if !bytes.Equal(enc1, enc2) {
		t.Fatalf("encoding is not stable:\nenc1: %x\nenc2: %x", enc1, enc2)
	}
}

// wireEqual is reflect.DeepEqual with two differences that no wire format
// can preserve: a NaN equals a NaN with the same bits, and a nil slice or
// map equals an empty one (an omitempty field that decoded as empty is
// omitted on re-encoding and comes back nil).
func wireEqual(a, b reflect.Value) bool {
	if a.IsValid() != b.IsValid() {
		return false
	}
	if !a.IsValid() {
		return true
	}
	if a.Type() != b.Type() {
		return false
	}
	switch a.Kind() {
	case reflect.Float32, reflect.Float64:
		x, y := a.Float(), b.Float()
		return x == y || math.IsNaN(x) && math.IsNaN(y) && math.Float64bits(x) == math.Float64bits(y)
	case reflect.Pointer:
		if a.IsNil() || b.IsNil() {
			return a.IsNil() == b.IsNil()
		}
		return wireEqual(a.Elem(), b.Elem())
	case reflect.Interface:
		if a.IsNil() || b.IsNil() {
			return a.IsNil() == b.IsNil()
		}
		return wireEqual(a.Elem(), b.Elem())
	case reflect.Struct:
		for i := range a.NumField() {
			if !wireEqual(a.Field(i), b.Field(i)) {
				return false
			}
		}
		return true
	case reflect.Slice, reflect.Array:
		if a.Len() != b.Len() {
			return false
		}
		for i := range a.Len() {
			if !wireEqual(a.Index(i), b.Index(i)) {
				return false
			}
		}
		return true
	case reflect.Map:
		if a.Len() != b.Len() {
			return false
		}
		for _, k := range a.MapKeys() {
			bv := b.MapIndex(k)
			if !bv.IsValid() || !wireEqual(a.MapIndex(k), bv) {
				return false
			}
		}
		return true
	default:
		return reflect.DeepEqual(a.Interface(), b.Interface())
	}
}

func TestWireEqual(t *testing.T) {
	nan := math.NaN()
	tests := []struct {
		a, b any
		want bool
	}{
		{1, 1, true},
		{1, 2, false},
		{nan, nan, true},
		{nan, 1.0, false},
		{TokenIDs(nil), TokenIDs{}, true},
		{TokenIDs{1}, TokenIDs{}, false},
		{Args(nil), Args{}, true},
		{Args{"a": nan}, Args{"a": nan}, true},
		{Args{"a": int64(1)}, Args{"a": uint64(1)}, false},
		{Args{"a": nil}, Args{"b": nil}, false},
		{&Request{SamplingParams: SamplingParams{Stop: nil}}, &Request{SamplingParams: SamplingParams{Stop: []string{}}}, true},
		{&Request{SamplingParams: SamplingParams{Stop: []string{"a"}}}, &Request{SamplingParams: SamplingParams{Stop: []string{"b"}}}, false},
		{&ReqMeta{LoadSpec: nil}, &ReqMeta{LoadSpec: &LoadSpec{}}, false},
		{[]any{[]byte{1}}, []any{"\x01"}, false},
	}
	for i, tc := range tests {
		if got := wireEqual(reflect.ValueOf(tc.a), reflect.ValueOf(tc.b)); got != tc.want {
			t.Errorf("%d: wireEqual(%#v, %#v) = %v, want %v", i, tc.a, tc.b, got, tc.want)
		}
	}
}

func FuzzDecodeRequest(f *testing.F) {
	addSeeds(f, sampleRequest(), goldenRequest(), &Request{RequestID: "r", FrontendID: "f"})
	f.Add(mustMsgpack(f, map[string]any{
		"request_id": "r", "frontend_id": "f", "prompt_token_ids": []any{1, 2, 3},
		"sampling_params": map[string]any{"extra_args": map[string]any{"session_id": "s", "x": []any{1.5, nil}}},
		"future":          []any{1, "x"},
	}))
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeRequest) })
}

func FuzzDecodeReqMeta(f *testing.F) {
	addSeeds(f, sampleReqMeta(), goldenReqMeta())
	f.Add(mustMsgpack(f, map[string]any{
		"req_id": "r", "group": "g0", "token_len": 4, "token_ids": []int{1, 2, 3, 4}, "block_size": 2,
		"block_hashes": []any{uint64(1), -1}, "frontend_id": "f", "result_subject": "s",
	}))
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeReqMeta) })
}

func FuzzDecodeRankResult(f *testing.F) {
	addSeeds(f, sampleRankResult(), &RankResult{ReqID: "r"})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeRankResult) })
}

func FuzzDecodeOutput(f *testing.F) {
	addSeeds(f, sampleOutputFinal(), sampleOutputError(), &Output{ReqID: "r", TokenIDs: TokenIDs{}})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeOutput) })
}

func FuzzDecodeKVEventBatch(f *testing.F) {
	addSeeds(f, sampleKVEventBatch(), &KVEventBatch{Events: []KVEvent{}}, &KVEventBatch{})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeKVEventBatch) })
}

func FuzzDecodeHeartbeat(f *testing.F) {
	addSeeds(f, sampleHeartbeat())
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeHeartbeat) })
}

func FuzzDecodeAbort(f *testing.F) {
	addSeeds(f, sampleAbort(), &Abort{ReqID: "r"})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeAbort) })
}

func FuzzSessionKey(f *testing.F) {
	for _, s := range []string{"", "a", "sess-alpha", "none", "ünïcode", "\x00\xff", "0123456789abcdef"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		k := SessionKey(s)
		if k != SessionKey(s) {
			t.Fatalf("SessionKey(%q) is not deterministic", s)
		}
		if s == "" {
			if k != NoSession {
				t.Fatalf(`SessionKey("") = %q, want %q`, k, NoSession)
			}
			return
		}
		if want := fmt.Sprintf("%016x", xxh3.HashString(s)); k != want {
			t.Fatalf("SessionKey(%q) = %q, want %q", s, k, want)
		}
		if len(k) != 16 || !isToken(k) {
			t.Fatalf("SessionKey(%q) = %q is not 16 hex digits", s, k)
		}
	})
}

func FuzzDecodeAnnouncement(f *testing.F) {
	addSeeds(f, &Announcement{Role: RoleScheduler, ID: "sched-1", Ready: true, ReadyGroups: 2, UnixMs: 1})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeAnnouncement) })
}

func FuzzDecodeSavePlan(f *testing.F) {
	addSeeds(f, &SavePlan{SchedulerID: "s", ReqID: "r", Group: "g0", BlockHashes: BlockHashes{1, 2}, ExpiresUnixMs: 5})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeSavePlan) })
}

func FuzzDecodePoolRead(f *testing.F) {
	addSeeds(f, &PoolRead{ReqID: "r", Model: "m", TPRank: 1, BlockHashes: BlockHashes{1, 2, 3}})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodePoolRead) })
}

func FuzzDecodePoolPart(f *testing.F) {
	addSeeds(f, &PoolPart{Part: 0, Parts: 2, Pieces: []PoolPiece{{Index: 1, Offset: 4, Size: 8, Data: []byte{1, 2, 3, 4}}}})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodePoolPart) })
}

func FuzzDecodeDrainPlan(f *testing.F) {
	addSeeds(f, &DrainPlan{Group: "g1", Model: "m", Targets: []HandoffTarget{{Group: "g0", Runs: []HandoffRun{{Session: "abc", BlockHashes: BlockHashes{1, 2}}}}}})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeDrainPlan) })
}

func FuzzDecodeHandoff(f *testing.F) {
	addSeeds(f, &Handoff{Model: "m", TPRank: 2, Source: "g1", Runs: []HandoffRun{{Session: "abc", BlockHashes: BlockHashes{1, 2}}}})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeHandoff) })
}

func FuzzDecodeHandoffResult(f *testing.F) {
	addSeeds(f, &HandoffResult{Stored: 3, Failed: 1, Bytes: 1 << 20})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeHandoffResult) })
}

func FuzzDecodeResend(f *testing.F) {
	addSeeds(f, &Resend{ReqID: "r", Attempt: 1, FromIndex: 7})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeResend) })
}

func FuzzDecodeResendReply(f *testing.F) {
	addSeeds(f, &ResendReply{Resent: 3, Done: true}, &ResendReply{Error: "gone"})
	f.Fuzz(func(t *testing.T, data []byte) { fuzzDecode(t, data, DecodeResendReply) })
}
