package workers_test

import (
	"testing"
	"time"
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
