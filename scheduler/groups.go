package scheduler

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"
)

// groupTable follows heartbeats. It is safe for concurrent use.
type groupTable struct {
	mu                    sync.Mutex
	timeout               time.Duration
	blockSize             int
	localLoad, remoteLoad float64
	groups                map[string]*groupInfo
	// order holds the groups sorted by name, so that the per-request
	// ready list needs no sort.
	order []*groupInfo
	// heardFrom is when this replica last reconnected to NATS: it heard
	// no heartbeat while cut off, so a rank's silence counts from then.
	heardFrom time.Time
	// cutSince: the cut that ended at heardFrom began after it, at most a
	// sweep interval after; a rank heard since was heard after the
	// reconnect (or in the cut's last moments before it began).
	cutSince time.Time
}

// groupInfo is what a scheduler knows of a group. Its load is the driver
// rank's last report (every replica hears the same heartbeats) plus what
// this replica changed since: its own dispatches, and the prefills and
// completions it heard of. So two replicas see one cluster's load.
type groupInfo struct {
	name      string
	worldSize int
	ranks     map[int]rankInfo
	// From the driver's last heartbeat, heard at hbAt.
	hbAt       time.Time
	hbInflight int
	hbQueued   int // blocks of prefill time: prefills and the loads before them
	// The prefill at the head of the queue (part of hbQueued): how long
	// the engine had been on it, and at most how many blocks it is.
	prefilling       time.Duration
	prefillingBlocks int
	// resendByGroup: the driver's last heartbeat says it answers Resends
	// on kvbus.ctl.resend.<group> (a driver before 2026-12-07 reads
	// kvbus.ctl.resend itself).
	resendByGroup bool
	// This replica's changes since that heartbeat.
	inflight int
	queued   int
	// blockTime is how long the group takes per block of prefill time,
	// learnt from its prefills (0: not yet known).
	blockTime time.Duration
	// mixedSaid is when ranks of the group serving different models were
	// last reported.
	mixedSaid time.Time
	// status is what the ranks' last heartbeats say of the group as a
	// whole, kept by observe (the only writer of ranks), so that the
	// per-request ready list costs no walk over every rank.
	status groupStatus
}

// groupStatus sums up a group's ranks. Heartbeats validate tp_rank <
// world_size and a new world size forgets the ranks, so a group whose
// world_size ranks are all in ranks, none failing its health check
// (complete), is alive while its least recently heard rank (oldestSeen)
// is heard; its other fields are then those of every rank.
type groupStatus struct {
	complete   bool
	oldestSeen time.Time
	draining   bool
	mixed      bool
	model      string
	depth      int
	// capacityBlocks is the least any rank's store holds (0: no rank
	// says): a rank saves no more of a prompt than that.
	capacityBlocks int64
}

// refresh recomputes g's status from its ranks.
func (g *groupInfo) refresh() {
	st := groupStatus{complete: len(g.ranks) == g.worldSize}
	n := 0
	for _, r := range g.ranks {
		st.complete = st.complete && !r.notReady
		if n == 0 || r.seen.Before(st.oldestSeen) {
			st.oldestSeen = r.seen
		}
		if n > 0 && r.model != st.model {
			st.mixed = true
		}
		st.model = r.model
		st.depth = max(st.depth, r.queueDepth)
		if c := r.capacityBlocks; c > 0 && (st.capacityBlocks == 0 || c < st.capacityBlocks) {
			st.capacityBlocks = c
		}
		st.draining = st.draining || r.draining
		n++
	}
	g.status = st
}

// aliveLocked reports whether every rank of g was heard within the
// timeout and none fails its health check. Called with t.mu held.
func (t *groupTable) aliveLocked(g *groupInfo, now time.Time) bool {
	return g.status.complete && g.worldSize > 0 && t.heardLocked(g.status.oldestSeen, now)
}

// load is the group's requests in flight and its queue in blocks of
// prefill time at now. The work done on the prefill at the head of the
// queue since it began is taken off (up to that prefill's blocks), once
// the group's pace is known: a queue whose head is nearly done is not as
// long as one whose head has just begun, and the heartbeat that says so
// comes only when the head ends.
func (g *groupInfo) load(now time.Time) (inflight, queued int) {
	q := g.hbQueued
	if g.blockTime > 0 && g.prefillingBlocks > 0 {
		done := int((g.prefilling + now.Sub(g.hbAt)) / g.blockTime)
		q -= min(max(done, 0), g.prefillingBlocks, q)
	}
	return max(g.hbInflight+g.inflight, 0), max(q+g.queued, 0)
}

// blockTimeWeight is the weight of a new prefill in a group's learnt pace.
const blockTimeWeight = 0.2

type rankInfo struct {
	seen    time.Time
	started int64
	// since is when this replica first heard the rank's process; replaced
	// is the started_unix_ms of the process it heard it replace (0: none).
	since    time.Time
	replaced int64
	// restarted is when this replica heard the rank's process change (a
	// later process: see olderLocked): requests dispatched before it that the rank
	// had not finished are lost on it.
	restarted time.Time
	// dupSaid is when a second process claiming this rank was last
	// reported.
	dupSaid time.Time
	// aheadSaid is when the rank's clock was last said to be ahead of
	// this host's.
	aheadSaid  time.Time
	queueDepth int
	draining   bool
	// notReady: the rank's engine does not take requests (it fails its
	// health check); the group is treated as one that lost a rank.
	notReady bool
	// model is the model the rank serves (its --model; "" from a worker
	// that does not say).
	model string
	// capacityBlocks is how many blocks the rank's store holds (0: not
	// said, as from a model server's own cache).
	capacityBlocks int64
}

// newGroupTable counts a group's queue in blocks of prefill time: prefill
// blocks, and loads at localLoad and remoteLoad of a block's prefill per
// block.
func newGroupTable(timeout time.Duration, blockSize int, localLoad, remoteLoad float64) *groupTable {
	return &groupTable{timeout: timeout, blockSize: max(blockSize, 1), localLoad: localLoad, remoteLoad: remoteLoad,
		groups: map[string]*groupInfo{}}
}

// loadWork is the prefill time, in blocks, of loading local and remote
// blocks.
func loadWork(local, remote int, localLoad, remoteLoad float64) int {
	return int(math.Round(localLoad*float64(local) + remoteLoad*float64(remote)))
}

// ready returns the groups whose world_size ranks all sent a heartbeat
// within the timeout, none is draining and all serve one model, sorted by
// name: where new requests may go (of that model: see forModel). A group
// whose live ranks name different models (workers of two models given one
// --group, or --rank auto slots shared by two models) is no group: a
// request of either model would be answered by ranks of both.
func (t *groupTable) ready(now time.Time) []GroupState {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]GroupState, 0, len(t.order))
	for _, g := range t.order {
		if st := &g.status; t.aliveLocked(g, now) && !st.draining && !st.mixed {
			inflight, queued := g.load(now)
			out = append(out, GroupState{Name: g.name, Model: st.model, WorldSize: g.worldSize, Inflight: inflight, QueuedBlocks: queued, QueueDepth: st.depth})
		}
	}
	return out
}

// notReadyWhy says in words why group is not ready at now: its ranks not
// heard within the timeout (and for how long), missing, failing their
// health check or draining, or serving different models; planned when it
// is only draining (a scale-down, a rolling restart).
func (t *groupTable) notReadyWhy(group string, now time.Time) (why string, planned bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	g := t.groups[group]
	if g == nil {
		return "not heard of", false
	}
	var reasons []string
	drains := 0
	for r := range g.worldSize {
		ri, ok := g.ranks[r]
		switch {
		case !ok:
			reasons = append(reasons, fmt.Sprintf("tp_rank %d not heard from", r))
		case !t.heardLocked(ri.seen, now):
			reasons = append(reasons, fmt.Sprintf("tp_rank %d silent for %s (heartbeat timeout %s)", r,
				now.Sub(ri.seen).Round(100*time.Millisecond), t.timeout))
		case ri.notReady:
			reasons = append(reasons, fmt.Sprintf("tp_rank %d says its engine is not ready", r))
		case ri.draining:
			reasons = append(reasons, fmt.Sprintf("tp_rank %d draining", r))
			drains++
		}
	}
	if g.status.mixed {
		reasons = append(reasons, "its ranks serve different models")
	}
	if len(reasons) == 0 {
		return "its ranks were not all heard within the heartbeat timeout", false
	}
	return strings.Join(reasons, "; "), drains == len(reasons)
}

// forming reports whether a group was heard from within the timeout but
// not yet from all its ranks: at a replica's start, the first heartbeats
// of a group's ranks other than its driver are still to come.
func (t *groupTable) forming(now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, g := range t.order {
		if g.worldSize > 0 && len(g.ranks) < g.worldSize && t.heardLocked(g.status.oldestSeen, now) {
			return true
		}
	}
	return false
}

// alive returns the groups whose world_size ranks all sent a heartbeat
// within the timeout and are ready, draining or not: their requests can
// still finish. A rank whose engine fails its health check counts as lost.
func (t *groupTable) alive(now time.Time) map[string]bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string]bool{}
	for name, g := range t.groups {
		out[name] = t.aliveLocked(g, now)
	}
	return out
}

// worldSize returns a group's world size, 0 when the group is unknown.
func (t *groupTable) worldSize(name string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	if g := t.groups[name]; g != nil {
		return g.worldSize
	}
	return 0
}

// resendByGroup reports whether the group's driver answers Resends on
// kvbus.ctl.resend.<group>, by its last heartbeat.
func (t *groupTable) resendByGroup(name string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	g := t.groups[name]
	return g != nil && g.resendByGroup
}

// capacityBlocks returns how many blocks the smallest store of the group's
// ranks holds, from their heartbeats; 0 when unknown.
func (t *groupTable) capacityBlocks(name string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	if g := t.groups[name]; g != nil {
		return int(min(g.status.capacityBlocks, math.MaxInt32))
	}
	return 0
}

// startedSince reports whether a rank of the group runs a process that
// started after the peer's dispatch d: one that cannot have its request.
// For a dispatch heard live, that is a restart this replica heard after
// the plan, both on its clock: read from the heartbeats' started_unix_ms
// (the rank's clock) against the time of the plan, a rank whose clock ran
// ahead had always "started since", and the request was placed again
// while its group ran it. For one replayed from the plan stream (this
// replica started after it), its process's start on the rank's clock
// against the plan's time on the NATS server's: nothing else orders them.
func (t *groupTable) startedSince(name string, d peerDispatch) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if g := t.groups[name]; g != nil {
		for _, r := range g.ranks {
			if d.replayed && r.started > d.at.UnixMilli() || !d.replayed && r.restarted.After(d.at) {
				return true
			}
		}
	}
	return false
}

// sources returns the names of the alive groups (see alive): those whose
// segments of the KV pool answer reads, a draining group's until it exits.
func (t *groupTable) sources(now time.Time) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(t.order))
	for _, g := range t.order {
		if t.aliveLocked(g, now) {
			out = append(out, g.name)
		}
	}
	return out
}

// ofWorldSize returns the groups of names whose world size is size: those
// whose ranks hold blocks sharded as a group of that size does.
func (t *groupTable) ofWorldSize(names []string, size int) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(names))
	for _, name := range names {
		if g := t.groups[name]; g != nil && g.worldSize == size {
			out = append(out, name)
		}
	}
	return out
}

// forget drops the groups none of whose ranks was heard of for after, and
// returns their names.
func (t *groupTable) forget(now time.Time, after time.Duration) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var gone []string
	for name, g := range t.groups {
		last := time.Time{}
		for _, r := range g.ranks {
			if r.seen.After(last) {
				last = r.seen
			}
		}
		if now.Sub(maxTime(last, t.heardFrom)) > after { // as heardLocked counts
			delete(t.groups, name)
			gone = append(gone, name)
		}
	}
	if len(gone) > 0 {
		t.order = slices.DeleteFunc(t.order, func(g *groupInfo) bool { return t.groups[g.name] != g })
	}
	return gone
}

// addInflight changes a group's in-flight requests and queued prefill
// blocks.
func (t *groupTable) addInflight(group string, requests, blocks int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if g := t.groups[group]; g != nil {
		g.inflight += requests
		g.queued += blocks
	}
}

// observePrefill learns a group's pace from one of its prefills: work
// blocks of prefill time that took the engine us microseconds.
func (t *groupTable) observePrefill(group string, work int, us int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	g := t.groups[group]
	if g == nil || work <= 0 || us <= 0 {
		return
	}
	sample := time.Duration(us) * time.Microsecond / time.Duration(work)
	if g.blockTime == 0 {
		g.blockTime = sample
		return
	}
	g.blockTime += time.Duration(blockTimeWeight * float64(sample-g.blockTime))
}

// each calls f for every known group with the model its driver rank (else
// any rank) serves, and its queue depth and in-flight count at now.
func (t *groupTable) each(now time.Time, f func(name, model string, inflight, queued int)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for name, g := range t.groups {
		inflight, queued := g.load(now)
		model := ""
		if r, ok := g.ranks[0]; ok {
			model = r.model
		} else {
			for _, r := range g.ranks {
				model = r.model
				break
			}
		}
		f(name, model, inflight, queued)
	}
}

// maxTime returns the later of a and b.
func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
