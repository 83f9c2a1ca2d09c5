package logevery

import (
	"testing"
	"time"
)

// TestOneLinePerIntervalWithTheCountHeldBack: of 1,000 lines in the first
// interval one is let through; the first after it carries the 999 held
// back and how long ago the last line was, and a line after a quiet
// interval carries none.
func TestOneLinePerIntervalWithTheCountHeldBack(t *testing.T) {
	now := time.Unix(1000, 0)
	l := &Limiter[int]{Every: 10 * time.Second, Now: func() time.Time { return now }}
	let := 0
	for i := range 1000 {
		ok, held, _ := l.Allow(0)
		if ok {
			let++
			if held != 0 {
				t.Errorf("line %d let through with %d held, want 0", i, held)
			}
		}
		now = now.Add(time.Millisecond) // 1,000 a second
	}
	if let != 1 {
		t.Errorf("%d of 1,000 lines within 10 s let through, want 1", let)
	}
	now = time.Unix(1011, 0)
	ok, held, over := l.Allow(0)
	if !ok || held != 999 || over != 11*time.Second {
		t.Errorf("after the interval: Allow() = %v, %d held, over %v; want true, 999, 11s", ok, held, over)
	}
	now = now.Add(time.Minute)
	if ok, held, _ := l.Allow(0); !ok || held != 0 {
		t.Errorf("after a quiet minute: Allow() = %v, %d held; want true, 0", ok, held)
	}
}

// TestABurstWithinAnIntervalIsStillTold: a burst of 100 lines that ends
// within an interval is logged as its first line, and Held is told of the
// other 99 once the interval is over. Held is that interval's line: a line
// just after it is held and told of at the next interval's end; then,
// nothing held, Held is not called again.
func TestABurstWithinAnIntervalIsStillTold(t *testing.T) {
	told := make(chan [2]int64, 2)
	l := &Limiter[int]{Every: 200 * time.Millisecond, Held: func(_ int, held int, over time.Duration) {
		told <- [2]int64{int64(held), int64(over)}
	}}
	let := 0
	for range 100 {
		if ok, _, _ := l.Allow(0); ok {
			let++
		}
	}
	if let != 1 {
		t.Fatalf("%d of a burst of 100 let through, want 1", let)
	}
	wantHeld := func(n int64) {
		t.Helper()
		select {
		case got := <-told:
			if got[0] != n || time.Duration(got[1]) < l.Every {
				t.Errorf("Held(%d, %v), want %d held over at least %v", got[0], time.Duration(got[1]), n, l.Every)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("Held was not called in 5 s for the %d lines held back", n)
		}
	}
	wantHeld(99)
	if ok, _, _ := l.Allow(0); ok {
		t.Error("a line just after Held was let through; Held is the interval's line")
	}
	wantHeld(1)
	select {
	case got := <-told:
		t.Errorf("Held called again with %d; nothing was held since", got[0])
	case <-time.After(3 * l.Every):
	}
}
