package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alecthomas/kong"
	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

// The fake engines' ZeroMQ PUB sockets leave go-zeromq's writer goroutine
// behind when closed (a leak of the library, not of kvbus).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
		// TestTopInATerminal's reader of the terminal emulator's answers.
		goleak.IgnoreAnyFunction("github.com/charmbracelet/x/vt.(*Emulator).Read"))
}

// TestEveryFlagHasAnEnvTwin parses the CLI and checks that every flag of
// parseCLI parses args as the kvbus command line.
func parseCLI(t *testing.T, args ...string) *cli {
	t.Helper()
	var c cli
	p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Parse(args); err != nil {
		t.Fatal(err)
	}
	return &c
}

// every command names a KVBUS_* variable.
func TestEveryFlagHasAnEnvTwin(t *testing.T) {
	var c cli
	p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"), kong.Exit(func(int) {}))
	if err != nil {
		t.Fatal(err)
	}
	for _, node := range p.Model.Children {
		for _, fl := range node.Flags {
			if fl.Name == "help" {
				continue
			}
			if len(fl.Envs) == 0 || !strings.HasPrefix(fl.Envs[0], "KVBUS_") {
				t.Errorf("%s --%s has no KVBUS_* environment twin (%v)", node.Name, fl.Name, fl.Envs)
			}
		}
	}
}

// freeAddr returns a loopback address free a moment ago
// (testenv.FreeAddrs), for a process or role that takes no open listener
// (every kvbus command binds its own flags' addresses) to bind later; this
// process never gives one twice, as a test may draw several before its
// processes bind them.
func freeAddr(t *testing.T) string {
	t.Helper()
	freePorts.Lock()
	defer freePorts.Unlock()
	for {
		if addr := testenv.FreeAddrs(t, 1)[0]; !freePorts.given[addr] {
			freePorts.given[addr] = true
			return addr
		}
	}
}

// freePorts are the addresses freeAddr gave.
var freePorts = struct {
	sync.Mutex
	given map[string]bool
}{given: map[string]bool{}}

// TestServe runs `kvbus serve` in-process as `make run` does (with the
// instant engine) and checks the README's curl example, sent the moment
// vLLM's /health passes: a completion, and
// four store thread lines with session_id=abc, one per tp_rank.
func TestServe(t *testing.T) {
	var c cli
	p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"))
	if err != nil {
		t.Fatal(err)
	}
	httpAddr := freeAddr(t)
	if _, err := p.Parse([]string{"serve", "--nats-addr", freeAddr(t), "--http-addr", httpAddr, "--time-scale", "0", "--kv-capacity", "64MiB"}); err != nil {
		t.Fatal(err)
	}
	logs := &testenv.LogBuffer{}
	c.Serve.out = logs
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	var runErr error
	wg.Go(func() { runErr = c.Serve.Run(ctx) })
	defer func() {
		cancel()
		wg.Wait()
		if runErr != nil {
			t.Errorf("serve: %v", runErr)
		}
		for _, l := range []string{"frontend stopped", "scheduler stopped", "rank stopped"} {
			if len(logs.Lines(l)) == 0 {
				t.Errorf("serve did not log %q on shutdown", l)
			}
		}
	}()

	client := &http.Client{Timeout: 10 * time.Second}
	defer client.CloseIdleConnections()
	// As a user of vLLM does: poll /health, and send the moment it passes.
	// One request, no retry: a 503 here is a health check that lied.
	testenv.Eventually(t, 30*time.Second, "/health 200", func() bool {
		resp, err := client.Get("http://" + httpAddr + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	req, _ := http.NewRequest(http.MethodPost, "http://"+httpAddr+"/v1/chat/completions",
		strings.NewReader(`{"model":"kvbus-sim","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("X-Session-ID", "abc")
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	body := string(b)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the first request after /health passed: %d %s", resp.StatusCode, body)
	}
	if !strings.Contains(body, `"object":"chat.completion"`) {
		t.Fatalf("body %s", body)
	}
	testenv.Eventually(t, 5*time.Second, "four store thread lines", func() bool {
		return len(logs.Lines(`msg="store thread"`, "session_id=abc")) >= 4
	})
	for r := range 4 {
		if n := len(logs.Lines(`msg="store thread"`, "session_id=abc", fmt.Sprintf("tp_rank=%d ", r))); n != 1 {
			t.Errorf("tp_rank %d: %d store thread lines with session_id=abc, want 1", r, n)
		}
	}
}

// TestServeHTTPPortInUse: `kvbus serve` (make run) whose HTTP address is
// taken exits at once with an error that names it, instead of running on
// without a frontend; and before it starts anything (it started NATS and
// connected every role, logged "kvbus serving", then stopped them).
func TestServeHTTPPortInUse(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	c := parseCLI(t, "serve", "--nats-addr", freeAddr(t), "--http-addr", taken.Addr().String(), "--time-scale", "0", "--kv-capacity", "64MiB")
	logs := &testenv.LogBuffer{}
	c.Serve.out = logs
	done := make(chan error, 1)
	go func() { done <- c.Serve.Run(t.Context()) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), taken.Addr().String()) || !strings.Contains(err.Error(), "--http-addr") {
			t.Fatalf("serve with its HTTP address taken returned %v; want an error naming %s and --http-addr", err, taken.Addr())
		}
		if started := logs.Lines("nats connected"); len(started) > 0 {
			t.Errorf("serve started its roles before it found its HTTP address taken:\n%s", strings.Join(started, "\n"))
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve with its HTTP address taken still runs after 20 s")
	}
}

func TestHealthcheck(t *testing.T) {
	ok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }))
	defer ok.Close()
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusServiceUnavailable) }))
	defer bad.Close()
	for _, tc := range []struct {
		url  string
		want bool
	}{{ok.URL, true}, {bad.URL, false}, {"http://127.0.0.1:1/healthz", false}} {
		err := (&healthcheckCmd{URL: tc.url, Timeout: time.Second}).Run(t.Context())
		if (err == nil) != tc.want {
			t.Errorf("healthcheck %s: %v, want healthy=%v", tc.url, err, tc.want)
		}
	}
	ok.Client().CloseIdleConnections()
	http.DefaultClient.CloseIdleConnections()
}

// TestWorkerBadSizes: a bad size flag is reported before the worker
// connects (no NATS runs here), naming the flag.
func TestWorkerBadSizes(t *testing.T) {
	for _, tc := range []struct{ flag, value string }{{"--drain-handoff", "lots"}, {"--kv-capacity", "-1GiB"}, {"--kv-capacity", "12"}} {
		c := parseCLI(t, "worker", "--group", "g0", "--nats-url", "nats://127.0.0.1:1", tc.flag+"="+tc.value)
		err := c.Worker.Run(t.Context())
		if err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("worker %s %s: error %v, want one naming %s", tc.flag, tc.value, err, tc.flag)
		}
	}
}

// TestServeHeartbeatTimeoutAboveItsInterval: a --heartbeat-timeout at or
// below --heartbeat-interval is refused at once, naming both; before, serve
// started and no group ever stayed ready (every rank silent past the
// timeout between two heartbeats), with no word of why.
func TestServeHeartbeatTimeoutAboveItsInterval(t *testing.T) {
	for _, args := range [][]string{{"--heartbeat-timeout", "1ms"}, {"--heartbeat-timeout", "2s", "--heartbeat-interval", "2s"}} {
		c := parseCLI(t, append([]string{"serve", "--nats-addr", freeAddr(t), "--http-addr", freeAddr(t), "--data-dir", t.TempDir()}, args...)...)
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second) // before: served until stopped
		start := time.Now()
		err := runParsed(ctx, c, "serve")
		cancel()
		if err == nil || time.Since(start) > 2*time.Second || !strings.Contains(err.Error(), "--heartbeat-timeout") || !strings.Contains(err.Error(), "--heartbeat-interval") {
			t.Errorf("serve %v: %v after %v; want an error at once naming --heartbeat-timeout and --heartbeat-interval", args, err, time.Since(start).Round(time.Millisecond))
		}
	}
}

// TestSchedulerWarnsOfAHeartbeatTimeoutBelowTwoBeats: a scheduler's
// --heartbeat-timeout under twice the workers' default interval (1 s) is
// warned of at start (the scheduler cannot know the workers' interval, so
// it is no refusal); the default is not. Before, 1ms ran without a word
// and no group stayed ready.
func TestSchedulerWarnsOfAHeartbeatTimeoutBelowTwoBeats(t *testing.T) {
	for _, tc := range []struct {
		timeout string
		warned  bool
	}{{"1ms", true}, {"1500ms", true}, {"3s", false}} {
		c := parseCLI(t, "scheduler", "--nats-url", "nats://127.0.0.1:1", "--metrics-addr=", "--heartbeat-timeout", tc.timeout)
		logs := &testenv.LogBuffer{}
		c.Scheduler.out = logs
		ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond) // it cannot connect: only its start matters
		_ = c.Scheduler.Run(ctx)
		cancel()
		if got := len(logs.Lines("level=WARN", "--heartbeat-timeout is below twice")); got != map[bool]int{true: 1, false: 0}[tc.warned] {
			t.Errorf("--heartbeat-timeout %s: %d warnings, want warned=%v:\n%s", tc.timeout, got, tc.warned, logs.String())
		}
	}
}

// TestWorkerRankOutOfRangeBeforeItConnects: a rank identity no group can
// have (--tp-rank at or past --tp-size, --ep-rank past --ep-size), or a
// --tp-rank/--ep-rank given with --rank auto (which picks the rank
// itself), is refused at once naming the flags, before the worker
// connects. Before, the range was checked only after connecting: with NATS
// not up yet the worker said "cannot connect" after 10 s and nothing of
// the flags, and --rank auto --tp-rank 2 quietly claimed rank 0.
func TestWorkerRankOutOfRangeBeforeItConnects(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		want    []string
		notWant string // a flag the command line did not give
	}{
		{[]string{"--group", "g0", "--tp-rank", "4", "--tp-size", "4"}, []string{"--tp-rank 4", "--tp-size 4"}, ""},
		{[]string{"--group", "g0", "--tp-rank", "1", "--tp-size", "2", "--ep-rank", "5", "--ep-size", "4"}, []string{"--ep-rank 5", "--ep-size 4"}, ""},
		{[]string{"--group", "g0", "--tp-rank", "3", "--tp-size", "4", "--ep-size", "2"}, []string{"--ep-rank 3", "--ep-size 2"}, ""},
		// It said "give no --tp-rank (got 2) or --ep-rank (got -1)", an
		// --ep-rank no one gave.
		{[]string{"--rank", "auto", "--tp-rank", "2"}, []string{"--rank auto", "--tp-rank 2"}, "--ep-rank"},
		{[]string{"--rank", "auto", "--ep-rank", "1"}, []string{"--rank auto", "--ep-rank 1"}, "--tp-rank 0"},
		{[]string{"--rank", "auto", "--tp-rank", "2", "--ep-rank", "1"}, []string{"--tp-rank 2", "--ep-rank 1"}, ""},
		{[]string{"--group", "g0", "--ep-rank=-2"}, []string{"--ep-rank -2", "-1"}, ""}, // was taken as -1
	} {
		c := parseCLI(t, append([]string{"worker", "--nats-url", "nats://127.0.0.1:1", "--metrics-addr="}, tc.args...)...)
		start := time.Now()
		err := c.Worker.Run(t.Context())
		if err == nil || time.Since(start) > 2*time.Second {
			t.Errorf("worker %v: %v after %v; want an error at once", tc.args, err, time.Since(start).Round(time.Millisecond))
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("worker %v: %v; want it to name %q", tc.args, err, w)
			}
		}
		if tc.notWant != "" && strings.Contains(err.Error(), tc.notWant) {
			t.Errorf("worker %v: %v; names %q, which was not given", tc.args, err, tc.notWant)
		}
	}
}

// TestMetricsAddrInUseStopsARoleBeforeItConnects: a worker or scheduler
// whose --metrics-addr is taken (a second process started with a running
// one's flags) fails naming the address before it connects, so it never
// joins a rank or takes requests: the worker did, and its group was
// unusable for seconds before it exited.
func TestMetricsAddrInUseStopsARoleBeforeItConnects(t *testing.T) {
	srv := testenv.StartNATS(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	// The frontend's --http-addr too: with NATS not up it said only "cannot
	// connect" after 10 s, and the port was found taken once NATS was there.
	for _, args := range [][]string{
		{"worker", "--group", "g0", "--tp-rank", "0", "--tp-size", "1", "--time-scale", "0", "--kv-capacity", "64MiB", "--metrics-addr"},
		{"scheduler", "--metrics-addr"},
		{"frontend", "--http-addr"},
	} {
		before, err := srv.Varz(nil)
		if err != nil {
			t.Fatal(err)
		}
		flag := args[len(args)-1]
		c := parseCLI(t, append(args, taken.Addr().String(), "--nats-url", srv.ClientURL())...)
		err = runParsed(t.Context(), c, args[0])
		if err == nil || !strings.Contains(err.Error(), taken.Addr().String()) || !strings.Contains(err.Error(), flag) {
			t.Errorf("%s with its %s taken returned %v; want an error naming %s and %s", args[0], flag, err, taken.Addr(), flag)
		}
		if after, _ := srv.Varz(nil); after.TotalConnections != before.TotalConnections {
			t.Errorf("%s connected to NATS (%d connections, %d before) before it found its %s taken",
				args[0], after.TotalConnections, before.TotalConnections, flag)
		}
	}
}

// TestBenchChecksEveryRunFirst: a typo in a later policy or pool fails at
// once, before anything else (it failed after the runs before it, minutes
// on a real trace, and printed nothing of them): here before the trace,
// which is not one, is even read.
func TestBenchChecksEveryRunFirst(t *testing.T) {
	trace := filepath.Join(t.TempDir(), "t.jsonl")
	if err := os.WriteFile(trace, []byte("not a trace\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ flag, value, want string }{
		{"--policies", "kv,round-robbin", "round-robbin"},
		{"--pool", "global,locl", "locl"},
	} {
		c := parseCLI(t, "bench", "--trace", trace, tc.flag, tc.value)
		err := c.Bench.Run(t.Context())
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("bench %s %s: error %v, want one naming %s", tc.flag, tc.value, err, tc.want)
		}
	}
}

// TestEngineUnavailableWaitFlag: --engine-unavailable-wait reaches the
// engine adapter (2 s unless given).
func TestEngineUnavailableWaitFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want time.Duration
	}{{nil, 2 * time.Second}, {[]string{"--engine-unavailable-wait", "5s"}, 5 * time.Second}} {
		c := parseCLI(t, append([]string{"worker", "--engine", "openai", "--engine-url", "http://127.0.0.1:1", "--tp-size", "1"}, tc.args...)...)
		oc, _, err := c.Worker.openAI(0)
		if err != nil || oc.UnavailableWait != tc.want {
			t.Errorf("%v: UnavailableWait %s, %v; want %s", tc.args, oc.UnavailableWait, err, tc.want)
		}
	}
}

// TestFrontendAndSchedulerCheckFlagsBeforeTheyConnect: a frontend or
// scheduler flag that is wrong whatever NATS says (the frontend's
// --http-addr, --id, --session-header; the scheduler's --id) is refused at
// once, naming the flag, with no NATS running. Before, both connected
// first: with NATS not up yet the operator read 10 s of "cannot connect"
// and nothing of the flag.
func TestFrontendAndSchedulerCheckFlagsBeforeTheyConnect(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"frontend", "--http-addr", "garbage"}, "--http-addr"},
		{[]string{"frontend", "--http-addr", ":99999"}, "--http-addr"},
		{[]string{"frontend", "--id", "a.b"}, "--id"},
		{[]string{"frontend", "--session-header", "bad header"}, "--session-header"},
		{[]string{"scheduler", "--id", "a.b", "--metrics-addr="}, "--id"},
	} {
		c := parseCLI(t, append(tc.args, "--nats-url", "nats://127.0.0.1:1")...)
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second) // before: "cannot connect" after 10 s, cut short here
		start := time.Now()
		var err error
		if tc.args[0] == "frontend" {
			err = c.Frontend.Run(ctx)
		} else {
			err = c.Scheduler.Run(ctx)
		}
		cancel()
		if err == nil || time.Since(start) > 2*time.Second || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v after %v; want an error at once naming %s", tc.args, err, time.Since(start).Round(time.Millisecond), tc.want)
		}
	}
}

// TestValuesThatCannotWorkAreRefused: values that parse but cannot work
// are refused at once, naming the flag and what to give. Before, each
// was served without a word: no --session-header at all (sessions from headers silently off), an
// --allowed-origins no browser sends (CORS silently off for it), a
// request log smaller than one request of --max-body-bytes (every such
// request a 503 request_log_full for ever) or that drops requests before
// --request-timeout.
func TestValuesThatCannotWorkAreRefused(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"frontend", "--session-header="}, "--session-header"},
		{[]string{"frontend", "--allowed-origins", "not an origin"}, "--allowed-origins"},
		{[]string{"frontend", "--allowed-origins", "https://app.example/"}, "--allowed-origins"},
		{[]string{"frontend", "--request-log-max-bytes", "10"}, "--max-body-bytes"},
		{[]string{"frontend", "--request-log-max-age", "1ms"}, "--request-timeout"},
		{[]string{"scheduler", "--request-log-max-age", "1ms", "--metrics-addr="}, "--request-log-max-age"},
		{[]string{"serve", "--request-log-max-bytes", "10", "--nats-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"}, "--request-log-max-bytes"},
	} {
		args := tc.args
		if args[0] != "serve" {
			args = append(args, "--nats-url", "nats://127.0.0.1:1")
		}
		took, err := runArgs(t, args, 3*time.Second) // before: "cannot connect" after 10 s, or served
		if err == nil || took > 2*time.Second || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v after %v; want an error at once naming %s", tc.args, err, took.Round(time.Millisecond), tc.want)
		}
	}
}

// TestErrorsNameTheFlag: a bad value fails at once with an error naming
// its flag and what to give. Before: tap --subject a..b said "nats:
// invalid subject", healthcheck --url notaurl "unsupported protocol
// scheme", --metrics-addr :99999 "is this role already running?", and
// serve --groups 100000 "give at most 0.0 GiB per rank with --kv-capacity".
func TestErrorsNameTheFlag(t *testing.T) {
	srv := testenv.StartNATS(t)
	trace := oneRequestTrace(t, t.TempDir())
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"tap", "--nats-url", srv.ClientURL(), "--subject", "a..b"}, []string{"--subject"}},
		{[]string{"healthcheck", "--url", "notaurl"}, []string{"--url", "http://"}},
		{[]string{"healthcheck", "--url", "http://127.0.0.1:99999/healthz", "--wait", "10s"}, []string{"--url", "65535"}}, // was probed as a role down, for --wait
		{[]string{"scheduler", "--nats-url", "nats://127.0.0.1:1", "--metrics-addr", ":99999"}, []string{"--metrics-addr", "65535"}},
		{[]string{"serve", "--groups", "100000", "--nats-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"}, []string{"--groups"}},
		{[]string{"serve", "--model-profile", "llama-4", "--nats-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"}, []string{"--model-profile", "tiny"}},
		{[]string{"replay", trace, "--target", "ftp://127.0.0.1:1", "--nats-url", "nats://" + freeAddr(t)}, []string{"--target", "http://"}}, // after 2 s of NATS before
	} {
		_, err := runArgs(t, tc.args, 3*time.Second)
		for _, w := range tc.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("%v: %v; want an error naming %q", tc.args, err, w)
			}
		}
	}
}

// oneRequestTrace writes a Mooncake trace of one request into dir and
// returns its path.
func oneRequestTrace(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "trace.jsonl")
	if err := os.WriteFile(path, []byte(`{"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [1]}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// runArgs parses args and runs their command (args[0]) within timeout; it
// returns how long it ran and the command's error.
func runArgs(t *testing.T, args []string, timeout time.Duration) (time.Duration, error) {
	t.Helper()
	c := parseCLI(t, args...)
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	start := time.Now()
	err := runParsed(ctx, c, args[0])
	return time.Since(start), err
}

// runParsed runs command name of the parsed command line c, its logs kept
// from the test's output.
func runParsed(ctx context.Context, c *cli, name string) error {
	logs := &testenv.LogBuffer{}
	switch name {
	case "nats":
		c.NATS.out = logs
		return c.NATS.Run(ctx)
	case "frontend":
		c.Frontend.out = logs
		return c.Frontend.Run(ctx)
	case "scheduler":
		c.Scheduler.out = logs
		return c.Scheduler.Run(ctx)
	case "worker":
		c.Worker.out = logs
		return c.Worker.Run(ctx)
	case "tap":
		c.Tap.out = logs
		return c.Tap.Run(ctx)
	case "healthcheck":
		return c.Health.Run(ctx)
	case "replay":
		c.Replay.out = logs
		return c.Replay.Run(ctx)
	case "serve":
		c.Serve.out = logs
		return c.Serve.Run(ctx)
	}
	panic("runParsed: no command " + name)
}

// TestTapSubjectByTheServersRule: tap's --subject is checked by the NATS
// server's own rule, so a literal token with * or > in it ("jobs*"), which
// NATS accepts and the hand-written check refused, is tapped, and what NATS
// refuses is refused naming the flag.
func TestTapSubjectByTheServersRule(t *testing.T) {
	for _, ok := range []string{"", "kvbus.meta.>", "kvbus.*.g0", ">", "jobs*", "a.b>c"} {
		if err := replay.CheckTapSubject(ok); err != nil {
			t.Errorf("--subject %q: %v; NATS accepts it", ok, err)
		}
	}
	for _, bad := range []string{"a..b", ".a", "a.", "a.>.b", "a b", "a.\tb"} {
		if err := replay.CheckTapSubject(bad); err == nil || !strings.Contains(err.Error(), "--subject") {
			t.Errorf("--subject %q: %v; want NATS's refusal naming --subject", bad, err)
		}
	}
}
