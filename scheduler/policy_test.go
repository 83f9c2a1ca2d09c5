package scheduler

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

func groupStates(names ...string) []GroupState {
	gs := make([]GroupState, len(names))
	for i, n := range names {
		gs[i] = GroupState{Name: n, WorldSize: 2}
	}
	return gs
}

func TestRendezvousOrder(t *testing.T) {
	groups := groupStates("g0", "g1", "g2", "g3", "g4")
	for k := range 200 {
		key := fmt.Sprintf("session-%d", k)
		order := RendezvousOrder(key, groups)
		sorted := slices.Sorted(slices.Values(order))
		if !slices.Equal(sorted, []int{0, 1, 2, 3, 4}) {
			t.Fatalf("RendezvousOrder(%q) = %v is not a permutation", key, order)
		}
		if again := RendezvousOrder(key, groups); !slices.Equal(order, again) {
			t.Fatalf("RendezvousOrder(%q) not stable: %v then %v", key, order, again)
		}
		// The order is by group name, not position: reversing the input
		// gives the same names in the same order.
		rev := slices.Clone(groups)
		slices.Reverse(rev)
		var names, revNames []string
		for _, i := range order {
			names = append(names, groups[i].Name)
		}
		for _, i := range RendezvousOrder(key, rev) {
			revNames = append(revNames, rev[i].Name)
		}
		if !slices.Equal(names, revNames) {
			t.Fatalf("key %q: order %v depends on input order (%v)", key, names, revNames)
		}
	}
	if got := RendezvousOrder("k", nil); len(got) != 0 {
		t.Errorf("RendezvousOrder over no groups = %v", got)
	}
}

// TestRendezvousMinimalDisruption checks the rendezvous property: removing a
// group that is not a key's first choice never moves the key.
func TestRendezvousMinimalDisruption(t *testing.T) {
	groups := groupStates("g0", "g1", "g2", "g3", "g4", "g5")
	moved := 0
	for k := range 1000 {
		key := fmt.Sprintf("key-%d", k)
		first := groups[RendezvousOrder(key, groups)[0]].Name
		for drop := range groups {
			if groups[drop].Name == first {
				continue
			}
			rest := slices.Delete(slices.Clone(groups), drop, drop+1)
			if got := rest[RendezvousOrder(key, rest)[0]].Name; got != first {
				t.Fatalf("key %q: removing %s moved it from %s to %s", key, groups[drop].Name, first, got)
			}
		}
		// Removing the first choice moves the key to its second choice.
		order := RendezvousOrder(key, groups)
		rest := slices.Delete(slices.Clone(groups), order[0], order[0]+1)
		if got, want := rest[RendezvousOrder(key, rest)[0]].Name, groups[order[1]].Name; got != want {
			t.Fatalf("key %q: without %s it went to %s, want its second choice %s", key, first, got, want)
		}
		moved++
	}
	if moved != 1000 {
		t.Fatal(moved)
	}
}

func TestSessionPolicySticky(t *testing.T) {
	p := &SessionPolicy{Epsilon: 0.25}
	groups := groupStates("g0", "g1", "g2", "g3")
	for k := range 100 {
		tr := &RequestTracker{ReqID: fmt.Sprintf("req-%d", k), SessionID: fmt.Sprintf("sess-%d", k%10)}
		want := groups[RendezvousOrder(tr.SessionID, groups)[0]].Name
		for range 3 {
			tr.ReqID += "x" // a new turn: another request id, same session
			got, err := p.Place(tr, groups)
			if err != nil || got != want {
				t.Fatalf("session %s: Place = %q, %v; want %q", tr.SessionID, got, err, want)
			}
		}
	}
}

func TestSessionPolicySpread(t *testing.T) {
	p := &SessionPolicy{Epsilon: 0.25}
	groups := groupStates("g0", "g1", "g2", "g3")
	const sessions = 10000
	count := map[string]int{}
	for k := range sessions {
		g, err := p.Place(&RequestTracker{ReqID: "r", SessionID: fmt.Sprintf("conversation-%d", k)}, groups)
		if err != nil {
			t.Fatal(err)
		}
		count[g]++
	}
	even := sessions / len(groups)
	for _, g := range groups {
		if n := count[g.Name]; n < even*85/100 || n > even*115/100 {
			t.Errorf("group %s got %d of %d sessions, want %d ± 15%%: %v", g.Name, n, sessions, even, count)
		}
	}
}

func TestSessionPolicyBoundedLoad(t *testing.T) {
	p := &SessionPolicy{Epsilon: 0.25}
	tr := &RequestTracker{ReqID: "r1", SessionID: "hot-session"}
	base := groupStates("g0", "g1", "g2", "g3")
	order := RendezvousOrder(tr.SessionID, base)
	name := func(i int) string { return base[order[i]].Name }

	tests := []struct {
		name     string
		inflight map[int]int // by rendezvous rank of the group
		want     string
	}{
		{"equal load: first choice", nil, name(0)},
		// total 1+3+2+2+2 = 10, limit ceil(1.25·10/4) = 4: 3+1 fits.
		{"first choice a little busier: still first", map[int]int{0: 3, 1: 2, 2: 2, 3: 2}, name(0)},
		// total 1+3+1+1+1 = 7, mean 1.75, limit max(ceil(1.25·1.75), ceil(1.75)+1) = 3: 3+1 does not fit.
		{"first choice just over the bound: second", map[int]int{0: 3, 1: 1, 2: 1, 3: 1}, name(1)},
		// total 1+2+1+1+1 = 6, mean 1.5, limit max(2, 2+1) = 3: at low load one above the mean fits.
		{"low load: one above the mean still fits", map[int]int{0: 2, 1: 1, 2: 1, 3: 1}, name(0)},
		{"first choice far above the mean: second choice", map[int]int{0: 100}, name(1)},
		{"first two overloaded: third choice", map[int]int{0: 50, 1: 50}, name(2)},
		// total 1+40+40+40+0 = 121, limit ceil(1.25·121/4) = 38: only the
		// last choice is under it.
		{"only the last choice has room", map[int]int{0: 40, 1: 40, 2: 40}, name(3)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			groups := slices.Clone(base)
			for rank, n := range tt.inflight {
				groups[order[rank]].Inflight = n
			}
			got, err := p.Place(tr, groups)
			if err != nil || got != tt.want {
				t.Errorf("Place = %q, %v; want %q (order %s %s %s %s)", got, err, tt.want, name(0), name(1), name(2), name(3))
			}
		})
	}
	// With epsilon 0 a group may take one more than the mean and no more.
	strict := &SessionPolicy{}
	groups := slices.Clone(base)
	groups[order[0]].Inflight = 2 // total 3 over 4 groups: limit ceil(0.75)+1 = 2
	if got, _ := strict.Place(tr, groups); got != name(1) {
		t.Errorf("epsilon 0: Place = %q, want %q", got, name(1))
	}
}

func TestSessionPolicyWithoutSessionUsesReqID(t *testing.T) {
	p := &SessionPolicy{Epsilon: 0.25}
	groups := groupStates("a", "b", "c", "d", "e")
	spread := map[string]bool{}
	for k := range 50 {
		id := fmt.Sprintf("req-%d", k)
		got, err := p.Place(&RequestTracker{ReqID: id}, groups)
		if err != nil {
			t.Fatal(err)
		}
		if want := groups[RendezvousOrder(id, groups)[0]].Name; got != want {
			t.Errorf("request %s without session went to %s, want %s", id, got, want)
		}
		spread[got] = true
	}
	if len(spread) < 3 {
		t.Errorf("50 requests without session all went to %v", spread)
	}
}

func TestPoliciesWithoutGroups(t *testing.T) {
	for _, p := range []Policy{&SessionPolicy{Epsilon: 0.25}, &RoundRobinPolicy{}} {
		if g, err := p.Place(&RequestTracker{ReqID: "r", SessionID: "s"}, nil); !errors.Is(err, ErrNoReadyGroup) {
			t.Errorf("%T.Place(no groups) = %q, %v; want ErrNoReadyGroup", p, g, err)
		}
	}
}

func TestRoundRobinPolicy(t *testing.T) {
	p := &RoundRobinPolicy{}
	groups := groupStates("g0", "g1", "g2")
	var got []string
	for k := range 7 {
		// The session is ignored.
		g, err := p.Place(&RequestTracker{ReqID: fmt.Sprint(k), SessionID: "same"}, groups)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, g)
	}
	if want := []string{"g0", "g1", "g2", "g0", "g1", "g2", "g0"}; !slices.Equal(got, want) {
		t.Errorf("round robin = %v, want %v", got, want)
	}
}

func TestNewPolicy(t *testing.T) {
	tests := []struct {
		name    string
		epsilon float64
		want    Policy
		errHas  []string
	}{
		{PolicySession, 0.25, &SessionPolicy{Epsilon: 0.25}, nil},
		{PolicySession, 0, &SessionPolicy{}, nil},
		{PolicyRoundRobin, 0, &RoundRobinPolicy{}, nil},
		{PolicyRoundRobin, -1, &RoundRobinPolicy{}, nil}, // epsilon only matters to session
		{PolicySession, -0.1, nil, []string{"epsilon", "-0.1"}},
		{"sticky", 0.25, nil, []string{`"sticky"`, PolicySession, PolicyRoundRobin}},
		{"", 0.25, nil, []string{PolicySession, PolicyRoundRobin}},
	}
	for _, tt := range tests {
		p, err := NewPolicy(tt.name, tt.epsilon)
		if tt.errHas != nil {
			if err == nil {
				t.Errorf("NewPolicy(%q, %g) = %T, want an error", tt.name, tt.epsilon, p)
				continue
			}
			for _, s := range tt.errHas {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("NewPolicy(%q, %g) error %q does not mention %q", tt.name, tt.epsilon, err, s)
				}
			}
			continue
		}
		if err != nil {
			t.Errorf("NewPolicy(%q, %g): %v", tt.name, tt.epsilon, err)
			continue
		}
		if fmt.Sprintf("%T %+v", p, p) != fmt.Sprintf("%T %+v", tt.want, tt.want) {
			t.Errorf("NewPolicy(%q, %g) = %T %+v, want %T %+v", tt.name, tt.epsilon, p, p, tt.want, tt.want)
		}
	}
}
