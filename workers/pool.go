package workers

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// The KV pool's transport: every rank serves reads
// of its segment — its block store — on kvbus.pool.<group>.<rank>, so that
// rank t of another group can read the blocks rank t of this group holds,
// as Mooncake's store, whose keys name no instance, lets it. Replies are
// chunked to the connection's max payload; a block larger than one reply is
// sent in pieces. Loads read the LoadSpec's remote runs through it
// (rank_load.go), and draining groups hand their blocks off over it
// (drain.go).

// poolPartOverhead is the room a PoolPart needs besides its pieces, and
// poolPieceOverhead what each piece needs besides its bytes (its index,
// offset, size and the msgpack around them: under 40 bytes).
const (
	poolPartOverhead  = 1024
	poolPieceOverhead = 64
)

// onPoolRead answers a PoolRead with the blocks this rank holds, in as many
// PoolParts as the connection's max payload needs. A block this rank is
// still saving (the turn that just ran here) is sent once saved, within
// SaveWait, as a local load would wait for it. A block it neither holds
// nor saves may belong to a ReqMeta that reached this rank before the read
// but that its intake has not handled yet (the group's driver answered
// first, and the next turn went elsewhere): the read waits for the intake
// to catch up with what it had received (within a quarter of SaveWait),
// then for the saves it registered. In a NATS cluster the read can also
// come before that ReqMeta reached this rank at all: a read the scheduler
// planned from a save in flight here (PoolRead.Saving) waits, within the
// same quarter of SaveWait, for the ReqMeta that saves its blocks.
// Those waits happen off the subscription's goroutine (up to poolWaitSlots
// at once, and until Run closes r.poolWaits), so that reads of blocks
// already held are not queued behind them; with every slot taken, a read
// waits only for saves it knows of. A save queued behind this rank's own
// read from the reader's group is not waited for by the group first by
// name (see waitsOnReader).
func (r *Rank) onPoolRead(ctx context.Context, m *nats.Msg) error {
	req, err := messages.DecodePoolRead(m.Data)
	if err != nil {
		return err
	}
	if m.Reply == "" {
		return fmt.Errorf("%w: pool read without a reply subject", messages.ErrInvalid)
	}
	if req.StartedUnixMs != 0 && req.StartedUnixMs != r.started.UnixMilli() {
		// A read of another process of this rank (the one this process
		// replaces, handing off as it drains): it answers, and an answer
		// from here, without its blocks, would be taken for its.
		return nil
	}
	keys := make([]string, len(req.BlockHashes))
	for i, h := range req.BlockHashes {
		keys[i] = StoreKey(req.Model, req.TPRank, h)
	}
	values := r.store.BatchGet(ctx, keys, RecencyKept) // another group reads: it keeps its own copy
	// The intake's mark comes before the check of the saves: caught up,
	// every ReqMeta received by then has registered its saves, and the
	// check sees them. Taken after it (after the read again below), a
	// ReqMeta handled in between registered a save the read neither
	// waited for nor found.
	intake, caughtUp := r.intakeMark()
	unknown, saving := r.notSaving(keys, values)
	if len(unknown) > 0 {
		// A save may have ended between the read and the check (the store
		// thread puts, then settles): the block is in the store now, as
		// a local load finds it (rank_load.go).
		r.readAgain(ctx, keys, values, unknown)
		unknown = slices.DeleteFunc(unknown, func(i int) bool { return values[i] != nil })
	}
	// No ReqMeta comes once the intake stopped.
	planned := req.Saving && len(unknown) > 0 && r.intakeOpen()
	if (len(unknown) == 0 || caughtUp) && !planned {
		if !saving {
			return r.answerPoolRead(m.Reply, values)
		}
		intake = 0
	}
	arrived := time.Now()
	answer := func(intake int64, planned bool) func() error {
		return func() error {
			// A quarter of SaveWait: the reader gave the whole read
			// SaveWait from when it sent it.
			if intake > 0 {
				r.awaitIntake(intake, arrived.Add(r.cfg.SaveWait/4))
			}
			if planned {
				r.awaitUnreceivedSaves(ctx, req.Group, keys, values, unknown, arrived.Add(r.cfg.SaveWait/4))
			}
			r.awaitPoolSaves(ctx, req.Group, keys, values, arrived.Add(r.cfg.SaveWait))
			if intake > 0 || planned {
				found := 0
				for _, i := range unknown {
					if values[i] != nil {
						found++
					}
				}
				r.series.poolAwaitedIntake.Add(float64(found))
			}
			return r.answerPoolRead(m.Reply, values)
		}
	}
	// With no slot free, the intake is not waited for on this goroutine.
	return r.poolWaits.run(r.log, answer(intake, planned), answer(0, false), "pool read", "req_id", req.ReqID)
}

// awaitUnreceivedSaves waits until deadline, or until the intake stops,
// for the blocks at unknown (neither held nor being saved when the read
// came): for the ReqMeta that saves them to reach this rank and be
// handled (a block it registers is left to awaitPoolSaves), or for them to
// arrive in the store. One arrived by then is filled into values. It stops
// waiting once such a save would be queued behind this rank's read from
// reader (see waitsOnReader).
func (r *Rank) awaitUnreceivedSaves(ctx context.Context, reader string, keys []string, values [][]byte, unknown []int, deadline time.Time) {
	left := slices.Clone(unknown)
	for wait := 50 * time.Microsecond; ; wait = min(2*wait, 5*time.Millisecond) {
		// Each poll: a ReqMeta handled since registered its saves (the
		// one the read came just behind, maybe, before this wait began),
		// or a block came another way (a copy from another group, which
		// no ReqMeta of this rank saves).
		r.mu.Lock()
		closed := r.closed
		left = slices.DeleteFunc(left, func(i int) bool { return r.saving[keys[i]] != nil })
		r.mu.Unlock()
		r.readAgain(ctx, keys, values, left)
		left = slices.DeleteFunc(left, func(i int) bool { return values[i] != nil })
		if len(left) == 0 || closed || !time.Now().Before(deadline) || r.waitsOnReader(reader, nil) {
			return
		}
		time.Sleep(min(wait, time.Until(deadline)))
	}
}

// intakeOpen reports whether ReqMetas can still come: the intake has not
// stopped.
func (r *Rank) intakeOpen() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return !r.closed
}

// intakeMark returns how many ReqMetas this rank's subscription has
// received so far (delivered to its handler or queued for it; the one in
// the handler is counted twice, as nats.go counts it pending until its
// handler returns), and whether the handler has finished with every one of
// them. A stopped intake is caught up once its handler returned.
func (r *Rank) intakeMark() (received int64, caughtUp bool) {
	if r.metaSub == nil {
		return 0, true
	}
	pending, _, err := r.metaSub.Pending()
	if err != nil {
		return 0, r.metaBusy.Load() == 0
	}
	delivered, err := r.metaSub.Delivered()
	if err != nil {
		return 0, r.metaBusy.Load() == 0
	}
	received = delivered + int64(pending)
	return received, pending == 0 || r.metaHandled.Load() >= received
}

// awaitIntake waits until the ReqMeta handler has finished with received
// messages, or the intake is caught up otherwise, or deadline passes.
func (r *Rank) awaitIntake(received int64, deadline time.Time) {
	for wait := 50 * time.Microsecond; time.Now().Before(deadline); wait = min(2*wait, 5*time.Millisecond) {
		if r.metaHandled.Load() >= received {
			return
		}
		if _, caughtUp := r.intakeMark(); caughtUp {
			return
		}
		time.Sleep(min(wait, time.Until(deadline)))
	}
}

// poolWaitSlots bounds the pool reads of a rank waiting for saves at once.
const poolWaitSlots = 64

// notSaving returns the indexes of the values missing that no request
// here is saving, and whether any missing one is being saved.
func (r *Rank) notSaving(keys []string, values [][]byte) (unknown []int, saving bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, v := range values {
		switch {
		case v != nil:
		case r.saving[keys[i]] != nil:
			saving = true
		default:
			unknown = append(unknown, i)
		}
	}
	return unknown, saving
}

// awaitPoolSaves fills in the missing values whose saves settle by
// deadline: it waits for each (one request's settling settles all its
// keys), then reads again every value still missing. A save queued behind
// this rank's read from reader is not waited for (see waitsOnReader).
func (r *Rank) awaitPoolSaves(ctx context.Context, reader string, keys []string, values [][]byte, deadline time.Time) {
	var stop func(*rankReq) bool
	if r.mayStopFor(reader) {
		stop = func(owner *rankReq) bool { return r.waitsOnReader(reader, owner) }
	}
	var missing []int
	notAwaited := 0
	for i, v := range values {
		if v == nil {
			if !r.awaitSave(keys[i], deadline, stop) {
				notAwaited++
			}
			missing = append(missing, i)
		}
	}
	r.readAgain(ctx, keys, values, missing)
	if notAwaited > 0 {
		r.series.poolNotAwaited.Add(float64(notAwaited))
	}
}

// cycleGrace is how long a piece of the load thread's read from the
// reader's group must have been under way before a read from that group
// stops waiting (see waitsOnReader): half of SaveWait, 1 s by default. A
// read from a source that waits on nothing but its own engine (a save
// behind a prefill of hundreds of milliseconds) is answered within it, so
// it is not taken for one waiting on this group: at an eighth of SaveWait,
// a rolling-upgrade check at --time-scale 1 on a loaded host stopped 182
// blocks' waits in 40 s, most of them reads that were only slow. A true
// cycle still ends in half the time, with one of its two runs read.
func (r *Rank) cycleGrace() time.Duration {
	return r.cfg.SaveWait / 2
}

// mayStopFor reports whether this rank's group is the one of the pair
// with reader's that stops waiting (see waitsOnReader): the first by name.
// A reader that did not say its group is always waited for.
func (r *Rank) mayStopFor(reader string) bool {
	return reader != "" && r.cfg.Group < reader
}

// loadReading is a piece of a pool read of the load thread: from which
// group, for which request (its rankReq.id), since when.
type loadReading struct {
	source string
	id     uint64
	since  time.Time
}

// waitsOnReader reports whether a pool read from group reader must not wait
// for owner's save (nil: one whose ReqMeta has not come yet): owner's load
// is, or is queued behind, the load thread's read from that very group,
// and that read's current piece has had no answer for cycleGrace — it may
// wait for the reader's own load thread in turn (a save queued behind that
// thread's read from this group). Two groups reading from each other so
// would both wait out SaveWait and recompute both runs. Only the group
// first by name stops waiting: its read is answered with what it holds,
// the reader recomputes the rest, its load thread moves on and the other
// group's read gets its saves.
func (r *Rank) waitsOnReader(reader string, owner *rankReq) bool {
	if !r.mayStopFor(reader) {
		return false
	}
	cur := r.loadReading.Load()
	return cur != nil && cur.source == reader && (owner == nil || owner.id >= cur.id) && time.Since(cur.since) >= r.cycleGrace()
}

// readAgain reads the values at indexes at from the store again.
func (r *Rank) readAgain(ctx context.Context, keys []string, values [][]byte, at []int) {
	again := make([]string, len(at))
	for j, i := range at {
		again[j] = keys[i]
	}
	for j, v := range r.store.BatchGet(ctx, again, RecencyKept) {
		values[at[j]] = v
	}
}

// answerPoolRead sends values (nil: absent) to reply.
func (r *Rank) answerPoolRead(reply string, values [][]byte) error {
	parts := poolParts(values, int(busLimit(r.cfg.Conn))-poolPartOverhead)
	for i := range parts {
		parts[i].Part, parts[i].Parts = i, len(parts)
		data, err := messages.Marshal(&parts[i])
		if err != nil {
			return err
		}
		if err := r.cfg.Conn.Publish(reply, data); err != nil {
			return fmt.Errorf("answer pool read (part %d of %d): %w", i+1, len(parts), err)
		}
	}
	return nil
}

// poolParts packs the present values (nil: absent) into parts of at most
// budget bytes each, pieces and their overhead counted, splitting values
// that do not fit; there is always at least one part.
func poolParts(values [][]byte, budget int) []messages.PoolPart {
	budget = max(budget, poolPieceOverhead+1)
	parts := []messages.PoolPart{{}}
	room := budget
	for i, v := range values {
		if v == nil {
			continue
		}
		for off := 0; off < len(v) || (len(v) == 0 && off == 0); {
			if room <= poolPieceOverhead {
				parts = append(parts, messages.PoolPart{})
				room = budget
			}
			n := min(len(v)-off, room-poolPieceOverhead)
			last := &parts[len(parts)-1]
			last.Pieces = append(last.Pieces, messages.PoolPiece{Index: i, Offset: off, Size: len(v), Data: v[off : off+n]})
			room -= poolPieceOverhead + n
			off += n
			if len(v) == 0 {
				break
			}
		}
	}
	return parts
}

// PoolClient reads blocks from other ranks' segments of the KV pool. Safe
// for concurrent use; Conn is owned by the caller.
type PoolClient struct {
	Conn     *nats.Conn
	Subjects messages.Subjects
}

// ErrPoolRead is wrapped by failed pool reads.
var ErrPoolRead = errors.New("workers: pool read failed")

// Read asks rank rank of group for req's blocks, every one size bytes
// long, and returns for each hash its value, or nil when the rank does not
// hold it, or sent it torn or of another size. It waits for every part
// until ctx ends. A reply allocates nothing beyond the size bytes of each
// block asked for, whatever it claims.
func (c PoolClient) Read(ctx context.Context, group string, rank int, req *messages.PoolRead, size int) ([][]byte, error) {
	data, err := messages.Marshal(req)
	if err != nil {
		return nil, err
	}
	inbox := c.Conn.NewRespInbox()
	sub, err := c.Conn.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrPoolRead, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	// The replies may all arrive before the first is read: room for every
	// block asked for (the default 64 MB is 128 blocks of 512 KiB).
	if err := sub.SetPendingLimits(-1, max(64<<20, 2*len(req.BlockHashes)*size)); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrPoolRead, err)
	}
	if err := c.Conn.PublishRequest(c.Subjects.Pool(group, rank), inbox, data); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrPoolRead, err)
	}
	values := make([][]byte, len(req.BlockHashes))
	filled := make([]int, len(req.BlockHashes)) // bytes received in order; -1: torn
	seen := map[int]bool{}
	parts := 0 // as the first reply says
	for parts == 0 || len(seen) < parts {
		msg, err := sub.NextMsgWithContext(ctx)
		if errors.Is(err, nats.ErrNoResponders) {
			return nil, fmt.Errorf("%w: %s/%d: no rank serves pool reads there (it stopped, or never started)", ErrPoolRead, group, rank)
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %s/%d: %d of %d parts received: %w", ErrPoolRead, group, rank, len(seen), parts, err)
		}
		part, err := messages.DecodePoolPart(msg.Data)
		if err != nil {
			return nil, fmt.Errorf("%w: %s/%d: %w", ErrPoolRead, group, rank, err)
		}
		if parts == 0 {
			parts = part.Parts
		}
		if part.Parts != parts {
			return nil, fmt.Errorf("%w: %s/%d: parts disagree (%d, %d)", ErrPoolRead, group, rank, part.Parts, parts)
		}
		if seen[part.Part] {
			continue
		}
		seen[part.Part] = true
		for _, p := range part.Pieces {
			// A block is sent in order: a piece of another size, or one
			// that does not start where the bytes so far end, tears it.
			if p.Index >= len(values) || filled[p.Index] < 0 {
				continue
			}
			if p.Size != size || p.Offset != filled[p.Index] {
				filled[p.Index] = -1
				continue
			}
			if values[p.Index] == nil {
				values[p.Index] = make([]byte, size)
			}
			filled[p.Index] += copy(values[p.Index][p.Offset:], p.Data)
		}
	}
	for i, v := range values {
		if v != nil && filled[i] != len(v) {
			values[i] = nil // torn, or not every piece arrived
		}
	}
	return values, nil
}
