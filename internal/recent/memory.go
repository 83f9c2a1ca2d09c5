// Package recent remembers recently seen ids (string keys), each with a
// small value, in a memory that is bounded both by count and by age.
//
// It is meant for "have I seen this id lately?" bookkeeping on hot paths,
// such as a scheduler's memory of ended request ids or a worker's memory of
// (request id, attempt) pairs, where a plain map would grow without bound.
//
// Entries live in insertion order in a ring buffer (a FIFO queue) indexed by
// a map. Every operation costs O(1) amortized: expiry only ever looks at the
// head of the queue, and each call sweeps at most a few aged entries, so no
// call scans the whole memory.
package recent

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"time"
)

// ErrConfig is wrapped by the errors returned from Config.Validate and New.
var ErrConfig = errors.New("recent: bad configuration")

// Config bounds a Memory.
type Config struct {
	// MaxIDs caps how many ids are remembered (required >= 1). When a new
	// id would exceed it, the oldest id is forgotten first.
	MaxIDs int
	// MaxAge caps how long an id is remembered (required > 0). An id
	// whose last Put is more than MaxAge before the caller's now is
	// treated as absent.
	MaxAge time.Duration
}

// maxIDsLimit keeps ring positions comfortably inside an int32 range and
// stops absurd configurations early.
const maxIDsLimit = 1 << 30

// Validate reports whether c is usable. Errors wrap ErrConfig.
func (c Config) Validate() error {
	if c.MaxIDs < 1 {
		return fmt.Errorf("%w: MaxIDs is %d; set it to at least 1", ErrConfig, c.MaxIDs)
	}
	if c.MaxIDs > maxIDsLimit {
		return fmt.Errorf("%w: MaxIDs is %d; set it to at most %d", ErrConfig, c.MaxIDs, maxIDsLimit)
	}
	if c.MaxAge <= 0 {
		return fmt.Errorf("%w: MaxAge is %v; set it to a positive duration", ErrConfig, c.MaxAge)
	}
	return nil
}

// sweepBudget is how many head entries (aged or tombstoned) one call may
// drop beyond what the count cap requires. Any value > 1 drains a backlog
// of aged entries faster than Put can add to it.
const sweepBudget = 4

// minRing is the initial ring capacity (or MaxIDs if smaller).
const minRing = 16

// entry is one ring slot. There is no separate "live" flag (it would cost
// 8 bytes per id after padding): a slot whose at is tombAt is a tombstone
// (its id was replaced or deleted) or free, and its id and v are zeroed.
type entry[V any] struct {
	id string
	at int64 // unix nanoseconds of the last Put; tombAt if dead
	v  V
}

// tombAt marks a dead slot. Put never stores it (see clampAt).
const tombAt = math.MinInt64

func (e *entry[V]) live() bool { return e.at != tombAt }

// clampAt converts now for storage, keeping it distinct from tombAt.
func clampAt(now time.Time) int64 {
	return max(now.UnixNano(), tombAt+1)
}

// Memory remembers up to Config.MaxIDs ids, each for at most Config.MaxAge,
// with a value of type V per id.
//
// A Memory is safe for concurrent use by multiple goroutines; all methods
// serialize on one mutex. The zero value is not usable: create one with New.
// Values are stored by copy, so V should be a small value type; if V holds
// pointers, the memory shares what they point to.
//
// Callers pass the current time to each method that needs it; times are
// expected to be (roughly) non-decreasing across calls. Len counts ids that
// are still held, which may include a few that have aged past MaxAge but not
// yet been swept; Get and Update never return such ids.
type Memory[V any] struct {
	mu     sync.Mutex
	maxIDs int
	maxAge int64 // nanoseconds

	index map[string]int // id -> position in ring of its live entry
	ring  []entry[V]     // circular buffer; len(ring) is its capacity
	head  int            // position of the oldest entry
	n     int            // entries in the ring, live and tombstoned
	tombs int            // tombstoned entries in the ring
}

// New returns an empty Memory bounded by cfg, or an error wrapping ErrConfig
// if cfg is invalid.
func New[V any](cfg Config) (*Memory[V], error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Memory[V]{
		maxIDs: cfg.MaxIDs,
		maxAge: int64(cfg.MaxAge),
		index:  make(map[string]int),
	}, nil
}

// Put remembers id with value v as seen at now. If id is already
// remembered, its value is replaced and its age restarts from now (it
// becomes the newest id). If the memory is full, the oldest id is forgotten.
func (m *Memory[V]) Put(id string, v V, now time.Time) {
	t := clampAt(now)
	m.mu.Lock()
	defer m.mu.Unlock()

	if pos, ok := m.index[id]; ok {
		if pos == m.tailPos() {
			// Already the newest: refresh in place, no tombstone.
			e := &m.ring[pos]
			e.at, e.v = t, v
			m.sweep(t, sweepBudget)
			return
		}
		m.tombstone(pos)
		delete(m.index, id)
	}
	m.sweep(t, sweepBudget)
	m.insert(id, v, t)
}

// GetOrPut returns the value remembered for id and true if id is present
// and not older than MaxAge at now, leaving it as it is. Otherwise it
// remembers id with v as seen at now, as Put does, and returns v and false.
// It is Get followed by Put in one step: one lookup, and nothing can Put id
// in between.
func (m *Memory[V]) GetOrPut(id string, v V, now time.Time) (V, bool) {
	t := clampAt(now)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sweep(t, sweepBudget)
	if pos, ok := m.index[id]; ok {
		if !m.stale(pos, t) {
			return m.ring[pos].v, true
		}
		m.tombstone(pos)
		delete(m.index, id)
	}
	m.insert(id, v, t)
	return v, false
}

// Get returns the value remembered for id and true, or the zero value and
// false if id is absent or was last Put more than MaxAge before now.
func (m *Memory[V]) Get(id string, now time.Time) (V, bool) {
	t := clampAt(now)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sweep(t, sweepBudget)
	pos, ok := m.index[id]
	if !ok {
		var zero V
		return zero, false
	}
	if m.stale(pos, t) {
		m.tombstone(pos)
		delete(m.index, id)
		var zero V
		return zero, false
	}
	return m.ring[pos].v, true
}

// Update calls f with a pointer to the value remembered for id and returns
// true, if id is present and not older than MaxAge; otherwise it returns
// false without calling f. Update does not refresh the id's age.
//
// f runs with the Memory locked: it must not call methods of the same
// Memory, and must not keep the pointer after it returns.
func (m *Memory[V]) Update(id string, now time.Time, f func(v *V)) bool {
	t := clampAt(now)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sweep(t, sweepBudget)
	pos, ok := m.index[id]
	if !ok {
		return false
	}
	if m.stale(pos, t) {
		m.tombstone(pos)
		delete(m.index, id)
		return false
	}
	f(&m.ring[pos].v)
	return true
}

// Delete forgets id. It does nothing if id is absent.
func (m *Memory[V]) Delete(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if pos, ok := m.index[id]; ok {
		m.tombstone(pos)
		delete(m.index, id)
	}
}

// Len returns how many ids are remembered. It is at most MaxIDs and may
// include a few ids older than MaxAge that have not been swept yet.
func (m *Memory[V]) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.index)
}

// --- internals; all require m.mu held ---

// insert adds id, which is not in the index, as the newest entry.
func (m *Memory[V]) insert(id string, v V, t int64) {
	for len(m.index) >= m.maxIDs {
		m.evictHead()
	}
	if m.n == len(m.ring) {
		m.makeRoom(t)
	}
	pos := m.head + m.n
	if pos >= len(m.ring) {
		pos -= len(m.ring)
	}
	m.ring[pos] = entry[V]{id: id, at: t, v: v}
	m.n++
	m.index[id] = pos
}

func (m *Memory[V]) tailPos() int {
	if m.n == 0 {
		return -1
	}
	p := m.head + m.n - 1
	if p >= len(m.ring) {
		p -= len(m.ring)
	}
	return p
}

// stale reports whether the entry at pos is older than MaxAge at t.
func (m *Memory[V]) stale(pos int, t int64) bool {
	return t-m.ring[pos].at > m.maxAge
}

// tombstone marks the entry at pos dead and releases what it references.
// The caller removes the id from the index.
func (m *Memory[V]) tombstone(pos int) {
	m.ring[pos] = entry[V]{at: tombAt}
	m.tombs++
}

// popHead removes the head entry, forgetting its id if it is live.
func (m *Memory[V]) popHead() {
	e := &m.ring[m.head]
	if e.live() {
		delete(m.index, e.id)
	} else {
		m.tombs--
	}
	*e = entry[V]{at: tombAt}
	m.head++
	if m.head == len(m.ring) {
		m.head = 0
	}
	m.n--
}

// Expire forgets every id older than MaxAge at now and, when what is left
// fills under an eighth of the ring, gives the ring's and the index's
// memory back. The other methods sweep only a few aged ids each, as they
// are called: a process that goes idle calls Expire periodically, or it
// keeps its last busy minutes' ids (and values) until traffic returns.
func (m *Memory[V]) Expire(now time.Time) {
	t := clampAt(now)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sweep(t, m.n)
	live := m.n - m.tombs
	if size := len(m.ring); size > minRing && live < size/8 {
		// A map keeps its buckets when emptied: relayout fills a new one.
		m.index = make(map[string]int, live)
		m.relayout(max(minRing, 2*live), t)
	}
}

// evictHead drops head entries up to and including the oldest live one.
// Tombstones popped on the way were paid for when they were made.
func (m *Memory[V]) evictHead() {
	for m.n > 0 {
		live := m.ring[m.head].live()
		m.popHead()
		if live {
			return
		}
	}
}

// sweep drops at most budget head entries that are tombstones or
// older than MaxAge at t. It stops at the first fresh live entry.
func (m *Memory[V]) sweep(t int64, budget int) {
	for i := 0; i < budget && m.n > 0; i++ {
		e := &m.ring[m.head]
		if e.live() && t-e.at <= m.maxAge {
			return
		}
		m.popHead()
	}
}

// makeRoom is called when the ring is full. If tombstones make up at least
// half of it, it compacts in place (dropping aged entries too); otherwise it
// grows the ring. Either way the work is O(n) and leaves at least n/2 free
// slots, so it is O(1) amortized per Put.
//
// Capacity: the ring grows by doubling up to MaxIDs, which is enough when
// ids are never replaced or deleted. Tombstones may push it to 2*MaxIDs; at
// that size a full ring is at least half tombstones, so it compacts instead.
func (m *Memory[V]) makeRoom(t int64) {
	size := len(m.ring)
	if m.n > 0 && 2*m.tombs >= m.n {
		m.relayout(size, t)
		return
	}
	var grown int
	switch {
	case size == 0:
		grown = min(minRing, m.maxIDs)
	case size < m.maxIDs:
		grown = min(2*size, m.maxIDs)
	default:
		grown = min(2*size, 2*m.maxIDs)
	}
	m.relayout(grown, t)
}

// relayout copies live, fresh entries, oldest first, into a ring of the
// given size starting at position 0, and rewrites the index.
func (m *Memory[V]) relayout(size int, t int64) {
	old := m.ring
	ring := make([]entry[V], size)
	for i := range ring {
		ring[i].at = tombAt
	}
	k := 0
	for i, p := 0, m.head; i < m.n; i++ {
		e := &old[p]
		if e.live() {
			if t-e.at > m.maxAge {
				delete(m.index, e.id)
			} else {
				ring[k] = *e
				m.index[e.id] = k
				k++
			}
		}
		p++
		if p == len(old) {
			p = 0
		}
	}
	m.ring, m.head, m.n, m.tombs = ring, 0, k, 0
}
