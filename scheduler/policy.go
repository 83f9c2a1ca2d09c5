package scheduler

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"

	"github.com/zeebo/xxh3"
)

// ErrNoReadyGroup is returned when no worker group is ready.
var ErrNoReadyGroup = errors.New("scheduler: no ready worker group")

// Policy chooses a worker group for a request. Place is called from one
// goroutine at a time per Policy (the scheduler's dispatch loop) and gets a
// non-empty list of ready groups sorted by name.
type Policy interface {
	Place(t *RequestTracker, groups []GroupState) (string, error)
}

// Policy names accepted by --policy.
const (
	PolicySession    = "session"
	PolicyRoundRobin = "round-robin"
)

// PolicyNames lists the policies NewPolicy knows.
var policyNames = []string{PolicySession, PolicyRoundRobin}

// NewPolicy returns the policy called name. epsilon is the bounded-load
// slack of the session policy.
func NewPolicy(name string, epsilon float64) (Policy, error) {
	switch name {
	case PolicySession:
		if epsilon < 0 {
			return nil, fmt.Errorf("scheduler: --session-epsilon must be >= 0, got %g", epsilon)
		}
		return &SessionPolicy{Epsilon: epsilon}, nil
	case PolicyRoundRobin:
		return &RoundRobinPolicy{}, nil
	}
	return nil, fmt.Errorf("scheduler: unknown --policy %q (known: %s)", name, strings.Join(policyNames, ", "))
}

// SessionPolicy pins a session to a group by rendezvous (highest random
// weight) hashing of the session id over the ready groups, with bounded
// load: a group whose in-flight count would exceed (1+Epsilon) × the mean
// passes the session on to the next group in its rendezvous order. A request
// without a session is keyed by its request id.
type SessionPolicy struct {
	Epsilon float64
}

// Place implements Policy.
func (p *SessionPolicy) Place(t *RequestTracker, groups []GroupState) (string, error) {
	if len(groups) == 0 {
		return "", ErrNoReadyGroup
	}
	key := t.SessionID
	if key == "" {
		key = t.ReqID
	}
	order := RendezvousOrder(key, groups)
	total := 1 // this request
	for _, g := range groups {
		total += g.Inflight
	}
	limit := int(math.Ceil((1 + p.Epsilon) * float64(total) / float64(len(groups))))
	for _, i := range order {
		if groups[i].Inflight+1 <= limit {
			return groups[i].Name, nil
		}
	}
	return groups[order[0]].Name, nil
}

// RendezvousOrder returns the indexes of groups sorted by descending
// rendezvous weight xxh3(key ‖ 0 ‖ group name) for key.
func RendezvousOrder(key string, groups []GroupState) []int {
	w := make([]uint64, len(groups))
	order := make([]int, len(groups))
	buf := make([]byte, 0, len(key)+40)
	for i, g := range groups {
		buf = append(append(append(buf[:0], key...), 0), g.Name...)
		w[i] = xxh3.Hash(buf)
		order[i] = i
	}
	sort.Slice(order, func(a, b int) bool { return w[order[a]] > w[order[b]] })
	return order
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
