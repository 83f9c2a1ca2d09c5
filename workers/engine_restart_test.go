package workers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// TestEngineRestartRules proves the rules that tell an engine's restart
// from its health polls: a slow or failed poll (or three) is no restart,
// nor is a refused connection to an engine whose process started before
// it was last seen healthy (or whose start time did not change); a start
// time after that is one; without a start time, an engine that could not
// be connected to and answers again is one; an engine that comes up after
// the worker is not; a restart between two polls is left to the KV events.
func TestEngineRestartRules(t *testing.T) {
	t.Parallel()
	// Steps, one second apart from t=1000 s: "ok:S" a successful poll
	// whose start time, if read, is S (0: none); "fail" a poll that
	// connected but failed (slow, 503); "gone" a poll that could not
	// connect; "req" a request that could not.
	cases := []struct {
		name  string
		steps []string
		want  []int // indexes of the steps that find a restart
	}{
		{"a slow poll is no restart", []string{"ok:500", "fail", "ok:500", "ok:500"}, nil},
		{"a slow poll is no restart, without identity", []string{"ok:0", "fail", "ok:0"}, nil},
		{"three failed polls and back, same process", []string{"ok:500", "fail", "fail", "fail", "ok:500"}, nil},
		{"three failed polls and back, without identity", []string{"ok:0", "fail", "fail", "fail", "ok:0"}, nil},
		{"refused and back, same process (a network blip)", []string{"ok:500", "gone", "gone", "ok:500"}, nil},
		{"refused and back, a new process", []string{"ok:500", "gone", "gone", "ok:1002.5", "ok:1002.5"}, []int{3}},
		{"refused and back, without identity", []string{"ok:0", "gone", "ok:0", "ok:0"}, []int{2}},
		{"failed and back as a new process", []string{"ok:500", "fail", "ok:1001.5"}, []int{2}},
		{"a request found it gone, without identity", []string{"ok:0", "req", "ok:0"}, []int{2}},
		{"a request found it gone, same process", []string{"ok:500", "req", "ok:500"}, nil},
		{"the engine comes up after the worker", []string{"gone", "gone", "fail", "ok:500", "ok:500"}, nil},
		{"the new process is the reference", []string{"ok:500", "gone", "ok:1001.5", "gone", "ok:1001.5", "fail", "ok:1003.5"}, []int{2, 6}},
		{"identity unreadable after a refusal, then readable", []string{"ok:500", "gone", "ok:0", "ok:0", "gone", "ok:1001.5"}, []int{2}},
		// Between two polls: the KV events' to tell, and the process that
		// answered since is the one the next recovery compares with.
		{"restarted between two polls", []string{"ok:500", "ok:1000.5", "ok:1000.5", "fail", "ok:1000.5"}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := newRestartRules()
			t0 := time.Unix(1000, 0)
			var got []int
			var lastOK time.Time
			for i, step := range tc.steps {
				at := t0.Add(time.Duration(i) * time.Second)
				switch {
				case step == "fail":
					r.pollFailed(false)
				case step == "gone":
					r.pollFailed(true)
				case step == "req":
					r.requestFoundGone()
				default:
					var start float64
					fmt.Sscanf(step, "ok:%g", &start)
					read := r.wantIdentity()
					if !read {
						start = 0
					}
					rs, restart := r.pollPassed(at, read, start)
					if restart {
						got = append(got, i)
						if rs.Why == "" || rs.LastSeen.IsZero() || !rs.LastSeen.Before(at) || rs.LastSeen.After(lastOK) {
							t.Errorf("step %d: restart %+v: want a reason and the last poll that saw the old engine (%v)", i, rs, lastOK)
						}
					}
					lastOK = at
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("restarts at steps %v, want %v (%q)", got, tc.want, tc.steps)
			}
		})
	}
}

func TestParseStartTime(t *testing.T) {
	t.Parallel()
	for text, want := range map[string]float64{
		"# HELP process_start_time_seconds Start time.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.76e+09\n": 1.76e9,
		"python_info{version=\"3.12\"} 1.0\nprocess_start_time_seconds_total 5\nprocess_start_time_seconds{pid=\"7\"} 123.25\n":         123.25,
		"vllm:num_requests_running 0\n":  0,
		"process_start_time_seconds x\n": 0,
		"":                               0,
	} {
		if got := parseStartTime(strings.NewReader(text)); got != want {
			t.Errorf("parseStartTime(%q) = %v, want %v", text, got, want)
		}
	}
}

// FuzzParseStartTime: any /metrics body an engine serves gives a start time
// that is 0 or a positive finite number (NaN and Inf were returned as they
// were), and never a panic.
func FuzzParseStartTime(f *testing.F) {
	f.Add("process_start_time_seconds 1.76e+09\n")
	f.Add("process_start_time_seconds{pid=\"7\"} 123.25\n")
	f.Add("process_start_time_seconds{a=\"}\"} -1\nprocess_start_time_seconds NaN\n")
	f.Add(strings.Repeat("x", 70<<10) + "\nprocess_start_time_seconds 5\n")
	f.Fuzz(func(t *testing.T, text string) {
		if got := parseStartTime(strings.NewReader(text)); !(got == 0 || got > 0 && !math.IsInf(got, 0)) {
			t.Fatalf("parseStartTime(%q) = %v, want 0 or a positive time", text, got)
		}
	})
}

// testPort returns a loopback port that was free a moment ago: an engine is
// started at it again, at the same address, after a stop.
func testPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// restartableEngine is an HTTP engine at a fixed address that can be
// stopped (connections refused) and started again as a new process (a new
// /metrics process_start_time_seconds), and whose /health can be slowed.
type restartableEngine struct {
	t       *testing.T
	addr    string
	start   atomic.Int64 // unix micros; 0: /metrics has no start time
	delay   atomic.Int64 // /health delay, ns
	metrics atomic.Int32 // /metrics requests
	mu      sync.Mutex
	srv     *http.Server
}

func newRestartableEngine(t *testing.T) *restartableEngine {
	e := &restartableEngine{t: t, addr: fmt.Sprintf("127.0.0.1:%d", testPort(t))}
	e.up(time.Now())
	t.Cleanup(e.down)
	return e
}

func (e *restartableEngine) url() string { return "http://" + e.addr }

// up starts the engine's process, started at start (zero: no start time).
func (e *restartableEngine) up(start time.Time) {
	e.t.Helper()
	if !start.IsZero() {
		e.start.Store(start.UnixMicro())
	} else {
		e.start.Store(0)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(time.Duration(e.delay.Load())):
		case <-r.Context().Done():
		}
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		e.metrics.Add(1)
		fmt.Fprintf(w, "vllm:num_requests_running 0\n")
		if s := e.start.Load(); s != 0 {
			fmt.Fprintf(w, "process_start_time_seconds %g\n", float64(s)/1e6)
		}
	})
	var ln net.Listener
	var err error
	for range 100 { // the port of the process before may linger a moment
		if ln, err = net.Listen("tcp", e.addr); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		e.t.Fatal(err)
	}
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	e.mu.Lock()
	e.srv = srv
	e.mu.Unlock()
}

// down stops the engine's process: connections are refused.
func (e *restartableEngine) down() {
	e.mu.Lock()
	srv := e.srv
	e.srv = nil
	e.mu.Unlock()
	if srv != nil {
		srv.Close()
	}
}

// restartLog runs WatchHealthAndRestarts until the test ends and records,
// in order, "restart" for each restart and "healthy"/"unhealthy" for each
// health change.
type restartLog struct {
	mu     sync.Mutex
	events []string
}

func (l *restartLog) add(s string) {
	l.mu.Lock()
	l.events = append(l.events, s)
	l.mu.Unlock()
}

func (l *restartLog) get() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.events...)
}

func (l *restartLog) count(s string) int {
	n := 0
	for _, e := range l.get() {
		if e == s {
			n++
		}
	}
	return n
}

func watchRestarts(t *testing.T, e *OpenAIEngine) *restartLog {
	t.Helper()
	l := &restartLog{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.WatchHealthAndRestarts(ctx, func() {
			if ok, _ := e.Healthy(); ok {
				l.add("healthy")
			} else {
				l.add("unhealthy")
			}
		}, func(rs EngineRestart) {
			if rs.Why == "" || rs.LastSeen.IsZero() {
				t.Errorf("restart without a reason or a last seen time: %+v", rs)
			}
			l.add("restart")
		})
	}()
	t.Cleanup(func() { cancel(); <-done })
	return l
}

func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", within, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestOpenAIWatchHealthFindsRestarts proves the health watcher's restart
// detection against an engine at a fixed address: slow polls are no
// restart; an engine that went away and came back as a new process is one,
// told before the health change that makes it ready again; so is a new
// process that came up between two polls (found by its start time within
// engineIdentityEvery polls); an engine with no start time that went away
// and came back is one too.
func TestOpenAIWatchHealthFindsRestarts(t *testing.T) {
	t.Parallel()
	const interval = 20 * time.Millisecond
	t.Run("slow polls", func(t *testing.T) {
		t.Parallel()
		s := newRestartableEngine(t)
		e := newOpenAI(t, OpenAIConfig{URL: s.url(), HealthInterval: interval, HealthTimeout: 2 * time.Second})
		l := watchRestarts(t, e)
		eventually(t, 5*time.Second, "healthy", func() bool { return l.count("healthy") == 1 })
		s.delay.Store(int64(5 * interval)) // each poll slower than the interval, within the timeout
		time.Sleep(30 * interval)
		s.delay.Store(0)
		time.Sleep(10 * interval)
		if got := l.get(); len(got) != 1 {
			t.Fatalf("slow /health polls: %v, want only the first healthy", got)
		}
	})
	t.Run("down and back as a new process", func(t *testing.T) {
		t.Parallel()
		s := newRestartableEngine(t)
		e := newOpenAI(t, OpenAIConfig{URL: s.url(), HealthInterval: interval})
		l := watchRestarts(t, e)
		eventually(t, 5*time.Second, "healthy", func() bool { return l.count("healthy") == 1 })
		s.down()
		eventually(t, 5*time.Second, "unhealthy once refused", func() bool { return l.count("unhealthy") == 1 })
		s.up(time.Now())
		eventually(t, 5*time.Second, "healthy again", func() bool { return l.count("healthy") == 2 })
		if got := fmt.Sprint(l.get()); got != "[healthy unhealthy restart healthy]" {
			t.Fatalf("events %s, want the restart told before the engine is healthy again", got)
		}
	})
	t.Run("down and back as the same process", func(t *testing.T) {
		t.Parallel()
		s := newRestartableEngine(t)
		e := newOpenAI(t, OpenAIConfig{URL: s.url(), HealthInterval: interval})
		l := watchRestarts(t, e)
		eventually(t, 5*time.Second, "healthy", func() bool { return l.count("healthy") == 1 })
		start := s.start.Load()
		s.down()
		eventually(t, 5*time.Second, "unhealthy once refused", func() bool { return l.count("unhealthy") == 1 })
		s.up(time.UnixMicro(start))
		eventually(t, 5*time.Second, "healthy again", func() bool { return l.count("healthy") == 2 })
		if n := l.count("restart"); n != 0 {
			t.Fatalf("an engine with the same start time refused connections and came back: %d restarts, want 0 (%v)", n, l.get())
		}
	})
	t.Run("a healthy engine is not asked", func(t *testing.T) {
		t.Parallel()
		s := newRestartableEngine(t)
		e := newOpenAI(t, OpenAIConfig{URL: s.url(), HealthInterval: interval})
		l := watchRestarts(t, e)
		eventually(t, 5*time.Second, "healthy", func() bool { return l.count("healthy") == 1 })
		s.start.Add(1_000_000) // a new process no poll saw gone: the KV events' to tell
		time.Sleep(20 * interval)
		if got := fmt.Sprint(l.get()); got != "[healthy]" || s.metrics.Load() != 0 {
			t.Fatalf("events %s, %d GET /metrics: a healthy engine's /metrics is not read", got, s.metrics.Load())
		}
	})
	t.Run("down and back without a start time", func(t *testing.T) {
		t.Parallel()
		s := newRestartableEngine(t)
		s.start.Store(0)
		e := newOpenAI(t, OpenAIConfig{URL: s.url(), HealthInterval: interval})
		l := watchRestarts(t, e)
		eventually(t, 5*time.Second, "healthy", func() bool { return l.count("healthy") == 1 })
		s.down()
		eventually(t, 5*time.Second, "unhealthy once refused", func() bool { return l.count("unhealthy") == 1 })
		s.up(time.Time{})
		eventually(t, 5*time.Second, "healthy again", func() bool { return l.count("healthy") == 2 })
		if got := fmt.Sprint(l.get()); got != "[healthy unhealthy restart healthy]" {
			t.Fatalf("events %s", got)
		}
	})
}

// TestEngineRestartedClearsOnce proves how a driver rank clears its
// engine's blocks once per restart, whichever finds it first: the health
// watcher (then the new engine's first KV event batch, its sequence going
// back, clears nothing more) or the KV events (then the health watcher's
// finding of the same restart clears nothing: the new engine's blocks
// stay). A second restart after a first the health watcher found is
// cleared again: it failed before, when the first new engine's sequence
// going back was taken for evidence of the second restart.
func TestEngineRestartedClearsOnce(t *testing.T) {
	t.Parallel()
	nc := busConn(t)
	sub, err := nc.SubscribeSync("kvbus.kv.g0.0")
	if err != nil {
		t.Fatal(err)
	}
	r := &Rank{log: slog.New(slog.DiscardHandler), events: newEventLog(nc, "kvbus.kv.g0.0", "g0", 0, slog.New(slog.DiscardHandler))}
	tr, err := vllmevents.NewTranslator(vllmevents.TranslatorConfig{BlockSize: 2, Hash: chainedHash("m")})
	if err != nil {
		t.Fatal(err)
	}
	k := &engineKV{tr: tr}
	// published returns the event types of the batches published since
	// the last call.
	published := func() string {
		t.Helper()
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		var out []string
		for {
			m, err := sub.NextMsg(100 * time.Millisecond)
			if err != nil {
				return strings.Join(out, " ")
			}
			b, err := messages.DecodeKVEventBatch(m.Data)
			if err != nil {
				t.Fatal(err)
			}
			for _, ev := range b.Events {
				out = append(out, ev.Type)
			}
		}
	}
	stored := func(h uint64) {
		t.Helper()
		b := &vllmevents.Batch{Events: []vllmevents.Event{{Type: messages.EventBlockStored,
			BlockHashes: []vllmevents.Hash{vllmevents.HashFromUint64(h)}, TokenIDs: []uint32{1, 2}, BlockSize: 2}}}
		if _, err := r.engineBatch(k, 1, b); err != nil {
			t.Fatal(err)
		}
	}
	const cleared, storedEv = messages.EventAllBlocksCleared, messages.EventBlockStored

	// Engine 1 stores; engine 2 is found by the health watcher, then
	// publishes its first batch (its sequence went back).
	stored(1)
	seen := time.Now()
	r.engineRestarted(k, EngineRestart{Why: "test", LastSeen: seen})
	r.engineGap(k, 1, 0)
	stored(2)
	if got, want := published(), storedEv+" "+cleared+" "+storedEv; got != want {
		t.Fatalf("health first: published %q, want %q", got, want)
	}
	// Engine 3 comes up: the health watcher finds it; engine 2's sequence
	// going back above is no evidence of it.
	seen = time.Now()
	r.engineRestarted(k, EngineRestart{Why: "test", LastSeen: seen})
	if got := published(); got != cleared {
		t.Fatalf("a second restart: published %q, want %q", got, cleared)
	}
	stored(3)
	// Engine 4 shows itself by its KV events first (a restart between two
	// polls), then the health watcher finds it.
	seen = time.Now()
	r.engineGap(k, 1, 0)
	stored(4)
	r.engineRestarted(k, EngineRestart{Why: "test", LastSeen: seen})
	if got, want := published(), storedEv+" "+cleared+" "+storedEv; got != want {
		t.Fatalf("events first: published %q, want %q (the new engine's block must stay)", got, want)
	}
	if n := r.events.heldBlocks(); n != 1 {
		t.Fatalf("the rank holds %d blocks, want engine 4's 1", n)
	}
	// Lost batches (not a restart) clear, as before.
	r.engineGap(k, 2, 5)
	if got := published(); got != cleared {
		t.Fatalf("lost batches: published %q, want %q", got, cleared)
	}
}

// TestEngineBatchWhole: a block of an unknown parent is an error of the
// engine's stream only when the rank heard that stream from its first
// batch (seq 0) and did not forget it since; a rank that joined mid-way
// (a worker restarted beside a running engine) or lost batches expects it
// (TestWorkerRestartBesideARunningEngine, ./testenv).
func TestEngineBatchWhole(t *testing.T) {
	t.Parallel()
	nc := busConn(t)
	r := &Rank{log: slog.New(slog.DiscardHandler), events: newEventLog(nc, "kvbus.kv.g0.0", "g0", 0, slog.New(slog.DiscardHandler))}
	tr, err := vllmevents.NewTranslator(vllmevents.TranslatorConfig{BlockSize: 2, Hash: chainedHash("m")})
	if err != nil {
		t.Fatal(err)
	}
	k := &engineKV{tr: tr}
	orphan := func(seq uint64) bool {
		t.Helper()
		parent := vllmevents.HashFromUint64(1000 + seq)
		b := &vllmevents.Batch{Events: []vllmevents.Event{{Type: messages.EventBlockStored, Parent: &parent,
			BlockHashes: []vllmevents.Hash{vllmevents.HashFromUint64(seq)}, TokenIDs: []uint32{1, 2}, BlockSize: 2}}}
		whole, err := r.engineBatch(k, seq, b)
		if !errors.Is(err, vllmevents.ErrUnknownParent) {
			t.Fatalf("seq %d: err %v, want an unknown parent", seq, err)
		}
		return whole
	}
	if orphan(7) {
		t.Error("joined at seq 7: the rank cannot have heard every block")
	}
	if !orphan(0) {
		t.Error("from the engine's first batch on, an unknown parent is an error of its stream")
	}
	r.engineGap(k, 1, 3) // lost, not replayed
	if orphan(3) {
		t.Error("after a gap the translator forgot the engine's blocks")
	}
	r.engineRestarted(k, EngineRestart{LastSeen: time.Now()})
	if !orphan(0) {
		t.Error("the restarted engine's first batch: the rank hears all of it again")
	}
}
