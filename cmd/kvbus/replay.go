package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"time"

	"golang.org/x/term"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/replay"
)

// progressOut is standard error when it is a terminal, else nil: long runs
// show a progress bar on a terminal and stay quiet otherwise.
func progressOut() io.Writer {
	if term.IsTerminal(int(os.Stderr.Fd())) {
		return os.Stderr
	}
	return nil
}

// traceFlags say which part of a trace to replay, and how.
type traceFlags struct {
	Format        string  `name:"format" enum:"auto,capture,mooncake,tracelab,azure" default:"auto" help:"Trace format: auto (told by the file's content), capture (kvbus capture), mooncake (JSONL), tracelab (JSONL round trace) or azure (LLM inference CSV)."`
	Speed         float64 `name:"speed" positive:"" default:"1" help:"Replay speed: the trace clock is divided by this."`
	Mode          string  `name:"mode" enum:"open,session" default:"open" help:"open: each request at its trace time; session: closed loop per session (a turn waits for the previous answer plus the original gap / speed)."`
	Limit         int     `name:"limit" help:"Replay at most this many requests (after --skip; 0, the default: all)."`
	Skip          int     `name:"skip" help:"Skip this many requests first."`
	InferSessions bool    `name:"infer-sessions" help:"Give sessions to a trace without them: a request continues the session whose previous prompt it extends."`
	JSON          string  `name:"json" type:"path" help:"Also write the report(s) as JSON to this file."`
	HTML          string  `name:"html" type:"path" help:"Also write one self-contained HTML page of plots (TTFT CDF, hit ratio by turn against the ideal, local/remote cache, requests per group over time) to this file."`
}

// write writes the reports as JSON and HTML where the flags say.
func (f traceFlags) write(title string, reports []*replay.Report) error {
	if f.JSON != "" {
		if err := replay.WriteJSON(f.JSON, reports); err != nil {
			return err
		}
	}
	if f.HTML != "" {
		return replay.WriteHTMLFile(f.HTML, title, reports)
	}
	return nil
}

// check fails on flags no run can use, and when --json or --html cannot be
// written: before a run, not after it.
func (f traceFlags) check() error {
	if f.Speed <= 0 || math.IsInf(f.Speed, 0) || math.IsNaN(f.Speed) {
		return fmt.Errorf("--speed %v must be a positive number", f.Speed)
	}
	if f.Limit < 0 || f.Skip < 0 {
		return fmt.Errorf("--limit (%d) and --skip (%d) cannot be negative (0: no limit, none skipped)", f.Limit, f.Skip)
	}
	return checkOutputs(map[string]string{"--json": f.JSON, "--html": f.HTML})
}

// load reads the part of the trace to replay; what a damaged capture left
// out is logged. blockSize is the cluster's, by which --infer-sessions
// matches a capture's prompts.
func (f traceFlags) load(path string, blockSize int, log *slog.Logger) (*replay.Trace, error) {
	tr, err := replay.ReadTraceFile(path, f.Format)
	if err != nil {
		return nil, err
	}
	for _, d := range tr.Damage {
		log.Warn("damaged "+tr.Format+" file: replaying what it holds", "file", path, "left_out", d)
	}
	if len(tr.Items) == 0 {
		return nil, fmt.Errorf("%s holds no request to replay (read as a %s file): check that it is the file you meant", path, tr.Format)
	}
	if f.InferSessions {
		// A trace's prompts are made of its 512-token blocks; a capture's
		// are real prompts, matched as the schedulers match them, by the
		// cluster's blocks (512-token ones made a session of every request
		// shorter than a block, and one session of every conversation
		// that opened with the same long system prompt).
		blockTokens := replay.MooncakeBlockTokens
		if tr.Format == replay.FormatCapture {
			blockTokens = blockSize
		}
		replay.InferSessions(tr, blockTokens)
	}
	if total := len(tr.Items); f.Skip >= total {
		return nil, fmt.Errorf("--skip %d leaves none of the %d requests of %s: give a smaller --skip", f.Skip, total, path)
	}
	if f.Skip > 0 {
		tr.Items = tr.Items[f.Skip:]
	}
	if f.Limit > 0 && f.Limit < len(tr.Items) {
		tr.Items = tr.Items[:f.Limit]
	}
	// Times are relative to the first replayed request.
	first := tr.Items[0].At
	for i := range tr.Items {
		tr.Items[i].At -= first
	}
	return tr, nil
}

type replayCmd struct {
	busFlags   `embed:""`
	traceFlags `embed:""`
	File       string        `arg:"" type:"existingfile" help:"Capture file or trace to replay."`
	Target     string        `name:"target" required:"" help:"nats://HOST:PORT (publish Requests onto the bus) or http://HOST:PORT (through the frontend)."`
	Model      string        `name:"model" help:"Model every request asks for, a capture's included (replaying a capture on a cluster that serves another model name). Default: each captured request's own model; kvbus-sim for a trace."`
	Policy     string        `name:"policy-label" default:"replay" help:"Label of the report's policy column."`
	BlockSize  int           `name:"block-size" positive:"" default:"16" help:"The cluster's block size, for ideal_hit_ratio (and --infer-sessions of a capture)."`
	Timeout    time.Duration `name:"timeout" positive:"" default:"10m" help:"Deadline of one request."`
	APIKey     string        `name:"api-key" env:"KVBUS_API_KEY,OPENAI_API_KEY" help:"With an http:// target, the frontend's --api-key, sent as a bearer token."`
}

func (c *replayCmd) Run(ctx context.Context) error {
	log := c.logger()
	onStop(ctx, log, func() stopPlan {
		return stopPlan{doing: "abandoning the requests in flight and reporting those sent so far", inFlight: -1}
	})
	if c.BlockSize < 1 {
		return errors.New("--block-size must be at least 1")
	}
	if err := c.check(); err != nil {
		return err
	}
	tr, err := c.load(c.File, c.BlockSize, log)
	if err != nil {
		return err
	}
	u, err := replay.ParseTarget(c.Target) // before NATS is tried
	if err != nil {
		return err
	}
	natsURL := c.NATSURL
	if u.Scheme == "nats" || u.Scheme == "tls" {
		natsURL = c.Target
	}
	nf := c.natsFlags
	nf.NATSURL = natsURL
	bc := nf.config("kvbus-replay", "", log)
	overHTTP := u.Scheme != "nats" && u.Scheme != "tls"
	if overHTTP {
		// The bus only tells which group served each request, and how
		// much of its cache came from other groups: a replay through the
		// frontend does not wait long for it.
		bc.ConnectTimeout = 2 * time.Second
		log.Info("connecting to NATS to learn each request's group (give --nats-url the cluster's)", "nats_url", bus.RedactURLs(natsURL))
	}
	nc, err := bus.Connect(ctx, bc)
	if err != nil {
		if errors.Is(err, context.Canceled) { // a signal while waiting: a stop, as for the roles
			return fmt.Errorf("%w: %w", errStoppedConnecting, err)
		}
		if !overHTTP {
			return err
		}
		log.Warn("replaying over HTTP without the bus: groups and the local/remote split of cached tokens will not be reported", "err", err)
	} else {
		defer drain(nc)
	}
	r, err := replay.New(replay.Config{
		Target: c.Target, Conn: nc, Subjects: c.subjects(), Model: c.Model, Speed: c.Speed, Mode: c.Mode,
		Timeout: c.Timeout, APIKey: c.APIKey, Progress: progressOut(), Logger: log,
	})
	if err != nil {
		return err
	}
	log.Info("replaying", "file", c.File, "format", tr.Format, "requests", len(tr.Items), "sessions", tr.Sessions(), "target", bus.RedactURLs(c.Target), "speed", c.Speed, "mode", c.Mode)
	results, elapsed, err := r.Run(ctx, tr.Items)
	// Each request's model seeds its block hashes, as the replay asks for
	// it: --model, else a captured request's own.
	rep := replay.Summarize(c.Policy, results, replay.IdealHitRatio(tr.Items, c.Model, c.BlockSize), elapsed)
	rep.Trace = c.File
	if rep.Failed == 0 && rep.HitRatio != nil && *rep.HitRatio > rep.IdealHitRatio+1e-9 {
		// The ideal counts only what the replay itself stored. (With
		// failures the two count different requests: outcome says so.)
		log.Warn("hit_ratio is over ideal_hit_ratio: the cluster's cache held prompts of this trace before the replay (an earlier replay of it?); for a measurement, replay onto a cluster started afresh, or use kvbus bench",
			"hit_ratio", *rep.HitRatio, "ideal_hit_ratio", rep.IdealHitRatio)
	}
	if werr := replay.WriteTable(os.Stdout, []*replay.Report{rep}); werr != nil {
		return werr
	}
	if werr := c.write("kvbus replay: "+c.File, []*replay.Report{rep}); werr != nil {
		return werr
	}
	if err != nil {
		if ctx.Err() != nil {
			return interrupted(results, err)
		}
		return err
	}
	return outcome(log, rep)
}

// interrupted is the error of a replay stopped (Ctrl-C) before its end:
// what the report printed before it holds.
func interrupted(results []replay.Result, err error) error {
	sent := 0
	for _, r := range results {
		if r.ReqID != "" {
			sent++
		}
	}
	return fmt.Errorf("replay interrupted: the report holds what happened to the %d of the %d requests sent before it "+
		"(those in flight count as failed: \"stopped\"); the %d never sent count as failed too (\"not sent\"): %w",
		sent, len(results), len(results)-sent, err)
}

// policyLabel is " (policy P)", or "" for a replay without a label.
func policyLabel(p string) string {
	if p == "" {
		return ""
	}
	return " (policy " + p + ")"
}

// outcome fails a run in which no request succeeded (a script must not
// take it for a measurement), naming the most frequent error, and warns
// that a run's hit ratios count only the requests that succeeded.
func outcome(log *slog.Logger, reports ...*replay.Report) error {
	for _, rep := range reports {
		if rep.Failed == 0 {
			continue
		}
		worst, n := "", 0
		for e, k := range rep.Errors {
			if k > n || (k == n && e < worst) {
				worst, n = e, k
			}
		}
		if rep.OK == 0 {
			return fmt.Errorf("none of the %d requests succeeded%s; the most frequent error (%d of them): %s", rep.Requests, policyLabel(rep.Policy), n, worst)
		}
		log.Warn("some requests failed: latencies and hit_ratio count only those that succeeded, ideal_hit_ratio every request of the trace",
			"policy", rep.Policy, "failed", rep.Failed, "of", rep.Requests, "most_frequent_error", worst)
	}
	return nil
}

// reportCmd redraws the plots of a JSON report.
type reportCmd struct {
	HTML string `name:"html" type:"path" required:"" help:"Write the HTML page here."`
	File string `arg:"" name:"report.json" type:"existingfile" help:"A report written by kvbus bench or kvbus replay with --json."`
}

func (c *reportCmd) Run() error {
	reports, err := replay.ReadJSONFile(c.File)
	if err != nil {
		return err
	}
	return replay.WriteHTMLFile(c.HTML, "kvbus report: "+c.File, reports)
}
