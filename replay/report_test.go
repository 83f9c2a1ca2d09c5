package replay_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

// tooLongMessage is the real frontend's message for a prompt of 1024
// tokens with a context of 600, its long token count read "N".
const tooLongMessage = "The prompt (total length N) is too long to fit into the model (context length 600). " +
	"Make sure that `max_model_len` is no smaller than the number of text tokens plus multimodal tokens."

// failedReplay replays three prompts of 1024 tokens through a real
// frontend whose context is 600 tokens: all three fail with its 400 error
// body, as a replay onto a cluster started without --max-model-len does.
func failedReplay(t *testing.T, policy string) *replay.Report {
	t.Helper()
	c := testenv.StartCluster(t, testenv.ClusterConfig{Payload: "accounting", MaxModelLen: 600})
	var b strings.Builder
	for i := range 3 {
		fmt.Fprintf(&b, `{"timestamp": %d, "input_length": 1024, "output_length": 2, "hash_ids": [%d, %d], "session_id": "s%d"}`+"\n", i, 2*i, 2*i+1, i)
	}
	tr, err := replay.ReadTrace(strings.NewReader(b.String()), replay.FormatMooncake)
	if err != nil {
		t.Fatal(err)
	}
	r, err := replay.New(replay.Config{Target: c.URL, Model: c.Model, Speed: 100})
	if err != nil {
		t.Fatal(err)
	}
	results, elapsed, err := r.Run(t.Context(), tr.Items)
	if err != nil {
		t.Fatal(err)
	}
	rep := replay.Summarize(policy, results, replay.IdealHitRatio(tr.Items, c.Model, 16), elapsed)
	rep.Trace = "/path/to/trace.jsonl"
	if rep.Failed != 3 || rep.OK != 0 {
		t.Fatalf("ok %d failed %d (%v), want the 3 requests refused", rep.OK, rep.Failed, rep.Errors)
	}
	return rep
}

// tableRows parses WriteTable's output: row name → its cells, and the
// lines under the table.
func tableRows(t *testing.T, reports []*replay.Report) (map[string][]string, []string) {
	t.Helper()
	var buf bytes.Buffer
	if err := replay.WriteTable(&buf, reports); err != nil {
		t.Fatal(err)
	}
	rows := map[string][]string{}
	var under []string
	for _, l := range strings.Split(strings.TrimRight(buf.String(), "\n"), "\n") {
		if strings.HasPrefix(l, "failed (") {
			under = append(under, l)
			continue
		}
		f := strings.Fields(l)
		n := len(f) - len(reports)
		rows[strings.Join(f[:n], " ")] = f[n:]
	}
	return rows, under
}

// page is WriteHTML's page of reports.
func page(t *testing.T, reports []*replay.Report) string {
	t.Helper()
	var b bytes.Buffer
	if err := replay.WriteHTML(&b, "test", reports); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// figure returns the cells of the page's Figures row titled title.
func figure(t *testing.T, page, title string) []string {
	t.Helper()
	m := regexp.MustCompile(`<tr><th>` + regexp.QuoteMeta(title) + `</th>((?:<td[^>]*>[^<]*</td>)+)</tr>`).FindStringSubmatch(page)
	if m == nil {
		t.Errorf("the figures have no row %q", title)
		return nil
	}
	var cells []string
	for _, c := range regexp.MustCompile(`<td[^>]*>([^<]*)</td>`).FindAllStringSubmatch(m[1], -1) {
		cells = append(cells, c[1])
	}
	return cells
}

// TestReportOfOnlyFailures: a replay none of whose requests succeeded
// measured no latency and no hit ratio: the JSON says null, the table and
// the page a dash, never a 0 ms TTFT; the page draws no hit ratio bar and
// lists why the requests failed. The JSON reads back and redraws alike.
func TestReportOfOnlyFailures(t *testing.T) {
	rep := failedReplay(t, "kv")
	path := filepath.Join(t.TempDir(), "r.json")
	if err := replay.WriteJSON(path, []*replay.Report{rep}); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var got []map[string]any
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"ttft_ms", "e2e_ms", "hit_ratio", "local_hit_ratio", "remote_hit_ratio"} {
		if v, ok := got[0][k]; !ok || v != nil {
			t.Errorf("%s = %v (present %v), want null: no request measured it", k, v, ok)
		}
	}
	if got[0]["ideal_hit_ratio"] != 0.0 || got[0]["failed"] != 3.0 {
		t.Errorf("ideal_hit_ratio %v failed %v: the trace's figures are still numbers", got[0]["ideal_hit_ratio"], got[0]["failed"])
	}

	rows, _ := tableRows(t, []*replay.Report{rep})
	for _, name := range []string{"hit_ratio", "local_hit_ratio", "remote_hit_ratio",
		"ttft_ms mean", "ttft_ms p50", "ttft_ms p95", "ttft_ms p99", "e2e_ms mean", "e2e_ms p50", "e2e_ms p95", "e2e_ms p99"} {
		if c := rows[name]; len(c) != 1 || c[0] != "-" {
			t.Errorf("table row %q: %q, want -", name, c)
		}
	}

	s := page(t, []*replay.Report{rep})
	for _, title := range []string{"TTFT mean (ms)", "TTFT p50 (ms)", "TTFT p95 (ms)", "TTFT p99 (ms)", "e2e latency p95 (ms)", "hit ratio (cached / prompt tokens)"} {
		if c := figure(t, s, title); len(c) != 1 || c[0] != "–" {
			t.Errorf("figure %q: %q, want –", title, c)
		}
	}
	if strings.Contains(s, "turn 1: 0.000") {
		t.Error("the page draws a measured 0.000 hit ratio bar where no request succeeded")
	}
	if !strings.Contains(s, "Failed requests") || !strings.Contains(s, "<td>3</td><td class=\"cause\">http 400 invalid_request_error: The prompt") {
		t.Errorf("the page does not list why the requests failed:\n%s", s)
	}

	again, err := replay.ReadJSONFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if redrawn := page(t, again); redrawn != s {
		t.Error("the page redrawn from the JSON report differs")
	}
	path2 := filepath.Join(t.TempDir(), "again.json")
	if err := replay.WriteJSON(path2, again); err != nil {
		t.Fatal(err)
	}
	if data2, _ := os.ReadFile(path2); !bytes.Equal(data2, data) {
		t.Errorf("the report read back writes\n%s\nwant\n%s", data2, data)
	}
}

// TestErrorKeysAreWholeOpenAIErrors: an OpenAI error body is keyed by its
// status, code (else type) and whole message, not cut in the middle of the
// JSON; anything else by its first line, cut at a character boundary.
func TestErrorKeysAreWholeOpenAIErrors(t *testing.T) {
	rep := failedReplay(t, "kv")
	want := "http 400 invalid_request_error: " + tooLongMessage
	if rep.Errors[want] != 3 || len(rep.Errors) != 1 {
		t.Errorf("errors %v, want 3 × %q", rep.Errors, want)
	}
	if _, under := tableRows(t, []*replay.Report{rep}); len(under) != 1 || under[0] != "failed (kv): 3 × "+want {
		t.Errorf("under the table %q, want the whole cause", under)
	}

	long := strings.Repeat("é", 200) // 400 bytes
	cases := []struct{ err, key string }{
		{`http 404: {"error":{"message":"The model ` + "`x`" + ` does not exist.","type":"not_found_error","param":"model","code":"model_not_found"}}`,
			"http 404 model_not_found: The model `x` does not exist."},
		{"http 400: {\n  \"error\": {\n    \"message\": \"prompt of 12345 tokens\",\n    \"type\": \"BadRequestError\",\n    \"code\": 400\n  }\n}",
			"http 400 BadRequestError: prompt of N tokens"},
		{`http 400: {"object":"error","message":"bad\nlines","type":"BadRequestError","param":null,"code":400}`,
			"http 400 BadRequestError: bad lines"},
		{`http 502: {"error":"upstream"}`, `http 502: {"error":"upstream"}`},
		{"http 500: <html>\n<body>oops</body>", "http 500: <html>"},
		{"timeout: no answer within 10m0s", "timeout: no answer within 10m0s"},
		{long, long[:240] + "…"},
		{"x" + long, "x" + long[:238] + "…"},
	}
	for _, tc := range cases {
		r := replay.Summarize("kv", []replay.Result{{Err: tc.err}}, 0, time.Second)
		if r.Errors[tc.key] != 1 || len(r.Errors) != 1 {
			t.Errorf("error %q: keys %v, want %q", tc.err, r.Errors, tc.key)
		}
		for k := range r.Errors {
			if !utf8.ValidString(k) {
				t.Errorf("error %q: key %q is not valid UTF-8", tc.err, k)
			}
		}
	}
}

// TestHitByTurnLeavesOutDepthsWithoutRequests: a turn depth at which a
// report had no request is not a measured 0.000, on the page or in the
// table; a depth no report had is not drawn.
func TestHitByTurnLeavesOutDepthsWithoutRequests(t *testing.T) {
	kv := replay.Summarize("kv", []replay.Result{
		{TurnDepth: 1, PromptTokens: 100, CachedTokens: 0, TTFT: time.Millisecond, E2E: time.Millisecond},
		{TurnDepth: 2, PromptTokens: 100, CachedTokens: 50, TTFT: time.Millisecond, E2E: time.Millisecond},
	}, 0.5, time.Second)
	rr := replay.Summarize("rr", []replay.Result{
		{TurnDepth: 1, PromptTokens: 100, CachedTokens: 0, TTFT: time.Millisecond, E2E: time.Millisecond},
		{TurnDepth: 3, PromptTokens: 100, CachedTokens: 20, TTFT: time.Millisecond, E2E: time.Millisecond},
	}, 0.5, time.Second)
	s := page(t, []*replay.Report{kv, rr})
	for _, bad := range []string{"kv turn 3: 0.000", "rr turn 2: 0.000", "turn 4+"} {
		if strings.Contains(s, bad) {
			t.Errorf("the page draws %q", bad)
		}
	}
	for _, want := range []string{"kv turn 2: 0.500", "rr turn 3: 0.200", "kv turn 3: no requests", "rr turn 2: no requests"} {
		if !strings.Contains(s, want) {
			t.Errorf("the page does not say %q", want)
		}
	}
	rows, _ := tableRows(t, []*replay.Report{kv, rr})
	for name, want := range map[string]string{"hit_ratio turn 1": "0.000 0.000", "hit_ratio turn 2": "0.500 -", "hit_ratio turn 3": "- 0.200"} {
		if got := strings.Join(rows[name], " "); got != want {
			t.Errorf("table row %q: %q, want %q", name, got, want)
		}
	}
	if _, ok := rows["hit_ratio turn 4+"]; ok {
		t.Error("the table has a row for a depth no report had")
	}
}

// TestHTMLFiguresShowEveryField: the page's figures are the report's
// (DESIGN §8: requests, ok, failed, hit ratios, TTFT and end-to-end
// p50/p95/p99, throughput, group load spread), each titled with its unit.
func TestHTMLFiguresShowEveryField(t *testing.T) {
	reps := reports()
	s := page(t, reps)
	for title, want := range map[string]string{
		"requests":              "200 200",
		"ok (requests)":         "200 200",
		"failed (requests)":     "0 0",
		"throughput (ok req/s)": "2.0 2.0",
		"TTFT mean (ms)":        "109.5 219.0",
		"TTFT p50 (ms)":         "109.0 218.0",
		"TTFT p95 (ms)":         "199.0 398.0",
		"TTFT p99 (ms)":         "207.0 414.0",
		"e2e latency mean (ms)": "199.5 199.5",
		"e2e latency p50 (ms)":  "199.0 199.0",
		"e2e latency p95 (ms)":  "289.0 289.0",
		"e2e latency p99 (ms)":  "297.0 297.0",
		"group load (busiest / mean requests per group)":          "1.00 1.00",
		"hit ratio (cached / prompt tokens)":                      "0.200 0.200",
		"ideal hit ratio (infinite shared cache / prompt tokens)": "0.400 0.400",
	} {
		if got := strings.Join(figure(t, s, title), " "); got != want {
			t.Errorf("figure %q: %q, want %q", title, got, want)
		}
	}
	for _, bare := range []string{"<th>p50</th>", "<th>p95</th>", "<th>p99 (ms)</th>", "<th>ideal</th>", "<th>req/s</th>"} {
		if strings.Contains(s, bare) {
			t.Errorf("the figures have a column %s that does not say what it is", bare)
		}
	}
}

// TestTTFTCDFSaysWhereItIsCut: the CDF's x axis ends past the largest
// p99; the slower requests are not piled at its edge as if they took that
// long, and the page says how many were left out and how slow the slowest
// was.
func TestTTFTCDFSaysWhereItIsCut(t *testing.T) {
	var res []replay.Result
	for i := range 100 {
		res = append(res, replay.Result{PromptTokens: 10, TTFT: time.Duration(10+i) * time.Millisecond, E2E: time.Second})
	}
	res = append(res, replay.Result{PromptTokens: 10, TTFT: 5 * time.Second, E2E: 6 * time.Second})
	tail := replay.Summarize("tail", res, 0, time.Second)
	s := page(t, []*replay.Report{tail})
	if !strings.Contains(s, "x axis cut at 200 ms") || !strings.Contains(s, "tail: up to 1% of requests") || !strings.Contains(s, "slowest 5000 ms") {
		t.Errorf("the page does not say that the CDF is cut:\n%s", s)
	}
	if strings.Contains(s, " 704.0,12.0\"") {
		t.Error("the slowest request is drawn at the axis' edge as if it took 200 ms")
	}
	if s := page(t, reports()); strings.Contains(s, "x axis cut") {
		t.Error("a CDF cut at none of its points says it is cut")
	}
}

// TestChartTicksAreExact: an axis to 0.1 is ticked 0.025, 0.05, 0.075,
// not 0.03 and 0.08.
func TestChartTicksAreExact(t *testing.T) {
	rep := replay.Summarize("kv", []replay.Result{{PromptTokens: 100, CachedTokens: 6, TTFT: time.Millisecond, E2E: time.Millisecond}}, 0.06, time.Second)
	s := page(t, []*replay.Report{rep})
	for _, want := range []string{">0.025<", ">0.05<", ">0.075<", ">0.1<"} {
		if !strings.Contains(s, want) {
			t.Errorf("no tick %s", want)
		}
	}
	for _, bad := range []string{">0.03<", ">0.08<"} {
		if strings.Contains(s, bad) {
			t.Errorf("a rounded tick %s", bad)
		}
	}
}

// TestEmptyPolicyLabel: a replay without --policy-label is labelled
// "replay", and a report without a policy (an older JSON file) is never
// shown as "()" or with a leading space.
func TestEmptyPolicyLabel(t *testing.T) {
	rep := replay.Summarize("", []replay.Result{{Err: "boom"}, {PromptTokens: 10, TTFT: time.Millisecond, E2E: time.Millisecond}}, 0, time.Second)
	if rep.Policy != "replay" {
		t.Errorf("policy %q, want replay", rep.Policy)
	}
	old, err := replay.ReadJSON(strings.NewReader(`[{"policy": "", "trace": "/path/to/trace", "requests": 1, "failed": 1, "errors": {"boom": 1}}]`))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []*replay.Report{rep, old[0]} {
		r.Trace = "/path/to/trace"
		var table bytes.Buffer
		if err := replay.WriteTable(&table, []*replay.Report{r}); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(table.String(), "failed (replay): 1 × boom") || strings.Contains(table.String(), "()") {
			t.Errorf("table:\n%s", table.String())
		}
		s := page(t, []*replay.Report{r})
		if strings.Contains(s, "()") || strings.Contains(s, "> (") || !strings.Contains(s, "replay (/path/to/trace)") {
			t.Errorf("page labels:\n%s", s)
		}
	}
}

// TestGroupLoadOfNoSuccessIsNoData: a bench run in which no request
// succeeded knows its groups (CountGroups) but no load: the table and the
// page read "-" and "–", as the JSON leaves group_load_max_over_mean out.
// Before, both showed 0.00, a figure no spread of requests can have.
func TestGroupLoadOfNoSuccessIsNoData(t *testing.T) {
	rep := replay.Summarize("kv", []replay.Result{{ReqID: "a", PromptTokens: 10, Err: "timeout"}}, 0, time.Second)
	rep.CountGroups([]string{"g0", "g1"})
	data, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(data, []byte("group_load_max_over_mean")) {
		t.Errorf("JSON %s has a group load", data)
	}
	rows, _ := tableRows(t, []*replay.Report{rep})
	if c := rows["group load max/mean"]; len(c) != 1 || c[0] != "-" {
		t.Errorf("table row group load max/mean: %q, want -", c)
	}
	if c := figure(t, page(t, []*replay.Report{rep}), "group load (busiest / mean requests per group)"); len(c) != 1 || c[0] != "–" {
		t.Errorf("figure group load: %q, want –", c)
	}
}

// TestIdealHitRatioKeepsSaltsApart: a captured request's cache_salt seeds
// its blocks as the scheduler seeds them, so the ideal cache shares blocks
// only between prompts of the same salt.
func TestIdealHitRatioKeepsSaltsApart(t *testing.T) {
	prompt := make([]uint32, 33) // two full blocks and one token more
	for i := range prompt {
		prompt[i] = uint32(i + 1)
	}
	item := func(salt string) replay.Item {
		return replay.Item{Prompt: prompt, Request: &messages.Request{Model: "m", CacheSalt: salt, PromptTokenIDs: prompt}}
	}
	for _, tc := range []struct {
		salts []string
		want  float64 // cached tokens over 33 per prompt
	}{
		{[]string{"a", "b", ""}, 0},
		{[]string{"a", "a"}, 32.0 / 66},
		{[]string{"a", "b", "a", "b"}, 64.0 / 132},
		{[]string{"", ""}, 32.0 / 66},
	} {
		var items []replay.Item
		for _, s := range tc.salts {
			items = append(items, item(s))
		}
		if got := replay.IdealHitRatio(items, "", 16); got != tc.want {
			t.Errorf("salts %q: ideal hit ratio %v, want %v", tc.salts, got, tc.want)
		}
	}
}

// TestIdealHitRatioKeepsAdaptersApart: a captured request's LoRA adapter
// seeds its blocks as the scheduler seeds them, so the ideal cache shares
// nothing between an adapter's prompts and the base model's, unless the
// replay asks for another model (--model), which sends every request
// without its adapter (Replayer.request): then they share as the replay's
// do. Before, the adapter still counted there, and a replay that found
// more cached than that ideal was warned of a hit ratio above it.
func TestIdealHitRatioKeepsAdaptersApart(t *testing.T) {
	prompt := make([]uint32, 33) // two full blocks and one token more
	for i := range prompt {
		prompt[i] = uint32(i + 1)
	}
	items := []replay.Item{
		{Prompt: prompt, Request: &messages.Request{Model: "m", LoRAName: "sql-lora", PromptTokenIDs: prompt}},
		{Prompt: prompt, Request: &messages.Request{Model: "m", PromptTokenIDs: prompt}},
	}
	for _, tc := range []struct {
		model string
		want  float64
	}{{"", 0}, {"m", 0}, {"other", 32.0 / 66}} {
		if got := replay.IdealHitRatio(items, tc.model, 16); got != tc.want {
			t.Errorf("model %q: ideal hit ratio %v, want %v", tc.model, got, tc.want)
		}
	}
}
