package workers

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// Drain hand-off. A group that is scaled down takes its cache with it, and
// the conversations it served would start again from nothing. With
// DrainHandoff set, a draining group hands its most recently used blocks to
// the other groups before it exits: once its requests are finished, the
// driver rank picks the blocks (whole sessions, newest first, within the
// byte budget per rank) and a target group for each session (the one with
// the most free room, from the heartbeats it watches), and publishes that
// DrainPlan to its ranks; every rank t then asks rank t of each target to
// read those blocks from its segment of the pool (a Handoff), so the
// target's ranks all hold the same whole prefixes and announce them in their
// KV events. The draining ranks answer pool reads until they exit, and a
// rank that handed blocks off exits only once its group's other ranks are
// done with theirs (their heartbeats say handed_off, or they are gone): a
// rank's exit clears its shard of every block from the index, and until
// every rank of the target holds its copies, the source group is the only
// one whose ranks all hold the sessions' prefixes.

// handoffReadBlocks is how many blocks a target asks for in one PoolRead.
const handoffReadBlocks = 32

// peerGroup is what a driver rank knows of another group from its
// heartbeats.
type peerGroup struct {
	model     string
	world     int
	seen      map[int]time.Time // tp_rank -> last heartbeat
	draining  map[int]bool
	freeBlock int64 // capacity - used, of its fullest rank
}

// peerHeartbeat is the latest heartbeat of one rank, as received.
type peerHeartbeat struct {
	at   time.Time
	data []byte
}

// ownProcess is one process of a rank of the draining rank's own group:
// its rank and started_unix_ms.
type ownProcess struct {
	rank    int
	started int64
}

// ownHeartbeat is what a process of the own group said last.
type ownHeartbeat struct {
	at                  time.Time
	draining, handedOff bool
}

// peerGroups tracks heartbeats once a rank drains, with DrainHandoff: on the
// driver rank every group's (its own included), on the others their own
// group's. Another group's heartbeat is kept as received and decoded only
// when asked. The own group's are kept by process: a rank replaced as its
// group drains (an upgrade starts the new ranks at once) has a new process
// on the same subject, which is not draining and is no part of the
// hand-off, and must not hide the old process's word. Safe for concurrent
// use.
type peerGroups struct {
	mu     sync.Mutex
	latest map[string]peerHeartbeat // subject -> last heartbeat on it
	own    map[ownProcess]ownHeartbeat
	// ownPrefix is the subject prefix of the own group's heartbeats, and
	// since when the rank began to follow heartbeats (when it began to
	// drain); both set by Run before it subscribes.
	ownPrefix string
	since     time.Time
}

func (p *peerGroups) onHeartbeat(_ context.Context, m *nats.Msg) error {
	if len(m.Data) > messages.MaxMessageBytes {
		return fmt.Errorf("peer heartbeat: %w", messages.ErrTooLarge)
	}
	var own *messages.Heartbeat
	if p.ownPrefix != "" && strings.HasPrefix(m.Subject, p.ownPrefix) {
		hb, err := messages.DecodeHeartbeat(m.Data)
		if err != nil {
			return fmt.Errorf("peer heartbeat: %w", err)
		}
		own = hb
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if own != nil {
		if p.own == nil {
			p.own = map[ownProcess]ownHeartbeat{}
		}
		p.own[ownProcess{own.TPRank, own.StartedUnixMs}] = ownHeartbeat{time.Now(), own.Draining, own.HandedOff}
		return nil
	}
	if p.latest == nil {
		p.latest = map[string]peerHeartbeat{}
	}
	p.latest[m.Subject] = peerHeartbeat{at: time.Now(), data: m.Data} // nats.go gives each message its own Data
	return nil
}

// groups decodes the latest heartbeats of the other groups into what each
// group's ranks said; one that does not decode is skipped. p.mu is held.
func (p *peerGroups) groups() map[string]*peerGroup {
	out := map[string]*peerGroup{}
	for _, raw := range p.latest {
		hb, err := messages.DecodeHeartbeat(raw.data)
		if err != nil {
			continue
		}
		g := out[hb.Group]
		free := max(hb.CapacityBlocks-hb.UsedBlocks, 0)
		if g == nil {
			g = &peerGroup{seen: map[int]time.Time{}, draining: map[int]bool{}, freeBlock: free}
			out[hb.Group] = g
		}
		g.model, g.world = hb.Model, hb.WorldSize
		g.seen[hb.TPRank] = raw.at
		g.draining[hb.TPRank] = hb.Draining
		g.freeBlock = min(g.freeBlock, free) // a hand-off needs room on every rank
	}
	return out
}

// drainingProcesses returns the processes of the own group's rank that
// said within fresh that they are draining. p.mu is held.
func (p *peerGroups) drainingProcesses(rank int, fresh time.Duration, now time.Time) []ownHeartbeat {
	var out []ownHeartbeat
	for k, hb := range p.own {
		if k.rank == rank && hb.draining && now.Sub(hb.at) <= fresh {
			out = append(out, hb)
		}
	}
	return out
}

// draining reports whether each of the given ranks of the own group has a
// process that said within fresh that it is draining.
func (p *peerGroups) draining(fresh time.Duration, ranks ...int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for _, rank := range ranks {
		if len(p.drainingProcesses(rank, fresh, now)) == 0 {
			return false
		}
	}
	return true
}

// handedOff reports whether every rank of the own group below world other
// than self is done with its drain hand-off: each of its draining
// processes' latest heartbeat says so, or it has none heard within fresh
// (it exited, or was killed; one never heard is gone once fresh has
// passed since the rank began to follow heartbeats).
func (p *peerGroups) handedOff(self, world int, fresh time.Duration) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for rank := range world {
		if rank == self {
			continue
		}
		procs := p.drainingProcesses(rank, fresh, now)
		if len(procs) == 0 && now.Sub(p.since) <= fresh {
			return false // not heard yet
		}
		for _, hb := range procs {
			if !hb.handedOff {
				return false
			}
		}
	}
	return true
}

// ready returns the groups of model and of world ranks (rank t hands off
// to rank t), other than self, whose every rank sent a heartbeat within
// fresh and none of which is draining, with their free room in blocks,
// sorted by name.
func (p *peerGroups) ready(model, self string, world int, fresh time.Duration) (names []string, free map[string]int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	free = map[string]int64{}
	now := time.Now()
	for name, g := range p.groups() {
		if name == self || g.model != model || g.world != world {
			continue
		}
		alive := 0
		draining := false
		for rank, t := range g.seen {
			if now.Sub(t) <= fresh && rank < g.world {
				alive++
				draining = draining || g.draining[rank]
			}
		}
		if alive == g.world && !draining {
			names = append(names, name)
			free[name] = g.freeBlock
		}
	}
	slices.Sort(names)
	return names, free
}

// drainPlan picks what the group hands off: whole sessions of the driver's
// store, newest first, within DrainHandoff bytes per rank; each session
// goes to the ready group with the most free room left.
func (r *Rank) drainPlan() *messages.DrainPlan {
	plan := &messages.DrainPlan{Group: r.cfg.Group, Model: r.cfg.Model, BlockSize: r.cfg.BlockSize}
	targets, free := r.peers.ready(r.cfg.Model, r.cfg.Group, r.cfg.TPSize, 3*r.cfg.HeartbeatInterval)
	if len(targets) == 0 {
		return plan
	}
	// Twice the budget is listed, so that sessions cut by the listing's end
	// do not leave the budget unused.
	recent := r.store.Recent(2 * r.cfg.DrainHandoff)
	type session struct {
		tag    string
		hashes messages.BlockHashes
		bytes  int64
	}
	var order []*session
	byTag := map[string]*session{}
	var listed int64
	for _, o := range recent {
		listed += o.Size
		s := byTag[o.Group]
		if s == nil {
			s = &session{tag: o.Group}
			byTag[o.Group] = s
			order = append(order, s)
		}
		s.hashes = append(s.hashes, o.Hash)
		s.bytes += o.Size
	}
	if listed+int64(r.blockBytes(r.cfg.BlockSize)) > 2*r.cfg.DrainHandoff {
		// The listing may have cut sessions short: those of which it saw
		// only some blocks — often the oldest, the head of the prefix that
		// gives the rest their use — are left out.
		order = slices.DeleteFunc(order, func(s *session) bool {
			return s.tag != "" && len(s.hashes) != r.store.GroupObjects(s.tag)
		})
	}
	byTarget := map[string]int{}
	budget := r.cfg.DrainHandoff
	for _, s := range order {
		if s.bytes > budget {
			continue
		}
		best := ""
		for _, t := range targets {
			if best == "" || free[t] > free[best] {
				best = t
			}
		}
		i, ok := byTarget[best]
		if !ok {
			i = len(plan.Targets)
			byTarget[best] = i
			plan.Targets = append(plan.Targets, messages.HandoffTarget{Group: best})
		}
		plan.Targets[i].Runs = append(plan.Targets[i].Runs, messages.HandoffRun{Session: s.tag, BlockHashes: s.hashes})
		free[best] -= int64(len(s.hashes))
		budget -= s.bytes
	}
	return plan
}

// handOff runs the drain hand-off on a stopping rank whose requests are
// finished. It happens only when the whole group stops (scaled down), not
// when one rank restarts: the driver waits, for a few heartbeats, until
// every rank of its group says it is draining, then publishes the plan —
// empty when they do not, so no rank waits for nothing. A rank other than
// the driver waits for the plan only once its driver is draining. A rank
// that holds no block has nothing to hand off and waits for nobody: the
// plan comes from the driver's store (an empty one is published at once),
// and another rank's part of it is what its own store holds.
//
// It returns, when the rank asked targets to take blocks, until when it
// waits for its group's other ranks to finish theirs (see
// awaitGroupHandOff); the zero time otherwise.
func (r *Rank) handOff() (until time.Time) {
	if r.cfg.DrainHandoff <= 0 {
		return time.Time{}
	}
	if !r.cfg.Conn.IsConnected() {
		// Neither a plan nor a block can cross: waiting for peers it cannot
		// hear held every rank of a cluster stopped with its NATS server
		// gone for 3 heartbeat intervals, a rank other than the driver up
		// to --shutdown-timeout more.
		r.log.Info("drain hand-off: NATS is unreachable; nothing handed off, the group's blocks leave with it")
		return time.Time{}
	}
	settle := 3 * r.cfg.HeartbeatInterval
	_, _, held := r.store.Usage()
	var plan *messages.DrainPlan
	if r.IsDriver() {
		plan = &messages.DrainPlan{Group: r.cfg.Group, Model: r.cfg.Model, BlockSize: r.cfg.BlockSize}
		all := make([]int, r.cfg.TPSize)
		for i := range all {
			all[i] = i
		}
		switch {
		case held == 0:
			// Nothing to plan: the group's ranks hear so now.
		case r.waitFor(settle, func() bool { return r.peers.draining(settle, all...) }):
			// Every ready group's ranks send one within an interval: hear
			// each of them once before choosing targets.
			time.Sleep(time.Until(r.peers.since.Add(3 * r.cfg.HeartbeatInterval / 2)))
			plan = r.drainPlan()
		case !r.cfg.Conn.IsConnected():
			r.log.Info("drain hand-off: NATS became unreachable; nothing handed off")
		default:
			r.log.Info("drain hand-off: only part of the group is stopping; nothing handed off")
		}
		data, err := messages.Marshal(plan)
		if err == nil && len(data) > int(busLimit(r.cfg.Conn)) {
			err = fmt.Errorf("plan of %d bytes exceeds the server's max payload %d: lower --drain-handoff", len(data), busLimit(r.cfg.Conn))
		}
		if err == nil {
			err = r.cfg.Conn.Publish(r.cfg.Subjects.Drain(r.cfg.Group), data)
		}
		if err != nil {
			r.log.Error("drain hand-off: cannot send the plan to the group's ranks; their blocks leave with the group", "err", err)
		}
	} else {
		if held == 0 {
			return time.Time{} // whatever the plan says, this rank has none of it
		}
		// A plan that came already (this rank finished its requests after
		// the driver, which may have handed off and exited) is the
		// driver's word that it stops.
		if !r.waitFor(settle, func() bool { return len(r.plans) > 0 || r.peers.draining(settle, 0) }) {
			r.log.Info("drain hand-off: the group's driver rank is not stopping, or NATS became unreachable; nothing handed off",
				"nats_connected", r.cfg.Conn.IsConnected())
			return time.Time{}
		}
		// The driver sends the plan once its own requests are finished.
		if !r.waitFor(r.cfg.ShutdownTimeout+settle, func() bool { return len(r.plans) > 0 }) {
			r.log.Warn("drain hand-off: no plan from the driver rank; nothing handed off", "nats_connected", r.cfg.Conn.IsConnected())
			return time.Time{}
		}
		plan = <-r.plans
	}
	if len(plan.Targets) == 0 {
		if r.IsDriver() {
			r.log.Info("drain hand-off: nothing to hand off, or no other group ready to take it")
		}
		return time.Time{}
	}
	// Every target copies at once: the hand-off takes one
	// --shutdown-timeout at most, not one per target.
	start := time.Now()
	results := make([]*messages.HandoffResult, len(plan.Targets))
	var sends sync.WaitGroup
	for i, t := range plan.Targets {
		sends.Go(func() {
			res, err := r.sendHandoff(t, plan.BlockSize)
			if err != nil {
				r.log.Warn("drain hand-off to a group failed; its sessions will recompute", "target_group", t.Group, "err", err)
				return
			}
			results[i] = res
			r.log.Info("drain hand-off: blocks handed to a group", "target_group", t.Group, "sessions", len(t.Runs),
				"stored_blocks", res.Stored, "failed_blocks", res.Failed, "bytes", res.Bytes)
		})
	}
	sends.Wait()
	var stored, failed int
	var bytes int64
	for _, res := range results {
		if res != nil {
			stored += res.Stored
			failed += res.Failed
			bytes += res.Bytes
		}
	}
	r.log.Info("drain hand-off done", "targets", len(plan.Targets), "stored_blocks", stored, "failed_blocks", failed,
		"bytes", bytes, "took_ms", time.Since(start).Milliseconds())
	// The other ranks began theirs at about the same time (the plan reached
	// them together) and each sender waits one --shutdown-timeout at most.
	return start.Add(r.cfg.ShutdownTimeout)
}

// awaitGroupHandOff waits, until the given time at most, for the group's
// other ranks to be done with their drain hand-offs (a zero time: no
// wait). A rank done before the others would otherwise exit and clear its
// shard of every block while some target rank still copies its own: no
// group's ranks would all hold the handed-off prefixes, and a next turn
// placed then recomputed them (measured with each role its own process,
// two groups of 4: the turn sent as the draining group's first rank
// exited found 0 or 512 of its 800 cached tokens, in 3 runs of 3).
func (r *Rank) awaitGroupHandOff(until time.Time) {
	if until.IsZero() {
		return
	}
	start := time.Now()
	fresh := 3 * r.cfg.HeartbeatInterval
	done := r.waitFor(time.Until(until), func() bool {
		return r.peers.handedOff(r.cfg.TPRank, r.cfg.TPSize, fresh)
	})
	if !done {
		r.log.Warn("drain hand-off: the group's other ranks did not finish theirs in time, or NATS became unreachable; exiting without them",
			"waited_ms", time.Since(start).Milliseconds(), "nats_connected", r.cfg.Conn.IsConnected())
	}
}

// waitFor polls cond, which rests on what the rank hears on the bus, until
// it holds (true), or d passed or the connection to NATS is down (false).
func (r *Rank) waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) || !r.cfg.Conn.IsConnected() {
			return false
		}
		time.Sleep(min(r.cfg.HeartbeatInterval/4, 50*time.Millisecond))
	}
	return true
}

// sendHandoff asks rank TPRank of target to copy its runs from this rank.
func (r *Rank) sendHandoff(t messages.HandoffTarget, blockSize int) (*messages.HandoffResult, error) {
	data, err := messages.Marshal(&messages.Handoff{Model: r.cfg.Model, TPRank: r.cfg.TPRank, Source: r.cfg.Group, BlockSize: blockSize, Runs: t.Runs,
		SourceStartedUnixMs: r.started.UnixMilli()})
	if err != nil {
		return nil, err
	}
	reply, err := r.cfg.Conn.Request(r.cfg.Subjects.Handoff(t.Group, r.cfg.TPRank), data, r.cfg.ShutdownTimeout)
	if err != nil {
		return nil, err
	}
	res, err := messages.DecodeHandoffResult(reply.Data)
	if err != nil {
		return nil, err
	}
	if res.Error != "" {
		return nil, fmt.Errorf("target refused: %s", res.Error)
	}
	return res, nil
}

// onDrainPlan keeps the driver's plan for handOff (non-driver ranks).
func (r *Rank) onDrainPlan(_ context.Context, m *nats.Msg) error {
	plan, err := messages.DecodeDrainPlan(m.Data)
	if err != nil {
		return err
	}
	if plan.Group != r.cfg.Group || plan.Model != r.cfg.Model {
		return fmt.Errorf("%w: drain plan of %s/%s on %s's subject", messages.ErrInvalid, plan.Group, plan.Model, r.cfg.Group)
	}
	if !r.draining.Load() {
		return nil // a plan of a drain this rank is not part of
	}
	select {
	case r.plans <- plan:
	default: // one plan per drain; a repeat is ignored
	}
	return nil
}

// onHandoff takes blocks a draining group hands to this rank: it reads them
// from the same rank of the source group (the pool), verifies them, keeps
// them tagged with their session and announces them in its KV events.
// Hand-offs are taken at once, up to handoffSlots together, off the
// subscription's goroutine: groups scaled in together may all hand off to
// this one, and each waits for its answer only as long as it has.
func (r *Rank) onHandoff(_ context.Context, m *nats.Msg) error {
	h, err := messages.DecodeHandoff(m.Data)
	if err != nil {
		return err
	}
	take := func() error {
		data, err := messages.Marshal(r.takeHandoff(h))
		if err != nil {
			return err
		}
		return m.Respond(data)
	}
	return r.handoffs.run(r.log, take, take, "drain hand-off: cannot answer", "source_group", h.Source)
}

// handoffSlots bounds the hand-offs a rank takes at once.
const handoffSlots = 8

// takeHandoff copies what h hands over, or says why not.
func (r *Rank) takeHandoff(h *messages.Handoff) *messages.HandoffResult {
	res := &messages.HandoffResult{}
	switch {
	case h.TPRank != r.cfg.TPRank || h.Model != r.cfg.Model || h.Source == r.cfg.Group:
		res.Error = fmt.Sprintf("rank %s/%d of %s does not take blocks of %s/%d for %s", r.cfg.Group, r.cfg.TPRank, r.cfg.Model, h.Source, h.TPRank, h.Model)
		return res
	case r.draining.Load():
		res.Error = fmt.Sprintf("group %s is draining too", r.cfg.Group)
		return res
	case h.BlockSize < 1:
		res.Error = "no block_size"
		return res
	case h.BlockSize > math.MaxInt/max(r.blockBytes(1), 1) ||
		r.cfg.Payload != PayloadAccounting && r.blockBytes(h.BlockSize) > messages.MaxPoolBlockBytes:
		// Its byte size would overflow (to 0, every block "verified"
		// empty and kept under its key), or its blocks could not cross
		// the pool.
		res.Error = fmt.Sprintf("block_size %d: its blocks would be larger than the pool carries (%d bytes)", h.BlockSize, messages.MaxPoolBlockBytes)
		return res
	}
	start := time.Now()
	size := r.blockBytes(h.BlockSize)
	// No client waits on a hand-off: its reads may take as long as the
	// source waits for this answer (its shutdown timeout; ours is the best
	// guess), less a tenth, so that the answer, with what was kept by
	// then, gets there in time.
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.ShutdownTimeout*9/10)
	defer cancel()
	// At most handoffReadBlocks a read, and within poolReadBytes: 32 blocks
	// of a large model at a small TP size are past the server's pending
	// limit for this rank.
	chunk := min(handoffReadBlocks, poolReadBlocks(r.valueBytes(h.BlockSize)))
	for _, run := range h.Runs {
		for hashes := range slices.Chunk(run.BlockHashes, chunk) {
			stored, bytes := r.copyHandedOff(ctx, h, run.Session, hashes, size)
			res.Stored += stored
			res.Failed += len(hashes) - stored
			res.Bytes += bytes
		}
	}
	r.cfg.Metrics.handoff.WithLabelValues(h.Source, r.cfg.Group, r.labels[1]).Add(float64(res.Stored))
	r.cfg.Metrics.handoffBytes.WithLabelValues(h.Source, r.cfg.Group, r.labels[1]).Add(float64(res.Bytes))
	r.log.Info("kept blocks handed off by a draining group", "source_group", h.Source, "sessions", len(h.Runs),
		"stored_blocks", res.Stored, "failed_blocks", res.Failed, "bytes", res.Bytes, "took_ms", time.Since(start).Milliseconds())
	return res
}

// copyHandedOff reads one chunk of a run from the source and keeps what
// verifies; it returns the blocks stored and their bytes.
func (r *Rank) copyHandedOff(ctx context.Context, h *messages.Handoff, session string, hashes messages.BlockHashes, size int) (int, int64) {
	// Only the draining process answers: its replacement, started as it
	// drains, serves the same subject and holds none of these blocks.
	vals, err := r.pool.Read(ctx, h.Source, r.cfg.TPRank,
		&messages.PoolRead{Model: h.Model, TPRank: r.cfg.TPRank, BlockHashes: hashes, StartedUnixMs: h.SourceStartedUnixMs},
		r.valueBytes(h.BlockSize))
	if err != nil {
		r.log.Warn("hand-off: pool read failed", "source_group", h.Source, "blocks", len(hashes), "err", err)
		return 0, 0
	}
	objs := make([]Object, 0, len(hashes))
	kept := make(messages.BlockHashes, 0, len(hashes))
	var bytes int64
	for i, v := range vals {
		if !verifyBlock(r.cfg.Payload, v, hashes[i], r.cfg.TPRank, size) {
			continue
		}
		objs = append(objs, Object{Key: StoreKey(h.Model, r.cfg.TPRank, hashes[i]), Hash: hashes[i], Value: v, Size: int64(size), Group: session})
	}
	stored := 0
	for i, err := range r.store.BatchPut(ctx, objs) {
		if err == nil {
			stored++
			kept = append(kept, objs[i].Hash)
			bytes += objs[i].Size
		}
	}
	if len(kept) > 0 {
		r.events.publishStored(h.Model, []messages.KVEvent{{Type: messages.EventBlockStored, BlockHashes: kept, Medium: mediumKVPool}})
	}
	return stored, bytes
}
