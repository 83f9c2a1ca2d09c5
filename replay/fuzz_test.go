package replay

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"
)

// maxFuzzInput keeps fuzz inputs small: a reader materialises every
// prompt, so input size bounds the work of one run.
const maxFuzzInput = 1 << 16

// checkTrace checks what every reader promises: no panic (the caller got
// here), errors that say what is wrong, and items that can be replayed.
func checkTrace(t *testing.T, format string, tr *Trace, err error) {
	t.Helper()
	if err != nil {
		if !errors.Is(err, ErrFormat) && !errors.Is(err, ErrNotCapture) && !errors.Is(err, ErrCorrupt) {
			t.Fatalf("error %v wraps none of ErrFormat, ErrNotCapture, ErrCorrupt", err)
		}
		if tr != nil {
			t.Fatalf("a trace and an error")
		}
		return
	}
	if format != FormatAuto && tr.Format != format {
		t.Fatalf("format %q, asked for %q", tr.Format, format)
	}
	if !slices.Contains([]string{FormatCapture, FormatMooncake, FormatTraceLab, FormatAzure}, tr.Format) {
		t.Fatalf("format %q", tr.Format)
	}
	for i, it := range tr.Items {
		switch {
		case len(it.Prompt) == 0:
			t.Fatalf("item %d (%s): empty prompt", i, it.OriginalID)
		case it.At < 0:
			t.Fatalf("item %d (%s): negative time %v", i, it.OriginalID, it.At)
		case it.OutputTokens < 0:
			t.Fatalf("item %d (%s): negative output tokens %d", i, it.OriginalID, it.OutputTokens)
		case i > 0 && it.At < tr.Items[i-1].At:
			t.Fatalf("item %d (%s): at %v before item %d at %v", i, it.OriginalID, it.At, i-1, tr.Items[i-1].At)
		}
	}
	_ = tr.Sessions()
	_ = IdealHitRatio(tr.Items, "m", 16)
}

var mooncakeSeeds = []string{
	mooncakeFixture,
	`{"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": [0]}`,
	`{"timestamp": 0, "input_length": 513, "output_length": 0, "hash_ids": [0]}`,
	`{"timestamp": 0, "input_length": 512, "output_length": 0, "hash_ids": [0, 1]}`,
	`{"timestamp": -0, "input_length": 1, "output_length": -0, "hash_ids": [-9223372036854775808]}`,
	`{"timestamp": 31536000000, "input_length": 1, "output_length": 9223372036854775807, "hash_ids": [1]}`,
	`{"timestamp": 1e-300, "input_length": 1, "output_length": 0, "hash_ids": [1], "session_id": {"a": [1]}}`,
	`{"timestamp": 1, "input_length": 1, "output_length": 0, "hash_ids": [1], "session_id": ""}` + "\n\r\n\t\n" + `{"timestamp": 1}`,
	`{"timestamp": NaN, "input_length": 1, "output_length": 0, "hash_ids": [1]}`,
	`{"timestamp": 1, "input_length": 1, "output_length": 0, "hash_ids": [1]` + "\n",
	`{"timestamp": 1, "input_length": 1, "output_length": 0, "hash_ids": null}`,
	"null\n[]\n{}\n",
}

var traceLabSeeds = []string{
	traceLabFixture,
	tlLine("s", 0, 1, 0, 0, "2026-01-01T00:00:00Z"),
	tlLine("s", 0, 1, 5, 0, "2026-01-01T00:00:00Z") + "\n" + tlLine("s", 0, 1, 5, 0, "2025-01-01T00:00:00Z"),
	tlLine("s", -1, 10, 3, 2, "0001-01-01T00:00:00Z") + "\n" + tlLine("s", 1, 10, 3, 2, "9999-12-31T23:59:59.999999999Z"),
	tlLine("a", 3, 1000, 999, 1, "2026-01-01T00:00:00Z") + "\n" + tlLine("b", 3, 1000, 999, 1, "2026-01-01T00:00:00Z"),
	tlLine("s", 0, 4194305, 0, 0, "2026-01-01T00:00:00Z"),
	tlLine("s", 0, 0, 0, 0, "2026-01-01T00:00:00Z"),
	tlLine("s", 0, 10, 0, 1, "not a time"),
	`{"session_id": "s", "round_index": 0, "input_tokens_total": 1, "output_tokens": 0, "timing_events": [{}]}`,
	`{"session_id": "s", "round_index": 0, "input_tokens_total": 1, "output_tokens": 0, "timing_events": [{"timestamp": "2026-01-01T00:00:00Z"}], "prefix_tokens": null}`,
	`{"session_id": "s",`,
}

var azureSeeds = []string{
	azureFixture,
	"TIMESTAMP,ContextTokens,GeneratedTokens\n",
	"TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:17:03,1,0\r\n",
	"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:05,1,0\n2023-11-16 18:17:03,1,0\n0001-01-01 00:00:00,1,0\n9999-12-31 23:59:59.9999999,1,0\n",
	"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4194305,1\n",
	"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,0,1\n",
	"TIMESTAMP,ContextTokens,GeneratedTokens\n\"2023-11-16 18:17:03\",\"1\",\"2\"\n",
	"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,1\n",
	"TIMESTAMP\n",
	"",
}

// captureSeeds are capture files: valid ones and near misses.
func captureSeeds(f *testing.F) [][]byte {
	valid := captureFixture(f)
	return [][]byte{
		valid,
		captureBytes(f),
		captureBytes(f, Frame{Time: t0, Subject: "kvbus.req.m", Payload: []byte("junk")}),
		valid[:len(valid)-1],
		valid[:13],
		append([]byte("KVBUSCAP\x02\x00\x00\x00"), valid[12:]...),
		append(append([]byte{}, valid[:12]...), 0xff, 0xff, 0xff, 0xff),
	}
}

func FuzzReadMooncake(f *testing.F) {
	for _, s := range mooncakeSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > maxFuzzInput {
			t.Skip()
		}
		tr, err := ReadTrace(bytes.NewReader(data), FormatMooncake)
		checkTrace(t, FormatMooncake, tr, err)
		if err == nil {
			for _, it := range tr.Items {
				if !strings.HasPrefix(it.OriginalID, "line-") {
					t.Fatalf("original id %q", it.OriginalID)
				}
			}
		}
	})
}

func FuzzReadTraceLab(f *testing.F) {
	for _, s := range traceLabSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > maxFuzzInput {
			t.Skip()
		}
		tr, err := ReadTrace(bytes.NewReader(data), FormatTraceLab)
		checkTrace(t, FormatTraceLab, tr, err)
		if err != nil {
			return
		}
		// Every session starts at time 0.
		first := map[string]time.Duration{}
		for _, it := range tr.Items {
			if it.SessionID == "" {
				t.Fatalf("item %s without a session", it.OriginalID)
			}
			if _, ok := first[it.SessionID]; !ok {
				first[it.SessionID] = it.At
			}
		}
		for sid, at := range first {
			if at != 0 {
				t.Fatalf("session %q starts at %v", sid, at)
			}
		}
	})
}

func FuzzReadAzure(f *testing.F) {
	for _, s := range azureSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > maxFuzzInput {
			t.Skip()
		}
		tr, err := ReadTrace(bytes.NewReader(data), FormatAzure)
		checkTrace(t, FormatAzure, tr, err)
		if err == nil && len(tr.Items) > 0 && tr.Items[0].At != 0 {
			t.Fatalf("first item at %v", tr.Items[0].At)
		}
	})
}

func FuzzReadTraceAuto(f *testing.F) {
	for _, s := range slices.Concat(mooncakeSeeds, traceLabSeeds, azureSeeds) {
		f.Add([]byte(s))
	}
	for _, s := range captureSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > maxFuzzInput {
			t.Skip()
		}
		tr, err := ReadTrace(bytes.NewReader(data), FormatAuto)
		checkTrace(t, FormatAuto, tr, err)
	})
}

func FuzzCaptureReader(f *testing.F) {
	for _, s := range captureSeeds(f) {
		f.Add(s)
	}
	f.Add([]byte(mooncakeFixture))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > maxFuzzInput {
			t.Skip()
		}
		_, _ = Stats(bytes.NewReader(data))
		cr, err := NewCaptureReader(bytes.NewReader(data))
		if err != nil {
			if !errors.Is(err, ErrNotCapture) {
				t.Fatalf("NewCaptureReader: %v, want ErrNotCapture", err)
			}
			return
		}
		var frames []Frame
		for {
			fr, err := cr.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				if !errors.Is(err, ErrCorrupt) {
					t.Fatalf("Next: %v, want ErrCorrupt", err)
				}
				break
			}
			frames = append(frames, fr)
		}
		// Whatever was read writes back and reads again the same.
		cr2, err := NewCaptureReader(bytes.NewReader(captureBytes(t, frames...)))
		if err != nil {
			t.Fatal(err)
		}
		for i, want := range frames {
			got, err := cr2.Next()
			if err != nil {
				t.Fatalf("frame %d rewritten: %v", i, err)
			}
			if got.Time.UnixNano() != want.Time.UnixNano() || got.Subject != want.Subject || !bytes.Equal(got.Payload, want.Payload) {
				t.Fatalf("frame %d rewritten: %+v, want %+v", i, got, want)
			}
		}
		if _, err := cr2.Next(); err != io.EOF {
			t.Fatalf("after the rewritten frames: %v", err)
		}
	})
}

// FuzzErrorClass: any error, whatever its body, has a key of
// Report.Errors: one printable line of valid UTF-8, bounded, and no panic.
func FuzzErrorClass(f *testing.F) {
	for _, s := range []string{
		`http 400: {"error":{"message":"The prompt (total length 16838) is too long.","type":"invalid_request_error","param":"prompt","code":null}}`,
		`http 404: {"error":{"message":"no","type":"not_found_error","code":"model_not_found"}}`,
		`http 400: {"object":"error","message":"m","type":"BadRequestError","param":null,"code":400}`,
		"http 400: {\n \"error\": {\"message\": \"a\\nb\", \"type\": 7}}",
		`http 400: {"error":null}`, `http 400: {"error":"x"}`, `http 400: [1,2]`, `http 4000: {}`, "http : ", "http 400:",
		"timeout: no answer\nmore", strings.Repeat("é", 300), "x" + strings.Repeat("é", 300), "\xff\xfe" + strings.Repeat("1", 500), "0\r0", "\x1b[31mred\x1b[0m", "",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		k := errorClass(s)
		if strings.IndexFunc(k, unicode.IsControl) >= 0 {
			t.Fatalf("key %q of %q has a line break or another control character", k, s)
		}
		if len(k) > maxErrorKey+len("…") {
			t.Fatalf("key of %d bytes, over %d", len(k), maxErrorKey)
		}
		if !utf8.ValidString(k) {
			t.Fatalf("key %q of %q is not valid UTF-8", k, s)
		}
	})
}

// FuzzReadJSON: a report file (kvbus report --html reads any file given
// it) is read or refused with an error, never a panic, and what is read
// can be drawn as the table and the page. (ReadJSON had no fuzz target.)
func FuzzReadJSON(f *testing.F) {
	rep := Summarize("kv", []Result{
		{TurnDepth: 1, PromptTokens: 100, CachedTokens: 40, RemoteTokens: 8, Group: "g0", Sent: t0, TTFT: time.Millisecond, E2E: 3 * time.Millisecond},
		{TurnDepth: 4, PromptTokens: 50, Group: "g1", Sent: t0.Add(time.Second), TTFT: 2 * time.Millisecond, E2E: 5 * time.Millisecond},
		{TurnDepth: 2, Err: "http 503: no"},
	}, 0.5, time.Second)
	var good bytes.Buffer
	if err := json.NewEncoder(&good).Encode([]*Report{rep, Summarize("", nil, 0, 0)}); err != nil {
		f.Fatal(err)
	}
	for _, s := range []string{
		good.String(), `{"policy":"x"}`, `[]`, `[null]`, `null`, `{}`, `[{}]`, `"x"`,
		`[{"ttft_cdf_ms":[1e308,-1,0],"hit_ratio_by_turn":{"zz\t\n":2,"1":-1},"group_timeline":{"bucket_s":0,"groups":{"g":[-5,1e9]}}}]`,
		`[{"group_timeline":{"bucket_s":-1,"groups":{"":[]}},"group_requests":{"a":-3},"errors":{"\u001b[31m":-1},"failed":2}]`,
		`[{"hit_ratio":-0.5,"local_hit_ratio":2,"remote_hit_ratio":null,"ideal_hit_ratio":1e300,"policy":"` + strings.Repeat("é", 40) + `"}]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > maxFuzzInput {
			return
		}
		reports, err := ReadJSON(bytes.NewReader(data))
		if err != nil {
			if reports != nil {
				t.Fatalf("reports and an error")
			}
			return
		}
		if slices.Contains(reports, nil) {
			t.Fatalf("a nil report")
		}
		if err := WriteTable(io.Discard, reports); err != nil {
			t.Fatal(err)
		}
		if err := WriteHTML(io.Discard, "fuzz", reports); err != nil {
			t.Fatal(err)
		}
	})
}

// FuzzReadStream: a streamed /v1/completions answer, whatever the server
// sends, gives a result that is a failure, or a success with its TTFT
// before its end and cached tokens within the prompt. (The stream parser
// had no fuzz target.)
func FuzzReadStream(f *testing.F) {
	for _, s := range []string{
		"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"usage\":{\"prompt_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\ndata: [DONE]\n\n",
		"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":11}}}\ndata: [DONE]\n",
		"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":-1}}}\ndata: [DONE]\n",
		"data: {\"error\":{\"message\":\"m\",\"code\":\"c\"}}\n\ndata: [DONE]\n\n",
		"data: [DONE]\n", "data: {}\n", ": ping\n\n", "data: {\"usage\":null}\n", "data: " + strings.Repeat("x", 70000) + "\n", "",
	} {
		f.Add([]byte(s), 10)
	}
	f.Fuzz(func(t *testing.T, data []byte, prompt int) {
		if len(data) > maxFuzzInput || prompt < 0 {
			return
		}
		res := Result{Sent: time.Now()}
		readStream(bytes.NewReader(data), prompt, &res)
		if res.Err != "" {
			return
		}
		if res.TTFT <= 0 || res.E2E < res.TTFT {
			t.Fatalf("a success with TTFT %v and E2E %v", res.TTFT, res.E2E)
		}
		if res.CachedTokens < 0 || res.CachedTokens > prompt {
			t.Fatalf("a success with %d cached tokens of a %d-token prompt", res.CachedTokens, prompt)
		}
	})
}
