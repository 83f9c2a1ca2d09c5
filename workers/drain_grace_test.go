package workers_test

import (
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/workers"
)

// TestDrainGraceTakesReqMetas: a stopping rank sends a draining
// heartbeat and, for drainGrace (200 ms), still takes ReqMetas, because a
// scheduler may have placed a request on the group just before it heard the
// heartbeat (workers/rank.go: "A ReqMeta placed just before the scheduler
// heard it is still taken"). A ReqMeta sent right after the draining
// heartbeat must be run and answered, not dropped in silence (the scheduler
// would wait for the whole drain and a heartbeat timeout before moving it).
func TestDrainGraceTakesReqMetas(t *testing.T) {
	env := startRanks(t, rankEnvConfig{engine: workers.SimConfig{}})
	go env.stop()
	testenv.Eventually(t, waitFor, "a draining heartbeat from every rank", func() bool {
		for r := range worldSize {
			hbs := env.heartbeats(r)
			if len(hbs) == 0 || !hbs[len(hbs)-1].Draining {
				return false
			}
		}
		return true
	})
	sent := time.Now()
	env.sendMeta(newMeta("in-grace", "sess", testenv.PromptTokens(1, 40)))
	if d := time.Since(sent); d > 100*time.Millisecond {
		t.Skipf("the ReqMeta went out %s after the draining heartbeat: not within the grace period", d)
	}
	<-env.stopped
	if got := env.results("in-grace"); len(got) != worldSize {
		t.Errorf("a ReqMeta sent within the drain grace period: %d RankResults, want %d (it was dropped)", len(got), worldSize)
	}
}
