package scheduler

import (
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
)

// Causal placement. A conversation's next turn is caused by the previous
// answer, and the messages that describe the state after that answer (the
// other replica's SavePlan, the driver's load heartbeat) reached this
// replica's connection before the next turn's request did: the server forwards each connection's messages in order, and the
// request left the client only after them. But each subscription has its
// own goroutine, so they may not be applied yet when the request is
// placed. awaitCausal closes that gap: it waits, for at most
// causalWaitMax, until every message those subscriptions had received when
// the request arrived is applied.

const causalWaitMax = 100 * time.Millisecond

// causalSub counts the messages of one subscription its handler applied,
// and signals each one to a waiter.
type causalSub struct {
	sub     *nats.Subscription
	applied atomic.Uint64
	signal  chan struct{} // capacity 1
}

func newCausalSub() *causalSub { return &causalSub{signal: make(chan struct{}, 1)} }

// done records one applied message.
func (c *causalSub) done() {
	c.applied.Add(1)
	select {
	case c.signal <- struct{}{}:
	default:
	}
}

// received is at least how many messages the subscription got so far:
// handed to the handler, or waiting for it. It says more while a message
// is in its handler or just past it: nats.go counts a message delivered
// when it hands it to the handler and pending until its goroutine comes
// back for the next one. Pending is read first, so that a message the
// goroutine finishes with between the two readings is counted still.
func (c *causalSub) received() uint64 {
	pending, _, _ := c.sub.Pending()
	delivered, _ := c.sub.Delivered()
	return uint64(delivered) + uint64(pending)
}

// causalRecheck is how often a causal wait reads the count again when no
// message was applied (see awaitCausal).
const causalRecheck = 200 * time.Microsecond

// awaitCausal waits until the causal subscriptions applied what they had
// received on entry (bounded by causalWaitMax).
func (s *Scheduler) awaitCausal() { awaitCausal(s.causal, causalMarks(s.causal), causalWaitMax) }

// causalMarks is what each of subs has received.
func causalMarks(subs []*causalSub) []uint64 {
	marks := make([]uint64, len(subs))
	for i, c := range subs {
		marks[i] = c.received()
	}
	return marks
}

// awaitCausal waits until each of subs applied what it had received when
// its mark was taken, at most limit in all, and says whether they all did.
//
// A mark may be more than had arrived (a message in its handler).
// Waiting for that one, a request that came while a heartbeat was being
// applied waited for the next heartbeat, or limit: 100 ms for about 1
// request in 500 of a lone client. So each wake-up reads the count
// again, and every causalRecheck while nothing is applied: a later
// reading is never below what had arrived on entry, and once the handler
// is idle it is exact.
func awaitCausal(subs []*causalSub, marks []uint64, limit time.Duration) bool {
	var timeout <-chan time.Time
	var recheck <-chan time.Time
	for i, c := range subs {
		target := marks[i]
		for c.applied.Load() < target {
			if timeout == nil {
				t := time.NewTimer(limit)
				defer t.Stop()
				timeout = t.C
				tick := time.NewTicker(causalRecheck)
				defer tick.Stop()
				recheck = tick.C
			}
			select {
			case <-c.signal:
			case <-recheck:
			case <-timeout:
				return false
			}
			target = min(target, c.received())
		}
	}
	return true
}
