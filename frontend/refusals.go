package frontend

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

// refusalLogEvery bounds how often refused requests are logged.
const refusalLogEvery = 10 * time.Second

// refusalLog logs the requests the frontend refuses before they reach the
// bus (no ready scheduler, not connected, shutting down, over
// --max-inflight, bad input): the first one at once, with its message, and
// then at most one line per refusalLogEvery counting them by status and
// code. Refused requests left no log line, and a restart of the schedulers
// showed only as a counter. Safe for concurrent use.
type refusalLog struct {
	log   *slog.Logger
	every time.Duration // refusalLogEvery when 0

	mu       sync.Mutex
	last     time.Time          // when a line was last written
	counts   map[refusalKey]int // since last
	lastErr  *APIError          // the latest refusal counted
	flushing bool               // a flush of counts is scheduled
}

// refusalKey is a refusal's status and code (its type when it has none).
type refusalKey struct {
	status int
	code   string
}

// String is how the log line names it: "503 no_ready_scheduler".
func (k refusalKey) String() string { return fmt.Sprint(k.status, " ", k.code) }

func (r *refusalLog) interval() time.Duration { return cmp.Or(r.every, refusalLogEvery) }

// note records a refused request. One counted within the interval of the
// last line is logged once it has passed, whether or not another comes:
// a burst that then stopped was never logged beyond its first refusal.
func (r *refusalLog) note(now time.Time, e *APIError) {
	key := refusalKey{e.Status, cmp.Or(e.Code, e.Type)}
	r.mu.Lock()
	if r.counts == nil {
		r.counts = map[refusalKey]int{}
	}
	r.counts[key]++
	r.lastErr = e
	if wait := r.interval() - now.Sub(r.last); wait > 0 {
		r.scheduleLocked(wait)
		r.mu.Unlock()
		return
	}
	r.writeLocked(now)
}

// scheduleLocked has the counts logged in wait, unless a flush is already
// scheduled. r.mu is held.
func (r *refusalLog) scheduleLocked(wait time.Duration) {
	if r.flushing {
		return
	}
	r.flushing = true
	time.AfterFunc(wait, func() { r.flush(false) })
}

// flush logs the refusals counted since the last line, if any: once the
// interval has passed, or at once with force (the frontend stopping).
func (r *refusalLog) flush(force bool) {
	now := time.Now()
	r.mu.Lock()
	r.flushing = false
	if len(r.counts) == 0 {
		r.mu.Unlock()
		return
	}
	if wait := r.interval() - now.Sub(r.last); wait > 0 && !force { // a line was written since
		r.scheduleLocked(wait)
		r.mu.Unlock()
		return
	}
	r.writeLocked(now)
}

// writeLocked logs the counts and resets them; r.mu is held, and released.
func (r *refusalLog) writeLocked(now time.Time) {
	counts, since, e := r.counts, r.last, r.lastErr
	r.counts, r.last = nil, now
	r.mu.Unlock()
	total := 0
	parts := make([]string, 0, len(counts))
	for _, k := range slices.SortedFunc(maps.Keys(counts), func(a, b refusalKey) int { return strings.Compare(a.String(), b.String()) }) {
		total += counts[k]
		parts = append(parts, fmt.Sprintf("%s: %d", k, counts[k]))
	}
	attrs := []any{"refused", total, "by_status", strings.Join(parts, ", "), "last_status", e.Status, "last_code", e.Code, "last_message", clipMessage(e.Message)}
	if !since.IsZero() {
		attrs = append(attrs, "since", now.Sub(since).Round(time.Second))
	}
	level := slog.LevelInfo // a client's bad request
	if e.Status >= 500 || e.Status == 429 {
		level = slog.LevelWarn // the cluster refused
	}
	r.log.Log(context.Background(), level, "requests refused before reaching the bus", attrs...)
}

// maxLoggedMessage bounds a refusal's message in the log: it can quote what
// a client sent (a model name of a megabyte), and log shippers drop or
// split lines far shorter than that.
const maxLoggedMessage = 1024

// clipMessage is msg cut to maxLoggedMessage bytes at a rune boundary, with
// how long it was.
func clipMessage(msg string) string {
	if len(msg) <= maxLoggedMessage {
		return msg
	}
	cut := maxLoggedMessage
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return fmt.Sprintf("%s… (%d bytes in all)", msg[:cut], len(msg))
}
