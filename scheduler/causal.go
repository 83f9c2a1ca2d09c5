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
	var timeout <-chan time.Time
	for _, c := range s.causal {
		target := c.received()
		for c.applied.Load() < target {
			if timeout == nil {
				t := time.NewTimer(causalWaitMax)
				defer t.Stop()
				timeout = t.C
			}
			select {
			case <-c.signal:
			case <-timeout:
				return
			}
		}
	}
}
