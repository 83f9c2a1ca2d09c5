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

// Limiter lets one line through per Every. The zero value lets every line
// through; a Limiter must not be copied after first use.
type Limiter struct {
	Every time.Duration
	// Now is the clock (nil: time.Now).
	Now func() time.Time

	mu   sync.Mutex
	last time.Time // the last line let through
	held int       // lines held back since
}

// Allow reports whether a line may be logged now. When it may, held is how
// many were held back since the last line let through and over is how long
// ago that line was: a line with held > 0 should say so ("and held more in
// the last over"), or the log understates the condition.
func (l *Limiter) Allow() (ok bool, held int, over time.Duration) {
	now := time.Now()
	if l.Now != nil {
		now = l.Now()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.last.IsZero() && now.Sub(l.last) < l.Every {
		l.held++
		return false, 0, 0
	}
	held, over = l.held, now.Sub(l.last)
	if l.last.IsZero() {
		over = 0
	}
	l.last, l.held = now, 0
	return true, held, over
}
