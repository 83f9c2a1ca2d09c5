package scheduler

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// TestResendAskIsAnsweredWithItsGroup: a frontend that lost outputs asks
// the schedulers (kvbus.ctl.resend) which group's driver holds them. The
// replica names the group of a request it runs, of one it ended lately
// (the driver keeps the outputs for a while after the end), and of one
// another replica placed (from its save plan); it says nothing of a request
// it does not know or has not placed yet, nor of one whose group's driver
// predates kvbus.ctl.resend.<group> (its heartbeats do not say
// resend_by_group: it reads kvbus.ctl.resend and answers itself).
func TestResendAskIsAnsweredWithItsGroup(t *testing.T) {
	s, nc := newBareScheduler(t)
	now := time.Now()
	for g, byGroup := range map[string]bool{"g0": true, "g1": true, "earlier": false} {
		s.groups.observe(&messages.Heartbeat{Group: g, TPRank: 0, WorldSize: 1, StartedUnixMs: 1, ResendByGroup: byGroup}, now)
	}
	track := func(id, group string) *RequestTracker {
		tr := promptTracker(id, 1)
		tr.Group, tr.WorldSize = group, 1
		s.trackers.add(tr)
		return tr
	}
	track("live", "g0")
	track("queued", "")
	track("on-earlier", "earlier")
	ended := track("ended", "g1")
	if done, _, _ := s.trackers.addResult(&messages.RankResult{ReqID: "ended", Group: "g1", Attempt: ended.Attempt}, nil); done == nil {
		t.Fatal("the request did not end")
	}
	s.dispatched.Put("theirs", dispatchRecord{group: "g1", scheduler: "s1"}, now)

	if _, err := nc.Subscribe(s.cfg.Subjects.Resend(), func(m *nats.Msg) {
		if err := s.onResend(context.Background(), m); err != nil {
			t.Error(err)
		}
	}); err != nil {
		t.Fatal(err)
	}
	replies := make(chan *nats.Msg, 16)
	if _, err := nc.ChanSubscribe("answers.>", replies); err != nil {
		t.Fatal(err)
	}
	// One handler goroutine answers in order: once the last ask is
	// answered, every earlier one was handled.
	ids := []string{"unknown", "queued", "on-earlier", "live", "ended", "theirs"}
	for _, id := range ids {
		data, err := messages.Marshal(&messages.Resend{ReqID: id, FromIndex: 2})
		if err != nil {
			t.Fatal(err)
		}
		if err := nc.PublishRequest(s.cfg.Subjects.Resend(), "answers."+id, data); err != nil {
			t.Fatal(err)
		}
	}
	got := map[string]string{}
	for len(got) < 3 {
		select {
		case m := <-replies:
			reply, err := messages.DecodeResendReply(m.Data)
			if err != nil {
				t.Fatal(err)
			}
			got[m.Subject[len("answers."):]] = reply.Group
			if reply.Error == "" {
				t.Errorf("the answer to %s has no error for a frontend that knows no group", m.Subject)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("answers %v; want 3", got)
		}
	}
	if want := map[string]string{"live": "g0", "ended": "g1", "theirs": "g1"}; !maps.Equal(got, want) {
		t.Errorf("groups named: %v; want %v (and no answer for an unknown request, one not placed, one on an earlier driver)", got, want)
	}
}
