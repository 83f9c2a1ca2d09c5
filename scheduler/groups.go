package scheduler

import (
	"sort"
	"sync"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// GroupState is a snapshot of one worker group as placement sees it.
type GroupState struct {
	Name      string
	WorldSize int
	// Inflight counts this scheduler's requests placed on the group and not
	// yet finished.
	Inflight int
	// QueueDepth is the largest queue depth the group's ranks reported.
	QueueDepth int
}

// groupTable follows heartbeats. It is safe for concurrent use.
type groupTable struct {
	mu      sync.Mutex
	timeout time.Duration
	groups  map[string]*groupInfo
}

type groupInfo struct {
	worldSize int
	ranks     map[int]rankInfo
	inflight  int
}

type rankInfo struct {
	seen       time.Time
	started    int64
	queueDepth int
}

func newGroupTable(timeout time.Duration) *groupTable {
	return &groupTable{timeout: timeout, groups: map[string]*groupInfo{}}
}

// observe records a heartbeat.
func (t *groupTable) observe(hb *messages.Heartbeat, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	g := t.groups[hb.Group]
	if g == nil {
		g = &groupInfo{ranks: map[int]rankInfo{}}
		t.groups[hb.Group] = g
	}
	if g.worldSize != hb.WorldSize {
		// A group re-formed with another size: forget the old ranks.
		g.worldSize = hb.WorldSize
		g.ranks = map[int]rankInfo{}
	}
	g.ranks[hb.TPRank] = rankInfo{seen: now, started: hb.StartedUnixMs, queueDepth: hb.QueueDepth}
}

// ready returns the groups whose world_size ranks all sent a heartbeat
// within the timeout, sorted by name.
func (t *groupTable) ready(now time.Time) []GroupState {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []GroupState
	for name, g := range t.groups {
		alive, depth := 0, 0
		for _, r := range g.ranks {
			if now.Sub(r.seen) <= t.timeout {
				alive++
				depth = max(depth, r.queueDepth)
			}
		}
		if alive == g.worldSize {
			out = append(out, GroupState{Name: name, WorldSize: g.worldSize, Inflight: g.inflight, QueueDepth: depth})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// addInflight changes a group's in-flight count.
func (t *groupTable) addInflight(group string, delta int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if g := t.groups[group]; g != nil {
		g.inflight += delta
	}
}
