package scheduler

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// Resyncs. A rank's KV events carry a seq; a gap, a restart or a rank first
// heard of mid-stream makes the index ask the rank for a dump of what it
// holds. At most one dump per rank is in flight, and a failed or repeated
// one backs off from 100 ms, doubling to 5 s, so that no malformed or lost
// batch can make a storm of dumps.
//
// At most maxDumpsInFlight dumps are fetched at once; the others wait their
// turn. A dump is held until it is applied (8 bytes a block, and its chunks
// as they queue, ~60 bytes a block with their token ids), and a scheduler
// started in a cluster of a thousand ranks asked them all at once: its
// memory was the sum of every rank's dump.

const (
	resyncMinBackoff = 100 * time.Millisecond
	resyncMaxBackoff = 5 * time.Second
	maxDumpsInFlight = 8
)

type resyncState struct {
	inflight bool
	next     time.Time // no dump before this
	backoff  time.Duration
}

func (s *Scheduler) onHeartbeat(ctx context.Context, m *nats.Msg) error {
	hb, err := messages.DecodeHeartbeat(m.Data)
	if err != nil {
		return err
	}
	if err := s.ownSubject(m.Subject, s.cfg.Subjects.Heartbeat(hb.Group, hb.TPRank), "heartbeat", hb.Group, hb.TPRank); err != nil {
		return err
	}
	now := time.Now()
	stale, report, gap := s.groups.observe(hb, now)
	if gap > 0 {
		s.m.heartbeatGap.Observe(gap.Seconds())
	}
	if stale {
		if report && !hb.Draining { // a draining one is being replaced: no slip
			s.log.Error("two worker processes claim the same rank: give each its own --tp-rank (or use --rank auto); "+
				"the older one's heartbeats are ignored", "group", hb.Group, "tp_rank", hb.TPRank,
				"older_started", time.UnixMilli(hb.StartedUnixMs).UTC().Format(time.RFC3339Nano))
		}
		return nil
	}
	// started_unix_ms is a time on the rank's clock: it tells one process
	// of the rank from another, and nothing of when it started here. A
	// heartbeat whose process started "in the future" comes from a host
	// whose clock is ahead of this one's: taken, and said (refused, a
	// worker on a host a few minutes ahead was not heard until this clock
	// caught up with its start, its group not ready meanwhile).
	if ahead := time.UnixMilli(hb.StartedUnixMs).Sub(now); ahead >= clockSkewWarning && s.groups.sayAhead(hb.Group, hb.TPRank, now) {
		s.log.Warn("a worker's clock is ahead of this scheduler's: its process says it started in the future (kvbus does not need the clocks to agree, but check NTP on its host)",
			"group", hb.Group, "tp_rank", hb.TPRank, "rank_ahead_by_at_least", ahead.Round(time.Millisecond).String(),
			"started", time.UnixMilli(hb.StartedUnixMs).UTC().Format(time.RFC3339Nano))
	}
	if models, report := s.groups.mixedModels(hb.Group, now); report {
		s.log.Error("the ranks of one worker group serve different models: it takes no request until they agree. "+
			"Give each model's workers groups of their own: fix the --group of the workers started with one; "+
			"a --rank auto worker of this kvbus claims only a group of its own model, so restart one that joined this group (a worker of an older kvbus joins any)",
			"group", hb.Group, "models", models)
	}
	if s.index.ObserveRank(hb.Group, hb.TPRank, hb.WorldSize, hb.StartedUnixMs, hb.CapacityBlocks) {
		s.log.Info("rank (re)started or first heard of: asking it for a dump", "group", hb.Group, "tp_rank", hb.TPRank)
		s.requestDump(ctx, hb.Group, hb.TPRank)
	}
	return nil
}

// ownSubject refuses a rank's message that arrived on another rank's
// subject: the bus's permissions let a worker publish only on its own
// group's subjects, so the group and rank a message names must be those of
// its subject, or one group could write another's index and load.
func (s *Scheduler) ownSubject(got, want, what, group string, rank int) error {
	if got == want {
		return nil
	}
	return fmt.Errorf("%w: %s of %s/%d arrived on %s, not %s: dropped (a rank publishes only as itself)", messages.ErrInvalid, what, group, rank, got, want)
}

func (s *Scheduler) onKVEvents(ctx context.Context, m *nats.Msg) error {
	b, err := messages.DecodeKVEventBatch(m.Data)
	if err != nil {
		return err
	}
	if err := s.ownSubject(m.Subject, s.cfg.Subjects.KV(b.Group, b.Rank), "KV event batch", b.Group, b.Rank); err != nil {
		return err
	}
	if s.groups.notTheRank(b.Group, b.Rank, b.StartedUnixMs, time.Now()) {
		// A second process given this rank (its heartbeats are ignored and
		// reported): its seqs would interleave with the rank's and make
		// the index resync on every batch.
		s.log.Debug("KV events of a second process claiming the rank: dropped", "group", b.Group, "tp_rank", b.Rank,
			"started_unix_ms", b.StartedUnixMs)
		return nil
	}
	rejected, refused := s.index.Rejected(), s.index.Refused()
	if s.index.Apply(b) {
		s.log.Warn("gap in KV events: asking the rank for a dump", "group", b.Group, "tp_rank", b.Rank, "seq", b.Seq)
		s.requestDump(ctx, b.Group, b.Rank)
	}
	if s.index.Refused() != refused {
		s.sayOverBound(b.Group, b.Rank)
	}
	if s.index.Rejected() != rejected {
		return fmt.Errorf("%w: KV event batch of %s/%d with seq %d, impossibly far past the rank's last seq: dropped (corrupted, replayed or forged?)",
			messages.ErrInvalid, b.Group, b.Rank, b.Seq)
	}
	return nil
}

// sayOverBound logs, at most once a minute per rank, that the index did not
// record some of a rank's stores (KVIndex.OverBound).
func (s *Scheduler) sayOverBound(group string, rank int) {
	o, ok := s.index.OverBound(group, rank, time.Now())
	if !ok {
		return
	}
	args := []any{"group", group, "tp_rank", rank, "not_recorded", o.Refused, "held", o.Held, "bound", o.Limit,
		"capacity_blocks", o.CapacityBlocks, "index_entries", o.Entries, "index_bound", o.MaxEntries}
	if o.IndexFull() {
		s.log.Warn("the KV index is full: a rank's stores are not recorded (placement misses those blocks; removals still apply). "+
			"Check for forged ranks, which make up groups and blocks: enable auth (README \"Who may do what on the bus\"); "+
			"or the cluster caches more blocks than one scheduler indexes", args...)
		return
	}
	s.log.Warn("a rank says it holds more blocks than its bound (twice its heartbeats' capacity_blocks and some slack, or the fixed bound "+
		"when it says none): its stores past it are not recorded (placement misses those blocks; removals still apply). "+
		"Check for a rank whose store's capacity grew without a restart, or a forged rank: enable auth (README \"Who may do what on the bus\")", args...)
}

// requestDump asks a rank for everything it holds, in the background,
// unless a dump of it is in flight or backing off; the sweep retries ranks
// still resyncing.
func (s *Scheduler) requestDump(ctx context.Context, group string, rank int) {
	id := rankID{group, rank}
	now := time.Now()
	s.resyncMu.Lock()
	st := s.resyncs[id]
	if st == nil {
		st = &resyncState{}
		s.resyncs[id] = st
	}
	if st.inflight || now.Before(st.next) || ctx.Err() != nil {
		s.resyncMu.Unlock()
		return
	}
	st.inflight = true
	s.resyncMu.Unlock()
	s.m.resyncs.Inc()
	s.dumps.Go(func() {
		again, err := s.resync(ctx, group, rank)
		if err != nil && ctx.Err() == nil {
			s.log.Warn("dump request failed; will retry", "group", group, "tp_rank", rank, "err", err)
		}
		s.resyncMu.Lock()
		defer s.resyncMu.Unlock()
		st.inflight = false
		if err != nil || again {
			st.backoff = min(max(2*st.backoff, resyncMinBackoff), resyncMaxBackoff)
			st.next = time.Now().Add(st.backoff)
		} else {
			st.backoff /= 2
			st.next = time.Now().Add(resyncMinBackoff)
		}
	})
}

// resync fetches a rank's dump, once fewer than maxDumpsInFlight are, and
// applies it to the index; again reports a gap in its events since.
func (s *Scheduler) resync(ctx context.Context, group string, rank int) (again bool, err error) {
	select {
	case s.dumpSlots <- struct{}{}:
		defer func() { <-s.dumpSlots }() // once applied: the dump is held until then
	case <-ctx.Done():
		return false, ctx.Err()
	}
	epoch := s.index.Epoch(group, rank) // the process the dump comes from
	dump, got, err := s.fetchDump(ctx, group, rank)
	if err != nil {
		return false, err
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	refused := s.index.Refused()
	again = s.index.ApplyDumpOf(group, rank, epoch, dump)
	s.log.Info("rank resynced from its dump", "group", group, "tp_rank", rank, "seq", dump.Seq,
		"blocks", dumpBlocks(dump), "chunks", got.chunks, "gap_again", again)
	s.index.NoteRefused(group, rank, got.cut)
	if s.index.Refused() != refused {
		s.sayOverBound(group, rank)
	}
	return again, nil
}

// dumpGot is what fetchDump gathered: chunks, and the hashes cut from them
// past the rank's bound.
type dumpGot struct{ chunks, cut int }

// fetchDump asks a rank for its dump and gathers its chunks into one batch,
// keeping at most as many hashes as the index records of the rank.
func (s *Scheduler) fetchDump(ctx context.Context, group string, rank int) (dump *messages.KVEventBatch, got dumpGot, err error) {
	nc := s.cfg.Conn
	ctx, cancel := context.WithTimeout(ctx, s.cfg.DumpTimeout)
	defer cancel()
	inbox := nc.NewRespInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return nil, got, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.PublishRequest(s.cfg.Subjects.Dump(group, rank), inbox, nil); err != nil {
		return nil, got, err
	}
	var (
		parts []*messages.KVEventBatch
		seq   uint64
		// budget is how many more hashes the chunks may keep: what the
		// index would record of the rank (a forged rank's 65,536 chunks of
		// 8 MiB were all held until the last came).
		budget = s.index.RankLimit(group, rank)
	)
	for {
		msg, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			return nil, got, fmt.Errorf("dump of %s/%d: %d of %d chunks received: %w", group, rank, got.chunks, len(parts), err)
		}
		b, err := messages.DecodeKVEventBatch(msg.Data)
		if err != nil {
			return nil, got, fmt.Errorf("malformed dump chunk: %w", err)
		}
		if s.groups.notTheRank(group, rank, b.StartedUnixMs, time.Now()) {
			continue // a second process given this rank answers too
		}
		if b.DumpChunks <= 1 {
			return b, dumpGot{chunks: 1}, nil // the whole dump in one message (ApplyDump cuts it)
		}
		if parts == nil {
			parts, seq = make([]*messages.KVEventBatch, b.DumpChunks), b.Seq
		}
		if b.DumpChunks != len(parts) || b.Seq != seq {
			return nil, got, fmt.Errorf("%w: dump chunks of %s/%d disagree (chunks %d/%d, seq %d)", messages.ErrInvalid, group, rank,
				b.DumpChunks, len(parts), b.Seq)
		}
		if parts[b.DumpChunk] == nil {
			got.cut += keepHashes(b, &budget)
			parts[b.DumpChunk] = b
			got.chunks++
		}
		if got.chunks == len(parts) {
			return mergeDump(parts), got, nil
		}
	}
}

// keepHashes cuts a dump chunk's BlockStored hashes to the budget's
// remainder, takes what it keeps off budget, and drops their token ids
// (mergeDump reads the hashes alone). It returns how many it cut.
func keepHashes(b *messages.KVEventBatch, budget *int) (cut int) {
	for i := range b.Events {
		ev := &b.Events[i]
		if ev.Type != messages.EventBlockStored {
			continue
		}
		if n := max(*budget, 0); len(ev.BlockHashes) > n {
			cut += len(ev.BlockHashes) - n
			ev.BlockHashes = slices.Clone(ev.BlockHashes[:n]) // the rest of the array goes
		}
		*budget -= len(ev.BlockHashes)
		ev.TokenIDs = nil
	}
	return cut
}

// mergeDump joins a dump's chunks into one batch: AllBlocksCleared, then
// every held block.
func mergeDump(chunks []*messages.KVEventBatch) *messages.KVEventBatch {
	out := *chunks[0]
	out.DumpChunk, out.DumpChunks = 0, 0
	stored := messages.KVEvent{Type: messages.EventBlockStored}
	for _, c := range chunks {
		for _, ev := range c.Events {
			if ev.Type == messages.EventBlockStored {
				stored.BlockHashes = append(stored.BlockHashes, ev.BlockHashes...)
				stored.Medium = ev.Medium
			}
		}
	}
	out.Events = []messages.KVEvent{{Type: messages.EventAllBlocksCleared}, stored}
	return &out
}

func dumpBlocks(b *messages.KVEventBatch) int {
	n := 0
	for _, ev := range b.Events {
		if ev.Type == messages.EventBlockStored {
			n += len(ev.BlockHashes)
		}
	}
	return n
}
