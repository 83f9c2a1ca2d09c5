package scheduler

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// TestFrontendClocks follows one frontend's clock through the cases a
// scheduler meets: ahead of this host's, a request that waited in the log,
// a step of the frontend's clock back (early deadlines for at most
// clockWindow) and forward (taken at once), and an earlier frontend that
// sends no time left.
func TestFrontendClocks(t *testing.T) {
	c := newFrontendClocks()
	// at is a receipt time rel after the clocks' origin, with its
	// monotonic reading; sent is a request of frontend "fe" whose clock is
	// skew ahead of this host's, published waited before at with left.
	at := func(rel time.Duration) time.Time { return c.base.Add(rel) }
	sent := func(received time.Time, skew, waited, left time.Duration) *messages.Request {
		published := received.Round(0).Add(skew - waited)
		return &messages.Request{FrontendID: "fe", DeadlineUnixMs: published.Add(left).UnixMilli(), TimeoutMs: left.Milliseconds()}
	}
	check := func(name string, got, want time.Time, wantSkew, skew time.Duration) {
		t.Helper()
		if d := got.Sub(want); d < -2*time.Millisecond || d > 2*time.Millisecond {
			t.Errorf("%s: deadline %v off the one wanted", name, d)
		}
		if d := skew - wantSkew; d < -2*time.Millisecond || d > 2*time.Millisecond {
			t.Errorf("%s: skew %v, want %v", name, skew, wantSkew)
		}
	}
	r := at(time.Second)
	d, skew := c.deadline(sent(r, 90*time.Second, 0, time.Minute), r, true)
	check("90 s ahead", d, r.Add(time.Minute), 90*time.Second, skew)

	r = at(2 * time.Second)
	d, skew = c.deadline(sent(r, 90*time.Second, 30*time.Second, time.Minute), r, true)
	check("waited 30 s in the log", d, r.Add(30*time.Second), 90*time.Second, skew)
	d, _ = c.deadline(sent(r, 90*time.Second, 30*time.Second, time.Minute), r, false)
	check("adopted after 30 s", d, r.Add(30*time.Second), 90*time.Second, skew)

	// The frontend's clock steps back 60 s: within the window its
	// deadlines are read 60 s early, after it they are right again.
	r = at(3 * time.Second)
	d, skew = c.deadline(sent(r, 30*time.Second, 0, time.Minute), r, true)
	check("stepped back, within the window", d, r, 90*time.Second, skew)
	r = at(3*time.Second + clockWindow + time.Millisecond)
	d, skew = c.deadline(sent(r, 30*time.Second, 0, time.Minute), r, true)
	check("stepped back, after the window", d, r.Add(time.Minute), 30*time.Second, skew)

	// Forward: the next request shows it.
	r = r.Add(time.Second)
	d, skew = c.deadline(sent(r, 5*time.Minute, 0, time.Minute), r, true)
	check("stepped forward", d, r.Add(time.Minute), 5*time.Minute, skew)

	// No time left sent: the deadline on this clock, as before.
	old := &messages.Request{FrontendID: "old", DeadlineUnixMs: 1_800_000_000_000}
	if d, skew := c.deadline(old, r, true); !d.Equal(time.UnixMilli(old.DeadlineUnixMs)) || skew != 0 {
		t.Errorf("a frontend that sends no timeout_ms: deadline %v, skew %v", d, skew)
	}
}

// TestPeerPlanKeptWhateverThePeersClock: a save plan of another replica
// counts its group's blocks as held for PlanTTL, so that the next turn of
// a conversation loads them whichever replica places it. The plan's expiry
// was read on this replica's clock: from a replica whose clock ran 30 s
// behind, every plan had expired when it came, and the next turn placed
// here missed the blocks the previous one was saving. A plan now says how
// long it has left.
func TestPeerPlanKeptWhateverThePeersClock(t *testing.T) {
	s, _ := newBareScheduler(t)
	holding(s, "g0")
	heard(s, "g0", time.Now(), 0)
	peerNow := time.Now().Add(-30 * time.Second) // the peer's clock
	data, err := messages.Marshal(&messages.SavePlan{SchedulerID: "s1", ReqID: "r1", Group: "g0", LogSeq: 1,
		BlockHashes: []uint64{1, 2, 3, 4}, ExpiresUnixMs: peerNow.Add(10 * time.Second).UnixMilli(), ExpiresInMs: 10_000})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.onPlan(context.Background(), &nats.Msg{Data: data}); err != nil {
		t.Fatal(err)
	}
	s.index.ExpirePlans(time.Now())
	if n := s.index.Plans(); n != 4 {
		t.Errorf("a plan of a replica whose clock is 30 s behind: %d blocks planned, want 4", n)
	}
	// And for no longer than this replica's PlanTTL.
	s.index.ExpirePlans(time.Now().Add(s.cfg.PlanTTL + time.Millisecond))
	if n := s.index.Plans(); n != 0 {
		t.Errorf("%d blocks still planned after PlanTTL", n)
	}
}
