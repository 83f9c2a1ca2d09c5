// Package logevery keeps a repeated log line from flooding the log: the
// first of a condition is logged, then at most one line an interval, which
// carries how many were held back since the last. kvbus logs this way
// whatever a peer or a client can make it repeat many times a second (net/http's
// accept errors, a bus handler's failures).
package logevery

import (
	"sync"
	"time"
)

// Limiter lets one line through per Every; T is what a line tells (its
// error, its text). The zero value lets every line through; a Limiter must
// not be copied after first use. It is safe for concurrent use.
type Limiter[T any] struct {
	Every time.Duration
	// Now is the clock (nil: time.Now).
	Now func() time.Time
	// Held, if not nil, is told of lines held back that no later line
	// carried: once Every has passed since the last line let through, it is
	// called on a goroutine of its own with the last of them, their count
	// and how long ago that line was, and counts as the interval's line.
	// Without it a burst that ends within an interval is logged as its
	// first line alone.
	Held func(last T, held int, over time.Duration)

	mu       sync.Mutex
	last     time.Time   // the last line let through
	held     int         // lines held back since
	lastHeld T           // the last of them
	timer    *time.Timer // calls Held at the interval's end, while lines are held
}

// Allow reports whether line v may be logged now. When it may, held is how
// many were held back since the last line let through and over is how long
// ago that line was: a line with held > 0 should say so ("and held more in
// the last over"), or the log understates the condition.
func (l *Limiter[T]) Allow(v T) (ok bool, held int, over time.Duration) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.last.IsZero() && now.Sub(l.last) < l.Every {
		l.held++
		l.lastHeld = v
		if l.Held != nil && l.timer == nil {
			l.timer = time.AfterFunc(l.Every-now.Sub(l.last), l.flush)
		}
		return false, 0, 0
	}
	held, over = l.held, now.Sub(l.last)
	if l.last.IsZero() {
		over = 0
	}
	l.letThrough(now)
	return true, held, over
}

// flush tells Held of the lines held back since the last let through, if no
// line has carried them since the timer was set.
func (l *Limiter[T]) flush() {
	now := l.now()
	l.mu.Lock()
	held, over, last := l.held, now.Sub(l.last), l.lastHeld
	if held == 0 {
		l.timer = nil
		l.mu.Unlock()
		return
	}
	l.letThrough(now)
	l.mu.Unlock()
	l.Held(last, held, over)
}

// letThrough starts a new interval at now. l.mu is held.
func (l *Limiter[T]) letThrough(now time.Time) {
	var zero T
	l.last, l.held, l.lastHeld = now, 0, zero
	if l.timer != nil {
		l.timer.Stop()
		l.timer = nil
	}
}

func (l *Limiter[T]) now() time.Time {
	if l.Now != nil {
		return l.Now()
	}
	return time.Now()
}
