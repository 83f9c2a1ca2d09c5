package testenv_test

import (
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestDrainHandoffKeepsTheCache scales a group down in the middle of its
// conversations. With the drain hand-off its ranks give their sessions'
// blocks to the same ranks of the other groups before they exit, and every
// next turn of those conversations finds >= 95% of its previous prompt
// cached; without it, the group's cache leaves with it and the next turns
// find nothing.
func TestDrainHandoffKeepsTheCache(t *testing.T) {
	for _, tc := range []struct {
		name    string
		handoff int64
	}{{"handoff", 64 << 20}, {"off", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 3, Pool: "global", DrainHandoff: tc.handoff})
			client := &http.Client{Timeout: 30 * time.Second}
			defer client.CloseIdleConnections()
			// Turn 1 of six conversations, spread over the three groups.
			dialogs, bySession, count, victim := firstTurns(t, c, client, "drain-"+tc.name+"-", 700)
			t.Logf("sessions per group %v; scaling %s down", count, victim)
			if err := c.StopGroup(victim); err != nil {
				t.Fatal(err)
			}
			// The fault took effect: the group's ranks are gone from the bus.
			testenv.Eventually(t, 5*time.Second, "the stopped group's ranks disconnected", func() bool {
				for r := range 4 {
					if c.Connected(t, fmt.Sprintf("kvbus-worker-%s-%d", victim, r)) {
						return false
					}
				}
				return true
			})
			handedOff := testenv.CounterSum(t, c.Registry, "kvbus_worker_handoff_blocks_total", map[string]string{"source_group": victim})
			var due float64
			for session, g := range bySession {
				if g != victim {
					continue
				}
				d := dialogs[session]
				prev := d.Turns[0]
				due += float64(prev.PromptTokens / 16 * 4) // full blocks, on each of 4 ranks
				share := secondTurnShare(t, d, session, victim)
				switch {
				case tc.handoff > 0 && share < 0.95:
					t.Errorf("session %s found %.1f%% of its previous prompt after its group was scaled down, want >= 95%%", session, 100*share)
				case tc.handoff == 0 && share != 0:
					t.Errorf("session %s found %.1f%% of its previous prompt without a hand-off, want 0 (the cache left with the group)", session, 100*share)
				}
			}
			t.Logf("rank-blocks handed off by %s: %v (turn-1 rank-blocks of its sessions: %v)", victim, handedOff, due)
			if tc.handoff > 0 && handedOff < due {
				t.Errorf("%v rank-blocks handed off, want >= %v (every full block of its sessions' prompts, on every rank)", handedOff, due)
			}
			if tc.handoff == 0 && handedOff != 0 {
				t.Errorf("%v rank-blocks handed off with --drain-handoff 0", handedOff)
			}
		})
	}
}

// TestDrainHandoffOnlyForAWholeGroup: a rank that restarts alone (its group
// stays) hands nothing off and does not wait for a plan; a driver that
// stops alone sends an empty plan.
func TestDrainHandoffOnlyForAWholeGroup(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Pool: "global", DrainHandoff: 64 << 20})
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	for i := range 4 {
		if _, err := (testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 800 + i,
			Headers: map[string]string{"X-Session-ID": fmt.Sprint("whole-", i)}}).Run(t.Context(), 1); err != nil {
			t.Fatal(err)
		}
	}
	c.RestartRank(t, "g0", 2)
	if n := len(c.Logs.Lines("the group's driver rank is not stopping", "group=g0", "tp_rank=2")); n != 1 {
		t.Errorf("a non-driver rank restarting alone logged %d times that its driver is not stopping, want 1", n)
	}
	c.RestartRank(t, "g1", 0)
	if n := len(c.Logs.Lines("only part of the group is stopping", "group=g1", "tp_rank=0")); n != 1 {
		t.Errorf("a driver restarting alone logged %d times that only part of its group stops, want 1", n)
	}
	if n := testenv.CounterSum(t, c.Registry, "kvbus_worker_handoff_blocks_total", nil); n != 0 {
		t.Errorf("%v blocks handed off by single-rank restarts, want 0", n)
	}
}

// TestGroupReplacedInPlaceHandsOffItsCache replaces a group's ranks as a
// rolling upgrade does (README, "Upgrading a running deployment", step 5):
// every rank stopped together and a new process of each started at once,
// while the old ones drain and hand their blocks to the other group. The
// new processes serve the same pool subjects, holding nothing: they
// answered the hand-off's reads with every block missing before the
// draining ones could, and the next turns of the replaced group's sessions
// recomputed their prefixes (with every role its own process: 0 or 512 of
// 800-1,072 due tokens, 3 sessions of 3 in each of 3 runs). The hand-off's
// reads name the draining process now, and only it answers.
func TestGroupReplacedInPlaceHandsOffItsCache(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Pool: "global", DrainHandoff: 64 << 20})
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	dialogs, bySession, count, victim := firstTurns(t, c, client, "replace-", 900)
	t.Logf("sessions per group %v; replacing %s's ranks", count, victim)
	if err := c.ReplaceGroup(victim); err != nil {
		t.Fatal(err)
	}
	c.WaitReady(t)
	if n := len(c.Logs.Lines(`msg="rank started"`, "group="+victim+" ")); n < 8 {
		t.Fatalf("%d rank starts of %s logged, want 8 (4 ranks, then their replacements): the fault did not take effect", n, victim)
	}
	for session, g := range bySession {
		if g != victim {
			continue
		}
		if share := secondTurnShare(t, dialogs[session], session, victim); share < 0.95 {
			t.Errorf("session %s found %.1f%% of its previous prompt after its group was replaced, want >= 95%%", session, 100*share)
		}
	}
	if lines := c.Logs.Lines("kept blocks handed off by a draining group", "source_group="+victim); len(lines) == 0 {
		t.Error("nothing was handed off by the replaced group")
	} else {
		for _, l := range lines {
			if !strings.Contains(l, "failed_blocks=0 ") {
				t.Errorf("a hand-off lost blocks: %s", l)
			}
		}
	}
}

// firstTurns sends turn 1 of six conversations (sessions prefix0 …
// prefix5, seeds from seed) and returns them, the group each landed on
// (its store thread lines say), the sessions per group, and the group with
// the most of them (the first by name of equals).
func firstTurns(t *testing.T, c *testenv.Cluster, client *http.Client, prefix string, seed int) (
	dialogs map[string]*testenv.Dialog, bySession map[string]string, count map[string]int, busiest string) {
	t.Helper()
	dialogs, bySession, count = map[string]*testenv.Dialog{}, map[string]string{}, map[string]int{}
	groupOf := regexp.MustCompile(`group=(\S+)`)
	for i := range 6 {
		session := fmt.Sprint(prefix, i)
		d := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: seed + i,
			Headers: map[string]string{"X-Session-ID": session}}.Start()
		if _, err := d.Next(t.Context()); err != nil {
			t.Fatal(err)
		}
		dialogs[session] = d
	}
	for session := range dialogs {
		var lines []string
		testenv.Eventually(t, 5*time.Second, "a store thread line of session "+session, func() bool {
			lines = c.Logs.Lines("store thread", "session_id="+session+" ")
			return len(lines) > 0
		})
		g := groupOf.FindStringSubmatch(lines[0])[1]
		bySession[session] = g
		count[g]++
	}
	for g, n := range count {
		if busiest == "" || n > count[busiest] || (n == count[busiest] && g < busiest) {
			busiest = g
		}
	}
	return dialogs, bySession, count, busiest
}

// secondTurnShare sends turn 2 of a session whose group (was) was scaled
// down or replaced, and returns the share of turn 1's prompt it found
// cached.
func secondTurnShare(t *testing.T, d *testenv.Dialog, session, was string) float64 {
	t.Helper()
	turn, err := d.Next(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	share := testenv.PreviousShares(d.Turns, 16)[0]
	t.Logf("session %s (was on %s): turn 2 prompt %d tokens, cached %d: %.1f%% of turn 1's", session, was,
		turn.PromptTokens, turn.CachedTokens, 100*share)
	return share
}
