package replay_test

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/replay"
)

// reports are two policies' summaries of a small synthetic run.
func reports() []*replay.Report {
	start := time.Unix(1_700_000_000, 0)
	var a, b []replay.Result
	for i := range 200 {
		res := replay.Result{ReqID: "r", SessionID: "s", TurnDepth: 1 + i%5, Group: []string{"g0", "g1"}[i%2],
			PromptTokens: 1000, CachedTokens: 100 * (i % 5), Sent: start.Add(time.Duration(i) * 500 * time.Millisecond),
			TTFT: time.Duration(10+i) * time.Millisecond, E2E: time.Duration(100+i) * time.Millisecond}
		a = append(a, res)
		res.TTFT *= 2
		res.RemoteTokens = res.CachedTokens / 2
		b = append(b, res)
	}
	return []*replay.Report{replay.Summarize("kv", a, 0.4, 100*time.Second), replay.Summarize("round-robin <b>", b, 0.4, 100*time.Second)}
}

// TestHTMLReport: the page is self-contained (no script, no external
// resource), has its four plots with one curve per report, escapes labels,
// and is redrawn identically from the JSON report (kvbus report --html).
func TestHTMLReport(t *testing.T) {
	reps := reports()
	if len(reps[0].TTFTCDF) != 101 || reps[0].TTFTCDF[0] != 10 || reps[0].TTFTCDF[100] != 209 {
		t.Fatalf("TTFT CDF %v", reps[0].TTFTCDF)
	}
	if tl := reps[0].GroupTimeline; tl == nil || tl.BucketS != 2 || len(tl.Groups["g0"]) != 50 || tl.Groups["g0"][0] != 2 {
		t.Fatalf("timeline %+v", reps[0].GroupTimeline)
	}
	var page bytes.Buffer
	if err := replay.WriteHTML(&page, "bench <test>", reps); err != nil {
		t.Fatal(err)
	}
	s := page.String()
	for _, bad := range []string{"<script", "http://", "https://", "<b>"} {
		if strings.Contains(strings.ReplaceAll(s, `xmlns="http://www.w3.org/2000/svg"`, ""), bad) {
			t.Errorf("the page contains %q", bad)
		}
	}
	// CDF: one curve per report; timelines: one per group per report.
	if n := strings.Count(s, "<svg"); n != 5 {
		t.Errorf("%d plots, want 5 (CDF, hit by turn, local/remote, two timelines)", n)
	}
	if n := strings.Count(s, "<polyline"); n != 2+4 {
		t.Errorf("%d curves, want 6", n)
	}
	if !strings.Contains(s, "round-robin &lt;b&gt;") || !strings.Contains(s, "bench &lt;test&gt;") {
		t.Error("labels are not escaped")
	}

	path := filepath.Join(t.TempDir(), "r.json")
	if err := replay.WriteJSON(path, reps); err != nil {
		t.Fatal(err)
	}
	again, err := replay.ReadJSONFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var redrawn bytes.Buffer
	if err := replay.WriteHTML(&redrawn, "bench <test>", again); err != nil {
		t.Fatal(err)
	}
	if redrawn.String() != s {
		t.Error("the page redrawn from the JSON report differs")
	}
}
