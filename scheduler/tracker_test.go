package scheduler

import (
	"slices"
	"testing"
	"time"

	"github.com/kvbus/kvbus/internal/recent"
	"github.com/kvbus/kvbus/messages"
)

func newTracker(id, group string, worldSize, attempt int, deadline time.Time) *RequestTracker {
	return &RequestTracker{ReqID: id, Group: group, WorldSize: worldSize, Attempt: attempt, Deadline: deadline,
		Results: map[int]*messages.RankResult{}}
}

func TestTrackerTableAddAbort(t *testing.T) {
	tt := testTrackerTable(t)
	a := newTracker("a", "g0", 2, 0, time.Now())
	if !tt.add(a) || tt.Len() != 1 || !tt.has("a") {
		t.Fatal("add(a) failed")
	}
	if tt.add(newTracker("a", "g1", 1, 0, time.Now())) {
		t.Error("a second tracker with the same id was added")
	}
	if tt.abort("missing", outcomeAborted) != nil {
		t.Error("abort(missing) returned a tracker")
	}
	// Aborted before it was dispatched: it never is.
	if !tt.seen("missing") || tt.add(newTracker("missing", "g0", 2, 0, time.Now())) {
		t.Error("a request aborted before it had a tracker can still be added")
	}
	if got := tt.abort("a", outcomeAborted); got != a || tt.Len() != 0 || tt.has("a") {
		t.Errorf("abort(a) = %v, Len %d", got, tt.Len())
	}
}

func TestTrackerTableAddResult(t *testing.T) {
	res := func(id, group string, rank, attempt int) *messages.RankResult {
		return &messages.RankResult{ReqID: id, Group: group, TPRank: rank, Attempt: attempt}
	}
	tests := []struct {
		name      string
		r         *messages.RankResult
		wantKnown bool
		wantDone  bool
		wantLen   int // trackers left
	}{
		{"unknown request", res("other", "g0", 0, 1), false, false, 1},
		{"wrong attempt", res("r", "g0", 0, 0), false, false, 1},
		{"wrong group", res("r", "g1", 0, 1), false, false, 1},
		{"rank 0", res("r", "g0", 0, 1), true, false, 1},
		{"rank 0 again does not count twice", res("r", "g0", 0, 1), true, false, 1},
		{"rank 2", res("r", "g0", 2, 1), true, false, 1},
		{"last rank completes and removes", res("r", "g0", 1, 1), true, true, 0},
		{"after completion: unknown", res("r", "g0", 1, 1), false, false, 0},
	}
	tt := testTrackerTable(t)
	tr := newTracker("r", "g0", 3, 1, time.Now().Add(time.Minute))
	tt.add(tr)
	for _, c := range tests {
		done, _, known := tt.addResult(c.r, nil)
		if known != c.wantKnown || (done != nil) != c.wantDone || tt.Len() != c.wantLen {
			t.Fatalf("%s: addResult = %v, %v with %d trackers left; want done=%v known=%v, %d left",
				c.name, done, known, tt.Len(), c.wantDone, c.wantKnown, c.wantLen)
		}
		if done != nil && (done != tr || len(done.Results) != 3) {
			t.Fatalf("%s: completed tracker %+v", c.name, done)
		}
	}
}

func TestTrackerTableExpired(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	tt := testTrackerTable(t)
	for _, c := range []struct {
		id       string
		deadline time.Duration
	}{{"past", -time.Second}, {"long-past", -time.Hour}, {"exactly-now", 0}, {"future", time.Second}} {
		tt.add(newTracker(c.id, "g0", 1, 0, now.Add(c.deadline)))
	}
	var ids []string
	for _, tr := range tt.expired(now) {
		ids = append(ids, tr.ReqID)
	}
	slices.Sort(ids)
	if want := []string{"long-past", "past"}; !slices.Equal(ids, want) {
		t.Errorf("expired = %v, want %v", ids, want)
	}
	if tt.Len() != 2 || !tt.has("exactly-now") || !tt.has("future") || tt.has("past") {
		t.Errorf("after expired: %d trackers left", tt.Len())
	}
	if got := tt.expired(now); len(got) != 0 {
		t.Errorf("expired twice: %d", len(got))
	}
	if got := tt.expired(now.Add(time.Hour)); len(got) != 2 || tt.Len() != 0 {
		t.Errorf("an hour later: %d expired, %d left", len(got), tt.Len())
	}
}

// TestTrackerTableIgnoresRanksOutsideWorldSize documents a bug: addResult
// counts a result from any tp_rank, so results from ranks 1 and 5 complete a
// request of world size 2 before its driver (rank 0) reported, and
// Scheduler.onDone then dereferences the missing t.Results[0] (a nil pointer
// panic, recovered by the handler middleware).
func TestTrackerTableIgnoresRanksOutsideWorldSize(t *testing.T) {
	tt := testTrackerTable(t)
	tt.add(newTracker("r", "g0", 2, 0, time.Now().Add(time.Minute)))
	for _, rank := range []int{1, 5, -1} {
		if done, _, _ := tt.addResult(&messages.RankResult{ReqID: "r", Group: "g0", TPRank: rank}, nil); done != nil {
			t.Fatalf("results from ranks 1 and %d completed a request of world size 2 without its driver", rank)
		}
	}
}

func testTrackerTable(t *testing.T) *trackerTable {
	t.Helper()
	tt, err := newTrackerTable(recent.Config{MaxIDs: 1000, MaxAge: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return tt
}
