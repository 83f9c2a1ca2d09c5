package testenv_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestNextTurnFindsItsCache is the cache promise as a user feels it: 4-turn
// chat conversations with a long system prompt, each turn sent the moment
// the previous answer arrived, at --time-scale 0, on 4 groups of 4 ranks
// whose rank 3 saves 60 ms late (so the next turn is placed while the
// previous turn's blocks are still being saved). Every next turn must find
// >= 95% of the previous prompt's full blocks cached — with one and with two
// scheduler replicas, with and without a session header.
func TestNextTurnFindsItsCache(t *testing.T) {
	for _, schedulers := range []int{1, 2} {
		for _, session := range []bool{true, false} {
			t.Run(fmt.Sprintf("schedulers=%d/session=%v", schedulers, session), func(t *testing.T) {
				c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 4, Schedulers: schedulers,
					StoreDelays: map[int]time.Duration{3: 60 * time.Millisecond}})
				client := &http.Client{Timeout: 30 * time.Second}
				defer client.CloseIdleConnections()
				worst := 1.0
				for conv := range 4 {
					var headers map[string]string
					if session {
						headers = map[string]string{"X-Session-ID": fmt.Sprintf("ryw-%d-%d", schedulers, conv)}
					}
					turns, err := testenv.Conversation{BaseURL: c.URL, Client: client, Headers: headers, Model: c.Model,
						Seed: conv + 10*schedulers}.Run(t.Context(), 4)
					if err != nil {
						t.Fatal(err)
					}
					shares := testenv.PreviousShares(turns, 16)
					for i, s := range shares {
						worst = min(worst, s)
						if s < 0.95 {
							t.Errorf("conversation %d turn %d: %d of the previous prompt's %d tokens cached (%.0f%%), want >= 95%%",
								conv, i+2, turns[i+1].CachedTokens, turns[i].PromptTokens/16*16, 100*s)
						}
					}
				}
				// The fault took effect: loads waited for rank 3's saves in flight
				// (rank 3 lags the answers; count once every rank reported).
				testenv.Eventually(t, 10*time.Second, "every rank reported", func() bool {
					for _, s := range c.Schedulers {
						if s.Trackers() != 0 {
							return false
						}
					}
					return true
				})
				waited := testenv.CounterSum(t, c.Registry, "kvbus_worker_blocks_total", map[string]string{"op": "waited_for_save"})
				t.Logf("worst share of the previous prompt cached: %.3f; loads that waited for a save in flight: %v", worst, waited)
				// One per next turn is expected (12); a loaded machine may make a
				// turn slower than the slow rank now and then.
				if waited < 3 {
					t.Errorf("%v loads waited for a save in flight, want about one per next turn (12): the slow rank did not slow them, the test shows nothing", waited)
				}
			})
		}
	}
}
