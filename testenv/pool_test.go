package testenv_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
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
			var remote, predicted, actual float64
			// The driver's report counts its own remote tokens; the other
			// ranks may finish their loads after it answered.
			testenv.Eventually(t, 5*time.Second, "every request and every rank's remote reads counted", func() bool {
				done := testenv.CounterSum(t, c.Registry, "kvbus_scheduler_requests_total", map[string]string{"outcome": "completed"})
				predicted = testenv.CounterSum(t, c.Registry, "kvbus_scheduler_pool_cached_tokens_total", map[string]string{"kind": "predicted", "source": "remote"})
				actual = testenv.CounterSum(t, c.Registry, "kvbus_scheduler_pool_cached_tokens_total", map[string]string{"kind": "actual", "source": "remote"})
				remote = testenv.CounterSum(t, c.Registry, "kvbus_worker_pool_remote_blocks_total", nil)
				return done == 2*4 && predicted == actual && remote == 4*actual/16
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

// TestPoolReadWaitsForASaveNotYetRegistered: a conversation's next turn
// lands on another group while a rank of the previous turn's group has not
// yet handled that turn's ReqMeta (its intake is behind its driver's: the
// fault delays its first ReqMeta). The next turn's rank reads those blocks
// from it: the rank neither holds them nor knows yet that it will save
// them. The read came after that ReqMeta, on the same connection, so the
// source waits for its intake to handle it, then for the save, rather than
// answering "missing" (which cost a recompute of every block on that rank).
func TestPoolReadWaitsForASaveNotYetRegistered(t *testing.T) {
	const delay = 400 * time.Millisecond
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Ranks: 2, Policy: "round-robin", Pool: "global",
		DelayFirstReqMeta: map[int]time.Duration{1: delay}})
	// A first request takes one group's delayed ReqMeta, and the delay
	// passes; the conversation's turn 1 then goes to the other group, whose
	// rank 1 handles it only after the delay, and turn 2 comes back here.
	body := fmt.Sprintf(`{"model":%q,"prompt":"warm up","max_tokens":2}`, c.Model)
	if code, _, resp := testenv.Send(t, http.MethodPost, c.URL+"/v1/completions", body, nil); code != http.StatusOK {
		t.Fatalf("warm-up: %d %s", code, resp)
	}
	time.Sleep(delay + 100*time.Millisecond)
	metas := c.Observe(t, messages.Subjects{}.MetaSession("unregistered"))
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	turns, err := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 77,
		Headers: map[string]string{"X-Session-ID": "unregistered"}}.Run(t.Context(), 2)
	if err != nil {
		t.Fatal(err)
	}
	// Turn 2 was planned from turn 1's save in flight: its run is marked
	// saving, so the read would wait for the source's ReqMeta even where
	// (in a NATS cluster) the read overtook it.
	var runs []messages.RemoteRun
	for _, m := range metas.Messages() {
		if meta, err := messages.DecodeReqMeta(m.Data); err == nil && meta.LoadSpec != nil && len(meta.LoadSpec.Remote) > 0 {
			runs = meta.LoadSpec.Remote
		}
	}
	if len(runs) != 1 || !runs[0].Saving {
		t.Errorf("turn 2's remote runs %+v; want one, marked saving", runs)
	}
	if got := len(c.Logs.Lines("fault injection: ReqMeta delayed")); got != 2 {
		t.Fatalf("%d delayed ReqMetas, want 2 (one per group): the fault did not take effect", got)
	}
	due := float64(turns[0].PromptTokens / 16) // turn 1's full blocks, read by each rank of the other group
	var remote [2]float64
	var failed float64
	testenv.Eventually(t, 5*time.Second, "both ranks' loads counted", func() bool {
		for r := range remote {
			remote[r] = testenv.CounterSum(t, c.Registry, "kvbus_worker_pool_remote_blocks_total", map[string]string{"tp_rank": fmt.Sprint(r)})
		}
		failed = testenv.CounterSum(t, c.Registry, "kvbus_worker_blocks_total", map[string]string{"op": "load_failed"})
		return remote[0] >= due && remote[1]+failed >= due
	})
	t.Logf("turn 2 cached %d of %d tokens; remote blocks read by rank 0 %v, rank 1 %v (due %v); load_failed %v",
		turns[1].CachedTokens, turns[0].PromptTokens, remote[0], remote[1], due, failed)
	if awaited := testenv.CounterSum(t, c.Registry, "kvbus_worker_blocks_total", map[string]string{"op": "pool_awaited_intake"}); awaited != due {
		t.Errorf("%v blocks found after waiting for the source's intake, want %v: the read did not meet the delayed intake", awaited, due)
	}
	if failed != 0 || remote[1] != remote[0] {
		t.Errorf("rank 1 read %v blocks where rank 0 read %v, %v blocks recomputed: the read did not wait for the save", remote[1], remote[0], failed)
	}
	if s := testenv.PreviousShares(turns, 16)[0]; s < 1 {
		t.Errorf("turn 2 found %.2f of turn 1's full blocks, want all", s)
	}
}

// TestPoolReadsFromAnotherHolderWhenTheSourceStopped: round-robin places
// a conversation's turns on g0, g1, g2 in turn; turn 2 copies turn 1's
// prefix from g0, so g0 and g1 both hold it and g1 also holds turn 2's own
// blocks. The group a LoadSpec names as the source of the run starting at
// block 0 (the lower index id of the two) is then killed, and turn 3 goes
// out at once, well within the heartbeat timeout: the scheduler still
// counts the dead group as a source. Turn 3's ranks find no rank serving
// it and read from the other holder, the run's alternate, what it holds:
// the whole previous prompt if g0 died (g1 holds it all), turn 1's prefix
// if g1 died (g0 holds that much). Before alternates, 0 of it either way.
func TestPoolReadsFromAnotherHolderWhenTheSourceStopped(t *testing.T) {
	const ranks = 2
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 3, Ranks: ranks, Policy: "round-robin", Pool: "global"})
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	d := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 77,
		Headers: map[string]string{"X-Session-ID": "alternate-source"}}.Start()
	for range 2 {
		if _, err := d.Next(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	// Turn 2's ranks have copied turn 1's blocks when its answer is
	// back; its KV events, which make g1 a holder, follow at once.
	turn1Blocks := d.Turns[0].PromptTokens / 16
	testenv.Eventually(t, 5*time.Second, "g1 holding turn 1's prefix as the scheduler's index sees it", func() bool {
		return c.Scheduler.Index().GroupBlocks("g1") >= d.Turns[1].PromptTokens/16
	})
	id0, ok0 := c.Scheduler.Index().GroupID("g0")
	id1, ok1 := c.Scheduler.Index().GroupID("g1")
	if !ok0 || !ok1 {
		t.Fatal("g0 or g1 unknown to the index")
	}
	dead, alive := "g0", "g1"
	due := d.Turns[1].PromptTokens / 16 // the alive group holds the whole previous prompt
	if id1 < id0 {
		// g1 is the source of one run over the whole previous prompt; g0
		// holds its start, turn 1's prefix.
		dead, alive, due = "g1", "g0", turn1Blocks
	}
	for r := range ranks {
		c.KillRank(t, dead, r)
	}
	testenv.Eventually(t, 5*time.Second, "the killed ranks' connections gone", func() bool {
		return !c.Connected(t, "kvbus-worker-"+dead+"-0") && !c.Connected(t, fmt.Sprintf("kvbus-worker-%s-%d", dead, ranks-1))
	})
	turn, err := d.Next(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// The driver answered after its own load; the other rank's copies may
	// be counted a moment later.
	var fromDead, fromAlive float64
	testenv.Eventually(t, 5*time.Second, "every rank of g2 to count its copies", func() bool {
		fromDead = testenv.CounterSum(t, c.Registry, "kvbus_worker_pool_remote_blocks_total", map[string]string{"source_group": dead, "group": "g2"})
		fromAlive = testenv.CounterSum(t, c.Registry, "kvbus_worker_pool_remote_blocks_total", map[string]string{"source_group": alive, "group": "g2"})
		return fromAlive >= float64(ranks*due)
	})
	t.Logf("killed %s (index ids g0 %d, g1 %d); turn 3 found %d tokens cached, %d due; g2's ranks copied %v blocks from %s, %v from %s",
		dead, id0, id1, turn.CachedTokens, due*16, fromDead, dead, fromAlive, alive)
	if turn.CachedTokens < due*16 {
		t.Errorf("turn 3 found %d tokens cached, want >= %d (what %s holds): the run of the stopped source was not read from its alternate",
			turn.CachedTokens, due*16, alive)
	}
	// The fault took effect: nothing came from the dead group, and every
	// rank of g2 read what the other holder has from it.
	if fromDead != 0 || fromAlive < float64(ranks*due) {
		t.Errorf("g2 copied %v blocks from the killed %s and %v from %s; want 0 and >= %d", fromDead, dead, fromAlive, alive, ranks*due)
	}
}
