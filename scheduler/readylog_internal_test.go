package scheduler

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/internal/logbuf"
	"github.com/kvbus/kvbus/messages"
)

// TestGroupNotReadyIsLoggedNamingTheRank: a rank killed -9 under load (a
// review, every role its own process) made its group unready; the
// schedulers' logs said "a rank has not answered: ReqMeta published again"
// for each request in flight there and "worker group failed, or a rank
// restarted, during generation", naming neither the rank nor that the group
// took no more requests. A sweep now logs a group that stops being ready
// with the ranks that made it so, and the group once ready again; a resend
// names the ranks that did not answer.
func TestGroupNotReadyIsLoggedNamingTheRank(t *testing.T) {
	s, _ := newBareScheduler(t)
	var logs logbuf.Buffer
	s.log = slog.New(slog.NewTextHandler(&logs, nil))
	beat := func(rank int, at time.Time) {
		s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: rank, WorldSize: 2, StartedUnixMs: 1, Model: "m"}, at)
	}
	now := time.Now()
	beat(0, now)
	beat(1, now)
	s.sweep(t.Context(), now)
	if got := logs.Take(); !strings.Contains(got, `msg="worker group ready" group=g0`) {
		t.Errorf("g0 heard in full: no line says it is ready; logged:\n%s", got)
	}
	s.sweep(t.Context(), now.Add(100*time.Millisecond))
	if got := logs.Take(); strings.Contains(got, "worker group") {
		t.Errorf("nothing changed, yet logged:\n%s", got)
	}
	// Rank 1 goes silent; rank 0 beats on.
	later := now.Add(s.cfg.HeartbeatTimeout + 500*time.Millisecond)
	beat(0, later)
	s.sweep(t.Context(), later)
	got := logs.Take()
	if !strings.Contains(got, `msg="worker group not ready: it takes no new requests" group=g0`) ||
		!strings.Contains(got, "tp_rank 1 silent for 1.5s") || strings.Contains(got, "tp_rank 0") || !strings.Contains(got, "level=WARN") {
		t.Errorf("rank 1 silent past the heartbeat timeout: want a warning naming g0 and tp_rank 1 (silent 1.5 s); logged:\n%s", got)
	}
	s.sweep(t.Context(), later.Add(100*time.Millisecond))
	if got := logs.Take(); strings.Contains(got, "worker group") {
		t.Errorf("logged again with nothing changed:\n%s", got)
	}
	back := later.Add(200 * time.Millisecond)
	beat(0, back)
	beat(1, back)
	s.sweep(t.Context(), back)
	if got := logs.Take(); !strings.Contains(got, `msg="worker group ready" group=g0`) {
		t.Errorf("g0 heard in full again: no line says so; logged:\n%s", got)
	}
	// A rank draining (a scale-down) is said at info level.
	s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: 1, WorldSize: 2, StartedUnixMs: 1, Model: "m", Draining: true}, back)
	s.sweep(t.Context(), back.Add(100*time.Millisecond))
	if got := logs.Take(); !strings.Contains(got, "level=INFO") || !strings.Contains(got, "tp_rank 1 draining") {
		t.Errorf("a draining rank: want an info line naming it; logged:\n%s", got)
	}

	// A resend names the ranks that did not answer.
	tr := promptTracker("r1", 2)
	tr.Group, tr.WorldSize, tr.Dispatched = "g0", 2, time.Now().Add(-time.Minute)
	tr.metaSubj, tr.metaData = "kvbus.meta.g0", []byte{0}
	tr.Heard = map[int]int64{0: 1}
	s.trackers.add(tr)
	s.resend(time.Now())
	if got := logs.Take(); !strings.Contains(got, "silent_tp_ranks=[1]") {
		t.Errorf("resend: want the silent rank named; logged:\n%s", got)
	}
}

// TestNoNotReadyLineAfterACutLongerThanTheTimeout: a replica cut off from
// NATS (a `kvbus nats` restart, a partition) for longer than the heartbeat
// timeout judges no group meanwhile and gives every rank a heartbeat
// timeout from its reconnect. Its sweep that found the reconnect judged
// the groups' readiness before that, on their silence during the cut: it
// logged every group "worker group not ready" (a warning) and, a sweep
// later, "worker group ready" again, though none was ever judged failed.
func TestNoNotReadyLineAfterACutLongerThanTheTimeout(t *testing.T) {
	s, _ := newBareScheduler(t)
	var logs logbuf.Buffer
	s.log = slog.New(slog.NewTextHandler(&logs, nil))
	beat := func(g string, rank int, at time.Time) {
		s.groups.observe(&messages.Heartbeat{Group: g, TPRank: rank, WorldSize: 2, StartedUnixMs: 1, Model: "m"}, at)
	}
	now := time.Now()
	for _, g := range []string{"g0", "g1"} {
		beat(g, 0, now)
		beat(g, 1, now)
	}
	s.sweep(t.Context(), now)
	if got := logs.Take(); strings.Count(got, `msg="worker group ready"`) != 2 {
		t.Fatalf("g0 and g1 heard in full: want two ready lines; logged:\n%s", got)
	}
	// Cut off for twice the heartbeat timeout; the sweep after finds the
	// connection reconnected (the count it compares with was from before).
	back := now.Add(2 * s.cfg.HeartbeatTimeout)
	s.reconnects = s.cfg.Conn.Stats().Reconnects + 1
	s.sweep(t.Context(), back)
	s.sweep(t.Context(), back.Add(250*time.Millisecond))
	if got := logs.Take(); strings.Contains(got, `msg="worker group `) {
		t.Errorf("a cut the replica judged no group over: want no readiness line; logged:\n%s", got)
	}
}

// TestResendAfterAReconnectNamesTheRanksWithoutAResult: after a NATS
// restart a request's ranks had all sent their receipts before the cut, so
// its resend, for the results not come since, named no rank: a review
// with every role its own process, a group's rank 1 killed -9 during the
// cut, logged "a rank has not answered: ReqMeta published again" with
// silent_tp_ranks=[]. It now names the ranks whose result has not come.
func TestResendAfterAReconnectNamesTheRanksWithoutAResult(t *testing.T) {
	s, _ := newBareScheduler(t)
	var logs logbuf.Buffer
	s.log = slog.New(slog.NewTextHandler(&logs, nil))
	tr := promptTracker("r1", 2)
	tr.Group, tr.WorldSize, tr.Dispatched = "g0", 2, time.Now().Add(-time.Minute)
	tr.metaSubj, tr.metaData = "kvbus.meta.g0", []byte{0}
	tr.Heard = map[int]int64{0: 1, 1: 1}
	tr.Results = map[int]*messages.RankResult{0: {}}
	s.trackers.add(tr)
	s.trackers.reconnected(time.Now().Add(-time.Minute))
	s.resend(time.Now())
	if got := logs.Take(); !strings.Contains(got, "silent_tp_ranks=[1]") {
		t.Errorf("resend after a reconnect, rank 1's result not come: want it named; logged:\n%s", got)
	}
}
