package scheduler

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"

	"github.com/zeebo/xxh3"
)

// ErrNoReadyGroup is returned when no worker group is ready.
var ErrNoReadyGroup = errors.New("scheduler: no ready worker group")

// GroupState is a snapshot of one ready worker group as placement sees it,
// for one request.
type GroupState struct {
	Name string
	// Model is the model the group's ranks serve (their heartbeats'
	// model); a request is placed only on groups of its model.
	Model     string
	WorldSize int
	// Inflight counts the group's requests not yet finished and
	// QueuedBlocks their blocks still to prefill, cluster-wide: the
	// driver's last heartbeat plus this replica's changes since.
	Inflight     int
	QueuedBlocks int
	// QueueDepth is the largest queue depth the group's ranks reported.
	QueueDepth int
	// IndexBlocks is how many leading blocks of the request every rank of
	// the group holds, from the KV index.
	IndexBlocks int
	// CachedBlocks is IndexBlocks, raised to the previous turn's blocks on
	// the group bound to the request's session (its KV events may not have
	// arrived yet).
	CachedBlocks int
	// Bound is true for the group that served the session's previous turn.
	Bound bool
	// RemoteBlocks is how many blocks past CachedBlocks the group can read
	// from other groups' segments of the KV pool (--pool global; else 0).
	RemoteBlocks int
}

// Policy chooses a worker group for a request. Place gets a non-empty list
// of ready groups sorted by name. Implementations are safe for concurrent
// use.
type Policy interface {
	Place(t *RequestTracker, groups []GroupState) (string, error)
}

// Policy names accepted by --policy.
const (
	PolicyKV          = "kv"
	PolicySession     = "session"
	PolicyRoundRobin  = "round-robin"
	PolicyRandom      = "random"
	PolicyLeastLoaded = "least-loaded"
)

// PolicyNames lists the policies NewPolicy knows, the default first.
func PolicyNames() []string {
	return []string{PolicyKV, PolicySession, PolicyRoundRobin, PolicyRandom, PolicyLeastLoaded}
}

// NewPolicy returns the policy called name. epsilon is the bounded-load
// slack of the session policy.
func NewPolicy(name string, epsilon float64) (Policy, error) {
	// Checked whatever the policy: a value that cannot work is a mistake
	// even where it is not used.
	if epsilon < 0 || math.IsNaN(epsilon) || math.IsInf(epsilon, 0) {
		return nil, fmt.Errorf("scheduler: --session-epsilon must be a number >= 0, got %g", epsilon)
	}
	switch name {
	case PolicyKV:
		return KVPolicy{}, nil
	case PolicySession:
		return &SessionPolicy{Epsilon: epsilon}, nil
	case PolicyRoundRobin:
		return &RoundRobinPolicy{}, nil
	case PolicyRandom:
		return RandomPolicy{}, nil
	case PolicyLeastLoaded:
		return LeastLoadedPolicy{}, nil
	}
	return nil, fmt.Errorf("scheduler: unknown --policy %q (known: %s)", name, strings.Join(PolicyNames(), ", "))
}

// policyName is the --policy name of p, for logs (its Go type for a policy
// kvbus does not name).
func policyName(p Policy) string {
	switch p.(type) {
	case KVPolicy, *KVPolicy:
		return PolicyKV
	case *SessionPolicy:
		return PolicySession
	case *RoundRobinPolicy:
		return PolicyRoundRobin
	case RandomPolicy:
		return PolicyRandom
	case LeastLoadedPolicy:
		return PolicyLeastLoaded
	}
	return fmt.Sprintf("%T", p)
}

// placementKey is what rendezvous hashing uses for a request: its session,
// or its own id when it has none.
func placementKey(t *RequestTracker) string {
	if t.SessionID != "" {
		return t.SessionID
	}
	return t.ReqID
}

// KVPolicy places a request where it costs least: blocks to prefill (total
// minus the cached prefix on the group) plus the blocks already queued for
// prefill there. The session is a signal, not a pin: the group bound to it
// is credited with the previous turn's blocks. Ties go to the group with
// more cached blocks, then by rendezvous order of the session, so a session
// is stable.
//
// The cost is in one unit, the prefill time of a block: blocks found
// nowhere are prefilled (1 each), cached blocks cost LocalLoad each, blocks
// read from another group (--pool global) RemoteLoad each, plus the blocks
// queued for prefill on the group. A Scheduler given zero weights sets its
// LocalLoadCost and RemoteLoadCost.
type KVPolicy struct {
	LocalLoad, RemoteLoad float64
}

// Place implements Policy.
func (p KVPolicy) Place(t *RequestTracker, groups []GroupState) (string, error) {
	if len(groups) == 0 {
		return "", ErrNoReadyGroup
	}
	total := len(t.BlockHashes)
	key := placementKey(t)
	buf := make([]byte, 0, len(key)+40)
	best, bestCost, bestWeight := -1, 0.0, uint64(0)
	for i := range groups {
		g := &groups[i]
		cached := min(g.CachedBlocks, total)
		remote := min(g.RemoteBlocks, total-cached)
		cost := float64(total-cached-remote) + p.LocalLoad*float64(cached) + p.RemoteLoad*float64(remote) + float64(g.QueuedBlocks)
		// At equal cost the group with more of the prefix wins (it keeps the
		// cache warm for the next turn), then the higher rendezvous weight
		// (see RendezvousOrder; one pass, no sort).
		w := rendezvousWeight(buf, key, g.Name)
		if best < 0 || cost < bestCost || cost == bestCost &&
			(g.CachedBlocks > groups[best].CachedBlocks || g.CachedBlocks == groups[best].CachedBlocks && w > bestWeight) {
			best, bestCost, bestWeight = i, cost, w
		}
	}
	return groups[best].Name, nil
}

// SessionPolicy pins a session to a group: the group bound to it, else the
// first by rendezvous (highest random weight) hashing of the session id over
// the ready groups, with bounded load: a group whose in-flight count would
// exceed (1+Epsilon) × the mean (and the mean + 1) passes the session on to
// the next group in its rendezvous order. A request without a session is
// keyed by its id.
type SessionPolicy struct {
	Epsilon float64
}

// Place implements Policy.
func (p *SessionPolicy) Place(t *RequestTracker, groups []GroupState) (string, error) {
	if len(groups) == 0 {
		return "", ErrNoReadyGroup
	}
	limit := p.limit(groups)
	for _, g := range groups {
		if g.Bound && g.Inflight+1 <= limit {
			return g.Name, nil
		}
	}
	order := RendezvousOrder(placementKey(t), groups)
	for _, i := range order {
		if groups[i].Inflight+1 <= limit {
			return groups[i].Name, nil
		}
	}
	return groups[order[0]].Name, nil
}

// limit is the bounded-load cap on a group's in-flight requests, this one
// included: ceil((1+ε) × mean), and at least one above the mean, so that a
// handful of requests finishing late never moves a session at low load.
func (p *SessionPolicy) limit(groups []GroupState) int {
	total := 1 // this request
	for _, g := range groups {
		total += g.Inflight
	}
	mean := float64(total) / float64(len(groups))
	return max(int(math.Ceil((1+p.Epsilon)*mean)), int(math.Ceil(mean))+1)
}

// RendezvousOrder returns the indexes of groups sorted by descending
// rendezvous weight xxh3(key ‖ 0 ‖ group name) for key.
func RendezvousOrder(key string, groups []GroupState) []int {
	w := make([]uint64, len(groups))
	order := make([]int, len(groups))
	buf := make([]byte, 0, len(key)+40)
	for i, g := range groups {
		w[i] = rendezvousWeight(buf, key, g.Name)
		order[i] = i
	}
	sort.Slice(order, func(a, b int) bool { return w[order[a]] > w[order[b]] })
	return order
}

// rendezvousWeight is xxh3(key ‖ 0 ‖ group), hashed in buf's memory.
func rendezvousWeight(buf []byte, key, group string) uint64 {
	return xxh3.Hash(append(append(append(buf[:0], key...), 0), group...))
}

// RoundRobinPolicy cycles through the ready groups, ignoring sessions: a
// baseline.
type RoundRobinPolicy struct {
	mu   sync.Mutex
	next uint64
}

// Place implements Policy.
func (p *RoundRobinPolicy) Place(_ *RequestTracker, groups []GroupState) (string, error) {
	if len(groups) == 0 {
		return "", ErrNoReadyGroup
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	g := groups[p.next%uint64(len(groups))].Name
	p.next++
	return g, nil
}

// RandomPolicy picks a ready group uniformly at random: a baseline.
type RandomPolicy struct{}

// Place implements Policy.
func (RandomPolicy) Place(_ *RequestTracker, groups []GroupState) (string, error) {
	if len(groups) == 0 {
		return "", ErrNoReadyGroup
	}
	return groups[rand.IntN(len(groups))].Name, nil
}

// LeastLoadedPolicy picks the group with the fewest blocks queued for
// prefill, then the fewest requests in flight, ignoring the cache: a
// baseline. Ties break by rendezvous order.
type LeastLoadedPolicy struct{}

// Place implements Policy.
func (LeastLoadedPolicy) Place(t *RequestTracker, groups []GroupState) (string, error) {
	if len(groups) == 0 {
		return "", ErrNoReadyGroup
	}
	best := -1
	for _, i := range RendezvousOrder(placementKey(t), groups) {
		g := &groups[i]
		if best < 0 || g.QueuedBlocks < groups[best].QueuedBlocks ||
			g.QueuedBlocks == groups[best].QueuedBlocks && g.Inflight < groups[best].Inflight {
			best = i
		}
	}
	return groups[best].Name, nil
}
