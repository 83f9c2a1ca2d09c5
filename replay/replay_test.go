package replay_test

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// knownTrace is 3 sessions × 3 turns in Mooncake format: turn k of session
// s is blocks [s0 … s(k-1)] of 512 tokens, one second apart. An infinite
// cache hits the previous turn's blocks: per session 0 + 512 + 1024 of
// 512 + 1024 + 1536 prompt tokens, so both ratios are exactly 0.5.
func knownTrace() string {
	var b strings.Builder
	for turn := 1; turn <= 3; turn++ {
		for s := range 3 {
			ids := make([]string, turn)
			for k := range turn {
				ids[k] = fmt.Sprint(100*s + k)
			}
			fmt.Fprintf(&b, `{"timestamp": %d, "input_length": %d, "output_length": 3, "hash_ids": [%s], "session_id": "s%d"}`+"\n",
				1000*(turn-1)+s, 512*turn, strings.Join(ids, ", "), s)
		}
	}
	return b.String()
}

func TestKnownAnswerReplay(t *testing.T) {
	tr, err := replay.ReadTrace(strings.NewReader(knownTrace()), replay.FormatAuto)
	if err != nil {
		t.Fatal(err)
	}
	if tr.Format != replay.FormatMooncake || len(tr.Items) != 9 || tr.Sessions() != 3 {
		t.Fatalf("parsed %s, %d items, %d sessions", tr.Format, len(tr.Items), tr.Sessions())
	}
	if got := replay.IdealHitRatio(tr.Items, "kvbus-sim", 16); got != 0.5 {
		t.Fatalf("ideal hit ratio %v, want exactly 0.5", got)
	}
	for _, target := range []string{"nats", "http"} {
		t.Run(target, func(t *testing.T) {
			c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Payload: "accounting"})
			nc := testenv.Connect(t, c.NATS)
			cfg := replay.Config{Target: c.NATS.ClientURL(), Conn: nc, Speed: 10, Mode: replay.ModeSession, Model: c.Model}
			if target == "http" {
				cfg.Target = c.URL
			}
			r, err := replay.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			results, elapsed, err := r.Run(t.Context(), tr.Items)
			if err != nil {
				t.Fatal(err)
			}
			rep := replay.Summarize("kv", results, replay.IdealHitRatio(tr.Items, c.Model, 16), elapsed)
			if rep.OK != 9 || rep.Failed != 0 {
				t.Fatalf("ok %d failed %d: %v", rep.OK, rep.Failed, rep.Errors)
			}
			if rep.HitRatio != 0.5 || rep.IdealHitRatio != 0.5 {
				t.Errorf("hit_ratio %v ideal %v, want exactly 0.5 and 0.5", rep.HitRatio, rep.IdealHitRatio)
			}
			if math.Abs(rep.HitRatioByTurn["1"]) != 0 || rep.HitRatioByTurn["3"] != 1024.0/1536 {
				t.Errorf("by turn %v", rep.HitRatioByTurn)
			}
			if rep.TTFT.P50 <= 0 || rep.E2E.P99 < rep.TTFT.P50 {
				t.Errorf("latencies ttft %+v e2e %+v", rep.TTFT, rep.E2E)
			}
			if len(rep.GroupRequests) == 0 {
				t.Errorf("no group learned from ReqMeta subjects")
			}
		})
	}
}

// TestSessionModeIsClosedLoop checks that turn n+1 of a session is never
// sent before turn n finished, even when the trace has them at once.
func TestSessionModeIsClosedLoop(t *testing.T) {
	var b strings.Builder
	for turn := 1; turn <= 4; turn++ {
		fmt.Fprintf(&b, `{"timestamp": 0, "input_length": %d, "output_length": 20, "hash_ids": [%s], "session_id": "only"}`+"\n",
			512*turn, strings.TrimSuffix(strings.Repeat("7, ", turn), ", "))
	}
	tr, err := replay.ReadTrace(strings.NewReader(b.String()), "")
	if err != nil {
		t.Fatal(err)
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{TimeScale: 0.01, Payload: "accounting"})
	r, err := replay.New(replay.Config{Target: c.NATS.ClientURL(), Conn: testenv.Connect(t, c.NATS), Mode: replay.ModeSession, Model: c.Model})
	if err != nil {
		t.Fatal(err)
	}
	results, _, err := r.Run(t.Context(), tr.Items)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i < len(results); i++ {
		prevEnd := results[i-1].Sent.Add(results[i-1].E2E)
		if results[i].Err != "" || results[i].Sent.Before(prevEnd) {
			t.Errorf("turn %d sent at %v, before turn %d ended at %v (err %q)", i+1, results[i].Sent, i, prevEnd, results[i].Err)
		}
	}
}
