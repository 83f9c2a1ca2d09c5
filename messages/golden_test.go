package messages

import (
	"bytes"
	"encoding/hex"
	"flag"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata")

// goldenRequest and goldenReqMeta are fixed, fully populated messages. Do
// not change them without regenerating the golden files: the files pin the
// wire format that other kvbus versions and other languages read.

func goldenRequest() *Request {
	return &Request{
		RequestID:      "req-golden-1",
		SessionID:      "sess-golden",
		Model:          "meta-llama/Llama-3.1-8B-Instruct",
		FrontendID:     "fe-0",
		ArrivalUnixMs:  1_700_000_000_000,
		DeadlineUnixMs: 1_700_000_060_000,
		PromptTokenIDs: TokenIDs{128000, 9906, 1917, 0, math.MaxUint32},
		SamplingParams: SamplingParams{
			MaxTokens:   256,
			MinTokens:   1,
			Temperature: 0.5,
			TopP:        0.9,
			Seed:        ptrTo(int64(1234)),
			Stop:        []string{"</s>"},
			IgnoreEOS:   true,
			// Inserted out of order: the encoder sorts map keys.
			ExtraArgs: Args{"session_id": "sess-golden", "priority": int64(2)},
		},
		Stream:           true,
		KVTransferParams: Args{"do_remote_prefill": false},
		Endpoint:         EndpointChat,
	}
}

func goldenReqMeta() *ReqMeta {
	return &ReqMeta{
		ReqID:       "req-golden-1",
		SessionID:   "sess-golden",
		Model:       "meta-llama/Llama-3.1-8B-Instruct",
		Group:       "g0",
		TokenLen:    8,
		TokenIDs:    TokenIDs{1, 2, 3, 4, 5, 6, 7, 8},
		BlockSize:   4,
		BlockHashes: BlockHashes{0x0102030405060708, 0xfffefdfcfbfaf9f8},
		LoadSpec: &LoadSpec{
			VLLMCachedTokens:   0,
			KVPoolCachedTokens: 4,
			CanLoad:            true,
		},
		CanSave:         true,
		SaveFromBlock:   1,
		IsLastChunk:     true,
		NumPromptTokens: 8,
		SamplingParams: SamplingParams{
			MaxTokens:   16,
			Temperature: 0,
			TopP:        1,
			ExtraArgs:   Args{"session_id": "sess-golden", "lora": "none"},
		},
		FrontendID:     "fe-0",
		ResultSubject:  "kvbus.done.sched-0",
		Attempt:        1,
		DeadlineUnixMs: 1_700_000_060_000,
	}
}

func TestGolden(t *testing.T) {
	tests := []struct {
		file   string
		msg    func() Message
		decode func([]byte) (Message, error)
	}{
		{"request.golden.hex", func() Message { return goldenRequest() }, decRequest},
		{"reqmeta.golden.hex", func() Message { return goldenReqMeta() }, decReqMeta},
	}
	for _, tc := range tests {
		t.Run(tc.file, func(t *testing.T) {
			got := mustMarshal(t, tc.msg())
			path := filepath.Join("testdata", tc.file)
			if *update {
				if err := os.MkdirAll("testdata", 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, []byte(hexLines(got)), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			text, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run with -update to create it)", err)
			}
			want, err := hex.DecodeString(strings.Join(strings.Fields(string(text)), ""))
			if err != nil {
				t.Fatalf("%s: %v", path, err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("Marshal output differs from %s (run with -update if the change is intended):\n got %x\nwant %x", path, got, want)
			}
			// The golden bytes decode to the fixture.
			dec, err := tc.decode(want)
			if err != nil {
				t.Fatalf("decode golden: %v", err)
			}
			exp := tc.msg()
			exp.setVersion()
			if !reflect.DeepEqual(dec, exp) {
				t.Errorf("golden decodes to\n %#v\nwant %#v", dec, exp)
			}
		})
	}
}

// TestGoldenReflectEncoding decodes the bytes the reflection-based encoder
// wrote before kvbus generated its codec (integers in other widths, int64
// always in 9 bytes): what an older kvbus, or another msgpack writer,
// publishes must still decode to the same message.
func TestGoldenReflectEncoding(t *testing.T) {
	for _, tc := range []struct {
		file   string
		msg    func() Message
		decode func([]byte) (Message, error)
	}{
		{"request.reflect.hex", func() Message { return goldenRequest() }, func(b []byte) (Message, error) { return DecodeRequest(b) }},
		{"reqmeta.reflect.hex", func() Message { return goldenReqMeta() }, func(b []byte) (Message, error) { return DecodeReqMeta(b) }},
	} {
		text, err := os.ReadFile(filepath.Join("testdata", tc.file))
		if err != nil {
			t.Fatal(err)
		}
		data, err := hex.DecodeString(strings.Join(strings.Fields(string(text)), ""))
		if err != nil {
			t.Fatal(err)
		}
		got, err := tc.decode(data)
		if err != nil {
			t.Fatalf("%s: %v", tc.file, err)
		}
		want := tc.msg()
		want.setVersion()
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s decodes to\n %#v\nwant %#v", tc.file, got, want)
		}
	}
}

// hexLines formats b as hex, 32 bytes a line, for readable diffs.
func hexLines(b []byte) string {
	var sb strings.Builder
	for len(b) > 0 {
		n := min(len(b), 32)
		sb.WriteString(hex.EncodeToString(b[:n]))
		sb.WriteByte('\n')
		b = b[n:]
	}
	return sb.String()
}
