package workers

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"
)

// ErrObjectTooLarge is returned by BatchPut for an object larger than the
// store's whole capacity.
var ErrObjectTooLarge = errors.New("workers: object larger than store capacity")

// Object is one value to put into a BlockStore. Group tags the object like
// Mooncake's ReplicateConfig.group_ids (kvbus uses the session key), so that
// a session's blocks can be found and evicted together. Size is what the
// object is charged against capacity; 0 means len(Value) (a store that keeps
// only a digest of a block charges the block's full size).
type Object struct {
	Key   string
	Hash  uint64
	Value []byte
	Size  int64
	Group string
	// Recency orders the object for eviction (see BlockStore).
	Recency Recency
}

// Recency orders a store's objects for eviction: the store evicts the
// object of the least recency (the greatest it was put or read at) first,
// and among objects of equal recency the least recently put or read. A rank gives whatever it does for one
// request the request's place in its intake order (rankReq.id): the ranks
// of a group take the same ReqMetas in the same order (NATS keeps a
// publisher's order for every subscriber; two scheduler replicas' may
// interleave differently only within an instant), so their stores
// order the blocks they share alike and evict the same ones, however each
// rank's load and store threads interleave. (Ordered by the moment each
// rank's threads touched them, the ranks of a group evicted different
// blocks, and a block is usable only while every rank holds its shard.)
type Recency uint64

const (
	// RecencyNow is the latest recency the store was given (plain LRU for
	// a caller that orders nothing).
	RecencyNow Recency = 0
	// RecencyKept, on BatchGet, reads without changing the objects'
	// recency: a read for another group, which keeps its own copy.
	RecencyKept Recency = math.MaxUint64
)

func (o *Object) size() int64 {
	if o.Size > 0 {
		return o.Size
	}
	return int64(len(o.Value))
}

// BlockStore is a rank's KV block store, shaped like the Mooncake store
// client (batch_is_exist, batch_put_from, batch_get_into, remove). All methods
// are safe for concurrent use. Values passed to BatchPut are owned by the
// store afterwards; values returned by BatchGet must not be modified.
type BlockStore interface {
	// BatchIsExist reports, for each key, whether the store holds it.
	BatchIsExist(ctx context.Context, keys []string) []bool
	// BatchPut stores the objects, evicting to make room (the least
	// Recency first); it returns one error (nil on success) per object.
	BatchPut(ctx context.Context, objs []Object) []error
	// BatchGet returns, for each key, its value or nil when absent, and
	// marks the found objects as used at recency at (unless RecencyKept).
	BatchGet(ctx context.Context, keys []string, at Recency) [][]byte
	// Remove deletes key; removing an absent key is not an error.
	Remove(ctx context.Context, key string) error
	// Usage reports the bytes charged, the capacity in bytes and the number
	// of objects.
	Usage() (used, capacity int64, objects int)
	// Recent lists the most recently used objects, newest first, until
	// their sizes reach maxBytes (values left out); it does not change
	// their recency.
	Recent(maxBytes int64) []Object
	// GroupObjects reports how many objects of a group (a session's tag)
	// the store holds.
	GroupObjects(group string) int
}

// Eviction policies of a MemStore.
const (
	// EvictLRU evicts the least recently used object.
	EvictLRU = "lru"
	// EvictSession evicts the least recently used object together with every
	// object of its group (its session), so that a conversation's prefix is
	// kept or dropped whole.
	EvictSession = "session"
)

// EvictFunc is told about every object a MemStore evicts or removes. It is
// called with the store's lock held and must not call back into the store.
type EvictFunc func(key string, hash uint64, group string)

// MemStoreConfig configures a MemStore.
type MemStoreConfig struct {
	// Capacity in bytes; required.
	Capacity int64
	// Evict is EvictLRU (default) or EvictSession.
	Evict string
	// OnEvict, if set, is told about evicted and removed objects.
	OnEvict EvictFunc
	// EvictIdle, if set, is told of every object evicted to make room (not
	// those removed) how long it had been since it was last put or read:
	// what vLLM calls a block's idle time before eviction. Called with the
	// store's lock held.
	EvictIdle func(idle time.Duration)
}

// MemStore is the embedded in-memory BlockStore: a byte-capacity LRU,
// ordered first by Recency.
type MemStore struct {
	mu     sync.Mutex
	cfg    MemStoreConfig
	used   int64
	latest Recency // the greatest given: RecencyNow's
	// buckets hold the entries of each recency, the most recent first;
	// within a bucket, front = most recently used.
	buckets   bucketList
	byRecency map[Recency]*recencyBucket
	last      *recencyBucket // the last placed into (a batch's are alike)
	byKey     map[string]*memEntry
	byGroup   map[string]map[*memEntry]struct{} // only with EvictSession
	groupN    map[string]int                    // objects per group
}

// memEntry is one object, linked into the store's recency list (an
// intrusive list: no second allocation per block).
type memEntry struct {
	key, group string
	hash       uint64
	value      []byte
	size       int64
	touched    int64 // unix ns of the last put or read
	bucket     *recencyBucket
	prev, next *memEntry
}

// recencyBucket holds the entries of one recency.
type recencyBucket struct {
	recency    Recency
	entries    memList
	prev, next *recencyBucket // prev: more recent
}

// bucketList is the buckets by recency, the greatest at the front.
type bucketList struct {
	front, back *recencyBucket
}

// memList is a doubly linked list of memEntries; the zero value is empty.
type memList struct {
	front, back *memEntry
}

func (l *memList) pushFront(e *memEntry) {
	e.prev, e.next = nil, l.front
	if l.front != nil {
		l.front.prev = e
	} else {
		l.back = e
	}
	l.front = e
}

func (l *memList) remove(e *memEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		l.front = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		l.back = e.prev
	}
	e.prev, e.next = nil, nil
}

func (l *memList) moveToFront(e *memEntry) {
	if l.front != e {
		l.remove(e)
		l.pushFront(e)
	}
}

// Validate checks that Capacity (--kv-capacity) is positive and Evict
// (--evict) is "" (EvictLRU), EvictLRU or EvictSession. Errors wrap
// ErrConfig. NewMemStore calls it.
func (c MemStoreConfig) Validate() error {
	if c.Capacity <= 0 {
		return fmt.Errorf("%w: store capacity (--kv-capacity) must be positive, got %d", ErrConfig, c.Capacity)
	}
	switch c.Evict {
	case "", EvictLRU, EvictSession:
		return nil
	default:
		return fmt.Errorf("%w: unknown eviction policy %q (--evict: want %s or %s)", ErrConfig, c.Evict, EvictLRU, EvictSession)
	}
}

// NewMemStore returns an empty store. It calls cfg.Validate first.
func NewMemStore(cfg MemStoreConfig) (*MemStore, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Evict == "" {
		cfg.Evict = EvictLRU
	}
	s := &MemStore{cfg: cfg, byKey: map[string]*memEntry{}, groupN: map[string]int{}, byRecency: map[Recency]*recencyBucket{}}
	if cfg.Evict == EvictSession {
		s.byGroup = map[string]map[*memEntry]struct{}{}
	}
	return s, nil
}

// BatchIsExist implements BlockStore.
func (s *MemStore) BatchIsExist(_ context.Context, keys []string) []bool {
	out := make([]bool, len(keys))
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, k := range keys {
		_, out[i] = s.byKey[k]
	}
	return out
}

// BatchPut implements BlockStore.
func (s *MemStore) BatchPut(_ context.Context, objs []Object) []error {
	errs := make([]error, len(objs))
	now := time.Now().UnixNano()
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range objs {
		o := &objs[i]
		size := o.size()
		if size > s.cfg.Capacity {
			errs[i] = fmt.Errorf("%w: %s is %d bytes, capacity %d", ErrObjectTooLarge, o.Key, size, s.cfg.Capacity)
			continue
		}
		if el, ok := s.byKey[o.Key]; ok {
			s.unlink(el)
		}
		for s.used+size > s.cfg.Capacity {
			s.evictOldest(now)
		}
		el := &memEntry{key: o.Key, hash: o.Hash, group: o.Group, value: o.Value, size: size, touched: now}
		s.place(el, o.Recency)
		s.byKey[o.Key] = el
		s.used += size
		s.groupN[o.Group]++
		if s.byGroup != nil && o.Group != "" {
			g := s.byGroup[o.Group]
			if g == nil {
				g = map[*memEntry]struct{}{}
				s.byGroup[o.Group] = g
			}
			g[el] = struct{}{}
		}
	}
	return errs
}

// BatchGet implements BlockStore.
func (s *MemStore) BatchGet(_ context.Context, keys []string, at Recency) [][]byte {
	out := make([][]byte, len(keys))
	now := time.Now().UnixNano()
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, k := range keys {
		if el, ok := s.byKey[k]; ok {
			if at != RecencyKept {
				s.place(el, at)
				el.touched = now
			}
			out[i] = el.value
		}
	}
	return out
}

// place makes e the most recently used entry of recency at (RecencyNow:
// the latest), unless it is of a greater recency already: an object's
// recency is the greatest it was used at, whatever order the uses came in
// (a rank's store thread saving request n and touching its prefix after
// its load thread loaded request n+5's: on another rank the two come the
// other way round). s.mu is held.
func (s *MemStore) place(e *memEntry, at Recency) {
	if at == RecencyNow {
		at = s.latest
	}
	s.latest = max(s.latest, at)
	if e.bucket != nil {
		switch {
		case at < e.bucket.recency:
			return
		case at == e.bucket.recency:
			e.bucket.entries.moveToFront(e)
			return
		}
		s.leave(e)
	}
	b := s.last
	if b == nil || b.recency != at {
		b = s.byRecency[at]
	}
	if b == nil {
		b = &recencyBucket{recency: at}
		s.byRecency[at] = b
		// From the most recent: a request's recency is at or near the
		// front, unless its thread is many requests behind the others.
		next := s.buckets.front
		for next != nil && next.recency > at {
			next = next.next
		}
		s.buckets.insertBefore(b, next)
	}
	b.entries.pushFront(e)
	e.bucket = b
	s.last = b
}

// leave takes e out of its bucket, and drops the bucket once empty; s.mu is
// held.
func (s *MemStore) leave(e *memEntry) {
	b := e.bucket
	b.entries.remove(e)
	e.bucket = nil
	if b.entries.front == nil {
		s.buckets.remove(b)
		delete(s.byRecency, b.recency)
		if s.last == b {
			s.last = nil
		}
	}
}

// insertBefore links b before next (nil: at the back).
func (l *bucketList) insertBefore(b, next *recencyBucket) {
	b.next = next
	if next == nil {
		b.prev = l.back
		l.back = b
	} else {
		b.prev = next.prev
		next.prev = b
	}
	if b.prev != nil {
		b.prev.next = b
	} else {
		l.front = b
	}
}

func (l *bucketList) remove(b *recencyBucket) {
	if b.prev != nil {
		b.prev.next = b.next
	} else {
		l.front = b.next
	}
	if b.next != nil {
		b.next.prev = b.prev
	} else {
		l.back = b.prev
	}
	b.prev, b.next = nil, nil
}

// Remove implements BlockStore.
func (s *MemStore) Remove(_ context.Context, key string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if el, ok := s.byKey[key]; ok {
		s.drop(el)
	}
	return nil
}

// Usage implements BlockStore.
func (s *MemStore) Usage() (used, capacity int64, objects int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used, s.cfg.Capacity, len(s.byKey)
}

// Recent implements BlockStore.
func (s *MemStore) Recent(maxBytes int64) []Object {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Object
	total := int64(0)
	for b := s.buckets.front; b != nil; b = b.next {
		for e := b.entries.front; e != nil; e = e.next {
			if total+e.size > maxBytes {
				return out
			}
			total += e.size
			out = append(out, Object{Key: e.key, Hash: e.hash, Size: e.size, Group: e.group})
		}
	}
	return out
}

// GroupObjects implements BlockStore.
func (s *MemStore) GroupObjects(group string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.groupN[group]
}

// unlink removes an entry without telling OnEvict (it is being replaced).
func (s *MemStore) unlink(e *memEntry) {
	s.leave(e)
	delete(s.byKey, e.key)
	s.used -= e.size
	if s.groupN[e.group]--; s.groupN[e.group] <= 0 {
		delete(s.groupN, e.group)
	}
	if s.byGroup != nil && e.group != "" {
		g := s.byGroup[e.group]
		delete(g, e)
		if len(g) == 0 {
			delete(s.byGroup, e.group)
		}
	}
}

// drop removes an entry and tells OnEvict.
func (s *MemStore) drop(e *memEntry) {
	s.unlink(e)
	if s.cfg.OnEvict != nil {
		s.cfg.OnEvict(e.key, e.hash, e.group)
	}
}

// evictOldest evicts the least recently used entry of the least recency
// and, under EvictSession, the rest of its group (untagged objects go one
// by one); now is the time of the put that needs the room.
func (s *MemStore) evictOldest(now int64) {
	e := s.buckets.back.entries.back
	evict := func(e *memEntry) {
		if s.cfg.EvictIdle != nil {
			s.cfg.EvictIdle(time.Duration(max(now-e.touched, 0)))
		}
		s.drop(e)
	}
	if s.byGroup == nil || e.group == "" {
		evict(e)
		return
	}
	for other := range s.byGroup[e.group] {
		evict(other)
	}
}
