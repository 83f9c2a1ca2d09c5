package scheduler

import (
	"context"
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
