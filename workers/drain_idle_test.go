package workers_test

import (
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestIdleRankStopsWithoutWaitingForPeers: with the drain hand-off on, a
// rank that holds no block has nothing to hand off, and exits on SIGTERM
// once its drain grace (200 ms) is over. It waited for its peers'
// heartbeats first: the driver of a whole group 1.5 heartbeat intervals
// (to hear every other group before choosing targets), a rank whose group
// does not stop with it 3 (to learn that): 3.2 s in all with the default
// 1 s interval. Another group is ready to take blocks throughout, so the empty
// store is the only reason not to wait. (A rank that holds blocks still
// waits and hands them off: TestDrainHandsOffToEveryTargetAtOnce,
// TestSlowRankHandsOffAfterItsDriverLeft.)
func TestIdleRankStopsWithoutWaitingForPeers(t *testing.T) {
	const (
		// Twice kvbus's default --heartbeat-interval: waits of 3 s and
		// 6 s, far from the bound.
		interval = 2 * time.Second
		bound    = 1500 * time.Millisecond // the drain grace, and room for a busy host
	)
	for _, tc := range []struct {
		name  string
		ranks []int // stopped, in this order; nil: all at once
	}{
		{"the whole group", nil},
		{"the driver alone", []int{0}},
		{"another rank alone", []int{1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := startRanks(t, rankEnvConfig{drainHandoff: 1 << 20, hbInterval: interval})
			defer env.readyGroups("g1")()
			if tc.ranks == nil {
				start := time.Now()
				env.stop()
				if took := time.Since(start); took > bound {
					t.Errorf("an idle group took %s to stop, want under %s", took.Round(time.Millisecond), bound)
				}
			}
			for _, r := range tc.ranks {
				if took := env.stopRank(r); took > bound {
					t.Errorf("idle rank %d took %s to stop alone, want under %s", r, took.Round(time.Millisecond), bound)
				}
			}
			if !t.Failed() {
				return
			}
			t.Logf("logs:\n%s", env.logs.String())
		})
	}
}

// TestRankStopsAtOnceWithNATSGone: ranks that hold blocks, stopped after
// their NATS server went away (a whole cluster stopped at once, the server
// first), hand off nothing and exit once their drain grace is over. They
// waited for heartbeats they could not hear: 3 heartbeat intervals, 6.2 s
// here (with kvbus's defaults every rank of a multi-process cluster took
// 3.2 s more than its drain grace, a rank whose driver's plan was awaited
// up to --shutdown-timeout more).
func TestRankStopsAtOnceWithNATSGone(t *testing.T) {
	const (
		interval = 2 * time.Second         // waits of 6 s before
		bound    = 1500 * time.Millisecond // the drain grace, and room for a busy host
		gone     = "NATS is unreachable; nothing handed off"
	)
	env := startRanks(t, rankEnvConfig{drainHandoff: 1 << 20, hbInterval: interval})
	stopReady := env.readyGroups("g2") // a group ready to take the blocks
	env.sendMeta(newMeta("a", "s", testenv.PromptTokens(1, 4*blockSize+1)))
	env.finalOutput("a")
	env.resultsByRank("a")
	for r := range worldSize {
		if n := len(env.dump(r)); n != 4 {
			t.Fatalf("rank %d holds %d blocks, want the prompt's 4 (a rank holding none exits at once anyway)", r, n)
		}
	}
	stopReady()
	env.srv.Shutdown()
	testenv.Eventually(t, waitFor, "the test's connection to see the server gone", func() bool { return !env.nc.IsConnected() })
	time.Sleep(100 * time.Millisecond) // the ranks' connections see it as the test's did
	start := time.Now()
	env.stop()
	if took := time.Since(start); took > bound {
		t.Errorf("ranks holding blocks took %s to stop with NATS gone, want under %s", took.Round(time.Millisecond), bound)
	}
	if n := len(env.logs.Lines(gone)); n != worldSize {
		t.Errorf("%d ranks logged %q, want all %d", n, gone, worldSize)
	}
	if t.Failed() {
		t.Logf("logs:\n%s", env.logs.String())
	}
}
