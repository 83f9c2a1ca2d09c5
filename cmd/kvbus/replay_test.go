package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/alecthomas/kong"

	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

// tinyTrace writes a Mooncake trace of n requests, two sessions.
func tinyTrace(t *testing.T, n int) string {
	t.Helper()
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, `{"timestamp": %d, "input_length": 40, "output_length": 2, "hash_ids": [%d], "session_id": "s%d"}`+"\n", i*10, i%2, i%2)
	}
	path := filepath.Join(t.TempDir(), "trace.jsonl")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestFailedCaptureKeepsTheFile: a capture that fails (here: no request log
// under its prefix) leaves the file it was to replace as it was; it
// truncated it to nothing. Flags that exclude each other are refused.
func TestFailedCaptureKeepsTheFile(t *testing.T) {
	srv := testenv.StartNATS(t)
	out := filepath.Join(t.TempDir(), "x.kvcap")
	if err := os.WriteFile(out, []byte("an earlier capture"), 0o644); err != nil {
		t.Fatal(err)
	}
	c := parseCLI(t, "capture", "--out", out, "--nats-url", srv.ClientURL(), "--subject-prefix", "foo")
	c.Capture.Record.out = &testenv.LogBuffer{}
	err := c.Capture.Record.Run(t.Context())
	if err == nil || !strings.Contains(err.Error(), "--subject-prefix") {
		t.Errorf("capture of a prefix without a log: %v, want an error naming --subject-prefix", err)
	}
	if b, _ := os.ReadFile(out); string(b) != "an earlier capture" {
		t.Errorf("the failed capture left %q in the file", b)
	}
	if left, _ := filepath.Glob(filepath.Join(filepath.Dir(out), ".*partial")); len(left) > 0 {
		t.Errorf("temporary files left: %v", left)
	}
	for _, args := range [][]string{
		{"--for", "3s"},
		{"--since", "2026-01-01T00:00:00Z", "--from-seq", "3"},
	} {
		c := parseCLI(t, append([]string{"capture", "--out", out, "--nats-url", srv.ClientURL()}, args...)...)
		c.Capture.Record.out = &testenv.LogBuffer{}
		if err := c.Capture.Record.Run(t.Context()); err == nil {
			t.Errorf("capture %v: no error", args)
		}
	}
}

// TestReplayFailsWhenNothingSucceeds: a replay none of whose requests
// succeeded exits with an error naming the cause (here a bus without this
// prefix's request log, which the error says), and still writes its
// report; an unwritable --json fails before anything is replayed.
func TestReplayFailsWhenNothingSucceeds(t *testing.T) {
	srv := testenv.StartNATS(t)
	trace := tinyTrace(t, 3)
	report := filepath.Join(t.TempDir(), "r.json")
	c := parseCLI(t, "replay", trace, "--target", srv.ClientURL(), "--subject-prefix", "elsewhere", "--speed", "100", "--json", report)
	c.Replay.out = &testenv.LogBuffer{}
	err := c.Replay.Run(t.Context())
	if err == nil || !strings.Contains(err.Error(), "none of the 3 requests succeeded") || !strings.Contains(err.Error(), "--subject-prefix") {
		t.Errorf("replay onto no request log: %v; want an error saying none succeeded and naming --subject-prefix", err)
	}
	var reports []map[string]any
	if b, err := os.ReadFile(report); err != nil || json.Unmarshal(b, &reports) != nil || len(reports) != 1 || reports[0]["failed"] != 3.0 {
		t.Errorf("report %s: %v, %v", report, reports, err)
	}

	begin := time.Now()
	c = parseCLI(t, "replay", trace, "--target", srv.ClientURL(), "--json", filepath.Join(t.TempDir(), "no", "such", "dir", "r.json"))
	c.Replay.out = &testenv.LogBuffer{}
	if err := c.Replay.Run(t.Context()); err == nil || !strings.Contains(err.Error(), "--json") {
		t.Errorf("replay with an unwritable --json: %v, want an error naming --json", err)
	}
	if took := time.Since(begin); took > 5*time.Second {
		t.Errorf("the unwritable --json was found after %s", took)
	}
}

// TestBenchFlagsAndInterruption: sizes a run cannot use are refused at
// once, and a bench interrupted in its second policy still reports the
// first.
func TestBenchFlagsAndInterruption(t *testing.T) {
	trace := tinyTrace(t, 4)
	for _, args := range [][]string{{"--groups", "0"}, {"--ranks", "0"}, {"--limit=-5"}, {"--speed", "0"}} {
		// Refused by the command line's number check (TestNumberFlags), or
		// by bench itself.
		var c cli
		p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"), kong.Exit(func(int) {}))
		if err != nil {
			t.Fatal(err)
		}
		if _, err = p.Parse(append([]string{"bench", "--trace", trace}, args...)); err == nil {
			c.Bench.out = &testenv.LogBuffer{}
			err = c.Bench.Run(t.Context())
		}
		if err == nil || !strings.Contains(err.Error(), strings.TrimLeft(strings.Split(args[0], "=")[0], "-")) {
			t.Errorf("bench %v: %v, want an error naming the flag", args, err)
		}
	}

	report := filepath.Join(t.TempDir(), "r.json")
	c := parseCLI(t, "bench", "--trace", trace, "--policies", "round-robin,random", "--groups", "1", "--ranks", "1",
		"--kv-capacity", "64MiB", "--speed", "1000", "--json", report)
	logs := &testenv.LogBuffer{}
	c.Bench.out = logs
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go func() {
		for ctx.Err() == nil && len(logs.Lines("bench: starting a cluster")) < 2 {
			time.Sleep(5 * time.Millisecond)
		}
		cancel() // in the second policy's run
	}()
	err := c.Bench.Run(ctx)
	if err == nil {
		t.Fatal("an interrupted bench returned no error")
	}
	if msg := err.Error(); !strings.Contains(msg, "bench interrupted in policy random") || !strings.Contains(msg, "policies that finished") {
		t.Errorf("error %q, want one saying the bench was interrupted in policy random and what the report holds", msg)
	}
	var reports []map[string]any
	if b, rerr := os.ReadFile(report); rerr != nil || json.Unmarshal(b, &reports) != nil || len(reports) != 1 || reports[0]["policy"] != "round-robin" || reports[0]["ok"] != 4.0 {
		t.Errorf("after an interruption (%v) the report holds %v (%v); want round-robin's run of 4 requests", err, reports, rerr)
	}
}

// TestReplayModelFlag: `replay --model` applies to a capture's requests
// too: a capture of a cluster that served "prod-model" replays on one that
// serves kvbus-sim when told so; without --model each request keeps its
// own (here refused: model_not_found). Before, --model was ignored for
// captures, and its default made "given" undetectable.
func TestReplayModelFlag(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Payload: "accounting"})
	path := filepath.Join(t.TempDir(), "prod.kvcap")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	cw, err := replay.NewCaptureWriter(f)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		data, err := messages.Marshal(&messages.Request{RequestID: fmt.Sprint("prod-", i), FrontendID: "fe-prod", Model: "prod-model",
			Endpoint: messages.EndpointCompletions, PromptTokenIDs: testenv.PromptTokens(i, 40), SamplingParams: messages.SamplingParams{MaxTokens: 2}})
		if err != nil {
			t.Fatal(err)
		}
		if err := cw.Write(replay.Frame{Time: time.Unix(int64(i), 0), Subject: "kvbus.req.prod-model", Payload: data}); err != nil {
			t.Fatal(err)
		}
	}
	if err := errors.Join(cw.Flush(), f.Close()); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) error {
		c := parseCLI(t, append([]string{"replay", path, "--target", c.URL, "--nats-url", c.NATS.ClientURL(), "--speed", "100"}, args...)...)
		c.Replay.out = &testenv.LogBuffer{}
		return c.Replay.Run(t.Context())
	}
	if err := run("--model", c.Model); err != nil {
		t.Errorf("replay --model %s of a prod-model capture: %v", c.Model, err)
	}
	if err := run(); err == nil || !strings.Contains(err.Error(), "model_not_found") {
		t.Errorf("replay of a prod-model capture without --model: %v, want its own model asked for and refused", err)
	}
}

// TestBenchInterruptedBeforeAnyPolicySaysSo: Ctrl-C in the first policy's
// run says that the bench was interrupted and that there is nothing to
// report, and how to make a bench shorter. Before: "policy round-robin,
// pool global: context canceled".
func TestBenchInterruptedBeforeAnyPolicySaysSo(t *testing.T) {
	report := filepath.Join(t.TempDir(), "r.json")
	c := parseCLI(t, "bench", "--trace", tinyTrace(t, 4), "--policies", "round-robin,random", "--groups", "1", "--ranks", "1",
		"--kv-capacity", "64MiB", "--speed", "1000", "--json", report)
	logs := &testenv.LogBuffer{}
	c.Bench.out = logs
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go func() {
		for ctx.Err() == nil && len(logs.Lines("bench: starting a cluster")) < 1 {
			time.Sleep(time.Millisecond)
		}
		cancel() // in the first policy's run
	}()
	err := c.Bench.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), "bench interrupted in policy round-robin") ||
		!strings.Contains(err.Error(), "nothing to report") || !strings.Contains(err.Error(), "--limit") {
		t.Errorf("error %v, want one saying the bench was interrupted before any policy finished, and how to shorten it", err)
	}
	if _, serr := os.Stat(report); serr == nil {
		t.Errorf("an interrupted bench with no finished policy wrote %s", report)
	}
}

// TestReplayInterruptedSaysWhatTheReportHolds: a replay stopped by Ctrl-C
// says how many of its requests were sent before it, and that the others
// count as failed. Before: "context canceled".
func TestReplayInterruptedSaysWhatTheReportHolds(t *testing.T) {
	cl := testenv.StartCluster(t, testenv.ClusterConfig{Payload: "accounting"})
	// 3 requests at once, then 5 more a minute later: never sent.
	var b strings.Builder
	for i := range 8 {
		fmt.Fprintf(&b, `{"timestamp": %d, "input_length": 40, "output_length": 2, "hash_ids": [%d]}`+"\n", (i/3)*60000, i)
	}
	path := filepath.Join(t.TempDir(), "trace.jsonl")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	c := parseCLI(t, "replay", path, "--target", cl.NATS.ClientURL(), "--model", cl.Model)
	logs := &testenv.LogBuffer{}
	c.Replay.out = logs
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go func() {
		// The first three are sent and answered: the scheduler logged them
		// done (the replay's ids are rp-*). Interrupted then, or after 30 s
		// at most (the error below then says what was sent).
		deadline := time.Now().Add(30 * time.Second)
		for ctx.Err() == nil && time.Now().Before(deadline) && len(cl.Logs.Lines("request done", "req_id=rp-")) < 3 {
			time.Sleep(time.Millisecond)
		}
		cancel()
	}()
	err := c.Replay.Run(ctx)
	if err == nil || !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "replay interrupted") ||
		!strings.Contains(err.Error(), "the 3 of the 8 requests sent before it") || !strings.Contains(err.Error(), "the 5 never sent") {
		t.Errorf("error %v, want one saying the replay was interrupted after sending 3 of 8 requests", err)
	}
}

// TestTraceLoadSaysWhatIsWrong: a trace with no request says so and names
// the file; a --skip past its end names --skip. Before, both read "the
// trace has no request to replay (check --skip and --limit)", given no
// --skip or --limit at all. A trace whose last line was cut short replays
// the lines before it, with a warning.
func TestTraceLoadSaysWhatIsWrong(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	const line = `{"timestamp": 1, "input_length": 40, "output_length": 2, "hash_ids": [1]}`
	logs := &testenv.LogBuffer{}
	log := logFlags{out: logs}.logger()

	empty := write("empty.jsonl", "\n\n")
	_, err := traceFlags{Format: replay.FormatMooncake}.load(empty, 16, log)
	if err == nil || !strings.Contains(err.Error(), empty) || !strings.Contains(err.Error(), "holds no request") || strings.Contains(err.Error(), "--skip") {
		t.Errorf("empty trace: %v, want an error naming the file and saying it holds no request", err)
	}
	_, err = traceFlags{Format: replay.FormatAuto}.load(empty, 16, log)
	if err == nil || !strings.Contains(err.Error(), "empty") {
		t.Errorf("empty trace, auto: %v, want an error saying the file is empty", err)
	}

	two := write("two.jsonl", line+"\n"+line+"\n")
	_, err = traceFlags{Format: replay.FormatAuto, Skip: 2}.load(two, 16, log)
	if err == nil || !strings.Contains(err.Error(), "--skip 2 leaves none of the 2 requests") {
		t.Errorf("--skip 2 of 2: %v, want an error naming --skip", err)
	}
	tr, err := traceFlags{Format: replay.FormatAuto, Skip: 1}.load(two, 16, log)
	if err != nil || len(tr.Items) != 1 {
		t.Errorf("--skip 1 of 2: %v, %v", tr, err)
	}

	cut := write("cut.jsonl", line+"\n"+line+"\n"+line[:25])
	tr, err = traceFlags{Format: replay.FormatAuto}.load(cut, 16, log)
	if err != nil || len(tr.Items) != 2 {
		t.Fatalf("a trace with a cut last line: %v, %v; want its 2 whole lines", tr, err)
	}
	if w := logs.Lines("damaged mooncake file"); len(w) != 1 || !strings.Contains(w[0], "line 3, the last, is cut short") {
		t.Errorf("warnings %q, want one saying line 3 was cut short", w)
	}
}

// TestBenchRefusesARepeatedPolicyOrPool: --policies kv,kv ran kv twice
// into two columns and two JSON reports named kv that nothing could tell
// apart; it is refused before any cluster starts, pointing to --runs.
func TestBenchRefusesARepeatedPolicyOrPool(t *testing.T) {
	trace := tinyTrace(t, 2)
	for _, args := range [][]string{{"--policies", "kv,round-robin, kv"}, {"--pool", "local,global,local"}} {
		c := parseCLI(t, append([]string{"bench", "--trace", trace}, args...)...)
		logs := &testenv.LogBuffer{}
		c.Bench.out = logs
		err := c.Bench.Run(t.Context())
		if err == nil || !strings.Contains(err.Error(), "twice") || !strings.Contains(err.Error(), "--runs") {
			t.Errorf("bench %v: %v, want an error saying it names one twice, pointing to --runs", args, err)
		}
		if n := len(logs.Lines("bench: starting a cluster")); n != 0 {
			t.Errorf("bench %v started %d clusters before refusing", args, n)
		}
	}
}

// TestCaptureOfNothingKeepsTheFile: a capture that copies no request (a
// --since past the last request, a --follow during which nothing came)
// says so and leaves the file it was to replace as it was. Before, it
// exited 0 with "capture done requests=0" having replaced an earlier
// capture of that name with an empty one, which replay then refused.
func TestCaptureOfNothingKeepsTheFile(t *testing.T) {
	cl := testenv.StartCluster(t, testenv.ClusterConfig{Payload: "accounting"})
	out := filepath.Join(t.TempDir(), "x.kvcap")
	if err := os.WriteFile(out, []byte("an earlier capture"), 0o644); err != nil {
		t.Fatal(err)
	}
	future := time.Now().Add(24 * time.Hour).UTC().Format(time.RFC3339)
	for _, args := range [][]string{{"--since", future}, {"--follow", "--for", "300ms"}} {
		c := parseCLI(t, append([]string{"capture", "--out", out, "--nats-url", cl.NATS.ClientURL()}, args...)...)
		c.Capture.Record.out = &testenv.LogBuffer{}
		err := c.Capture.Record.Run(t.Context())
		if err == nil || !strings.Contains(err.Error(), "left as it was") {
			t.Errorf("capture %v: %v, want an error saying nothing was captured and the file is left as it was", args, err)
		}
		if b, _ := os.ReadFile(out); string(b) != "an earlier capture" {
			t.Errorf("capture %v of nothing left %q in the file", args, b)
		}
		if left, _ := filepath.Glob(filepath.Join(filepath.Dir(out), ".*partial")); len(left) > 0 {
			t.Errorf("temporary files left: %v", left)
		}
	}
}

// TestReplayOverItsIdealWarns: a replay onto a cluster whose cache already
// holds the trace's prompts (here: the same trace replayed a second time)
// reads a hit_ratio over its ideal_hit_ratio, which counts only what the
// replay stores; it says why, and what to do for a measurement. Before, the
// report stood unexplained, hit_ratio 0.9 of an "ideal" 0.5.
func TestReplayOverItsIdealWarns(t *testing.T) {
	cl := testenv.StartCluster(t, testenv.ClusterConfig{Payload: "accounting"})
	trace := tinyTrace(t, 4)
	for run := range 2 {
		c := parseCLI(t, "replay", trace, "--target", cl.NATS.ClientURL(), "--model", cl.Model, "--mode", "session", "--speed", "100")
		logs := &testenv.LogBuffer{}
		c.Replay.out = logs
		if err := c.Replay.Run(t.Context()); err != nil {
			t.Fatal(err)
		}
		warned := len(logs.Lines("hit_ratio is over ideal_hit_ratio")) > 0
		if warned != (run == 1) {
			t.Errorf("run %d: warned %v; want a warning only when the cache held the trace before (run 1)", run, warned)
		}
	}
}

// TestCaptureWithAnotherKeyStopsAtOnce: with `kvbus auth` keys, capture
// given a key other than admin's (the observer's, a role's) stops at once
// saying it needs the admin key, and leaves the file as it was. Before, its
// JetStream calls went unanswered on a reply inbox the key may not read: it
// waited 5 s and ended with "context deadline exceeded" and the hint twice.
func TestCaptureWithAnotherKeyStopsAtOnce(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t)
	out := filepath.Join(t.TempDir(), "x.kvcap")
	if err := os.WriteFile(out, []byte("an earlier capture"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"observer", "frontend", "worker"} {
		c := parseCLI(t, "capture", "--out", out, "--nats-url", srv.ClientURL(), "--nats-nkey", filepath.Join(dir, key+".nk"))
		c.Capture.Record.out = &testenv.LogBuffer{}
		start := time.Now()
		err := c.Capture.Record.Run(t.Context())
		took := time.Since(start)
		if err == nil || !strings.Contains(err.Error(), "admin key") || strings.Contains(err.Error(), "deadline") {
			t.Errorf("capture with the %s key: %v, want an error saying it needs the admin key", key, err)
		}
		if took > 2*time.Second {
			t.Errorf("capture with the %s key took %v to fail, want at once", key, took.Round(time.Millisecond))
		}
		if b, _ := os.ReadFile(out); string(b) != "an earlier capture" {
			t.Errorf("capture with the %s key left %q in the file", key, b)
		}
	}
}

// TestTraceLabRoundBeforeItsPreviousIsRefused: a TraceLab session whose
// round 2 starts before its round 1 (a trace edited or merged by hand)
// is refused, naming the line. Before, the rounds were timed by their
// timestamps and sent in that order: round 2, whose prompt is built on
// round 1's conversation, went to the cluster before round 1, in both
// modes, and the turn depths and hit ratios counted that order.
func TestTraceLabRoundBeforeItsPreviousIsRefused(t *testing.T) {
	round := func(k int, ts string) string {
		return fmt.Sprintf(`{"session_id": "s", "round_index": %d, "input_tokens_total": %d, "prefix_tokens": %d, "output_tokens": 5, "timing_events": [{"timestamp": %q}]}`,
			k, 100*(k+1), 100*k, ts)
	}
	path := filepath.Join(t.TempDir(), "rounds.jsonl")
	trace := round(0, "2026-06-01T05:40:20Z") + "\n" + round(1, "2026-06-01T05:40:40Z") + "\n" + round(2, "2026-06-01T05:40:30Z") + "\n"
	if err := os.WriteFile(path, []byte(trace), 0o644); err != nil {
		t.Fatal(err)
	}
	cl := testenv.StartCluster(t, testenv.ClusterConfig{Payload: "accounting"})
	for _, mode := range []string{"open", "session"} {
		c := parseCLI(t, "replay", path, "--target", cl.NATS.ClientURL(), "--mode", mode, "--speed", "1000")
		err := c.Replay.Run(t.Context())
		if err == nil || !strings.Contains(err.Error(), "line 3:") || !strings.Contains(err.Error(), "round 2") ||
			!strings.Contains(err.Error(), "before round 1 (line 2)") {
			t.Errorf("--mode %s: %v, want an error naming line 3 and saying round 2 starts before round 1 (line 2)", mode, err)
		}
	}
}

// TestBenchJSONSaysNothingMovedAsZero: a bench run in which no block
// moved between groups (one group, or --pool local) reports remote_bytes
// 0 in its JSON, as its table reads 0.0 MiB. Before, the key was left
// out whenever it was 0, so a bench's JSON had it for one policy and not
// for the next, and a reader could not tell "nothing moved" from a
// replay's "not known".
func TestBenchJSONSaysNothingMovedAsZero(t *testing.T) {
	trace := tinyTrace(t, 4)
	report := filepath.Join(t.TempDir(), "r.json")
	c := parseCLI(t, "bench", "--trace", trace, "--policies", "kv", "--pool", "local", "--groups", "1", "--ranks", "1",
		"--kv-capacity", "64MiB", "--speed", "1000", "--json", report)
	c.Bench.out = &testenv.LogBuffer{}
	if err := c.Bench.Run(t.Context()); err != nil {
		t.Fatal(err)
	}
	var reports []map[string]any
	b, err := os.ReadFile(report)
	if err != nil || json.Unmarshal(b, &reports) != nil || len(reports) != 1 {
		t.Fatalf("report %s: %v", b, err)
	}
	if v, ok := reports[0]["remote_bytes"]; !ok || v != 0.0 {
		t.Errorf("remote_bytes %v (present: %v), want 0: nothing moved, and bench knows it", v, ok)
	}
}

// TestAzureUnclosedQuoteIsAnError: an Azure CSV with a quote the reader
// cannot parse (an unclosed quoted field, a stray quote) is an error
// naming the line. Before, `kvbus replay` and `kvbus bench` panicked
// ("out of range index passed to FieldPos"): the line of a record the
// CSV reader returned no field of was asked of its first field.
func TestAzureUnclosedQuoteIsAnError(t *testing.T) {
	for name, bad := range map[string]string{"unclosed": `"2023-11-16 18:17:05,12,3`, "stray": `2023-11-16 "18:17:05,12,3`} {
		path := filepath.Join(t.TempDir(), "azure.csv")
		trace := "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n" + bad + "\n2023-11-16 18:17:06.0000000,10,1\n"
		if err := os.WriteFile(path, []byte(trace), 0o644); err != nil {
			t.Fatal(err)
		}
		c := parseCLI(t, "replay", path, "--target", "nats://127.0.0.1:1")
		err := c.Replay.Run(t.Context())
		if err == nil || !errors.Is(err, replay.ErrFormat) || !strings.Contains(err.Error(), "line 3:") {
			t.Errorf("%s quote: %v, want a format error naming line 3", name, err)
		}
	}
}

// TestHugeBadFieldIsNotQuotedWhole: a trace line whose timestamp or token
// count is megabytes long (a file that is not the trace it claims to be)
// is an error naming the line that quotes the start of the field, not all
// of it. Before, the error quoted it whole: a 10 MB line on the operator's
// terminal (twice over for a TraceLab timestamp, via time.Parse's error).
func TestHugeBadFieldIsNotQuotedWhole(t *testing.T) {
	huge := strings.Repeat("7", 1<<20)
	for name, trace := range map[string]string{
		"tracelab timestamp": `{"session_id": "s", "round_index": 0, "input_tokens_total": 10, "output_tokens": 1, "timing_events": [{"timestamp": "` + huge + `"}]}` + "\n",
		"azure timestamp":    "TIMESTAMP,ContextTokens,GeneratedTokens\n" + huge + ",12,3\n",
		"azure count":        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:05.0000000," + huge + ",3\n",
	} {
		path := filepath.Join(t.TempDir(), "trace")
		if err := os.WriteFile(path, []byte(trace), 0o644); err != nil {
			t.Fatal(err)
		}
		c := parseCLI(t, "replay", path, "--target", "nats://127.0.0.1:1")
		err := c.Replay.Run(t.Context())
		if err == nil || !errors.Is(err, replay.ErrFormat) || !strings.Contains(err.Error(), "line 2:") && !strings.Contains(err.Error(), "line 1:") {
			t.Errorf("%s: %.300v, want a format error naming the line", name, err)
			continue
		}
		if n := len(err.Error()); n > 1000 {
			t.Errorf("%s: the error is %d bytes long (%.200s…), want the field cut", name, n, err)
		}
	}
}

// modelCapture writes a capture file of n completions of one session,
// the i-th asking for models[i%len(models)], as a cluster serving those
// models logs them.
func modelCapture(t *testing.T, n int, models ...string) string {
	t.Helper()
	reqs := make([]*messages.Request, n)
	for i := range reqs {
		reqs[i] = &messages.Request{Model: models[i%len(models)], SessionID: "s", PromptTokenIDs: testenv.PromptTokens(0, 40+20*i)}
	}
	return writeCapture(t, reqs)
}

// writeCapture writes a capture file of completions reqs, 100 s apart,
// filling in their ids and what a frontend sets.
func writeCapture(t *testing.T, reqs []*messages.Request) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "prod.kvcap")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cw, err := replay.NewCaptureWriter(f)
	if err != nil {
		t.Fatal(err)
	}
	for i, req := range reqs {
		req.RequestID, req.FrontendID, req.Endpoint = fmt.Sprint("prod-", i), "fe-prod", messages.EndpointCompletions
		req.SamplingParams.MaxTokens = 2
		data, err := messages.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		if err := cw.Write(replay.Frame{Time: time.Unix(int64(i)*100, 0), Subject: "kvbus.req." + req.Model, Payload: data}); err != nil {
			t.Fatal(err)
		}
	}
	if err := cw.Flush(); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestBenchServesTheCapturesModel: bench of a capture made on a cluster
// serving another model name than kvbus-sim (any production cluster)
// starts its clusters serving that model, so its requests are answered.
// Before, the bench clusters served only kvbus-sim while the captured
// requests kept asking for their own model: every request failed
// "no_ready_group: no worker group of model "prod-model" is ready". A
// capture of several models, which one bench cluster cannot serve, is
// refused before any cluster starts, naming them.
func TestBenchServesTheCapturesModel(t *testing.T) {
	report := filepath.Join(t.TempDir(), "r.json")
	c := parseCLI(t, "bench", "--trace", modelCapture(t, 4, "prod-model"), "--policies", "kv", "--groups", "1", "--ranks", "1",
		"--kv-capacity", "64MiB", "--speed", "1000", "--timeout", "20s", "--json", report)
	c.Bench.out = &testenv.LogBuffer{}
	if err := c.Bench.Run(t.Context()); err != nil {
		t.Fatal(err)
	}
	var reports []replay.Report
	b, err := os.ReadFile(report)
	if err != nil || json.Unmarshal(b, &reports) != nil || len(reports) != 1 {
		t.Fatalf("report %s: %v", b, err)
	}
	if r := reports[0]; r.OK != 4 || r.HitRatio == nil || *r.HitRatio == 0 {
		t.Errorf("ok %d of 4, hit_ratio %v, errors %v: want every request of the capture answered, with hits", r.OK, r.HitRatio, r.Errors)
	}

	c = parseCLI(t, "bench", "--trace", modelCapture(t, 4, "model-a", "model-b"), "--policies", "kv", "--groups", "1", "--ranks", "1",
		"--kv-capacity", "64MiB", "--speed", "1000", "--timeout", "20s")
	c.Bench.out = &testenv.LogBuffer{}
	start := time.Now()
	err = c.Bench.Run(t.Context())
	if err == nil || !strings.Contains(err.Error(), `"model-a"`) || !strings.Contains(err.Error(), `"model-b"`) {
		t.Errorf("a capture of two models: %v, want an error naming both", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("the refusal took %v: it must come before any cluster starts", d)
	}
}

// TestInferSessionsOfACaptureUsesTheClustersBlocks: --infer-sessions on a
// capture (chat prompts without a session id) links the turns of a
// conversation by the cluster's --block-size blocks, as the schedulers
// match prefixes. Before, it used the Mooncake trace's 512-token blocks:
// conversations shorter than 512 tokens were a session per request (here
// 6 for 2), and conversations sharing a system prompt of 512 tokens or
// more were one session (here 1 for 2) whose turn depths ran on past 4.
func TestInferSessionsOfACaptureUsesTheClustersBlocks(t *testing.T) {
	system := testenv.PromptTokens(0, 600)
	var reqs []*messages.Request
	for turn := range 3 {
		for conv := range 4 {
			var prompt []uint32
			if conv < 2 { // a long system prompt, then the conversation
				prompt = append(slices.Clone(system), testenv.PromptTokens(1+conv, 40*(turn+1))...)
			} else { // a short conversation
				prompt = testenv.PromptTokens(1+conv, 100+50*turn)
			}
			reqs = append(reqs, &messages.Request{Model: "kvbus-sim", PromptTokenIDs: prompt})
		}
	}
	capture := writeCapture(t, reqs)
	log := slog.New(slog.DiscardHandler)
	for _, cmd := range []string{"replay", "bench"} {
		args := []string{cmd, capture, "--target", "nats://127.0.0.1:1", "--infer-sessions"}
		if cmd == "bench" {
			args = []string{cmd, "--trace", capture, "--infer-sessions"}
		}
		c := parseCLI(t, args...)
		var tr *replay.Trace
		var err error
		if cmd == "bench" {
			tr, err = c.Bench.load(c.Bench.Trace, c.Bench.BlockSize, log)
		} else {
			tr, err = c.Replay.load(c.Replay.File, c.Replay.BlockSize, log)
		}
		if err != nil {
			t.Fatal(err)
		}
		if n := tr.Sessions(); n != 4 {
			t.Errorf("%s: %d sessions inferred from the capture of 4 conversations, want 4", cmd, n)
		}
		for i, it := range tr.Items {
			if want := tr.Items[i%4].SessionID; it.SessionID != want {
				t.Errorf("%s: request %d (conversation %d, turn %d) in session %q, want its first turn's %q", cmd, i, i%4, i/4+1, it.SessionID, want)
			}
		}
	}
}
