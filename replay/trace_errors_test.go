package replay

import (
	"bytes"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// TestEmptyTraceSaysSo: an empty file (or one of blank lines) is said to
// be empty. Before, it read "cannot tell the format; give --format …",
// sending the user after a flag that cannot help.
func TestEmptyTraceSaysSo(t *testing.T) {
	for _, in := range []string{"", "\n\n", " \r\n\t\n", "\xef\xbb\xbf"} {
		_, err := ReadTrace(strings.NewReader(in), FormatAuto)
		if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), "empty") || strings.Contains(err.Error(), "--format") {
			t.Errorf("%q: error %v, want ErrFormat saying the file is empty", in, err)
		}
	}
}

// TestWrongFormatNamesTheFilesFormat: a trace read with a --format that is
// not its own says which format the file looks like. Before, reading the
// Azure CSV as mooncake said only "line 1: invalid character 'T' looking
// for beginning of value".
func TestWrongFormatNamesTheFilesFormat(t *testing.T) {
	cases := []struct {
		data, format, want string
	}{
		{azureFixture, FormatMooncake, "--format azure"},
		{azureFixture, FormatTraceLab, "--format azure"},
		{mooncakeFixture, FormatTraceLab, "--format mooncake"},
		{mooncakeFixture, FormatAzure, "--format mooncake"},
		{traceLabFixture, FormatMooncake, "--format tracelab"},
		{mooncakeFixture, FormatCapture, "--format mooncake"},
	}
	for _, tc := range cases {
		_, err := ReadTrace(strings.NewReader(tc.data), tc.format)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("a %s file read as %s: error %v, want one saying %q", detectFormat([]byte(tc.data)), tc.format, err, tc.want)
		}
	}
	// A file of its own format that is wrong says only what is wrong.
	_, err := ReadTrace(strings.NewReader(`{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": []}`+"\n"), FormatMooncake)
	if err == nil || strings.Contains(err.Error(), "looks like") {
		t.Errorf("a bad mooncake line: %v, want no other format named", err)
	}
}

// TestLongLineSaysWhatIsWrong: a line over the limit names its line and
// the limit. Before: "line 2: bufio.Scanner: token too long".
func TestLongLineSaysWhatIsWrong(t *testing.T) {
	const good = `{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}`
	input := good + "\n" + `{"timestamp": 1, "pad": "` + strings.Repeat("x", maxTraceLineBytes) + `"}` + "\n"
	_, err := ReadTrace(strings.NewReader(input), FormatMooncake)
	wantFormatErr(t, err, 2)
	if err == nil || !strings.Contains(err.Error(), "16 MiB") || strings.Contains(err.Error(), "token too long") {
		t.Errorf("error %v, want the line's limit in MiB", err)
	}
}

// TestCutLastLineIsLeftOut: a trace whose last line was cut short (a copy
// of a trace still being written, head -c) replays the lines before it,
// as a capture with a cut tail does, and says what it left out (Damage).
// Before, the whole trace was refused ("line 4: unexpected end of JSON
// input"), and no --limit could get past it. A bad line anywhere else, a
// last line that is whole but wrong, or a cut line followed by a line
// break (a line written short, not a file cut) stays an error.
func TestCutLastLineIsLeftOut(t *testing.T) {
	const mc = `{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}`
	tl := tlLine("s", 0, 10, 0, 1, "2026-01-01T00:00:00Z")
	const azHdr, az = "TIMESTAMP,ContextTokens,GeneratedTokens\n", "2023-11-16 18:17:03.9799600,4808,10"
	cases := []struct {
		name, format, input string
		items, cutLine      int // cutLine 0: an error
	}{
		{"mooncake", FormatMooncake, mc + "\n" + mc + "\n" + mc[:30], 2, 3},
		{"mooncake CRLF", FormatMooncake, mc + "\r\n" + mc[:len(mc)-1], 1, 2},
		{"mooncake only line", FormatMooncake, mc[:20], 0, 1},
		{"tracelab", FormatTraceLab, tl + "\n" + tl[:40], 1, 2},
		{"azure", FormatAzure, azHdr + az + "\n" + az[:20], 1, 3},
		{"azure cut after a comma", FormatAzure, azHdr + az + "\n" + az[:28], 1, 3},
		{"mooncake cut line then a line break", FormatMooncake, mc + "\n" + mc[:30] + "\n", 0, 0},
		{"mooncake cut line in the middle", FormatMooncake, mc + "\n" + mc[:30] + "\n" + mc + "\n", 0, 0},
		{"mooncake whole but wrong last line", FormatMooncake, mc + "\n" + `{"timestamp": 1}`, 0, 0},
		{"mooncake not JSON last line", FormatMooncake, mc + "\n" + `hello`, 0, 0},
		{"azure bad count last line", FormatAzure, azHdr + az + "\n" + "2023-11-16 18:17:03.9799600,x,1", 0, 0},
		{"azure four fields last line", FormatAzure, azHdr + az + "\n" + az + ",1", 0, 0},
		{"azure cut line then a line break", FormatAzure, azHdr + az + "\n" + az[:20] + "\n", 0, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := ReadTrace(strings.NewReader(tc.input), tc.format)
			if tc.cutLine == 0 {
				if err == nil {
					t.Fatalf("accepted (%d items, damage %q), want an error", len(tr.Items), tr.Damage)
				}
				wantFormatErr(t, err, 0)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(tr.Items) != tc.items || len(tr.Damage) != 1 || !strings.Contains(tr.Damage[0], "line "+strconv.Itoa(tc.cutLine)+", the last, is cut short") {
				t.Errorf("%d items, damage %q; want %d items and line %d said to be cut short", len(tr.Items), tr.Damage, tc.items, tc.cutLine)
			}
		})
	}
	// Through auto detection too.
	tr, err := ReadTrace(strings.NewReader(mc+"\n"+mc[:30]), FormatAuto)
	if err != nil || len(tr.Items) != 1 || len(tr.Damage) != 1 {
		t.Errorf("auto: %v, %+v", err, tr)
	}
}

// TestReadJSONRefusesUnknownTurnDepths: a report file whose
// hit_ratio_by_turn has depths no report has is refused, naming one. Each
// depth is a row of the table and bars of the page for every report: a
// 64 KiB file of a thousand depths and a thousand reports drew a page of
// millions of cells (found by FuzzReadJSON, which stalled on it).
func TestReadJSONRefusesUnknownTurnDepths(t *testing.T) {
	var b strings.Builder
	b.WriteString(`[{"policy":"a","hit_ratio_by_turn":{`)
	for d := range 1000 {
		if d > 0 {
			b.WriteString(",")
		}
		b.WriteString(`"` + strconv.Itoa(d+5) + `":0.5`)
	}
	b.WriteString(`}}` + strings.Repeat(`,{}`, 1000) + `]`)
	reports, err := ReadJSON(strings.NewReader(b.String()))
	if err == nil || reports != nil || !strings.Contains(err.Error(), "hit_ratio_by_turn") {
		t.Errorf("%d reports, error %v; want the file refused for its turn depths", len(reports), err)
	}
	reports, err = ReadJSON(strings.NewReader(`[{"policy":"a","hit_ratio_by_turn":{"1":0,"2":0.5,"3":0.7,"4+":0.9}}]`))
	if err != nil || len(reports) != 1 {
		t.Errorf("a report of depths 1, 2, 3, 4+: %v", err)
	}
}

// TestReadJSONRefusesWhatIsNoReport: JSON that is not a report (another
// tool's, a trace's line) is refused, saying what to give; kvbus report
// read it as a report of nothing, drew an empty page and exited 0. What
// WriteJSON writes is still read, a report with no requests included.
func TestReadJSONRefusesWhatIsNoReport(t *testing.T) {
	for _, in := range []string{`{"x":1}`, `{}`, `[{}]`, `[{"policy":"kv"},{"requests":3}]`,
		`{"timestamp": 0, "input_length": 512, "output_length": 2, "hash_ids": [0]}`} {
		reports, err := ReadJSON(strings.NewReader(in))
		if err == nil || reports != nil || !strings.Contains(err.Error(), "not a kvbus report") || !strings.Contains(err.Error(), "--json") {
			t.Errorf("%s: %d reports, error %v; want it refused as no report, saying what to give", in, len(reports), err)
		}
	}
	path := t.TempDir() + "/report.json"
	if err := WriteJSON(path, []*Report{Summarize("kv", nil, 0, 0), Summarize("", nil, 0, 0)}); err != nil {
		t.Fatal(err)
	}
	if reports, err := ReadJSONFile(path); err != nil || len(reports) != 2 {
		t.Errorf("WriteJSON's reports read back: %d, %v", len(reports), err)
	}
}

// TestStatsAgreesWithReplay: capture stats counts the sessions a replay of
// the file has (a session given only in extra_args is one), and its span
// runs from the earliest frame to the latest, whatever their order in the
// file (a live capture's frames are in arrival order). Before, a file whose
// last frame was logged before its first read as a negative span, and
// sessions in extra_args were not counted.
func TestStatsAgreesWithReplay(t *testing.T) {
	xargs := testRequest("r2", "", 20)
	xargs.SamplingParams.ExtraArgs = messages.Args{messages.ExtraArgSessionID: "only-xargs"}
	otherModel := testRequest("r5", "s1", 10)
	otherModel.Model = "m2"
	data := captureBytes(t,
		Frame{Time: t0.Add(time.Second), Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r1", "s1", 10))},
		Frame{Time: t0.Add(3 * time.Second), Subject: "kvbus.req.m", Payload: marshal(t, xargs)},
		Frame{Time: t0, Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r3", "s1", 5))},
		// An empty prompt: a replay leaves it out, and so do the stats
		// (it counted as a request, with a session of its own).
		Frame{Time: t0.Add(2 * time.Second), Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r4", "only-empty", 0))},
		// s1 of another model: another conversation (it counted as s1).
		Frame{Time: t0.Add(2500 * time.Millisecond), Subject: "kvbus.req.m2", Payload: marshal(t, otherModel)},
	)
	s, err := Stats(bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	tr, err := ReadTrace(bytes.NewReader(data), FormatCapture)
	if err != nil {
		t.Fatal(err)
	}
	if s.Sessions != tr.Sessions() || s.Sessions != 3 {
		t.Errorf("stats count %d sessions, a replay %d; want 3 (s1 of m and of m2, only-xargs)", s.Sessions, tr.Sessions())
	}
	if want := map[string]int{"m": 3, "m2": 1}; !equalMaps(s.Models, want) {
		t.Errorf("requests by model %v, want %v (the empty prompt left out)", s.Models, want)
	}
	if s.Requests-s.Malformed != len(tr.Items) || s.PromptTokens.Min != 5 {
		t.Errorf("stats: %d requests, %d malformed, shortest prompt %d; a replay sends %d requests, the shortest of 5 tokens",
			s.Requests, s.Malformed, s.PromptTokens.Min, len(tr.Items))
	}
	if s.Span != 3*time.Second || !s.First.Equal(t0) || !s.Last.Equal(t0.Add(3*time.Second)) {
		t.Errorf("span %v from %v to %v, want 3s from the earliest frame to the latest", s.Span, s.First, s.Last)
	}
}

// TestCaptureReplaysAskedAgainOnce: a request a frontend published again,
// its answer lost on the bus (a new id, AgainOf the first), is one request
// of its client: a replay of the capture sends it once, and the stats
// count it apart. Before, the replay sent it twice, as two turns of its
// session, the second hitting the first's blocks: requests, turn depths
// and hit ratios counted a request the client sent once.
func TestCaptureReplaysAskedAgainOnce(t *testing.T) {
	again := testRequest("r1-again1", "s1", 10)
	again.AgainOf = "r1"
	orphan := testRequest("r9-again1", "s2", 10) // its first is not in the file
	orphan.AgainOf = "r9"
	data := captureBytes(t,
		Frame{Time: t0, Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r1", "s1", 10))},
		Frame{Time: t0.Add(time.Second), Subject: "kvbus.req.m", Payload: marshal(t, again)},
		Frame{Time: t0.Add(2 * time.Second), Subject: "kvbus.req.m", Payload: marshal(t, orphan)},
	)
	tr, err := ReadTrace(bytes.NewReader(data), FormatCapture)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, it := range tr.Items {
		ids = append(ids, it.OriginalID)
	}
	if !slices.Equal(ids, []string{"r1", "r9-again1"}) {
		t.Errorf("replayed %q, want r1 and r9-again1", ids)
	}
	s, err := Stats(bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	if s.AskedAgain != 1 || s.Requests-s.Malformed-s.AskedAgain != len(tr.Items) {
		t.Errorf("stats: %d requests, %d malformed, %d asked again; a replay sends %d", s.Requests, s.Malformed, s.AskedAgain, len(tr.Items))
	}
	r, err := New(Config{Target: "http://127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	if req := r.request(&tr.Items[1], "rp-1"); req.AgainOf != "" {
		t.Errorf("the replayed request is again of %q, want a request of its own", req.AgainOf)
	}
}
