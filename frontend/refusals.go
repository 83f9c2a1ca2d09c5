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
	log *slog.Logger

	mu     sync.Mutex
	last   time.Time          // when a line was last written
	counts map[refusalKey]int // since last
}

// refusalKey is a refusal's status and code (its type when it has none).
type refusalKey struct {
	status int
	code   string
}

// String is how the log line names it: "503 no_ready_scheduler".
func (k refusalKey) String() string { return fmt.Sprint(k.status, " ", k.code) }

// note records a refused request.
func (r *refusalLog) note(now time.Time, e *APIError) {
	key := refusalKey{e.Status, cmp.Or(e.Code, e.Type)}
	r.mu.Lock()
	if r.counts == nil {
		r.counts = map[refusalKey]int{}
	}
	r.counts[key]++
	if now.Sub(r.last) < refusalLogEvery {
		r.mu.Unlock()
		return
	}
	counts, since := r.counts, r.last
	r.counts, r.last = nil, now
	r.mu.Unlock()
	total := 0
	parts := make([]string, 0, len(counts))
	for _, k := range slices.SortedFunc(maps.Keys(counts), func(a, b refusalKey) int { return strings.Compare(a.String(), b.String()) }) {
		total += counts[k]
		parts = append(parts, fmt.Sprintf("%s: %d", k, counts[k]))
	}
	attrs := []any{"refused", total, "by_status", strings.Join(parts, ", "), "last_status", e.Status, "last_code", e.Code, "last_message", e.Message}
	if !since.IsZero() {
		attrs = append(attrs, "since", now.Sub(since).Round(time.Second))
	}
	level := slog.LevelInfo // a client's bad request
	if e.Status >= 500 || e.Status == 429 {
		level = slog.LevelWarn // the cluster refused
	}
	r.log.Log(context.Background(), level, "requests refused before reaching the bus", attrs...)
}
