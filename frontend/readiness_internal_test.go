package frontend

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// TestJustStartedFrontendSaysItHasHeardNoSchedulerYet: in the first
// seconds after it starts, before any announcement came, a frontend's 503
// says it has not heard the schedulers yet, not to start one: a restarted
// frontend told its clients (19 requests in 0.9 s, in a fault review) to
// start a scheduler while two ran.
func TestJustStartedFrontendSaysItHasHeardNoSchedulerYet(t *testing.T) {
	start := time.Unix(1000, 0)
	var tab schedulerTable
	tab.timeout = 3 * time.Second
	tab.listen(start)
	if ok, why := tab.ready(start.Add(500 * time.Millisecond)); ok || !strings.Contains(why, "no scheduler heard yet") || strings.Contains(why, "start one") {
		t.Errorf("0.5 s after start: %v %q, want that none was heard yet", ok, why)
	}
	if ok, why := tab.ready(start.Add(4 * time.Second)); ok || !strings.Contains(why, "start one (kvbus scheduler)") {
		t.Errorf("4 s after start with none heard: %v %q, want the advice to start one", ok, why)
	}
	tab.observe(&messages.Announcement{Role: messages.RoleScheduler, ID: "s0", Ready: true}, start.Add(time.Second))
	if ok, why := tab.ready(start.Add(1500 * time.Millisecond)); !ok {
		t.Errorf("with a ready scheduler heard: %q", why)
	}
}

// TestRestartedSchedulersAreForgotten: a scheduler replica silent for a
// minute (stopped, or restarted under a new id) is forgotten at the next
// announcement of any replica. Before, only a readiness check that found no
// ready replica first forgot it: beside a ready one, every restart of the
// others stayed in the table for good.
func TestRestartedSchedulersAreForgotten(t *testing.T) {
	start := time.Unix(1000, 0)
	var tab schedulerTable
	tab.timeout = 3 * time.Second
	tab.listen(start)
	for i := range 100 { // a replica restarted every 10 s beside a ready one
		at := start.Add(time.Duration(i) * 10 * time.Second)
		tab.observe(&messages.Announcement{Role: messages.RoleScheduler, ID: "steady", Ready: true}, at)
		tab.observe(&messages.Announcement{Role: messages.RoleScheduler, ID: fmt.Sprint("restarted-", i), Ready: true}, at)
		if ok, why := tab.ready(at); !ok {
			t.Fatalf("not ready beside a ready replica: %s", why)
		}
	}
	// Heard within the last minute: "steady" and the last 7 ids.
	if n := len(tab.m); n != 8 {
		t.Errorf("%d replicas remembered, want 8", n)
	}
}

// TestAwaitReadyAgainSeesAReadyAnnouncementAlreadyIn: a ready announcement
// that lands between a request's readiness check and its hold (the
// generate path checks, then awaits) ends the hold at once. Before, the
// hold waited on the channel made after that announcement, for the next
// ready one (up to a second later) or the whole hold.
func TestAwaitReadyAgainSeesAReadyAnnouncementAlreadyIn(t *testing.T) {
	var tab schedulerTable
	tab.timeout = 3 * time.Second
	tab.listen(time.Now())
	hold := &messages.Announcement{Role: messages.RoleScheduler, ID: "s1", NoGroupWaitMs: 5000}
	tab.observe(&messages.Announcement{Role: messages.RoleScheduler, ID: "s1", Ready: true, NoGroupWaitMs: 5000}, time.Now())
	tab.observe(hold, time.Now())
	if ok, _ := tab.ready(time.Now()); ok {
		t.Fatal("ready after a not-ready announcement")
	}
	// The request found none ready; the scheduler's ready announcement
	// comes in before the request's hold begins.
	tab.observe(&messages.Announcement{Role: messages.RoleScheduler, ID: "s1", Ready: true, NoGroupWaitMs: 5000}, time.Now())
	start := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Second)
	defer cancel()
	if ok := tab.awaitReadyAgain(ctx, time.Now()); !ok || time.Since(start) > 100*time.Millisecond {
		t.Fatalf("awaitReadyAgain with a scheduler ready: %v after %s, want true at once", ok, time.Since(start))
	}
}

// TestShortCutWaitsForTheNextAnnouncement: a frontend cut off from NATS for
// less than the timeout (a NATS restart: 1.8 s in a review) comes back with
// the schedulers' last announcements still fresh; they go stale moments
// later, before the schedulers' next ones are heard (each role reconnects
// on its own schedule). The requests of that moment got 503
// no_ready_scheduler at once, "no scheduler announced itself within 3s:
// start one", while both schedulers were ready (2 in the review, 0.3 s
// after the frontend's reconnect). As after a longer cut, they now wait up
// to firstAnnouncementWait from the reconnect for the next announcement.
func TestShortCutWaitsForTheNextAnnouncement(t *testing.T) {
	var tab schedulerTable
	tab.timeout = 3 * time.Second
	now := time.Now()
	tab.listen(now.Add(-time.Minute))
	// The last announcement before the cut, 2.8 s before the reconnect.
	tab.observe(&messages.Announcement{Role: messages.RoleScheduler, ID: "s0", Ready: true}, now.Add(-2800*time.Millisecond))
	tab.reconnected(1, now)
	if ok, why := tab.ready(now); !ok {
		t.Fatalf("at the reconnect, with the announcement still fresh: %q", why)
	}
	// 0.3 s after the reconnect it is stale, and no new one was heard yet.
	stale := now.Add(300 * time.Millisecond)
	if ok, why := tab.ready(stale); ok || strings.Contains(why, "start one") || !strings.Contains(why, "since this frontend reconnected") {
		t.Errorf("0.3 s after the reconnect: %v %q, want that none was heard yet since the reconnect", ok, why)
	}
	// A request then waits for the next announcement, which comes 0.2 s
	// after it began to wait.
	go func() {
		time.Sleep(200 * time.Millisecond)
		tab.observe(&messages.Announcement{Role: messages.RoleScheduler, ID: "s0", Ready: true}, time.Now())
	}()
	tab.awaitFirstReady(t.Context(), time.Now())
	if ok, why := tab.ready(time.Now()); !ok {
		t.Errorf("after awaiting the next announcement: %q; want it heard (the wait returned at once)", why)
	}
}

// TestManySchedulerIDsCostEachAnnouncementLittle: an announcement does not
// scan every replica the frontend knows for ones to forget. Any client of
// the bus may announce a scheduler under any id, and 300,000 ids made each
// later announcement scan them all: the real binary's frontend spent a core
// for minutes on the flood, 1 ms an announcement, quadratic in the ids.
func TestManySchedulerIDsCostEachAnnouncementLittle(t *testing.T) {
	const n = 50000
	start := time.Unix(1000, 0)
	var tab schedulerTable
	tab.timeout = 3 * time.Second
	tab.listen(start)
	began := time.Now()
	for i := range n {
		tab.observe(&messages.Announcement{Role: messages.RoleScheduler, ID: fmt.Sprintf("forged%d", i)}, start.Add(time.Duration(i)*time.Microsecond))
	}
	if took := time.Since(began); took > 2*time.Second {
		t.Fatalf("%d announcements of distinct ids took %v: each scans every id heard", n, took.Round(time.Millisecond))
	}
	// Forgetting still works: a minute later they go at the next one.
	tab.observe(&messages.Announcement{Role: messages.RoleScheduler, ID: "s0", Ready: true}, start.Add(2*time.Minute))
	tab.mu.Lock()
	left := len(tab.m)
	tab.mu.Unlock()
	if left != 1 {
		t.Errorf("%d replicas known after a minute's silence of all but one, want 1", left)
	}
}
