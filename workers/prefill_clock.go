package workers

import (
	"sync"
	"time"
)

// prefillClock follows the engine's prefill queue on a driver rank: when
// each request reached the engine and when the last prefill ended. From it
// come a prefill's engine time (RankResult.PrefillUs) and how long the
// engine has been on the prefill at the head of its queue
// (Heartbeat.PrefillingUs), with which a scheduler tells a queue that is
// nearly worked off from one that has just begun. The engine is taken to
// prefill in arrival order (the sim engine does; a batching model server
// roughly). Safe for concurrent use.
type prefillClock struct {
	mu      sync.Mutex
	lastEnd time.Time
	waiting map[*rankReq]prefillEntry // in the engine, not yet prefilled
}

type prefillEntry struct {
	at     time.Time // when it reached the engine
	tokens int64     // tokens to prefill
}

// enter records that rr reached the engine at now.
func (c *prefillClock) enter(rr *rankReq, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.waiting == nil {
		c.waiting = map[*rankReq]prefillEntry{}
	}
	// Its loads are left out: a scheduler counts them in its queue at a
	// fraction of a prefilled token, so a cap in whole tokens would take
	// off far more than the head's own work.
	c.waiting[rr] = prefillEntry{at: now, tokens: int64(prefillTokens(rr.meta))}
}

// prefilled records that rr's prefill ended at now and returns its engine
// time: from when the engine could start it — it arrived, or the prefill
// before it ended — to now.
func (c *prefillClock) prefilled(rr *rankReq, now time.Time) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.waiting[rr]
	if !ok {
		return 0
	}
	delete(c.waiting, rr)
	start := e.at
	if c.lastEnd.After(start) {
		start = c.lastEnd
	}
	c.lastEnd = now
	return now.Sub(start)
}

// leave forgets rr when it ended without a prefill; if it was at the head,
// the engine moves on to the next one now.
func (c *prefillClock) leave(rr *rankReq, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.waiting[rr]; !ok {
		return
	}
	if head, _, _, _ := c.headLocked(); head == rr {
		c.lastEnd = now
	}
	delete(c.waiting, rr)
}

// head returns how long the engine has been on the prefill at the head of
// its queue at now, and that prefill's tokens to prefill (not those it
// loads); zeros when none waits.
func (c *prefillClock) head(now time.Time) (elapsed time.Duration, tokens int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, e, start, ok := c.headLocked()
	if !ok {
		return 0, 0
	}
	return max(now.Sub(start), 0), e.tokens
}

// headLocked is the request that reached the engine first among those
// waiting, and when its prefill started.
func (c *prefillClock) headLocked() (rr *rankReq, e prefillEntry, start time.Time, ok bool) {
	for r, x := range c.waiting {
		if !ok || x.at.Before(e.at) {
			rr, e, ok = r, x, true
		}
	}
	if !ok {
		return nil, e, start, false
	}
	start = e.at
	if c.lastEnd.After(start) {
		start = c.lastEnd
	}
	return rr, e, start, true
}
