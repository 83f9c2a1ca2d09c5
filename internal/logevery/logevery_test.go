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
	l := &Limiter{Every: 10 * time.Second, Now: func() time.Time { return now }}
	let := 0
	for i := range 1000 {
		ok, held, _ := l.Allow()
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
	ok, held, over := l.Allow()
	if !ok || held != 999 || over != 11*time.Second {
		t.Errorf("after the interval: Allow() = %v, %d held, over %v; want true, 999, 11s", ok, held, over)
	}
	now = now.Add(time.Minute)
	if ok, held, _ := l.Allow(); !ok || held != 0 {
		t.Errorf("after a quiet minute: Allow() = %v, %d held; want true, 0", ok, held)
	}
}
