package workers

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"sync"
)

// ErrObjectTooLarge is returned by BatchPut for an object larger than the
// store's whole capacity.
var ErrObjectTooLarge = errors.New("workers: object larger than store capacity")

// Object is one value to put into a BlockStore. Group tags the object like
// Mooncake's ReplicateConfig.group_ids (kvbus uses the session key), so that
// a session's blocks can be found and evicted together.
type Object struct {
	Key   string
	Value []byte
	Group string
}

// BlockStore is a rank's KV block store, shaped like the Mooncake store
// client (batch_is_exist, batch_put_from, batch_get_into, remove). All methods
// are safe for concurrent use. Values passed to BatchPut are owned by the
// store afterwards; values returned by BatchGet must not be modified.
type BlockStore interface {
	// BatchIsExist reports, for each key, whether the store holds it.
	BatchIsExist(ctx context.Context, keys []string) []bool
	// BatchPut stores the objects, evicting least recently used objects to
	// make room; it returns one error (nil on success) per object.
	BatchPut(ctx context.Context, objs []Object) []error
	// BatchGet returns, for each key, its value or nil when absent, and marks
	// the found objects as recently used.
	BatchGet(ctx context.Context, keys []string) [][]byte
	// Remove deletes key; removing an absent key is not an error.
	Remove(ctx context.Context, key string) error
	// Usage reports the bytes held, the capacity in bytes and the number of
	// objects.
	Usage() (used, capacity int64, objects int)
}

// EvictFunc is told about every object a MemStore evicts to make room. It is
// called with the store's lock held and must not call back into the store.
type EvictFunc func(key, group string)

// MemStore is the embedded in-memory BlockStore: a byte-capacity LRU.
type MemStore struct {
	mu       sync.Mutex
	capacity int64
	used     int64
	lru      *list.List // front = most recently used; values are *memEntry
	byKey    map[string]*list.Element
	onEvict  EvictFunc
}

type memEntry struct {
	key, group string
	value      []byte
}

// NewMemStore returns an empty store of capacity bytes; onEvict may be nil.
func NewMemStore(capacity int64, onEvict EvictFunc) (*MemStore, error) {
	if capacity <= 0 {
		return nil, fmt.Errorf("workers: store capacity must be positive, got %d", capacity)
	}
	return &MemStore{capacity: capacity, lru: list.New(), byKey: map[string]*list.Element{}, onEvict: onEvict}, nil
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
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, o := range objs {
		size := int64(len(o.Value))
		if size > s.capacity {
			errs[i] = fmt.Errorf("%w: %s is %d bytes, capacity %d", ErrObjectTooLarge, o.Key, size, s.capacity)
			continue
		}
		if el, ok := s.byKey[o.Key]; ok {
			s.removeLocked(el)
		}
		for s.used+size > s.capacity {
			s.evictLocked()
		}
		s.byKey[o.Key] = s.lru.PushFront(&memEntry{key: o.Key, group: o.Group, value: o.Value})
		s.used += size
	}
	return errs
}

// BatchGet implements BlockStore.
func (s *MemStore) BatchGet(_ context.Context, keys []string) [][]byte {
	out := make([][]byte, len(keys))
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, k := range keys {
		if el, ok := s.byKey[k]; ok {
			s.lru.MoveToFront(el)
			out[i] = el.Value.(*memEntry).value
		}
	}
	return out
}

// Remove implements BlockStore.
func (s *MemStore) Remove(_ context.Context, key string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if el, ok := s.byKey[key]; ok {
		s.removeLocked(el)
	}
	return nil
}

// Usage implements BlockStore.
func (s *MemStore) Usage() (used, capacity int64, objects int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used, s.capacity, len(s.byKey)
}

func (s *MemStore) removeLocked(el *list.Element) *memEntry {
	e := s.lru.Remove(el).(*memEntry)
	delete(s.byKey, e.key)
	s.used -= int64(len(e.value))
	return e
}

func (s *MemStore) evictLocked() {
	e := s.removeLocked(s.lru.Back())
	if s.onEvict != nil {
		s.onEvict(e.key, e.group)
	}
}
