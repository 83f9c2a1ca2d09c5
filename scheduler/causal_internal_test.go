package scheduler

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// heldSub is a causal subscription whose handler holds each message until
// the test lets it go.
type heldSub struct {
	cs      *causalSub
	entered chan struct{} // a message reached the handler
	release chan struct{} // one message may finish
}

func newHeldSub(t *testing.T, nc *nats.Conn, subject string) *heldSub {
	t.Helper()
	h := &heldSub{cs: newCausalSub(), entered: make(chan struct{}, 16), release: make(chan struct{}, 16)}
	sub, err := nc.Subscribe(subject, func(*nats.Msg) {
		defer h.cs.done()
		h.entered <- struct{}{}
		<-h.release
	})
	if err != nil {
		t.Fatal(err)
	}
	h.cs.sub = sub
	return h
}

// causalWaitEnd is how a causal wait ended: by the applied count (ok), and
// with how many messages applied.
type causalWaitEnd struct {
	ok      bool
	applied uint64
}

// awaitCausalAsync takes the subscription's mark now, then waits for it
// in the background, with a bound no test reaches, and reports how the
// wait ended.
func awaitCausalAsync(h *heldSub) <-chan causalWaitEnd {
	subs := []*causalSub{h.cs}
	marks := causalMarks(subs)
	out := make(chan causalWaitEnd, 1)
	go func() {
		ok := awaitCausal(subs, marks, time.Minute)
		out <- causalWaitEnd{ok: ok, applied: h.cs.applied.Load()}
	}()
	return out
}

// TestCausalWaitEndsWhenTheMessageInItsHandlerIsApplied: nats.go counts a
// message in its handler both as delivered and as pending, so a request
// placed while a heartbeat was being applied waited for one heartbeat
// more than had come: until the next one, or for 100 ms (one request in
// about 500 of a lone client). The wait now ends once the message in the
// handler is applied; before, this wait ran to its bound.
func TestCausalWaitEndsWhenTheMessageInItsHandlerIsApplied(t *testing.T) {
	nc := embeddedConn(t)
	h := newHeldSub(t, nc, "causal.test")
	if err := nc.Publish("causal.test", []byte("heartbeat")); err != nil {
		t.Fatal(err)
	}
	<-h.entered
	if got := h.cs.received(); got < 1 {
		t.Fatalf("received %d with one message in its handler; want at least 1", got)
	}
	res := awaitCausalAsync(h)
	h.release <- struct{}{}
	select {
	case r := <-res:
		if !r.ok || r.applied != 1 {
			t.Fatalf("awaitCausal ended ok=%t with %d applied; want it to end by the count with the 1 message applied", r.ok, r.applied)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("awaitCausal still waits 30 s after the one message it had to wait for was applied")
	}
}

// TestCausalWaitStillWaitsForWhatHadArrived: reading the count again must
// not end the wait before a message that had arrived on entry is applied.
// Two messages: the first in its handler, the second queued behind it;
// the wait ends only after both.
func TestCausalWaitStillWaitsForWhatHadArrived(t *testing.T) {
	nc := embeddedConn(t)
	h := newHeldSub(t, nc, "causal.test")
	for range 2 {
		if err := nc.Publish("causal.test", []byte("heartbeat")); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	<-h.entered
	// The second message is in the subscription's queue once the server
	// answered the flush's ping; wait until nats.go counts it.
	deadline := time.Now().Add(10 * time.Second)
	for {
		pending, _, _ := h.cs.sub.Pending()
		if pending >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second message never queued: %d pending", pending)
		}
		time.Sleep(time.Millisecond)
	}
	res := awaitCausalAsync(h)
	h.release <- struct{}{}
	<-h.entered // the second message is in its handler: the wait goes on
	select {
	case r := <-res:
		t.Fatalf("awaitCausal ended (ok=%t) with %d applied, while the second message that had arrived on entry was in its handler", r.ok, r.applied)
	case <-time.After(50 * time.Millisecond):
	}
	h.release <- struct{}{}
	select {
	case r := <-res:
		if !r.ok || r.applied != 2 {
			t.Fatalf("awaitCausal ended ok=%t with %d applied; want it to end by the count with both messages applied", r.ok, r.applied)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("awaitCausal still waits 30 s after both messages were applied")
	}
}
