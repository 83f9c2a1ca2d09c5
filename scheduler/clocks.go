package scheduler

import (
	"sync"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// A request's deadline comes from its frontend as a time on the frontend's
// clock (Request.deadline_unix_ms) and, from a frontend of this kvbus, as
// the time it had left when it was published (Request.timeout_ms). Read on
// this host's clock alone, a frontend whose clock ran a minute behind had
// every request refused as expired before dispatch; one ahead had its
// requests outlive their clients by as much. The time left alone, counted
// from when this replica got the request, leaves out the time it waited in
// the request log, which is real time of the client's: a backlog past its
// deadline would be dispatched. So each frontend's clock is learnt from
// its requests: received+timeout_ms is the latest the deadline can be here,
// and a request that waited nowhere puts it there exactly; the greatest
// offset between the two clocks over the last clockWindow (the request that
// waited least) is the frontend's clock, and a request's deadline is its
// deadline_unix_ms moved by it: what it waited in the log counts, the
// clocks' difference does not. The offset is kept on this process's
// monotonic clock, so a step of this host's clock moves nothing.

// clockWindow is how long an offset learnt from a frontend's requests is
// kept while no request shows a greater one: a frontend whose clock steps
// back has its requests' deadlines early by the step for at most this long.
const clockWindow = 10 * time.Second

// maxFrontendClocks bounds the frontends whose clocks are kept; past it a
// new frontend's requests are given their time left from receipt.
const maxFrontendClocks = 1024

// clockSkewWarning is how far apart a frontend's clock and this host's may
// be before the scheduler says so.
const clockSkewWarning = 5 * time.Second

// frontendClocks keeps, per frontend id, its clock's offset from this
// process's monotonic clock. Safe for concurrent use.
type frontendClocks struct {
	base time.Time // the monotonic origin of the offsets

	mu sync.Mutex
	m  map[string]frontendClock
}

type frontendClock struct {
	offsetMs int64     // frontend clock (ms) − ms since base, at the deadline
	at       time.Time // when offsetMs was last shown
	skew     time.Duration
}

func newFrontendClocks() *frontendClocks {
	return &frontendClocks{base: time.Now(), m: map[string]frontendClock{}}
}

// deadline is req's deadline on this host, received at received (with its
// monotonic reading); learn adds req to what is known of its frontend's
// clock (false for a request another replica received). skew is how far
// ahead of this host's clock the frontend's is, as learnt (0: not known).
func (c *frontendClocks) deadline(req *messages.Request, received time.Time, learn bool) (deadline time.Time, skew time.Duration) {
	if req.TimeoutMs <= 0 || req.DeadlineUnixMs <= 0 {
		// A frontend of an earlier kvbus: its deadline on this clock.
		return time.UnixMilli(req.DeadlineUnixMs), 0
	}
	latest := received.Add(time.Duration(req.TimeoutMs) * time.Millisecond)
	offset := req.DeadlineUnixMs - latest.Sub(c.base).Milliseconds()
	c.mu.Lock()
	defer c.mu.Unlock()
	fc, known := c.m[req.FrontendID]
	if learn && (!known || offset >= fc.offsetMs || received.Sub(fc.at) > clockWindow) {
		if !known && len(c.m) >= maxFrontendClocks {
			c.forgetLocked(received)
		}
		if known || len(c.m) < maxFrontendClocks {
			fc = frontendClock{offsetMs: offset, at: received, skew: time.UnixMilli(req.DeadlineUnixMs).Sub(latest.Round(0))}
			c.m[req.FrontendID], known = fc, true
		}
	}
	if !known {
		if !learn {
			return time.UnixMilli(req.DeadlineUnixMs), 0
		}
		return latest, 0
	}
	deadline = c.base.Add(time.Duration(req.DeadlineUnixMs-fc.offsetMs) * time.Millisecond)
	if learn && deadline.After(latest) {
		deadline = latest
	}
	return deadline, fc.skew
}

// forgetLocked drops the frontends not heard from within clockWindow.
func (c *frontendClocks) forgetLocked(now time.Time) {
	for id, fc := range c.m {
		if now.Sub(fc.at) > clockWindow {
			delete(c.m, id)
		}
	}
}
