package workers

import (
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// TestPrefillClock: a driver follows its engine's FCFS prefill queue. A
// prefill's engine time runs from when the engine could start it (it
// arrived, or the one before it ended); the head's time is what the
// heartbeats report.
func TestPrefillClock(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	req := func(tokens, cached int) *rankReq {
		meta := &messages.ReqMeta{TokenLen: tokens, BlockSize: 16}
		if cached > 0 {
			meta.LoadSpec = &messages.LoadSpec{CanLoad: true, KVPoolCachedTokens: cached}
		}
		return &rankReq{meta: meta}
	}
	var c prefillClock
	check := func(step string, now time.Time, wantElapsed time.Duration, wantTokens int64) {
		t.Helper()
		if el, tok := c.head(now); el != wantElapsed || tok != wantTokens {
			t.Errorf("%s: head = %v, %d tokens; want %v, %d", step, el, tok, wantElapsed, wantTokens)
		}
	}
	check("empty", at(0), 0, 0)
	a, b, d, e := req(100, 0), req(200, 64), req(50, 0), req(60, 0)
	c.enter(a, at(0))
	c.enter(b, at(1))
	check("a prefilling", at(5), 5*time.Millisecond, 100)
	if got := c.prefilled(a, at(10)); got != 10*time.Millisecond {
		t.Errorf("a's prefill took %v, want 10ms", got)
	}
	// b waited behind a: its prefill began when a's ended.
	check("b prefilling", at(12), 2*time.Millisecond, 136) // its 64 loaded tokens are not counted
	if got := c.prefilled(b, at(20)); got != 10*time.Millisecond {
		t.Errorf("b's prefill took %v, want 10ms (from a's end)", got)
	}
	// A request that finds the engine idle starts when it arrives.
	c.enter(d, at(30))
	if got := c.prefilled(d, at(35)); got != 5*time.Millisecond {
		t.Errorf("d's prefill took %v, want 5ms (from its arrival)", got)
	}
	// The head ends without a prefill (cancelled): the next starts then.
	c.enter(a, at(40))
	c.enter(e, at(41))
	c.leave(a, at(45))
	check("after the head left", at(47), 2*time.Millisecond, 60)
	c.leave(b, at(48)) // not waiting: nothing changes
	check("after one not waiting left", at(49), 4*time.Millisecond, 60)
	if got := c.prefilled(a, at(50)); got != 0 {
		t.Errorf("a request that left has a prefill time %v", got)
	}
}
