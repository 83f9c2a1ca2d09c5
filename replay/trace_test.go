package replay

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// blockTokens returns the tokens of Mooncake blocks ids, 512 each.
func blockTokens(ids ...int64) []uint32 {
	var p []uint32
	for _, id := range ids {
		p = appendBlockTokens(p, uint64(id), MooncakeBlockTokens)
	}
	return p
}

// commonPrefix returns the length of the longest common prefix of a and b.
func commonPrefix(a, b []uint32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// equalPositions counts the positions where a and b hold the same token.
func equalPositions(a, b []uint32) int {
	n := 0
	for i := range min(len(a), len(b)) {
		if a[i] == b[i] {
			n++
		}
	}
	return n
}

// wantFormatErr checks that err wraps ErrFormat and names line.
func wantFormatErr(t *testing.T, err error, line int) {
	t.Helper()
	if !errors.Is(err, ErrFormat) {
		t.Fatalf("error %v, want one wrapping ErrFormat", err)
	}
	if line > 0 && !strings.Contains(err.Error(), fmt.Sprintf("line %d:", line)) {
		t.Errorf("error %q does not name line %d", err, line)
	}
}

// ---------------------------------------------------------------- Mooncake

// mooncakeFixture has lines out of time order, a blank line, a string, a
// numeric and a null session_id, fractional milliseconds and partial last
// blocks.
const mooncakeFixture = `{"timestamp": 2000, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2], "session_id": "alice"}
{"timestamp": 500.5, "input_length": 512, "output_length": 0, "hash_ids": [1]}

{"timestamp": 1000, "input_length": 1100, "output_length": 7, "hash_ids": [1, 3, 4], "session_id": 42}
{"timestamp": 1000, "input_length": 1, "output_length": 3, "hash_ids": [9], "session_id": null}
`

type wantItem struct {
	at   time.Duration
	sid  string
	ids  []int64 // Mooncake block ids of the prompt
	in   int
	out  int
	orig string
}

func TestReadMooncake(t *testing.T) {
	cases := []struct {
		name  string
		input string
		want  []wantItem
	}{
		{"fixture sorted by timestamp", mooncakeFixture, []wantItem{
			{500500 * time.Microsecond, "", []int64{1}, 512, 0, "line-2"},
			{time.Second, "42", []int64{1, 3, 4}, 1100, 7, "line-4"},
			{time.Second, "", []int64{9}, 1, 3, "line-5"},
			{2 * time.Second, "alice", []int64{1, 2}, 1000, 5, "line-1"},
		}},
		{"no trailing newline, CRLF", "{\"timestamp\":3,\"input_length\":513,\"output_length\":1,\"hash_ids\":[5,6]}\r\n" +
			`{"timestamp":0,"input_length":1024,"output_length":2,"hash_ids":[5,6],"session_id":"s"}`, []wantItem{
			{0, "s", []int64{5, 6}, 1024, 2, "line-2"},
			{3 * time.Millisecond, "", []int64{5, 6}, 513, 1, "line-1"},
		}},
		{"big numeric and float session ids keep their text", `{"timestamp":0,"input_length":10,"output_length":0,"hash_ids":[-3],"session_id":12345678901234567890}
{"timestamp":0,"input_length":10,"output_length":0,"hash_ids":[-3],"session_id":1.5}
`, []wantItem{
			{0, "12345678901234567890", []int64{-3}, 10, 0, "line-1"},
			{0, "1.5", []int64{-3}, 10, 0, "line-2"},
		}},
		{"empty trace", "\n\n", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := ReadTrace(strings.NewReader(tc.input), FormatMooncake)
			if err != nil {
				t.Fatal(err)
			}
			if tr.Format != FormatMooncake || len(tr.Items) != len(tc.want) {
				t.Fatalf("format %q, %d items, want mooncake and %d", tr.Format, len(tr.Items), len(tc.want))
			}
			for i, w := range tc.want {
				it := tr.Items[i]
				if it.At != w.at || it.SessionID != w.sid || it.OutputTokens != w.out || it.OriginalID != w.orig {
					t.Errorf("item %d: at %v session %q output %d id %q, want %v %q %d %q",
						i, it.At, it.SessionID, it.OutputTokens, it.OriginalID, w.at, w.sid, w.out, w.orig)
				}
				if len(it.Prompt) != w.in {
					t.Errorf("item %d: prompt of %d tokens, want input_length %d", i, len(it.Prompt), w.in)
				}
				// The prompt is its blocks' tokens, the last block cut.
				if want := blockTokens(w.ids...)[:w.in]; !slices.Equal(it.Prompt, want) {
					t.Errorf("item %d: prompt is not the tokens of blocks %v cut to %d", i, w.ids, w.in)
				}
				if it.Request != nil || it.Subject != "" {
					t.Errorf("item %d: a trace item has a captured request or subject", i)
				}
			}
		})
	}
}

// TestMooncakePrefixSharing checks that equal hash_ids give equal tokens
// wherever they stand and different ids different tokens, so that an
// infinite cache sees exactly the sharing the trace describes.
func TestMooncakePrefixSharing(t *testing.T) {
	const trace = `{"timestamp":0,"input_length":1024,"output_length":1,"hash_ids":[7,8]}
{"timestamp":1,"input_length":1536,"output_length":1,"hash_ids":[7,8,9]}
{"timestamp":2,"input_length":1024,"output_length":1,"hash_ids":[7,10]}
{"timestamp":3,"input_length":700,"output_length":1,"hash_ids":[8,9]}
`
	tr, err := ReadTrace(strings.NewReader(trace), FormatMooncake)
	if err != nil {
		t.Fatal(err)
	}
	a, b, c, d := tr.Items[0].Prompt, tr.Items[1].Prompt, tr.Items[2].Prompt, tr.Items[3].Prompt
	checks := []struct {
		name string
		x, y []uint32
		same bool
	}{
		{"[7 8] is a prefix of [7 8 9]", a, b[:1024], true},
		{"block 7 shared", a[:512], c[:512], true},
		{"block 8 at another position", a[512:], d[:512], true},
		{"block 9 cut to 188 tokens", b[1024 : 1024+188], d[512:], true},
		{"blocks 8 and 10 differ", a[512:], c[512:], false},
		{"blocks 7 and 8 differ", a[:512], a[512:], false},
		{"blocks 9 and 10 differ", b[1024:], c[512:], false},
	}
	for _, ck := range checks {
		if ck.same && !slices.Equal(ck.x, ck.y) {
			t.Errorf("%s: tokens differ", ck.name)
		}
		if !ck.same && equalPositions(ck.x, ck.y) > 8 {
			t.Errorf("%s: %d of %d positions hold equal tokens", ck.name, equalPositions(ck.x, ck.y), len(ck.x))
		}
	}
	// b hits [7 8] (1024 tokens), c hits [7] (512); d starts with 8, which
	// no prompt starts with: 1536 of 1024+1536+1024+700 tokens.
	if got, want := IdealHitRatio(tr.Items, "m", 16), 1536.0/4284; got != want {
		t.Errorf("ideal hit ratio %v, want %v", got, want)
	}
}

func TestReadMooncakeErrors(t *testing.T) {
	const good = `{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}`
	cases := []struct {
		name string
		line string
		want string // in the error, when given
	}{
		{"bad JSON", `{"timestamp": 1, "input_length": 10,`, ""},
		{"not an object", `[1, 2, 3]`, ""},
		{"null", `null`, ""},
		{"no timestamp", `{"input_length": 10, "output_length": 1, "hash_ids": [1]}`, ""},
		{"no input_length", `{"timestamp": 1, "output_length": 1, "hash_ids": [1]}`, ""},
		{"no output_length", `{"timestamp": 1, "input_length": 10, "hash_ids": [1]}`, ""},
		{"no hash_ids", `{"timestamp": 1, "input_length": 10, "output_length": 1}`, ""},
		{"empty hash_ids", `{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": []}`, ""},
		{"hash_ids do not cover input_length", `{"timestamp": 1, "input_length": 513, "output_length": 1, "hash_ids": [1]}`, "1 hash_ids do not cover input_length 513 in 512-token blocks (2 needed)"},
		// Said "do not cover" before.
		{"too many hash_ids", `{"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}`, "2 hash_ids are more than input_length 512 needs in 512-token blocks (1)"},
		{"far too many hash_ids", `{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]}`, "are more than"},
		{"zero input_length", `{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}`, ""},
		{"negative input_length", `{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": [1]}`, ""},
		{"negative output_length", `{"timestamp": 1, "input_length": 10, "output_length": -1, "hash_ids": [1]}`, ""},
		{"negative timestamp", `{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}`, ""},
		{"NaN timestamp", `{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}`, ""},
		{"string NaN timestamp", `{"timestamp": "NaN", "input_length": 10, "output_length": 1, "hash_ids": [1]}`, ""},
		{"Infinity timestamp", `{"timestamp": Infinity, "input_length": 10, "output_length": 1, "hash_ids": [1]}`, ""},
		{"out of range timestamp", `{"timestamp": 1e999, "input_length": 10, "output_length": 1, "hash_ids": [1]}`, ""},
		{"timestamp over a year", `{"timestamp": 4e10, "input_length": 10, "output_length": 1, "hash_ids": [1]}`, ""},
		{"fractional input_length", `{"timestamp": 1, "input_length": 10.5, "output_length": 1, "hash_ids": [1]}`, ""},
		{"string input_length", `{"timestamp": 1, "input_length": "10", "output_length": 1, "hash_ids": [1]}`, ""},
		{"huge input_length", `{"timestamp": 1, "input_length": 1e30, "output_length": 1, "hash_ids": [1]}`, ""},
		{"string hash_id", `{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}`, ""},
		{"fractional hash_id", `{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1.5]}`, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// Two good lines and a blank one first: the bad one is line 4.
			input := good + "\n\n" + good + "\n" + tc.line + "\n" + good + "\n"
			tr, err := ReadTrace(strings.NewReader(input), FormatMooncake)
			if err == nil {
				t.Fatalf("accepted, %d items", len(tr.Items))
			}
			wantFormatErr(t, err, 4)
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not say %q", err, tc.want)
			}
		})
	}
	t.Run("line too long", func(t *testing.T) {
		input := good + "\n" + `{"timestamp": 1, "pad": "` + strings.Repeat("x", maxTraceLineBytes) + `"}` + "\n"
		_, err := ReadTrace(strings.NewReader(input), FormatMooncake)
		wantFormatErr(t, err, 2)
	})
}

// TestTraceTokenCountBounds checks that no trace line can make a reader
// allocate without bound: 16M tokens (4× the 1<<22 that readTraceLab and
// readAzure always refused) must be refused everywhere.
func TestTraceTokenCountBounds(t *testing.T) {
	const huge = 1 << 24
	ids := strings.TrimSuffix(strings.Repeat("1,", huge/MooncakeBlockTokens), ",")
	cases := []struct {
		name, format, input string
	}{
		// readTraceLab builds the conversation's output tokens: unbounded,
		// output_tokens 1e12 allocated terabytes (fatal out of memory).
		{"tracelab output_tokens", FormatTraceLab,
			fmt.Sprintf(`{"session_id":"s","round_index":0,"input_tokens_total":10,"output_tokens":%d,"timing_events":[{"timestamp":"2026-01-01T00:00:00Z"}]}`, huge)},
		{"tracelab input_tokens_total", FormatTraceLab,
			fmt.Sprintf(`{"session_id":"s","round_index":0,"input_tokens_total":%d,"output_tokens":1,"timing_events":[{"timestamp":"2026-01-01T00:00:00Z"}]}`, huge)},
		// Bounded only by len(hash_ids), a 16 MiB line of "0," built a
		// 4G-token (16 GiB) prompt.
		{"mooncake input_length", FormatMooncake,
			fmt.Sprintf(`{"timestamp":0,"input_length":%d,"output_length":1,"hash_ids":[%s]}`, huge, ids)},
		{"azure ContextTokens", FormatAzure, fmt.Sprintf("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,%d,1\n", huge)},
		{"azure GeneratedTokens", FormatAzure, fmt.Sprintf("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,1,%d\n", huge)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := ReadTrace(strings.NewReader(tc.input), tc.format)
			if err == nil {
				t.Fatalf("accepted a line of %d tokens (%d items); want ErrFormat", huge, len(tr.Items))
			}
			wantFormatErr(t, err, 0)
		})
	}
}

// ---------------------------------------------------------------- TraceLab

// tlLine is one TraceLab round; prefix < 0 leaves prefix_tokens out.
func tlLine(sid string, round, input, prefix, output int, ts string) string {
	p := ""
	if prefix >= 0 {
		p = fmt.Sprintf(`"prefix_tokens": %d, "newly_append_tokens": %d, `, prefix, max(input-prefix, 0))
	}
	return fmt.Sprintf(`{"session_id": %q, "round_index": %d, "input_tokens_total": %d, %s"output_tokens": %d, `+
		`"first_input_event_type": "tool_result", "timing_events": [{"event_type": "trigger", "timestamp": %q, "source": "x"}, `+
		`{"event_type": "later", "timestamp": "2030-01-01T00:00:00Z"}], "tools": []}`, sid, round, input, p, output, ts)
}

// traceLabFixture is two sessions months apart, rounds out of order.
var traceLabFixture = strings.Join([]string{
	tlLine("claude:a", 1, 300, 250, 20, "2026-06-01T05:40:31.651Z"),
	tlLine("codex:b", 2, 150, 1000, 5, "2026-03-21T10:06:30.5Z"),
	tlLine("claude:a", 0, 200, 0, 50, "2026-06-01T05:40:20.151Z"),
	"",
	tlLine("codex:b", 0, 100, -1, 10, "2026-03-21T10:06:00Z"),
	tlLine("claude:a", 2, 1200, 100, 0, "2026-06-01T05:41:00.151Z"),
	tlLine("codex:b", 1, 120, 60, 10, "2026-03-21T10:06:10+00:00"),
}, "\n") + "\n"

func TestReadTraceLab(t *testing.T) {
	tr, err := ReadTrace(strings.NewReader(traceLabFixture), FormatTraceLab)
	if err != nil {
		t.Fatal(err)
	}
	if tr.Format != FormatTraceLab || len(tr.Items) != 6 || tr.Sessions() != 2 {
		t.Fatalf("format %q, %d items, %d sessions", tr.Format, len(tr.Items), tr.Sessions())
	}
	type round struct {
		at       time.Duration
		in, out  int
		fromPrev int // tokens shared with the previous round's prompt
	}
	want := map[string][]round{
		"claude:a": {
			{0, 200, 50, 0},
			{11500 * time.Millisecond, 300, 20, 200}, // prefix 250 = prompt 200 + output 50
			{40 * time.Second, 1200, 0, 100},
		},
		"codex:b": {
			{0, 100, 10, 0},
			{10 * time.Second, 120, 10, 60},
			{30500 * time.Millisecond, 150, 5, 120}, // prefix 1000 capped at 120 + 10
		},
	}
	got := map[string][]Item{}
	for i, it := range tr.Items {
		if i > 0 && it.At < tr.Items[i-1].At {
			t.Errorf("items not sorted by time: %v after %v", it.At, tr.Items[i-1].At)
		}
		got[it.SessionID] = append(got[it.SessionID], it)
	}
	for sid, rounds := range want {
		items := got[sid]
		if len(items) != len(rounds) {
			t.Fatalf("session %s: %d items, want %d", sid, len(items), len(rounds))
		}
		for k, w := range rounds {
			it := items[k]
			if it.OriginalID != fmt.Sprintf("%s#%d", sid, k) {
				t.Errorf("%s round %d: original id %q (rounds not in round_index order?)", sid, k, it.OriginalID)
			}
			if it.At != w.at || len(it.Prompt) != w.in || it.OutputTokens != w.out {
				t.Errorf("%s round %d: at %v, prompt %d, output %d; want %v, %d, %d", sid, k, it.At, len(it.Prompt), it.OutputTokens, w.at, w.in, w.out)
			}
			if k > 0 {
				if n := commonPrefix(it.Prompt, items[k-1].Prompt); n != w.fromPrev {
					t.Errorf("%s round %d shares %d tokens with round %d, want %d", sid, k, n, k-1, w.fromPrev)
				}
			}
		}
	}
	// Nothing is shared across sessions.
	if n := commonPrefix(got["claude:a"][0].Prompt, got["codex:b"][0].Prompt); n != 0 {
		t.Errorf("sessions share %d tokens", n)
	}
}

// TestTraceLabPrefixIsConversation checks that round 1 starts with
// min(prefix_tokens, len(round 0's prompt + output)) tokens of the
// conversation: round 0 has a 300-token prompt and 20 output tokens.
func TestTraceLabPrefixIsConversation(t *testing.T) {
	read := func(t *testing.T, prefix, input int) (r0, r1 []uint32) {
		t.Helper()
		trace := tlLine("s", 0, 300, 0, 20, "2026-01-01T00:00:00Z") + "\n" + tlLine("s", 1, input, prefix, 7, "2026-01-01T00:00:05Z") + "\n"
		tr, err := ReadTrace(strings.NewReader(trace), FormatTraceLab)
		if err != nil {
			t.Fatal(err)
		}
		if len(tr.Items[1].Prompt) != input {
			t.Fatalf("round 1 prompt %d tokens, want %d", len(tr.Items[1].Prompt), input)
		}
		return tr.Items[0].Prompt, tr.Items[1].Prompt
	}
	// With prefix_tokens = 320 round 1 starts with the whole conversation.
	r0, full := read(t, 320, 400)
	cases := []struct {
		name          string
		prefix, input int
		want          int // tokens of the conversation round 1 starts with
	}{
		{"no prefix_tokens", -1, 400, 0},
		{"zero", 0, 400, 0},
		{"inside the prompt", 150, 400, 150},
		{"the whole prompt", 300, 400, 300},
		{"one output token", 301, 400, 301},
		{"all but one output token", 319, 400, 319},
		{"prefix over the conversation", 321, 400, 320},
		{"prefix far over", 100000, 400, 320},
		{"prefix over input_tokens_total", 320, 10, 10},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, r1 := read(t, tc.prefix, tc.input)
			if n := commonPrefix(r1, r0); n != min(tc.want, 300) {
				t.Errorf("shares %d tokens with round 0's prompt, want %d", n, min(tc.want, 300))
			}
			n := commonPrefix(r1, full)
			if tc.want >= 320 {
				if !slices.Equal(r1, full) {
					t.Errorf("differs from the round that asks for the whole conversation (common prefix %d)", n)
				}
			} else if n != tc.want {
				t.Errorf("starts with %d tokens of the conversation, want %d", n, tc.want)
			}
		})
	}
}

func TestReadTraceLabErrors(t *testing.T) {
	good := tlLine("s", 0, 10, 0, 1, "2026-01-01T00:00:00Z")
	cases := []struct {
		name string
		line string
	}{
		{"bad JSON", `{"session_id": "s",`},
		{"no session_id", `{"round_index": 1, "input_tokens_total": 10, "output_tokens": 1, "timing_events": [{"timestamp": "2026-01-01T00:00:00Z"}]}`},
		{"empty session_id", `{"session_id": "", "round_index": 1, "input_tokens_total": 10, "output_tokens": 1, "timing_events": [{"timestamp": "2026-01-01T00:00:00Z"}]}`},
		{"no round_index", `{"session_id": "s", "input_tokens_total": 10, "output_tokens": 1, "timing_events": [{"timestamp": "2026-01-01T00:00:00Z"}]}`},
		{"no input_tokens_total", `{"session_id": "s", "round_index": 1, "output_tokens": 1, "timing_events": [{"timestamp": "2026-01-01T00:00:00Z"}]}`},
		{"no output_tokens", `{"session_id": "s", "round_index": 1, "input_tokens_total": 10, "timing_events": [{"timestamp": "2026-01-01T00:00:00Z"}]}`},
		{"no timing_events", `{"session_id": "s", "round_index": 1, "input_tokens_total": 10, "output_tokens": 1}`},
		{"empty timing_events", `{"session_id": "s", "round_index": 1, "input_tokens_total": 10, "output_tokens": 1, "timing_events": []}`},
		{"bad timestamp", tlLine("s", 1, 10, 0, 1, "yesterday")},
		{"timestamp without zone", tlLine("s", 1, 10, 0, 1, "2026-01-01T00:00:00")},
		{"zero input", tlLine("s", 1, 0, 0, 1, "2026-01-01T00:00:00Z")},
		{"negative output", tlLine("s", 1, 10, 0, -1, "2026-01-01T00:00:00Z")},
		{"negative prefix", `{"session_id": "s", "round_index": 1, "input_tokens_total": 10, "prefix_tokens": -2, "output_tokens": 1, "timing_events": [{"timestamp": "2026-01-01T00:00:00Z"}]}`},
		{"implausible input", tlLine("s", 1, 1<<22+1, 0, 1, "2026-01-01T00:00:00Z")},
		{"numeric session_id", `{"session_id": 5, "round_index": 1, "input_tokens_total": 10, "output_tokens": 1, "timing_events": [{"timestamp": "2026-01-01T00:00:00Z"}]}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			input := good + "\n\n" + tc.line + "\n" + good + "\n"
			tr, err := ReadTrace(strings.NewReader(input), FormatTraceLab)
			if err == nil {
				t.Fatalf("accepted, %d items", len(tr.Items))
			}
			wantFormatErr(t, err, 3)
		})
	}
}

// ---------------------------------------------------------------- Azure

const azureFixture = `TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05,1,0
`

func TestReadAzure(t *testing.T) {
	cases := []struct {
		name  string
		input string
		want  []wantItem // ids unused
	}{
		{"fixture", azureFixture, []wantItem{
			{0, "", nil, 4808, 10, "line-2"},
			{52 * time.Millisecond, "", nil, 3180, 8, "line-3"},
			{52 * time.Millisecond, "", nil, 3180, 8, "line-4"},
			{1020040 * time.Microsecond, "", nil, 1, 0, "line-5"},
		}},
		{"CRLF, no trailing newline", "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:17:03.5,1024,3\r\n2023-11-16 18:17:04.5,1024,3", []wantItem{
			{0, "", nil, 1024, 3, "line-2"},
			{time.Second, "", nil, 1024, 3, "line-3"},
		}},
		{"header only", "TIMESTAMP,ContextTokens,GeneratedTokens\n", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := ReadTrace(strings.NewReader(tc.input), FormatAzure)
			if err != nil {
				t.Fatal(err)
			}
			if tr.Format != FormatAzure || len(tr.Items) != len(tc.want) || tr.Sessions() != 0 {
				t.Fatalf("format %q, %d items, %d sessions", tr.Format, len(tr.Items), tr.Sessions())
			}
			for i, w := range tc.want {
				it := tr.Items[i]
				if it.At != w.at || len(it.Prompt) != w.in || it.OutputTokens != w.out || it.OriginalID != w.orig || it.SessionID != "" {
					t.Errorf("item %d: at %v prompt %d output %d id %q session %q; want %v %d %d %q",
						i, it.At, len(it.Prompt), it.OutputTokens, it.OriginalID, it.SessionID, w.at, w.in, w.out, w.orig)
				}
			}
			// No sharing is invented: an infinite cache hits nothing, even
			// between two rows with equal token counts.
			for _, bs := range []int{1, 16, 512} {
				if got := IdealHitRatio(tr.Items, "m", bs); got != 0 {
					t.Errorf("ideal hit ratio %v with blocks of %d, want exactly 0", got, bs)
				}
			}
			for i := 1; i < len(tr.Items); i++ {
				if slices.Equal(tr.Items[i].Prompt[:min(16, len(tr.Items[i].Prompt))], tr.Items[i-1].Prompt[:min(16, len(tr.Items[i-1].Prompt))]) {
					t.Errorf("items %d and %d start alike", i-1, i)
				}
			}
		})
	}
}

func TestReadAzureErrors(t *testing.T) {
	const hdr = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
	const good = "2023-11-16 18:17:03.9799600,4808,10\n"
	cases := []struct {
		name  string
		input string
		line  int // 0: the header
	}{
		{"empty", "", 0},
		{"wrong header", "time,input,output\n" + good, 0},
		{"no header", good + good, 0},
		// The columns are read by position: a header that names them in
		// another order must not be misread as ContextTokens,GeneratedTokens.
		{"swapped columns", "TIMESTAMP,GeneratedTokens,ContextTokens\n" + good, 0},
		{"two fields", hdr + good + "2023-11-16 18:17:04,10\n", 3},
		{"four fields", hdr + good + "2023-11-16 18:17:04,10,1,1\n", 3},
		{"ISO timestamp", hdr + good + "2023-11-16T18:17:04Z,10,1\n", 3},
		{"garbage timestamp", hdr + good + "soon,10,1\n", 3},
		{"non-integer context", hdr + good + "2023-11-16 18:17:04,ten,1\n", 3},
		{"fractional generated", hdr + good + "2023-11-16 18:17:04,10,1.5\n", 3},
		{"zero context", hdr + good + "2023-11-16 18:17:04,0,1\n", 3},
		{"negative generated", hdr + good + "2023-11-16 18:17:04,10,-1\n", 3},
		{"implausible context", hdr + good + "2023-11-16 18:17:04,4194305,1\n", 3},
		{"bare quote", hdr + good + "2023-11-16 18:17:04,\"10,1\n", 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := ReadTrace(strings.NewReader(tc.input), FormatAzure)
			if err == nil {
				t.Fatalf("accepted, %d items", len(tr.Items))
			}
			wantFormatErr(t, err, tc.line)
		})
	}
}

// ---------------------------------------------------------------- formats

// testRequest is a valid Request with n prompt tokens.
func testRequest(id, session string, n int) *messages.Request {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32(100 + i)
	}
	return &messages.Request{
		RequestID: id, SessionID: session, Model: "m", FrontendID: "fe1", ArrivalUnixMs: 1,
		PromptTokenIDs: p, SamplingParams: messages.SamplingParams{MaxTokens: 4, Temperature: 1, TopP: 1},
		Endpoint: messages.EndpointCompletions,
	}
}

func marshal(t testing.TB, m messages.Message) []byte {
	t.Helper()
	b, err := messages.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// captureBytes writes frames as a capture file.
func captureBytes(t testing.TB, frames ...Frame) []byte {
	t.Helper()
	var buf bytes.Buffer
	cw, err := NewCaptureWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range frames {
		if err := cw.Write(f); err != nil {
			t.Fatal(err)
		}
	}
	if err := cw.Flush(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

var t0 = time.Date(2026, 5, 1, 12, 0, 0, 123456789, time.UTC)

func captureFixture(t testing.TB) []byte {
	r2 := testRequest("r2", "field", 20)
	r2.SamplingParams.ExtraArgs = messages.Args{messages.ExtraArgSessionID: "xargs"}
	return captureBytes(t,
		Frame{Time: t0, Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r1", "s1", 10))},
		Frame{Time: t0.Add(250 * time.Millisecond), Subject: "kvbus.req.other", Payload: marshal(t, r2)},
		Frame{Time: t0.Add(time.Second + 1), Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r3", "", 1))},
	)
}

func TestReadCaptureTrace(t *testing.T) {
	tr, err := ReadTrace(bytes.NewReader(captureFixture(t)), FormatCapture)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		at         time.Duration
		sid, id    string
		subj       string
		promptLen  int
		firstToken uint32
	}{
		{0, "s1", "r1", "kvbus.req.m", 10, 100},
		{250 * time.Millisecond, "xargs", "r2", "kvbus.req.other", 20, 100}, // extra_args win
		{time.Second + 1, "", "r3", "kvbus.req.m", 1, 100},
	}
	if tr.Format != FormatCapture || len(tr.Items) != len(want) {
		t.Fatalf("format %q, %d items", tr.Format, len(tr.Items))
	}
	for i, w := range want {
		it := tr.Items[i]
		if it.At != w.at || it.SessionID != w.sid || it.OriginalID != w.id || it.Subject != w.subj || len(it.Prompt) != w.promptLen || it.Prompt[0] != w.firstToken {
			t.Errorf("item %d: %+v", i, it)
		}
		if it.Request == nil || it.Request.RequestID != w.id || it.OutputTokens != 0 {
			t.Errorf("item %d: request %+v, output tokens %d", i, it.Request, it.OutputTokens)
		}
	}

	// A damaged capture gives the requests it has and says what it left
	// out; one with none is an error.
	t.Run("malformed payload", func(t *testing.T) {
		data := captureBytes(t,
			Frame{Time: t0, Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r1", "", 3))},
			Frame{Time: t0, Subject: "kvbus.req.m", Payload: []byte("not msgpack")},
			Frame{Time: t0.Add(time.Second), Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r3", "", 3))})
		tr, err := ReadTrace(bytes.NewReader(data), FormatCapture)
		if err != nil {
			t.Fatal(err)
		}
		if len(tr.Items) != 2 || tr.Items[1].OriginalID != "r3" || len(tr.Damage) != 1 || !strings.Contains(tr.Damage[0], "1 frames are not requests") ||
			!strings.Contains(tr.Damage[0], "frame 1") {
			t.Errorf("%d items, damage %q; want r1 and r3, and frame 1 named as left out", len(tr.Items), tr.Damage)
		}
	})
	t.Run("truncated tail", func(t *testing.T) {
		whole := captureFixture(t)
		tr, err := ReadTrace(bytes.NewReader(whole[:len(whole)-5]), FormatCapture)
		if err != nil {
			t.Fatal(err)
		}
		if len(tr.Items) != 2 || len(tr.Damage) != 1 || !strings.Contains(tr.Damage[0], "damaged from frame 2") {
			t.Errorf("%d items, damage %q; want the 2 whole frames and the cut one named", len(tr.Items), tr.Damage)
		}
	})
	t.Run("nothing readable", func(t *testing.T) {
		data := captureBytes(t, Frame{Time: t0, Subject: "kvbus.req.m", Payload: []byte("not msgpack")})
		_, err := ReadTrace(bytes.NewReader(data), FormatCapture)
		if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), "frame 0") {
			t.Errorf("error %v, want ErrFormat naming frame 0", err)
		}
	})
	t.Run("not a capture", func(t *testing.T) {
		_, err := ReadTrace(strings.NewReader(mooncakeFixture), FormatCapture)
		if !errors.Is(err, ErrNotCapture) {
			t.Errorf("error %v, want ErrNotCapture", err)
		}
	})
}

func TestDetectFormat(t *testing.T) {
	longMooncake := `{"timestamp": 1, "input_length": 1000000, "output_length": 1, "hash_ids": [` + strings.Repeat("12345, ", 2000) + "1]}\n"
	longTraceLab := `{"session_id": "s", "round_index": 0, "pad": "` + strings.Repeat("x", 5000) + `"}` + "\n"
	cases := []struct {
		name string
		head string
		want string
	}{
		{"capture", captureMagic + "\x01\x00\x00\x00", FormatCapture},
		{"capture of another version", captureMagic + "\x07\x00\x00\x00", FormatCapture},
		{"azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n", FormatAzure},
		{"mooncake", mooncakeFixture, FormatMooncake},
		{"mooncake CRLF", "{\"timestamp\":1,\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}\r\n", FormatMooncake},
		{"mooncake first line cut by the peek", longMooncake[:4096], FormatMooncake},
		{"tracelab", traceLabFixture, FormatTraceLab},
		{"tracelab first line cut by the peek", longTraceLab[:4096], FormatTraceLab},
		{"other JSON", `{"timestamp": 1, "prompt": "hi"}` + "\n", ""},
		{"JSON array", "[1, 2]\n", ""},
		{"other CSV", "time,in,out\n1,2,3\n", ""},
		{"text", "hello world\n", ""},
		{"empty", "", ""},
		{"binary", "\x00\x01\x02\xff", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := detectFormat([]byte(tc.head)); got != tc.want {
				t.Errorf("detectFormat = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestReadTraceAuto(t *testing.T) {
	cases := []struct {
		format string
		data   []byte
		items  int
	}{
		{FormatCapture, captureFixture(t), 3},
		{FormatMooncake, []byte(mooncakeFixture), 4},
		{FormatTraceLab, []byte(traceLabFixture), 6},
		{FormatAzure, []byte(azureFixture), 4},
		{FormatMooncake, []byte(`{"timestamp": 1, "input_length": 1000000, "output_length": 1, "hash_ids": [` +
			strings.Repeat("7, ", 1953) + "8]}\n"), 1}, // a first line longer than the peek
	}
	dir := t.TempDir()
	for i, tc := range cases {
		t.Run(tc.format, func(t *testing.T) {
			for _, f := range []string{FormatAuto, ""} {
				tr, err := ReadTrace(bytes.NewReader(tc.data), f)
				if err != nil {
					t.Fatalf("format %q: %v", f, err)
				}
				if tr.Format != tc.format || len(tr.Items) != tc.items {
					t.Errorf("format %q: read as %q with %d items, want %q with %d", f, tr.Format, len(tr.Items), tc.format, tc.items)
				}
			}
			path := filepath.Join(dir, fmt.Sprintf("trace-%d", i))
			if err := os.WriteFile(path, tc.data, 0o644); err != nil {
				t.Fatal(err)
			}
			tr, err := ReadTraceFile(path, FormatAuto)
			if err != nil || tr.Format != tc.format || len(tr.Items) != tc.items {
				t.Errorf("ReadTraceFile: %v, %+v", err, tr)
			}
		})
	}

	t.Run("unknown content", func(t *testing.T) {
		// (An empty file says so: TestEmptyTraceSaysSo.)
		for _, in := range []string{"hello\n", `{"prompt": "hi"}` + "\n", "a,b,c\n1,2,3\n"} {
			_, err := ReadTrace(strings.NewReader(in), FormatAuto)
			if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), "--format") {
				t.Errorf("%q: error %v, want ErrFormat telling to give --format", in, err)
			}
		}
	})
	t.Run("unknown format name", func(t *testing.T) {
		_, err := ReadTrace(strings.NewReader(mooncakeFixture), "jsonl")
		if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), `"jsonl"`) {
			t.Errorf("error %v, want ErrFormat naming the format", err)
		}
	})
	t.Run("missing file", func(t *testing.T) {
		if _, err := ReadTraceFile(filepath.Join(dir, "nope"), FormatAuto); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("error %v, want ErrNotExist", err)
		}
	})
}

// ---------------------------------------------------------------- sessions

func seq(start, n int) []uint32 {
	s := make([]uint32, n)
	for i := range s {
		s[i] = uint32(start + i)
	}
	return s
}

func cat(parts ...[]uint32) []uint32 { return slices.Concat(parts...) }

func TestInferSessions(t *testing.T) {
	const bs = 4
	items := []struct {
		name    string
		prompt  []uint32
		session string // given
		group   string // items of a group must share a session, others not
	}{
		{"first turn", cat(seq(1, 8), seq(900, 2)), "", "A"},
		{"extends the first turn's full blocks", cat(seq(1, 8), seq(900, 2), seq(20, 5)), "", "A"},
		{"unrelated", seq(50, 8), "", "B"},
		{"shares one of the first turn's two blocks", cat(seq(1, 4), seq(70, 8)), "", "C"},
		{"has a session already", cat(seq(1, 12), seq(20, 4)), "given", "given"},
		{"extends the second turn", cat(seq(1, 8), seq(900, 2), seq(20, 5), seq(300, 3)), "", "A"},
		{"extends the unrelated one", cat(seq(50, 8), seq(1, 4)), "", "B"},
		{"shorter than a block", seq(1, 3), "", "D"},
		{"same short prompt again", seq(1, 3), "", "E"},
		{"empty prompt", nil, "", "F"},
	}
	tr := &Trace{}
	for _, it := range items {
		tr.Items = append(tr.Items, Item{Prompt: it.prompt, SessionID: it.session})
	}
	InferSessions(tr, bs)
	byGroup := map[string]string{}
	bySession := map[string]string{}
	for i, it := range tr.Items {
		want := items[i]
		sid := it.SessionID
		if sid == "" {
			t.Errorf("%s: no session", want.name)
			continue
		}
		if want.session != "" && sid != want.session {
			t.Errorf("%s: session %q replaced by %q", want.name, want.session, sid)
		}
		if s, ok := byGroup[want.group]; ok && s != sid {
			t.Errorf("%s: session %q, want %q like the earlier items of its conversation", want.name, sid, s)
		}
		if g, ok := bySession[sid]; ok && g != want.group {
			t.Errorf("%s: put in session %q of an unrelated conversation", want.name, sid)
		}
		byGroup[want.group], bySession[sid] = sid, want.group
	}
	if tr.Sessions() != 7 {
		t.Errorf("%d sessions, want 7", tr.Sessions())
	}

	// Captured requests of another model or another cache salt share no
	// cache, so no session, whatever their prompts.
	captured := func(model, salt string, prompt []uint32) Item {
		return Item{Prompt: prompt, Request: &messages.Request{Model: model, CacheSalt: salt, PromptTokenIDs: prompt}}
	}
	first := cat(seq(1, 8), seq(900, 2))
	next := cat(first, seq(20, 5))
	ct := &Trace{Items: []Item{captured("m", "", first), captured("m", "", next), captured("m", "a", next),
		captured("n", "", next), captured("m", "a", cat(next, seq(40, 4)))}}
	InferSessions(ct, bs)
	cs := func(i int) string { return ct.Items[i].SessionID }
	if cs(0) != cs(1) || cs(2) == cs(1) || cs(3) == cs(1) || cs(3) == cs(2) || cs(4) != cs(2) {
		t.Errorf("captured sessions %q %q %q %q %q: want the salted and the other model's apart", cs(0), cs(1), cs(2), cs(3), cs(4))
	}

	// On a Mooncake trace: follow-up turns start with all full blocks of
	// the previous turn.
	mc, err := ReadTrace(strings.NewReader(`{"timestamp":0,"input_length":1000,"output_length":1,"hash_ids":[1,2]}
{"timestamp":1,"input_length":600,"output_length":1,"hash_ids":[3,4]}
{"timestamp":2,"input_length":1500,"output_length":1,"hash_ids":[1,2,5]}
{"timestamp":3,"input_length":1100,"output_length":1,"hash_ids":[3,4,6]}
{"timestamp":4,"input_length":2000,"output_length":1,"hash_ids":[1,2,5,7]}
{"timestamp":5,"input_length":512,"output_length":1,"hash_ids":[2]}
`), FormatMooncake)
	if err != nil {
		t.Fatal(err)
	}
	InferSessions(mc, MooncakeBlockTokens)
	s := func(i int) string { return mc.Items[i].SessionID }
	if s(0) != s(2) || s(2) != s(4) || s(1) != s(3) || s(0) == s(1) || s(5) == s(0) || s(5) == s(1) || mc.Sessions() != 3 {
		t.Errorf("sessions %q %q %q %q %q %q", s(0), s(1), s(2), s(3), s(4), s(5))
	}
}

// ---------------------------------------------------------------- ideal

func TestIdealHitRatio(t *testing.T) {
	a, b, c, d := seq(1000, 16), seq(2000, 16), seq(3000, 16), seq(4000, 16)
	cases := []struct {
		name    string
		prompts [][]uint32
		want    float64
	}{
		{"nothing", nil, 0},
		{"one prompt", [][]uint32{cat(a, b)}, 0},
		{"identical twice, multiple of 16: the last block is computed", [][]uint32{cat(a, b), cat(a, b)}, 16.0 / 64},
		{"identical twice, one token over", [][]uint32{cat(a, b, seq(1, 1)), cat(a, b, seq(1, 1))}, 32.0 / 66},
		{"identical twice, one block", [][]uint32{a, a}, 0},
		{"identical twice, under a block", [][]uint32{seq(1, 15), seq(1, 15)}, 0},
		{"three times", [][]uint32{cat(a, b, c), cat(a, b, c), cat(a, b, c)}, 64.0 / 144},
		{"shared prefix, different suffix", [][]uint32{cat(a, b, c), cat(a, b, d)}, 32.0 / 96},
		{"extension of an earlier prompt", [][]uint32{cat(a, b), cat(a, b, c, seq(1, 5))}, 32.0 / 85},
		{"shorter prompt after a longer one", [][]uint32{cat(a, b, c), cat(a, seq(1, 3))}, 16.0 / 67},
		{"prefix is a chain: a middle block alone does not hit", [][]uint32{cat(a, b, c), cat(d, b, c)}, 0},
		{"a different first block spoils the rest", [][]uint32{cat(a, b, c), cat(a, d, c, seq(1, 1))}, 16.0 / 97},
		{"shared only in arrival order", [][]uint32{cat(a, seq(1, 1)), cat(a, b, c)}, 16.0 / 65},
		{"empty prompts count nothing", [][]uint32{nil, cat(a, b), {}, cat(a, b)}, 16.0 / 64},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, sessions := range []string{"one", "each its own"} {
				items := make([]Item, len(tc.prompts))
				for i, p := range tc.prompts {
					items[i] = Item{Prompt: p, SessionID: "s"}
					if sessions != "one" {
						items[i].SessionID = fmt.Sprint("s", i) // sharing across sessions counts
					}
				}
				if got := IdealHitRatio(items, "kvbus-sim", 16); got != tc.want {
					t.Errorf("%s session(s): %v, want %v", sessions, got, tc.want)
				}
			}
		})
	}
	// --block-size is a flag of kvbus replay and bench: a bad value must
	// not panic after a whole replay (integer divide by zero) or give a
	// ratio outside [0, 1].
	t.Run("invalid block size", func(t *testing.T) {
		// Nothing is shared: no block size can make anything hit.
		items := []Item{{Prompt: cat(a, b)}, {Prompt: cat(c, d)}}
		for _, bs := range []int{0, -1, -16} {
			func() {
				defer func() {
					if r := recover(); r != nil {
						t.Errorf("blocks of %d: panic: %v", bs, r)
					}
				}()
				if got := IdealHitRatio(items, "m", bs); got != 0 {
					t.Errorf("blocks of %d: %v for prompts that share nothing, want 0", bs, got)
				}
			}()
		}
	})
	t.Run("block size", func(t *testing.T) {
		items := []Item{{Prompt: cat(a, b)}, {Prompt: cat(a, b)}}
		for _, bs := range []struct {
			size int
			want float64
		}{{1, 31.0 / 64}, {8, 24.0 / 64}, {32, 0}, {64, 0}} {
			if got := IdealHitRatio(items, "m", bs.size); got != bs.want {
				t.Errorf("blocks of %d: %v, want %v", bs.size, got, bs.want)
			}
		}
	})
}

// TestIdealHitRatioSeedsEachModel: a capture of a cluster serving two
// models replays each request with its own model, whose name seeds its
// block hashes in the scheduler: the same prompt under two models shares
// nothing, and the ideal says so. Before, every prompt was hashed with one
// model's seed, and the ideal counted a prefix shared across models.
func TestIdealHitRatioSeedsEachModel(t *testing.T) {
	prompt := seq(1000, 64)
	asks := func(model string) Item {
		req := testRequest("r-"+model, "", 0)
		req.Model, req.PromptTokenIDs = model, prompt
		return Item{Prompt: prompt, Request: req}
	}
	items := []Item{asks("llama"), asks("qwen"), asks("llama")}
	for _, tc := range []struct {
		model string
		want  float64
	}{
		{"", 48.0 / 192},      // each its own model: only the second llama hits
		{"m", 2 * 48.0 / 192}, // --model m: all three ask for m
	} {
		if got := IdealHitRatio(items, tc.model, 16); got != tc.want {
			t.Errorf("model %q: ideal %v, want %v", tc.model, got, tc.want)
		}
	}
	// A trace's items ask for DefaultModel, whatever seeds it.
	trace := []Item{{Prompt: prompt}, {Prompt: prompt}}
	if got, want := IdealHitRatio(trace, "", 16), 48.0/128; got != want {
		t.Errorf("trace: ideal %v, want %v", got, want)
	}
}

// ---------------------------------------------------------------- report

func msDur(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

func TestSummarize(t *testing.T) {
	var results []Result
	for i := 1; i <= 100; i++ {
		results = append(results, Result{
			ReqID: fmt.Sprint("r", i), TurnDepth: 1 + i%5, Group: []string{"g0", "g0", "g1"}[i%3],
			PromptTokens: 100, CachedTokens: 50 * (i % 2), TTFT: msDur(float64(i)), E2E: msDur(float64(2 * i)),
		})
	}
	long := strings.Repeat("x", 300)
	results = append(results,
		Result{ReqID: "f1", TurnDepth: 1, Group: "g2", PromptTokens: 1000, CachedTokens: 1000, TTFT: time.Hour, E2E: time.Hour, Err: "timeout: no answer\nmore detail"},
		Result{ReqID: "f2", TurnDepth: 4, Group: "g2", PromptTokens: 1000, CachedTokens: 1000, TTFT: time.Hour, E2E: time.Hour, Err: "timeout: no answer"},
		Result{ReqID: "f3", Err: long},
	)
	r := Summarize("kv", results, 0.75, 10*time.Second)

	// Turns: i%5 = 0..4 → depth 1..5; depth 4 and 5 are "4+". Cached 50 on
	// odd i only.
	byTurn := map[string]float64{}
	for _, turn := range []string{"1", "2", "3", "4+"} {
		var cached, total float64
		for i := 1; i <= 100; i++ {
			if turnLabel(1+i%5) == turn {
				cached, total = cached+float64(50*(i%2)), total+100
			}
		}
		byTurn[turn] = cached / total
	}
	if r.Policy != "kv" || r.Requests != 103 || r.OK != 100 || r.Failed != 3 {
		t.Errorf("policy %q requests %d ok %d failed %d", r.Policy, r.Requests, r.OK, r.Failed)
	}
	if r.PromptTokens != 10000 || r.CachedTokens != 2500 || *r.HitRatio != 0.25 || r.IdealHitRatio != 0.75 {
		t.Errorf("prompt %d cached %d hit %v ideal %v", r.PromptTokens, r.CachedTokens, *r.HitRatio, r.IdealHitRatio)
	}
	if len(r.HitRatioByTurn) != 4 {
		t.Errorf("by turn %v, want %v", r.HitRatioByTurn, byTurn)
	}
	for turn, want := range byTurn {
		if r.HitRatioByTurn[turn] != want {
			t.Errorf("turn %s: %v, want %v", turn, r.HitRatioByTurn[turn], want)
		}
	}
	if want := (Latency{Mean: 50.5, P50: 50, P95: 95, P99: 99}); r.TTFT == nil || *r.TTFT != want {
		t.Errorf("ttft %+v, want %+v", r.TTFT, want)
	}
	if want := (Latency{Mean: 101, P50: 100, P95: 190, P99: 198}); r.E2E == nil || *r.E2E != want {
		t.Errorf("e2e %+v, want %+v", r.E2E, want)
	}
	if r.DurationS != 10 || r.ThroughputRPS != 10 {
		t.Errorf("duration %v throughput %v, want 10 and 10", r.DurationS, r.ThroughputRPS)
	}
	// g0 gets i%3 ∈ {0,1}: 67 requests, g1 33; failed ones do not count.
	if r.GroupRequests["g0"] != 67 || r.GroupRequests["g1"] != 33 || len(r.GroupRequests) != 2 {
		t.Errorf("groups %v", r.GroupRequests)
	}
	if r.GroupLoadMaxOverMean != 67.0/50 {
		t.Errorf("group load max/mean %v, want %v", r.GroupLoadMaxOverMean, 67.0/50)
	}
	if want := map[string]int{"timeout: no answer": 2, long[:240] + "…": 1}; !equalMaps(r.Errors, want) {
		t.Errorf("errors %v, want %v", r.Errors, want)
	}
}

func equalMaps[K comparable, V comparable](a, b map[K]V) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// TestSummarizeSmall: what no request measured is nil (null in the JSON),
// never a made-up 0.
func TestSummarizeSmall(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	cases := []struct {
		name    string
		results []Result
		elapsed time.Duration
		ttft    *Latency
		hit     *float64
		load    float64
		thr     float64
	}{
		{"nothing", nil, time.Second, nil, nil, 0, 0},
		{"only failures", []Result{{Err: "x", PromptTokens: 5, TTFT: time.Second}}, time.Second, nil, nil, 0, 0},
		{"one", []Result{{TTFT: 1500 * time.Microsecond, PromptTokens: 4, CachedTokens: 1, Group: "g"}}, 0,
			&Latency{Mean: 1.5, P50: 1.5, P95: 1.5, P99: 1.5}, f(0.25), 1, 0},
		{"two", []Result{{TTFT: 10 * time.Millisecond, Group: "a", PromptTokens: 3}, {TTFT: 20 * time.Millisecond, Group: "b", PromptTokens: 3}}, 500 * time.Millisecond,
			&Latency{Mean: 15, P50: 10, P95: 20, P99: 20}, f(0), 1, 4},
		{"sub-microsecond rounding", []Result{{TTFT: 1234567, PromptTokens: 1}, {TTFT: 1234, PromptTokens: 1}}, time.Second,
			&Latency{Mean: 0.618, P50: 0.001, P95: 1.235, P99: 1.235}, f(0), 0, 2},
		{"no groups known", []Result{{TTFT: time.Millisecond, PromptTokens: 1}}, time.Second, &Latency{Mean: 1, P50: 1, P95: 1, P99: 1}, f(0), 0, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := Summarize("p", tc.results, 0, tc.elapsed)
			if !reflect.DeepEqual(r.TTFT, tc.ttft) || !reflect.DeepEqual(r.HitRatio, tc.hit) || r.GroupLoadMaxOverMean != tc.load || r.ThroughputRPS != tc.thr {
				t.Errorf("ttft %+v hit %v load %v throughput %v; want %+v %v %v %v", r.TTFT, r.HitRatio, r.GroupLoadMaxOverMean, r.ThroughputRPS,
					tc.ttft, tc.hit, tc.load, tc.thr)
			}
			if (r.TTFT == nil) != (r.E2E == nil) || (r.HitRatio == nil) != (r.LocalHitRatio == nil) || (r.HitRatio == nil) != (r.RemoteHitRatio == nil) {
				t.Errorf("ttft %v e2e %v hit %v local %v remote %v: all measured or none", r.TTFT, r.E2E, r.HitRatio, r.LocalHitRatio, r.RemoteHitRatio)
			}
			for _, v := range []float64{deref(r.HitRatio), r.GroupLoadMaxOverMean, r.ThroughputRPS} {
				if math.IsNaN(v) || math.IsInf(v, 0) {
					t.Errorf("a non-finite value in %+v", r)
				}
			}
			if _, err := json.Marshal(r); err != nil {
				t.Errorf("report does not encode: %v", err)
			}
		})
	}
}

func testReports() []*Report {
	kv := Summarize("kv", []Result{
		{TurnDepth: 1, PromptTokens: 100, CachedTokens: 0, Group: "g0", TTFT: 5 * time.Millisecond, E2E: 9 * time.Millisecond},
		{TurnDepth: 2, PromptTokens: 200, CachedTokens: 100, RemoteTokens: 60, Group: "g1", TTFT: 7 * time.Millisecond, E2E: 11 * time.Millisecond},
		{TurnDepth: 5, PromptTokens: 300, CachedTokens: 240, Group: "g0", TTFT: 8 * time.Millisecond, E2E: 12 * time.Millisecond},
		{Err: "boom"},
	}, 0.6, 2*time.Second)
	rr := Summarize("round-robin", []Result{
		{TurnDepth: 1, PromptTokens: 100, Group: "g0", TTFT: 6 * time.Millisecond, E2E: 10 * time.Millisecond},
		{TurnDepth: 3, PromptTokens: 200, CachedTokens: 16, Group: "g1", TTFT: 9 * time.Millisecond, E2E: 14 * time.Millisecond},
	}, 0.6, time.Second)
	return []*Report{kv, rr}
}

func TestWriteTable(t *testing.T) {
	var buf bytes.Buffer
	if err := WriteTable(&buf, testReports()); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	rows := map[string]string{}
	var names []string
	var causes []string
	for _, l := range lines {
		if strings.HasPrefix(l, "failed (") {
			causes = append(causes, l)
			continue
		}
		f := strings.Fields(l)
		if len(f) < 3 {
			t.Fatalf("row %q has not a name and two columns", l)
		}
		name := strings.Join(f[:len(f)-2], " ")
		names = append(names, name)
		rows[name] = strings.Join(f[len(f)-2:], " ")
	}
	wantNames := []string{"policy", "requests", "ok", "failed", "throughput req/s", "hit_ratio",
		"local_hit_ratio", "remote_hit_ratio", "remote MiB moved", "ideal_hit_ratio",
		"hit_ratio turn 1", "hit_ratio turn 2", "hit_ratio turn 3", "hit_ratio turn 4+",
		"ttft_ms mean", "ttft_ms p50", "ttft_ms p95", "ttft_ms p99", "e2e_ms mean", "e2e_ms p50", "e2e_ms p95", "e2e_ms p99",
		"group load max/mean"}
	if !slices.Equal(names, wantNames) {
		t.Errorf("rows\n%q\nwant\n%q", names, wantNames)
	}
	if len(causes) != 1 || !strings.HasPrefix(causes[0], "failed (kv): 1 × ") {
		t.Errorf("under the table %q, want kv's one failure and its cause", causes)
	}
	for name, want := range map[string]string{
		"policy": "kv round-robin", "requests": "4 2", "ok": "3 2", "failed": "1 0", "throughput req/s": "1.5 2.0",
		"hit_ratio": "0.567 0.053", "local_hit_ratio": "0.467 0.053", "remote_hit_ratio": "0.100 0.000", "ideal_hit_ratio": "0.600 0.600", "hit_ratio turn 2": "0.500 -",
		"hit_ratio turn 3": "- 0.080", "hit_ratio turn 4+": "0.800 -", "remote MiB moved": "- 0.0", "ttft_ms p50": "7.0 6.0", "e2e_ms p99": "12.0 14.0",
		"group load max/mean": "1.33 1.00",
	} {
		if rows[name] != want {
			t.Errorf("row %q: %q, want %q\n%s", name, rows[name], want, out)
		}
	}
}

func TestWriteJSON(t *testing.T) {
	path := filepath.Join(t.TempDir(), "report.json")
	if err := WriteJSON(path, testReports()); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var got []map[string]any
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatalf("%v:\n%s", err, data)
	}
	if len(got) != 2 {
		t.Fatalf("%d reports, want 2", len(got))
	}
	want := []map[string]any{
		{"policy": "kv", "requests": 4.0, "ok": 3.0, "failed": 1.0, "hit_ratio": 340.0 / 600, "ideal_hit_ratio": 0.6,
			"throughput_rps": 1.5, "group_load_max_over_mean": 2 / 1.5},
		{"policy": "round-robin", "requests": 2.0, "ok": 2.0, "failed": 0.0, "hit_ratio": 16.0 / 300, "ideal_hit_ratio": 0.6,
			"throughput_rps": 2.0, "group_load_max_over_mean": 1.0},
	}
	for i, r := range got {
		for k, v := range want[i] {
			if r[k] != v {
				t.Errorf("report %d: %s = %v (%T), want %v", i, k, r[k], r[k], v)
			}
		}
		for _, k := range []string{"ttft_ms", "e2e_ms"} {
			l, ok := r[k].(map[string]any)
			if !ok {
				t.Errorf("report %d: %s is %T, want an object", i, k, r[k])
				continue
			}
			for _, q := range []string{"mean", "p50", "p95", "p99"} {
				if _, ok := l[q].(float64); !ok {
					t.Errorf("report %d: %s.%s is %T, want a number", i, k, q, l[q])
				}
			}
		}
	}
	if got[0]["ttft_ms"].(map[string]any)["p50"] != 7.0 || got[1]["e2e_ms"].(map[string]any)["p99"] != 14.0 {
		t.Errorf("latencies %v %v", got[0]["ttft_ms"], got[1]["e2e_ms"])
	}
	if err := WriteJSON(filepath.Join(t.TempDir(), "no", "such", "dir.json"), nil); err == nil {
		t.Error("WriteJSON into a missing directory succeeded")
	}
}

// TestInferSessionsOfACapture: sessions inferred for a capture's requests
// (--infer-sessions) reach the replayed requests, as a trace's do; before,
// the report split hit ratios by inferred turns that the scheduler never
// saw. A captured session is kept.
func TestInferSessionsOfACapture(t *testing.T) {
	base := make([]uint32, 2*MooncakeBlockTokens)
	for i := range base {
		base[i] = uint32(i + 1)
	}
	var buf bytes.Buffer
	cw, err := NewCaptureWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	prompts := [][]uint32{base, append(slices.Clone(base), 7, 8, 9), {5, 6}}
	for i, p := range prompts {
		req := &messages.Request{RequestID: fmt.Sprintf("r%d", i), FrontendID: "fe-1", Model: "kvbus-sim", PromptTokenIDs: p}
		if i == 2 {
			req.SessionID = "captured"
			req.SamplingParams.ExtraArgs = messages.Args{messages.ExtraArgSessionID: "captured"}
		}
		data, err := messages.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		if err := cw.Write(Frame{Time: time.Unix(int64(i), 0), Subject: "kvbus.req.kvbus-sim", Payload: data}); err != nil {
			t.Fatal(err)
		}
	}
	if err := cw.Flush(); err != nil {
		t.Fatal(err)
	}
	tr, err := ReadTrace(&buf, FormatCapture)
	if err != nil {
		t.Fatal(err)
	}
	InferSessions(tr, MooncakeBlockTokens)
	if s := tr.Items[0].SessionID; s == "" || s != tr.Items[1].SessionID || tr.Items[2].SessionID != "captured" {
		t.Fatalf("sessions %q %q %q: want the first two inferred alike, the third captured", s, tr.Items[1].SessionID, tr.Items[2].SessionID)
	}
	r := &Replayer{cfg: Config{Model: "kvbus-sim", Timeout: time.Minute}, frontendID: "replay-x"}
	for i := range tr.Items {
		req := r.request(&tr.Items[i], "rp-1")
		if req.SessionID != tr.Items[i].SessionID || req.SamplingParams.SessionFromExtraArgs() != tr.Items[i].SessionID {
			t.Errorf("item %d: session %q, replayed with session_id %q and extra_args session %q",
				i, tr.Items[i].SessionID, req.SessionID, req.SamplingParams.SessionFromExtraArgs())
		}
	}
}

// TestGroupLoadCountsIdleGroups: every request on one group of four is a
// spread of 4.00 once the cluster's groups are known (bench knows them),
// not an even 1.00.
func TestGroupLoadCountsIdleGroups(t *testing.T) {
	var res []Result
	for range 8 {
		res = append(res, Result{ReqID: "x", Group: "g0", PromptTokens: 10, TTFT: time.Millisecond, E2E: time.Millisecond, Sent: time.Now()})
	}
	rep := Summarize("session", res, 0, time.Second)
	if rep.GroupLoadMaxOverMean != 1 {
		t.Fatalf("over the groups that served: %.2f, want 1", rep.GroupLoadMaxOverMean)
	}
	rep.CountGroups([]string{"g0", "g1", "g2", "g3"})
	if rep.GroupLoadMaxOverMean != 4 || len(rep.GroupRequests) != 4 {
		t.Errorf("over the cluster's 4 groups: %.2f (%v), want 4.00", rep.GroupLoadMaxOverMean, rep.GroupRequests)
	}
}

// TestReadJSONRefusesNull: a list of reports with a null in it is not a
// report file (kvbus report panicked on it).
func TestReadJSONRefusesNull(t *testing.T) {
	if _, err := ReadJSON(strings.NewReader(`[null]`)); err == nil {
		t.Error("[null] read as a list of reports")
	}
}

// TestFailuresAreClassed: requests that failed for one cause, with
// different numbers in their messages, count under one key, and the table
// says under it why requests failed.
func TestFailuresAreClassed(t *testing.T) {
	results := []Result{
		{Err: "http 400: total length 16838 exceeds 8192"},
		{Err: "http 400: total length 18053 exceeds 8192"},
		{Err: "http 503: no ready group"},
		{TTFT: time.Millisecond, E2E: time.Millisecond, PromptTokens: 10},
	}
	r := Summarize("kv", results, 0, time.Second)
	if len(r.Errors) != 2 || r.Errors["http 400: total length N exceeds N"] != 2 || r.Errors["http 503: no ready group"] != 1 {
		t.Errorf("errors %v, want the two 400s under one key", r.Errors)
	}
	var b strings.Builder
	if err := WriteTable(&b, []*Report{r}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "failed (kv): 2 × http 400: total length N exceeds N\nfailed (kv): 1 × http 503") {
		t.Errorf("the table does not say why requests failed:\n%s", b.String())
	}
}

// TestReadAzureRowsOutOfOrder: times are relative to the earliest row,
// whichever line it is on. Before, every row earlier than the first line's
// was sent at 0: a 10 s trace replayed as one burst.
func TestReadAzureRowsOutOfOrder(t *testing.T) {
	in := "TIMESTAMP,ContextTokens,GeneratedTokens\n" +
		"2023-11-16 18:17:10.0000000,10,1\n" +
		"2023-11-16 18:17:00.0000000,10,1\n" +
		"2023-11-16 18:17:05.0000000,10,1\n"
	tr, err := ReadTrace(strings.NewReader(in), FormatAzure)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, it := range tr.Items {
		got = append(got, fmt.Sprintf("%s at %v", it.OriginalID, it.At))
	}
	if want := []string{"line-3 at 0s", "line-4 at 5s", "line-2 at 10s"}; !slices.Equal(got, want) {
		t.Errorf("items %q, want %q (times relative to the earliest row)", got, want)
	}
}

// TestReadAzureCutAfterAComma: a file cut in its last line right after a
// comma (head -c, a copy still being written) replays the lines before
// the cut, with a warning, as one cut elsewhere does; it was refused.
// A whole line with an empty count, not the last, is still an error.
func TestReadAzureCutAfterAComma(t *testing.T) {
	in := "TIMESTAMP,ContextTokens,GeneratedTokens\n" +
		"2023-11-16 18:17:03.9799600,4808,10\n" +
		"2023-11-16 18:17:04.0319600,3180,"
	tr, err := ReadTrace(strings.NewReader(in), FormatAuto)
	if err != nil {
		t.Fatalf("a file cut in its last line: %v", err)
	}
	if len(tr.Items) != 1 || len(tr.Damage) != 1 {
		t.Errorf("%d items, damage %q; want 1 item and the cut said", len(tr.Items), tr.Damage)
	}
	if _, err := ReadTrace(strings.NewReader(in+"\n2023-11-16 18:17:05.0319600,10,1\n"), FormatAzure); !errors.Is(err, ErrFormat) {
		t.Errorf("an empty count on a line that is not the last: err %v, want ErrFormat", err)
	}
}

// TestReadAzureLineNumbersAfterABlankLine: errors and original ids name
// the file's own lines, blank lines counted; they were one short after
// each blank line.
func TestReadAzureLineNumbersAfterABlankLine(t *testing.T) {
	in := "TIMESTAMP,ContextTokens,GeneratedTokens\n" +
		"2023-11-16 18:17:03.9799600,4808,10\n" +
		"\n" +
		"2023-11-16 18:17:04.0319600,3180,8\n" + // line 4
		"2023-11-16 18:17:05.0319600,x,8\n" + // line 5: bad
		"2023-11-16 18:17:06.0319600,10,8\n"
	if _, err := ReadTrace(strings.NewReader(in), FormatAzure); err == nil || !strings.Contains(err.Error(), "line 5:") {
		t.Errorf("error %v, want it to name line 5", err)
	}
	tr, err := ReadTrace(strings.NewReader(strings.Replace(in, ",x,", ",7,", 1)), FormatAzure)
	if err != nil {
		t.Fatal(err)
	}
	if got := tr.Items[1].OriginalID; got != "line-4" {
		t.Errorf("the request on line 4 has the original id %q", got)
	}
}

// TestMooncakePromptsHoldNoSpareCapacity: a prompt whose last block is
// partial is built to its length: built whole and cut, a full trace's
// prompts kept about a third more memory than they used, for every policy
// kvbus bench runs.
func TestMooncakePromptsHoldNoSpareCapacity(t *testing.T) {
	in := `{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}` + "\n" +
		`{"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [1, 3]}` + "\n"
	tr, err := ReadTrace(strings.NewReader(in), FormatMooncake)
	if err != nil {
		t.Fatal(err)
	}
	for i, it := range tr.Items {
		if cap(it.Prompt) != len(it.Prompt) {
			t.Errorf("item %d: %d tokens in an array of %d", i, len(it.Prompt), cap(it.Prompt))
		}
	}
	// The first block's tokens are the same in both: a shared prefix.
	if !slices.Equal(tr.Items[0].Prompt[:MooncakeBlockTokens], tr.Items[1].Prompt[:MooncakeBlockTokens]) {
		t.Error("the two prompts differ in their shared first block")
	}
}
