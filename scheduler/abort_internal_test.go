package scheduler

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// TestClientAbortGoesToItsGroupOnly: a client's Abort (kvbus.ctl.abort,
// which only the schedulers read) is passed on, unchanged, to the ranks of
// the one group running the request (kvbus.ctl.abort.<group>), by the
// replica that placed it and by one that heard where another replica
// placed it; the Abort of a request nobody placed, or of one its replica
// said ended, goes to no group. Before, every rank of every group read
// every client's Abort.
func TestClientAbortGoesToItsGroupOnly(t *testing.T) {
	s, nc := newBareScheduler(t)
	now := time.Now()
	for _, g := range []string{"g0", "g1", "g2"} {
		holding(s, g)
		heard(s, g, now, 0)
	}
	mine := promptTracker("mine", 4)
	if _, err := s.place(mine, s.PlaceableGroups(now), Binding{}, false); err != nil {
		t.Fatal(err)
	}
	if err := s.buildMeta(mine); err != nil {
		t.Fatal(err)
	}
	s.trackers.add(mine)
	s.dispatched.Put("theirs", dispatchRecord{group: "g2", scheduler: "s1"}, now)
	s.dispatched.Put("ended", dispatchRecord{group: "g2", scheduler: "s1", ended: true}, now)

	sub, err := nc.SubscribeSync(s.cfg.Subjects.AbortGroup("*"))
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"never-placed", "ended", "mine", "theirs"} {
		clientAbort(t, s, id)
	}
	want := []relayedAbort{{s.cfg.Subjects.AbortGroup(mine.Group), "mine"}, {s.cfg.Subjects.AbortGroup("g2"), "theirs"}}
	if got := relayed(t, s, nc, sub); !slices.Equal(got, want) {
		t.Errorf("aborts passed on: %v; want %v (and none for a request nobody placed or one that ended)", got, want)
	}
	if mine.Group == "" {
		t.Fatal("the request was placed on no group")
	}
}

// TestClientAbortReachesTheAttemptAnAdoptionLeftBehind: a replica died
// after it dispatched r to g0 (attempt 0), and a rank of g0 restarted since:
// the replica that adopts r places it anew (attempt 1, on g1 here) and
// sends g0 no withdrawal; g0's other ranks still run attempt 0. When every
// rank read kvbus.ctl.abort, the client's Abort stopped them too; passed on
// to the tracker's group only, it reached g1 alone and attempt 0 ran on to
// its end. It goes to the group of the dispatch record as well.
func TestClientAbortReachesTheAttemptAnAdoptionLeftBehind(t *testing.T) {
	s, nc := newBareScheduler(t)
	now := time.Now()
	tr := promptTracker("r", 4)
	holding(s, "g0")
	holding(s, "g1", tr.BlockHashes...) // the placement's choice
	heard(s, "g0", now.Add(-time.Second), 0)
	heard(s, "g1", now, 0)
	dispatchedAt := now.Add(-500 * time.Millisecond)
	s.dispatched.Put("r", dispatchRecord{group: "g0", scheduler: "dead"}, dispatchedAt)
	// g0's rank restarts after the dispatch (a new process).
	s.groups.observe(&messages.Heartbeat{Group: "g0", TPRank: 0, WorldSize: 1, StartedUnixMs: 2}, now)

	req := tr.Request
	req.ArrivalUnixMs = now.UnixMilli()
	metas, err := nc.SubscribeSync(s.cfg.Subjects.MetaGroup("*"))
	if err != nil {
		t.Fatal(err)
	}
	aborts, err := nc.SubscribeSync(s.cfg.Subjects.AbortGroup("*"))
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if !s.adoptOne(req, peerDispatch{reqID: "r", seq: 1, at: dispatchedAt}, "dead") {
		t.Fatal("r not adopted")
	}
	m, err := metas.NextMsg(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	meta, err := messages.DecodeReqMeta(m.Data)
	if err != nil {
		t.Fatal(err)
	}
	if meta.Group != "g1" || meta.Attempt != 1 {
		t.Fatalf("r adopted onto %s as attempt %d, want g1 as attempt 1 (the test's premise)", meta.Group, meta.Attempt)
	}

	clientAbort(t, s, "r")
	var to []string
	for _, r := range relayed(t, s, nc, aborts) {
		to = append(to, r.subject)
	}
	slices.Sort(to)
	if want := []string{s.cfg.Subjects.AbortGroup("g0"), s.cfg.Subjects.AbortGroup("g1")}; !slices.Equal(to, want) {
		t.Errorf("the client's abort of r went to %q, want %q: g0's ranks still run attempt 0", to, want)
	}
}

// clientAbort hands s a client's Abort of reqID, as on kvbus.ctl.abort.
func clientAbort(t *testing.T, s *Scheduler, reqID string) {
	t.Helper()
	data, err := messages.Marshal(&messages.Abort{ReqID: reqID, Reason: messages.AbortReasonClientGone})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.onAbort(context.Background(), &nats.Msg{Subject: s.cfg.Subjects.Abort(), Data: data}); err != nil {
		t.Fatal(err)
	}
}

// relayedAbort is a client's Abort a scheduler passed on to a group.
type relayedAbort struct{ subject, reqID string }

// relayed returns the client's Aborts sub (on kvbus.ctl.abort.*) received
// until a marker published on nc, s's connection: it arrives after
// whatever s sent before it.
func relayed(t *testing.T, s *Scheduler, nc *nats.Conn, sub *nats.Subscription) []relayedAbort {
	t.Helper()
	end := s.cfg.Subjects.AbortGroup("end")
	if err := nc.Publish(end, nil); err != nil {
		t.Fatal(err)
	}
	var out []relayedAbort
	for {
		m, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("after %v: %v", out, err)
		}
		if m.Subject == end {
			return out
		}
		a, err := messages.DecodeAbort(m.Data)
		if err != nil || a.Group != "" || a.Reason != messages.AbortReasonClientGone {
			t.Fatalf("on %s: %+v (%v), want a client's abort passed on unchanged", m.Subject, a, err)
		}
		out = append(out, relayedAbort{m.Subject, a.ReqID})
	}
}
