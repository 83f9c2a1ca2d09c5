package scheduler

import (
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
)

// Causal placement. A conversation's next turn is caused by the previous
// answer, and the messages that describe the state after that answer (the
// other replica's SavePlan, the driver's load heartbeat, the ranks' KV
// events) reached this replica's connection before the next turn's request
// did: the server forwards each connection's messages in order, and the
// request left the client only after them. But each subscription has its
// own goroutine, so they may not be applied yet when the request is
// placed. awaitCausal closes that gap: it waits, for at most
// causalWaitMax, until every message those subscriptions had received when
// the request arrived is applied.

const causalWaitMax = 20 * time.Millisecond

// causalSub counts the messages of one subscription its handler applied.
type causalSub struct {
	sub     *nats.Subscription
	applied atomic.Uint64
}

// received is how many messages the subscription got so far: handed to
// the handler, or waiting for it.
func (c *causalSub) received() uint64 {
	delivered, _ := c.sub.Delivered()
	pending, _, _ := c.sub.Pending()
	return uint64(delivered) + uint64(pending)
}

// awaitCausal waits until the causal subscriptions applied what they had
// received on entry (bounded by causalWaitMax).
func (s *Scheduler) awaitCausal() {
	targets := make([]uint64, len(s.causal))
	for i, c := range s.causal {
		targets[i] = c.received()
	}
	var deadline time.Time
	for i, c := range s.causal {
		for c.applied.Load() < targets[i] {
			if deadline.IsZero() {
				deadline = time.Now().Add(causalWaitMax)
			} else if time.Now().After(deadline) {
				return
			}
			time.Sleep(20 * time.Microsecond)
		}
	}
}
