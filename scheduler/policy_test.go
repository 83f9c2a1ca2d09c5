package scheduler

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
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
		{PolicySession, -0.1, nil, []string{"epsilon", "-0.1"}},
		// A value that cannot work is refused whatever the policy (it
		// passed, unused, where only the session policy reads it).
		{PolicyRoundRobin, -1, nil, []string{"epsilon", "-1"}},
		{PolicyKV, math.NaN(), nil, []string{"epsilon", "NaN"}},
		{PolicySession, math.Inf(1), nil, []string{"epsilon", "Inf"}},
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

// kvTracker is a request of blocks blocks in session.
func kvTracker(session string, blocks int) *RequestTracker {
	return &RequestTracker{ReqID: "req-" + session, SessionID: session, BlockHashes: make([]uint64, blocks)}
}

func TestKVPolicy(t *testing.T) {
	type gs struct {
		cached, queued, inflight int
		bound                    bool
	}
	tests := []struct {
		name   string
		blocks int
		groups map[string]gs
		want   string
	}{
		{"largest cached prefix wins when queues are empty", 100,
			map[string]gs{"g0": {cached: 10}, "g1": {cached: 90}, "g2": {cached: 50}, "g3": {}}, "g1"},
		{"a cached prefix longer than the prompt counts as the whole prompt", 20,
			map[string]gs{"g0": {cached: 500, queued: 1}, "g1": {cached: 20}}, "g1"},
		// cost g1 = 100-90+50 = 60, g2 = 100-50+0 = 50.
		{"a shorter prefix wins when the best group's queue costs more", 100,
			map[string]gs{"g0": {cached: 10}, "g1": {cached: 90, queued: 50}, "g2": {cached: 50}}, "g2"},
		// cost g1 = 100-90+30 = 40, g2 = 50: the queue is not long enough.
		{"a queue shorter than the prefix gain keeps the best group", 100,
			map[string]gs{"g0": {cached: 10}, "g1": {cached: 90, queued: 30}, "g2": {cached: 50}}, "g1"},
		{"nothing cached: the least queued", 64,
			map[string]gs{"g0": {queued: 7}, "g1": {queued: 3}, "g2": {queued: 9}}, "g1"},
		{"in-flight count alone does not add cost", 64,
			map[string]gs{"g0": {cached: 64, inflight: 50}, "g1": {cached: 0}}, "g0"},
		{"the bound group is credited through CachedBlocks only", 100,
			map[string]gs{"g0": {cached: 0, bound: true}, "g1": {cached: 40}}, "g1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var groups []GroupState
			for _, name := range slices.Sorted(maps.Keys(tt.groups)) {
				g := tt.groups[name]
				groups = append(groups, GroupState{Name: name, WorldSize: 2, CachedBlocks: g.cached, IndexBlocks: g.cached,
					QueuedBlocks: g.queued, Inflight: g.inflight, Bound: g.bound})
			}
			for s := range 20 { // whatever the session's rendezvous order
				got, err := KVPolicy{}.Place(kvTracker(fmt.Sprint("s", s), tt.blocks), groups)
				if err != nil || got != tt.want {
					t.Fatalf("session s%d: Place = %q, %v; want %q", s, got, err, tt.want)
				}
			}
		})
	}
	if g, err := (KVPolicy{}).Place(kvTracker("s", 4), nil); !errors.Is(err, ErrNoReadyGroup) {
		t.Errorf("KVPolicy.Place(no groups) = %q, %v", g, err)
	}
}

func TestKVPolicyTiesBreakByRendezvous(t *testing.T) {
	groups := groupStates("g0", "g1", "g2", "g3", "g4")
	firsts := map[string]bool{}
	for k := range 200 {
		session := fmt.Sprintf("conv-%d", k)
		order := RendezvousOrder(session, groups)
		// All equal: the session's first rendezvous choice.
		want := groups[order[0]].Name
		for range 3 {
			if got, _ := (KVPolicy{}).Place(kvTracker(session, 32), groups); got != want {
				t.Fatalf("session %s, all groups equal: Place = %s, want %s (rendezvous first)", session, got, want)
			}
		}
		firsts[want] = true
		// A tie between two groups, the others worse: the one earlier in the
		// session's order, whichever the two are.
		tied := slices.Clone(groups)
		for i := range tied {
			tied[i].QueuedBlocks = 10
		}
		a, b := order[4], order[2] // the last and the middle choice
		tied[a].QueuedBlocks, tied[b].QueuedBlocks = 0, 0
		if got := must(KVPolicy{}.Place(kvTracker(session, 32), tied)); got != groups[b].Name {
			t.Fatalf("session %s: tie between %s and %s went to %s, want %s", session, groups[a].Name, groups[b].Name, got, groups[b].Name)
		}
	}
	if len(firsts) < 4 {
		t.Errorf("200 sessions broke ties toward only %v", firsts)
	}
	// The request id stands in for a missing session.
	for k := range 50 {
		tr := &RequestTracker{ReqID: fmt.Sprint("r", k), BlockHashes: make([]uint64, 8)}
		if got, want := must(KVPolicy{}.Place(tr, groups)), groups[RendezvousOrder(tr.ReqID, groups)[0]].Name; got != want {
			t.Fatalf("request %s without session: %s, want %s", tr.ReqID, got, want)
		}
	}
}

func must(s string, err error) string {
	if err != nil {
		panic(err)
	}
	return s
}

func TestSessionPolicyPrefersBound(t *testing.T) {
	p := &SessionPolicy{Epsilon: 0.25}
	tr := &RequestTracker{ReqID: "r", SessionID: "bound-session"}
	base := groupStates("g0", "g1", "g2", "g3")
	order := RendezvousOrder(tr.SessionID, base)
	bound := order[3] // the session's last rendezvous choice: only Bound can send it there
	tests := []struct {
		name     string
		inflight map[int]int // by index in base
		want     string
	}{
		{"bound group, no load", nil, base[bound].Name},
		// total 1+3+1+1+1 = 7, mean 1.75, limit max(ceil(1.25·1.75), ceil(1.75)+1) = 3: 3+1 > 3.
		{"bound group over the bound: rendezvous first", map[int]int{bound: 3, order[0]: 1, order[1]: 1, order[2]: 1}, base[order[0]].Name},
		// total 1+1+1+1+2 = 6, mean 1.5, limit 3: 1+1 fits.
		{"bound group busier but within the bound", map[int]int{bound: 1, order[0]: 1, order[1]: 1, order[2]: 2}, base[bound].Name},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			groups := slices.Clone(base)
			groups[bound].Bound = true
			for i, n := range tt.inflight {
				groups[i].Inflight = n
			}
			if got := must(p.Place(tr, groups)); got != tt.want {
				t.Errorf("Place = %s, want %s (bound %s, order %v)", got, tt.want, base[bound].Name, order)
			}
		})
	}
}

func TestRandomPolicy(t *testing.T) {
	groups := groupStates("g0", "g1", "g2", "g3")
	seen := map[string]int{}
	for k := range 1000 {
		g, err := RandomPolicy{}.Place(&RequestTracker{ReqID: fmt.Sprint(k), SessionID: "same"}, groups)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(groups, func(s GroupState) bool { return s.Name == g }) {
			t.Fatalf("RandomPolicy returned %q, not a ready group", g)
		}
		seen[g]++
	}
	if len(seen) != 4 {
		t.Errorf("1000 random placements used %v, want all 4 groups", seen)
	}
	for g, n := range seen {
		if n < 150 || n > 350 { // 250 expected; 150 is > 7 σ away
			t.Errorf("group %s got %d of 1000", g, n)
		}
	}
	// One ready group: always that one.
	for range 20 {
		if g := must(RandomPolicy{}.Place(&RequestTracker{ReqID: "r"}, groupStates("only"))); g != "only" {
			t.Fatalf("one group: %s", g)
		}
	}
	if g, err := (RandomPolicy{}).Place(&RequestTracker{ReqID: "r"}, nil); !errors.Is(err, ErrNoReadyGroup) {
		t.Errorf("RandomPolicy.Place(no groups) = %q, %v", g, err)
	}
}

func TestLeastLoadedPolicy(t *testing.T) {
	type load struct{ queued, inflight, cached int }
	tests := []struct {
		name  string
		loads []load // g0, g1, …
		want  string
	}{
		{"min queued blocks", []load{{9, 0, 0}, {3, 9, 0}, {5, 0, 0}}, "g1"},
		{"equal queues: min in flight", []load{{4, 3, 0}, {4, 1, 0}, {4, 2, 0}}, "g1"},
		{"queued before in flight", []load{{1, 100, 0}, {2, 0, 0}}, "g0"},
		{"the cache is ignored", []load{{1, 0, 0}, {2, 0, 1000}}, "g0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var groups []GroupState
			for i, l := range tt.loads {
				groups = append(groups, GroupState{Name: fmt.Sprint("g", i), WorldSize: 1,
					QueuedBlocks: l.queued, Inflight: l.inflight, CachedBlocks: l.cached, IndexBlocks: l.cached})
			}
			for s := range 20 {
				if got := must(LeastLoadedPolicy{}.Place(kvTracker(fmt.Sprint("s", s), 10), groups)); got != tt.want {
					t.Fatalf("session s%d: Place = %s, want %s", s, got, tt.want)
				}
			}
		})
	}
	// A full tie: the session's rendezvous first choice, stable.
	groups := groupStates("a", "b", "c", "d")
	for k := range 50 {
		s := fmt.Sprint("sess-", k)
		want := groups[RendezvousOrder(s, groups)[0]].Name
		if got := must(LeastLoadedPolicy{}.Place(kvTracker(s, 1), groups)); got != want {
			t.Fatalf("tie for %s: %s, want %s", s, got, want)
		}
	}
	if g, err := (LeastLoadedPolicy{}).Place(kvTracker("s", 1), nil); !errors.Is(err, ErrNoReadyGroup) {
		t.Errorf("LeastLoadedPolicy.Place(no groups) = %q, %v", g, err)
	}
}

func TestNewPolicyKnowsAllNames(t *testing.T) {
	want := map[string]string{
		PolicyKV:          "scheduler.KVPolicy",
		PolicySession:     "*scheduler.SessionPolicy",
		PolicyRoundRobin:  "*scheduler.RoundRobinPolicy",
		PolicyRandom:      "scheduler.RandomPolicy",
		PolicyLeastLoaded: "scheduler.LeastLoadedPolicy",
	}
	names := PolicyNames()
	if len(names) != 5 || names[0] != PolicyKV {
		t.Errorf("PolicyNames() = %v, want five names, kv first", names)
	}
	for _, name := range names {
		p, err := NewPolicy(name, 0.25)
		if err != nil {
			t.Errorf("NewPolicy(%q): %v", name, err)
			continue
		}
		if got := fmt.Sprintf("%T", p); got != want[name] {
			t.Errorf("NewPolicy(%q) = %s, want %s", name, got, want[name])
		}
		// Every policy places on one of the ready groups.
		groups := groupStates("g0", "g1")
		if g, err := p.Place(kvTracker("s", 4), groups); err != nil || (g != "g0" && g != "g1") {
			t.Errorf("%s: Place = %q, %v", name, g, err)
		}
		if _, err := p.Place(kvTracker("s", 4), nil); !errors.Is(err, ErrNoReadyGroup) {
			t.Errorf("%s: Place(no groups) = %v, want ErrNoReadyGroup", name, err)
		}
	}
	for _, name := range []string{"KV", "least_loaded", "roundrobin", " kv"} {
		if _, err := NewPolicy(name, 0.25); err == nil {
			t.Errorf("NewPolicy(%q) succeeded", name)
		}
	}
}

// TestKVPolicyTieKeepsTheCache: at equal cost the group holding more of the
// prefix wins, whatever the rendezvous order says.
func TestKVPolicyTieKeepsTheCache(t *testing.T) {
	for s := range 50 {
		tr := kvTracker(fmt.Sprint("tie-", s), 64)
		groups := groupStates("g0", "g1")
		groups[0].CachedBlocks, groups[0].QueuedBlocks = 32, 32 // cost 64 with the cache
		groups[1].CachedBlocks, groups[1].QueuedBlocks = 0, 0   // cost 64 without
		if got, err := (KVPolicy{}).Place(tr, groups); err != nil || got != "g0" {
			t.Fatalf("session %s: Place = %q, %v; want g0 (equal cost, more cached)", tr.SessionID, got, err)
		}
	}
}

// TestKVPolicyAgreesWithRendezvousWalk checks the one-pass KVPolicy.Place
// against its rule spelled as a walk in rendezvous order (the first of the
// cheapest, more cached blocks first at equal cost) on random clusters with
// many ties.
func TestKVPolicyAgreesWithRendezvousWalk(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 11))
	p := KVPolicy{LocalLoad: 0.25, RemoteLoad: 0.5}
	for trial := range 5_000 {
		groups := groupStates()
		for i := range 1 + rng.IntN(40) {
			groups = append(groups, GroupState{Name: fmt.Sprint("g", i), WorldSize: 4,
				CachedBlocks: rng.IntN(4) * 8, RemoteBlocks: rng.IntN(3) * 8, QueuedBlocks: rng.IntN(3) * 4})
		}
		tr := kvTracker(fmt.Sprint("s", trial), 8+rng.IntN(24))
		total := len(tr.BlockHashes)
		want, bestCost := -1, 0.0
		for _, i := range RendezvousOrder(placementKey(tr), groups) {
			g := groups[i]
			cached := min(g.CachedBlocks, total)
			remote := min(g.RemoteBlocks, total-cached)
			cost := float64(total-cached-remote) + p.LocalLoad*float64(cached) + p.RemoteLoad*float64(remote) + float64(g.QueuedBlocks)
			if want < 0 || cost < bestCost || cost == bestCost && g.CachedBlocks > groups[want].CachedBlocks {
				want, bestCost = i, cost
			}
		}
		if got := must(p.Place(tr, groups)); got != groups[want].Name {
			t.Fatalf("trial %d: Place = %s, want %s (groups %+v)", trial, got, groups[want].Name, groups)
		}
	}
}
