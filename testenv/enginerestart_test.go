package testenv_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/cluster"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/testenv/fakeengine"
	"github.com/kvbus/kvbus/workers"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// restartableEngine is a fake vLLM at a fixed HTTP address and KV event
// endpoint, which restart starts again as a new process would: a new
// process_start_time_seconds, an empty cache, a KV event sequence from 0.
type restartableEngine struct {
	cfg fakeengine.Config
	*fakeengine.Engine
}

func newRestartableEngine(t *testing.T) *restartableEngine {
	t.Helper()
	// Its ports are drawn below the kernel's ephemeral range, where the
	// kernel hands none out to another process's bind(:0) or connect():
	// free while the engine is stopped, only a process binding that very
	// number can take one before the restart binds it again. The first
	// start binds them itself, drawing others if one is in use (a port
	// picked free, closed and bound later could be taken in between).
	e := &restartableEngine{}
	var err error
	lo := testenv.EphemeralPortLow()
	for range 100 {
		e.cfg = fakeengine.Config{ModelName: "kvbus-sim", Addr: fmt.Sprintf("127.0.0.1:%d", 20000+rand.IntN(lo-20000)),
			KVEvents: &fakeengine.KVEventsConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", 20000+rand.IntN(lo-20000))}}
		if e.Engine, err = fakeengine.New(e.cfg); err == nil {
			t.Cleanup(func() { _ = e.Close() })
			return e
		}
	}
	t.Fatalf("start the engine: %v", err)
	return nil
}

// start starts the engine's process again after a stop; its address may
// linger a moment after the process before closed.
func (e *restartableEngine) start(t *testing.T) {
	t.Helper()
	var err error
	for range 100 {
		var ng *fakeengine.Engine
		if ng, err = fakeengine.New(e.cfg); err == nil {
			e.Engine = ng
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("restart the engine: %v", err)
}

// restartCluster is a kvbus (one group, g0) in front of one restartable
// engine.
func restartCluster(t *testing.T) (*testenv.Cluster, *restartableEngine) {
	t.Helper()
	e := newRestartableEngine(t)
	// The frontend tokenizes with another fake (the same tokenizer), so a
	// turn sent while the engine is down reaches the scheduler.
	tokenizer, err := fakeengine.New(fakeengine.Config{ModelName: "kvbus-sim"}) // never restarted: an ephemeral port
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tokenizer.Close() })
	tok, err := frontend.NewEngineTokenizer(frontend.EngineTokenizerConfig{URLs: []string{tokenizer.URL()}})
	if err != nil {
		t.Fatal(err)
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{Tokenizer: tok, Policy: "kv", MaxModelLen: 8192, NoGroupWait: 10 * time.Second,
		Engines: []cluster.EngineBackend{{
			OpenAI:   workers.OpenAIConfig{URL: e.URL(), HealthInterval: 100 * time.Millisecond},
			KVEvents: &vllmevents.Config{Endpoint: e.KVEventsAddr()},
		}}})
	waitSubscribed(t, e)
	return c, e
}

func waitSubscribed(t *testing.T, e *restartableEngine) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second) // setup (see engineCluster)
	defer cancel()
	if err := e.WaitSubscribed(ctx); err != nil {
		t.Fatalf("the rank never subscribed to the engine's KV events: %v", err)
	}
}

// credited is how many leading blocks of tokens the scheduler's index
// credits group g0 with (plans included, as placement counts them).
func credited(t *testing.T, c *testenv.Cluster, model string, tokens []uint32) (credit, blocks int) {
	t.Helper()
	hashes := scheduler.HashBlocks(nil, scheduler.HashSeed(model), tokens, fakeengine.DefaultBlockSize)
	id, ok := c.Scheduler.Index().GroupID("g0")
	if !ok {
		return 0, len(hashes)
	}
	return c.Scheduler.Index().PrefixMatch(hashes, nil)[id], len(hashes)
}

// promptOf is the prompt the engine received for a turn.
func promptOf(t *testing.T, e *restartableEngine, turn testenv.Turn) []uint32 {
	t.Helper()
	for _, r := range e.Requests() {
		if strings.HasPrefix(r.Header.Get("X-Request-Id"), turn.RequestID) && r.Path == "/v1/chat/completions" {
			return r.PromptTokens
		}
	}
	t.Fatalf("the engine did not receive %s", turn.RequestID)
	return nil
}

// predicted is the scheduler's predicted cached tokens of a turn, from its
// "request done" line.
func predicted(t *testing.T, c *testenv.Cluster, turn testenv.Turn) string {
	t.Helper()
	var p string
	testenv.Eventually(t, 5*time.Second, "the scheduler's request done line of "+turn.RequestID, func() bool {
		for _, l := range c.Logs.Lines("request done") {
			if strings.Contains(l, turn.RequestID) {
				if _, v, ok := strings.Cut(l, "predicted_tokens="); ok {
					p = strings.Fields(v)[0]
					return true
				}
			}
		}
		return false
	})
	return p
}

func waitPlaceable(t *testing.T, c *testenv.Cluster, want bool) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("g0 placeable = %v", want), func() bool {
		return (len(c.Scheduler.PlaceableGroups(time.Now())) == 1) == want
	})
}

// TestEngineRestartClearsItsBlocks: an engine that restarts (its process
// stops and a new one starts at the same URL and KV event endpoint, with an
// empty cache) no longer gets credit in the scheduler's index for the
// blocks the old process held, before the new one publishes any KV event:
//
// the health poll sees it refused, then a process_start_time_seconds after
// it was last seen healthy: within one health poll of the new process
// answering (bound asserted: 1 s, polls every 100 ms), before the group is
// ready again.
//
// The next turn's predicted cached tokens are 0, as the engine's own
// cached_tokens, and the new engine's blocks are credited again once it
// stores them (its KV events, whose sequence went back, clear nothing
// more). An engine that is unhealthy for a while but the same process
// keeps its blocks. Before the fix the index kept the old blocks until the new
// engine's first KV event: the bounds failed, and a turn placed after the
// restart was predicted the whole old prefix.
func TestEngineRestartClearsItsBlocks(t *testing.T) {
	for _, tc := range []struct {
		name   string
		down   bool // wait for the cluster to see the engine down before the new process starts
		within time.Duration
	}{
		{"down and back", true, time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, e := restartCluster(t)
			client := &http.Client{Timeout: 30 * time.Second}
			defer client.CloseIdleConnections()
			d := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 3,
				Headers: map[string]string{"X-Session-ID": "restart-" + strings.ReplaceAll(tc.name, " ", "-")}}.Start()
			first, err := d.Next(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			prompt := promptOf(t, e, first)
			testenv.Eventually(t, 10*time.Second, "turn 1's prompt credited to g0", func() bool {
				got, n := credited(t, c, c.Model, prompt)
				return got == n && n > 0
			})

			old := e.StartedAt()
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
			if tc.down {
				waitPlaceable(t, c, false)
			}
			e.start(t)
			restarted := time.Now()
			if !e.StartedAt().After(old) {
				t.Fatal("the new engine has the old process's start time")
			}
			testenv.Eventually(t, tc.within, "the index forgets the old engine's blocks", func() bool {
				got, _ := credited(t, c, c.Model, prompt)
				return got == 0
			})
			t.Logf("the index forgot the old engine's blocks %v after the new process started", time.Since(restarted).Round(time.Millisecond))
			if n := e.NextSeq(); n != 0 {
				t.Fatalf("the new engine published %d KV event batches: the clear did not come from the health watcher", n)
			}
			if l := c.Logs.Lines("engine restarted: its KV cache is empty"); len(l) != 1 {
				t.Errorf("restart log lines %q, want one", l)
			}

			waitPlaceable(t, c, true)
			waitSubscribed(t, e)
			second, err := d.Next(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if p := predicted(t, c, second); p != "0" || second.CachedTokens != 0 {
				t.Fatalf("turn 2 after the restart: predicted %s cached tokens, the engine had %d; want 0 and 0", p, second.CachedTokens)
			}
			prompt = promptOf(t, e, second)
			testenv.Eventually(t, 10*time.Second, "the new engine's blocks credited to g0", func() bool {
				got, n := credited(t, c, c.Model, prompt)
				return got == n
			})
			// The rank said the sequence went back at INFO, as a
			// restart its health showed; the subscriber said nothing.
			if l := c.Logs.Lines("sequence went back"); len(l) != 1 || !strings.Contains(l[0], "level=INFO") {
				t.Errorf("lines on the new engine's sequence: %q, want the rank's one at INFO", l)
			}

			// An engine that fails its health polls for a while (3 in a
			// row: the group is taken out) but is the same process keeps
			// its blocks: that is no restart.
			e.SetHealthy(false)
			waitPlaceable(t, c, false)
			e.SetHealthy(true)
			waitPlaceable(t, c, true)
			if got, n := credited(t, c, c.Model, prompt); got != n {
				t.Fatalf("an engine that was unhealthy, not restarted, is credited with %d of %d blocks", got, n)
			}
			if l := c.Logs.Lines("engine restarted: its KV cache is empty"); len(l) != 1 {
				t.Errorf("restart log lines %q, want the one restart", l)
			}
		})
	}
}

// TestWorkerRestartBesideARunningEngine: a worker restarted while its
// engine runs on hears the engine's KV events from the middle: the next
// turn of a conversation the engine cached before stores blocks whose
// parents the new process never heard of. That is expected (the blocks are
// not indexed; the session's save plans place its turns), and said once at
// INFO. It was logged at ERROR ("engine KV events: blocks skipped ...
// unknown parent block", "the engine's KV event stream may be incomplete")
// after every worker restart in a review's fault run, where nothing was
// wrong with the engine's stream.
func TestWorkerRestartBesideARunningEngine(t *testing.T) {
	c, e := restartCluster(t)
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	d := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 5,
		Headers: map[string]string{"X-Session-ID": "worker-restart"}}.Start()
	for range 2 {
		if _, err := d.Next(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	c.CrashRestartRank(t, "g0", 0)
	c.WaitReady(t)
	testenv.Eventually(t, 10*time.Second, "the new rank subscribed", func() bool {
		return len(c.Logs.Lines("engine KV events: subscribing")) == 2
	})
	// The new rank's subscription reaches the engine a moment after it is
	// made: turns go on until one's blocks reach it.
	expected := "blocks chained from blocks the engine cached before this rank heard its events"
	for turn := 0; len(c.Logs.Lines(expected)) == 0 && len(c.Logs.Lines("blocks skipped")) == 0; turn++ {
		if turn == 10 {
			t.Fatalf("10 turns after the worker restarted, its rank heard of no block of an unknown parent (engine seq %d)", e.NextSeq())
		}
		if _, err := d.Next(t.Context()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if l := c.Logs.Lines("level=ERROR", "engine KV events"); len(l) != 0 {
		t.Errorf("ERROR lines after a worker restart beside a running engine: %q", l)
	}
	if l := c.Logs.Lines(expected, "level=INFO"); len(l) != 1 {
		t.Errorf("lines %q, want one at INFO", l)
	}
}
