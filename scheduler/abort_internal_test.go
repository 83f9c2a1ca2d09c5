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
		data, err := messages.Marshal(&messages.Abort{ReqID: id, Reason: messages.AbortReasonClientGone})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.onAbort(context.Background(), &nats.Msg{Subject: s.cfg.Subjects.Abort(), Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	// Published last on the same connection: it arrives after whatever the
	// aborts above sent.
	if err := nc.Publish(s.cfg.Subjects.AbortGroup("end"), nil); err != nil {
		t.Fatal(err)
	}
	want := []struct{ subject, reqID string }{
		{s.cfg.Subjects.AbortGroup(mine.Group), "mine"},
		{s.cfg.Subjects.AbortGroup("g2"), "theirs"},
		{s.cfg.Subjects.AbortGroup("end"), ""},
	}
	for i, w := range want {
		m, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("message %d (%s on %s): %v", i, w.reqID, w.subject, err)
		}
		var id, reason string
		if m.Subject != s.cfg.Subjects.AbortGroup("end") {
			a, err := messages.DecodeAbort(m.Data)
			if err != nil {
				t.Fatal(err)
			}
			id, reason = a.ReqID, a.Reason
		}
		if m.Subject != w.subject || id != w.reqID {
			t.Fatalf("message %d: the abort of %q on %s, want that of %q on %s (and none for a request nobody placed or one that ended)",
				i, id, m.Subject, w.reqID, w.subject)
		}
		if w.reqID != "" && reason != messages.AbortReasonClientGone {
			t.Errorf("the abort of %s passed on with reason %q, want the client's %q", id, reason, messages.AbortReasonClientGone)
		}
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

	data, err := messages.Marshal(&messages.Abort{ReqID: "r", Reason: messages.AbortReasonClientGone})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.onAbort(context.Background(), &nats.Msg{Subject: s.cfg.Subjects.Abort(), Data: data}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish(s.cfg.Subjects.AbortGroup("end"), nil); err != nil {
		t.Fatal(err)
	}
	var to []string
	for {
		m, err := aborts.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if m.Subject == s.cfg.Subjects.AbortGroup("end") {
			break
		}
		if a, err := messages.DecodeAbort(m.Data); err != nil || a.ReqID != "r" || a.Group != "" {
			t.Fatalf("on %s: %+v (%v), want r's client abort", m.Subject, a, err)
		}
		to = append(to, m.Subject)
	}
	slices.Sort(to)
	if want := []string{s.cfg.Subjects.AbortGroup("g0"), s.cfg.Subjects.AbortGroup("g1")}; !slices.Equal(to, want) {
		t.Errorf("the client's abort of r went to %q, want %q: g0's ranks still run attempt 0", to, want)
	}
}
