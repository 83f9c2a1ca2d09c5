package scheduler

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// TestLastResultBesideTheAdoptersPlanIsCountedOnce: a replica back from a
// pause handles, at once and on two goroutines, the last result of a
// request that waited for it and the save plan of the replica that adopted
// the request meanwhile. The result's handler ended the tracker, then held
// the count; the plan's handler, between the two, found neither the
// tracker (to hand over) nor the held count (to give up as a duplicate):
// the held count was released two heartbeat timeouts later as completed,
// and the adopter counted the request completed too
// (TestAdoptedRequestCountedOnceAfterAPause: r-0 counted completed twice,
// 1 run of 5 beside other packages' tests). Whichever comes first, the
// request is now given up here: handed over, or counted duplicate.
func TestLastResultBesideTheAdoptersPlanIsCountedOnce(t *testing.T) {
	s, _ := newBareScheduler(t)
	now := time.Now()
	holding(s, "g0")
	heard(s, "g0", now, 0)
	// Not heard for 5 s: another replica may have adopted its requests.
	s.selfHeard.Store(now.Add(-5 * time.Second).UnixNano())
	const n = 500
	results, plans := make([]*nats.Msg, n), make([]*nats.Msg, n)
	for i := range n {
		id := fmt.Sprint("r", i)
		tr := promptTracker(id, 1)
		tr.Group, tr.WorldSize = "g0", 1
		if !s.trackers.add(tr) {
			t.Fatalf("%s not added", id)
		}
		r, err := messages.Marshal(&messages.RankResult{ReqID: id, Group: "g0", TPRank: 0})
		if err != nil {
			t.Fatal(err)
		}
		p, err := messages.Marshal(&messages.SavePlan{SchedulerID: "s1", ReqID: id, Group: "g0", Attempt: 1,
			ExpiresUnixMs: now.Add(time.Minute).UnixMilli()})
		if err != nil {
			t.Fatal(err)
		}
		results[i], plans[i] = &nats.Msg{Data: r}, &nats.Msg{Data: p}
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			if err := s.onDone(context.Background(), results[i]); err != nil {
				t.Error(err)
			}
		})
		wg.Go(func() {
			if err := s.onPlan(context.Background(), plans[i]); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	// Whatever is still held no plan claimed: counted as it ended.
	s.releaseHeld(time.Now().Add(time.Hour))
	if s.trackers.Len() != 0 {
		t.Errorf("%d trackers left", s.trackers.Len())
	}
	// Each was the adopter's to count: none completed here.
	checkOutcomes(t, s, map[string]float64{"completed": 0})
}
