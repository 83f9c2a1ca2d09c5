package testenv_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestGlobalPoolServesOtherGroups: with round-robin placement every turn
// of a conversation lands on the other group. With the global pool the
// next turn still finds >= 95% of the previous prompt cached, read from
// the other group's segments (same tp_rank); with the local pool it finds
// nothing — the pool, not placement, is what keeps the cache.
func TestGlobalPoolServesOtherGroups(t *testing.T) {
	for _, pool := range []string{"global", "local"} {
		t.Run(pool, func(t *testing.T) {
			c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Policy: "round-robin", Pool: pool})
			client := &http.Client{Timeout: 30 * time.Second}
			defer client.CloseIdleConnections()
			worst, best := 1.0, 0.0
			for conv := range 2 {
				turns, err := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 500 + conv,
					Headers: map[string]string{"X-Session-ID": fmt.Sprint("pool-", pool, conv)}}.Run(t.Context(), 4)
				if err != nil {
					t.Fatal(err)
				}
				for _, s := range testenv.PreviousShares(turns, 16) {
					worst, best = min(worst, s), max(best, s)
				}
			}
			remote := testenv.CounterSum(t, c.Registry, "kvbus_worker_pool_remote_blocks_total", nil)
			var predicted, actual float64
			testenv.Eventually(t, 5*time.Second, "every request counted", func() bool {
				done := testenv.CounterSum(t, c.Registry, "kvbus_scheduler_requests_total", map[string]string{"outcome": "completed"})
				predicted = testenv.CounterSum(t, c.Registry, "kvbus_scheduler_pool_cached_tokens_total", map[string]string{"kind": "predicted", "source": "remote"})
				actual = testenv.CounterSum(t, c.Registry, "kvbus_scheduler_pool_cached_tokens_total", map[string]string{"kind": "actual", "source": "remote"})
				return done == 2*4 && predicted == actual
			})
			t.Logf("pool %s: previous-prompt share cached worst %.3f, best %.3f; blocks read from the other group %v; remote tokens predicted %v, loaded %v",
				pool, worst, best, remote, predicted, actual)
			if predicted != actual {
				t.Errorf("remote tokens predicted %v, loaded %v: the LoadSpecs' remote runs were not all read", predicted, actual)
			}
			switch pool {
			case "global":
				if worst < 0.95 {
					t.Errorf("worst share %.3f, want >= 0.95 with the global pool", worst)
				}
				// Per conversation, turn 2's 4 ranks read turn 1's 50 blocks from
				// the other group; later turns read only the turn in between.
				if remote < 2*4*50 {
					t.Errorf("%v blocks read from the other group, want >= %d", remote, 2*4*50)
				}
			case "local":
				// Turn 2 lands where nothing of turn 1 is (turn 3 finds turn 1's
				// blocks again, back on its group).
				if worst != 0 || remote != 0 {
					t.Errorf("local pool: worst share %.3f, %v remote blocks; want a next turn that found nothing and no remote read", worst, remote)
				}
			}
		})
	}
}
