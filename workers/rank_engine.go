package workers

import (
	"cmp"
	"context"
	"errors"
	"sync"
	"time"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// EngineHealth is implemented by engines that can be down (a model server
// behind OpenAIEngine). Healthy is safe for concurrent use; WatchHealth
// runs until ctx ends and calls changed after each change.
type EngineHealth interface {
	Healthy() (ok bool, why string)
	WatchHealth(ctx context.Context, changed func())
}

// engineHealth returns the driver's engine health, or nil when the
// engine cannot be down (the sim) or the rank is not the driver.
func (r *Rank) engineHealth() EngineHealth {
	if !r.IsDriver() {
		return nil
	}
	h, _ := r.cfg.Engine.(EngineHealth)
	return h
}

// chainedHash is kvbus's block hash (scheduler.HashBlocks) of one block
// chained from its parent's, as vllmevents.Translator needs it.
func chainedHash(model string) vllmevents.HashFunc {
	seed := scheduler.HashSeed(model)
	return func(parent *uint64, tokens []uint32) uint64 {
		prev := seed
		if parent != nil {
			prev = *parent
		}
		var out [1]uint64
		return scheduler.HashBlocks(out[:0], prev, tokens, len(tokens))[0]
	}
}

// engineEventsRetry is how long the rank waits before subscribing again
// after the subscriber stopped with an error.
const engineEventsRetry = time.Second

// DefaultKVEventsSilence is RankConfig.KVEventsSilence's default: vLLM
// publishes a step's events as the step ends.
const DefaultKVEventsSilence = 10 * time.Second

// engineKV is what a driver rank's engine KV events and its engine's
// restarts share. The translator (nil without --kv-events) is used under mu
// by both: the events' goroutine and the health watcher's. A restart is
// found by whichever comes first, the health watcher (the engine's new
// process start time, or its coming back after refusing connections) or the
// KV events (their sequence went back), and clears the engine's blocks once:
//
//   - a sequence that goes back after the health watcher's clear, with no
//     batch in between, is the first batch of the engine that clear was
//     for: nothing more to clear;
//   - a restart the health watcher finds after the KV events showed one
//     (their sequence went back after the old engine was last seen) was
//     cleared then, and the new engine's blocks announced since stay.
type engineKV struct {
	mu sync.Mutex
	tr *vllmevents.Translator
	// seqBack is when the engine's KV event sequence last went back
	// without a health watcher's clear before it (zero once a health
	// restart was matched to it).
	seqBack time.Time
	// healthCleared: the health watcher cleared the engine's blocks and no
	// KV event batch came since.
	healthCleared bool
	// whole: the translator heard every block the engine stored, from
	// the engine's first batch (seq 0, or vllmevents.Batch.First) on, and
	// was not reset since. Until
	// then (a rank started, or its subscriber restarted, beside an engine
	// that had cached already; a gap nothing replayed) a block whose parent
	// it never heard of is expected, not an error of the engine's stream.
	whole bool
}

// newEngineKV returns the rank's engineKV, with a translator when the rank
// follows the engine's KV events (nil and an error when it cannot).
func (r *Rank) newEngineKV() (*engineKV, error) {
	k := &engineKV{}
	if r.cfg.KVEvents == nil {
		return k, nil
	}
	tr, err := vllmevents.NewTranslator(vllmevents.TranslatorConfig{BlockSize: r.cfg.BlockSize, Hash: chainedHash(r.cfg.Model)})
	if err != nil {
		return nil, err
	}
	k.tr = tr
	return k, nil
}

// runEngine follows the driver's model server until ctx ends: its health
// (h, nil for none) and its KV events (with KVEvents).
func (r *Rank) runEngine(ctx context.Context, h EngineHealth) {
	k, err := r.newEngineKV()
	if err != nil {
		r.log.Error("engine KV events: cannot translate", "err", err)
		k = &engineKV{}
	}
	var loops sync.WaitGroup
	if hr, ok := h.(EngineRestarts); ok && r.cfg.EngineCache {
		loops.Go(func() {
			hr.WatchHealthAndRestarts(ctx, r.heartbeat, func(rs EngineRestart) { r.engineRestarted(k, rs) })
		})
	} else if h != nil {
		loops.Go(func() { h.WatchHealth(ctx, r.heartbeat) })
	}
	if r.cfg.KVEvents != nil && k.tr != nil {
		loops.Go(func() { r.runEngineEvents(ctx, k) })
	}
	loops.Wait()
}

// engineRestarted clears the engine's blocks, in the rank's KV events and
// so in the schedulers' index, when its health watcher found it restarted:
// a restarted engine's cache is empty, and placement must not count the
// old one's blocks (nor the save plans of requests the old one took). It
// runs before the heartbeat that says the engine is ready again. A restart
// the engine's KV events already showed (see engineKV) is not cleared
// again: the blocks the new engine announced since are its own.
func (r *Rank) engineRestarted(k *engineKV, rs EngineRestart) {
	k.mu.Lock()
	defer k.mu.Unlock()
	seqBack := k.seqBack
	k.seqBack = time.Time{}
	if !seqBack.IsZero() && seqBack.After(rs.LastSeen) {
		r.log.Info("engine restarted; its KV events showed it first and its blocks were cleared then", "reason", rs.Why)
		return
	}
	events := []messages.KVEvent{{Type: messages.EventAllBlocksCleared}}
	if k.tr != nil {
		events = k.tr.Reset()
	}
	r.events.publish(events)
	k.healthCleared, k.whole = true, false
	r.log.Warn("engine restarted: its KV cache is empty, so its blocks are cleared from the schedulers' index",
		"reason", rs.Why, "hint", "expected after the engine's supervisor restarted it; a restart loop shows in the engine's own logs")
}

// engineGap handles a gap in the engine's KV events (vllmevents'
// Config.OnGap): lost batches, or a sequence that went back (a new
// publisher process). Either clears the engine's blocks, but for the first
// batch of an engine whose restart the health watcher cleared already.
func (r *Rank) engineGap(k *engineKV, from, to uint64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	switch {
	case to < from && k.healthCleared:
		r.log.Info("engine KV events: the engine's sequence went back: the restart its health showed, whose blocks were cleared then",
			"from", from, "to", to)
		return
	case to < from:
		k.seqBack = time.Now()
		r.log.Warn("engine KV events: the engine's sequence went back (it restarted): its blocks are cleared", "from", from, "to", to)
	default:
		r.log.Warn("engine KV events lost and not replayed: the engine's blocks are cleared until it stores them again",
			"from_seq", from, "to_seq", to, "hint", "give --kv-events-replay the engine's replay endpoint to recover lost batches")
	}
	r.events.publish(k.tr.Reset())
	k.whole = false
}

// engineBatch translates one batch of the engine's KV events and publishes
// the rank's; it returns the translation's error (blocks skipped), and
// whether the translator heard the engine's every block before this batch.
func (r *Rank) engineBatch(k *engineKV, seq uint64, b *vllmevents.Batch) (whole bool, err error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.healthCleared = false
	if !r.engineHeard.Swap(true) {
		r.log.Info("engine KV events: the first batch was heard", "seq", seq)
	}
	if seq == 0 || b.First {
		// The engine's first batch (numbered 0 by vLLM, 1 by llm-d's
		// simulator): nothing came before it.
		k.whole = true
	}
	evs, err := k.tr.Translate(b)
	r.events.publish(evs)
	return k.whole, err
}

// runEngineEvents turns the engine's KV events into the rank's, until ctx
// ends: the group's blocks in the scheduler's index are the engine's. A
// gap the engine cannot replay, or an engine restart, clears the rank's
// blocks (the scheduler's index follows); blocks of another size than
// kvbus's are reported once, with what to do.
func (r *Rank) runEngineEvents(ctx context.Context, k *engineKV) {
	cfg := *r.cfg.KVEvents
	cfg.Logger = r.log.With("kv_events", cfg.Endpoint)
	cfg.OnGap = func(from, to uint64) { r.engineGap(k, from, to) }
	sub, err := vllmevents.New(cfg)
	if err != nil {
		r.log.Error("engine KV events: bad configuration", "err", err)
		return
	}
	reported := map[error]bool{}
	joined := false // a block of an unknown parent was said to be expected
	handle := func(seq uint64, b *vllmevents.Batch) error {
		whole, err := r.engineBatch(k, seq, b)
		for _, kind := range []error{vllmevents.ErrBlockSize, vllmevents.ErrUnknownParent, vllmevents.ErrMalformed} {
			if !errors.Is(err, kind) {
				continue
			}
			if kind == vllmevents.ErrUnknownParent && !whole {
				// The engine cached the parent before this rank heard its
				// events (a worker restarted beside a running engine): not
				// an error. Such a turn's blocks are not indexed; the save
				// plans of its dispatches still place its next turns.
				if !joined {
					joined = true
					r.log.Info("engine KV events: blocks chained from blocks the engine cached before this rank heard its events are not indexed",
						"err", err, "hint", "expected after a worker restart beside a running engine, or a gap nothing replayed; reported once")
				}
				continue
			}
			if !reported[kind] {
				reported[kind] = true
				hint := "reported once; the engine's KV event stream may be incomplete"
				if kind == vllmevents.ErrBlockSize {
					hint = "set kvbus's --block-size to the engine's --block-size: until then the engine's blocks are not indexed"
				}
				r.log.Error("engine KV events: blocks skipped", "err", err, "hint", hint)
			}
		}
		return nil
	}
	r.log.Info("engine KV events: subscribing", "endpoint", cfg.Endpoint, "bind", cfg.Bind, "topic", cfg.Topic, "replay", cfg.ReplayEndpoint)
	var watch sync.WaitGroup
	defer watch.Wait()
	watch.Go(func() { r.watchEngineSilence(ctx, cfg) })
	for {
		err := sub.Run(ctx, handle)
		if ctx.Err() != nil {
			return
		}
		r.log.Error("engine KV events: subscriber stopped; subscribing again", "err", err, "retry_in", engineEventsRetry)
		k.mu.Lock()
		r.events.publish(k.tr.Reset())
		k.healthCleared, k.whole = false, false
		k.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-time.After(engineEventsRetry):
		}
	}
}

// watchEngineSilence warns, once, when the engine answered a prompt that
// stored new blocks KVEventsSilence ago and no batch of its KV events was
// heard since the rank started: kvbus is deaf to the engine's cache (its
// --kv-events misses the engine's endpoint or topic, or the engine
// publishes none), placement follows only sessions and save plans, and
// nothing else would say so.
func (r *Rank) watchEngineSilence(ctx context.Context, cfg vllmevents.Config) {
	silence := cmp.Or(r.cfg.KVEventsSilence, DefaultKVEventsSilence)
	tick := time.NewTicker(max(silence/4, time.Millisecond))
	defer tick.Stop()
	for !r.engineHeard.Load() {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		first := r.blockAnswered.Load()
		if first == 0 || r.engineHeard.Load() {
			continue
		}
		if since := time.Since(time.Unix(0, first)); since >= silence {
			r.log.Warn("engine KV events: none heard, though the engine stored new blocks "+since.Round(time.Second).String()+" ago: placement cannot see its cache",
				"endpoint", cfg.Endpoint, "bind", cfg.Bind, "topic", cfg.Topic, "hint", silenceHint(cfg))
			return
		}
	}
}

// silenceHint says how the engine must publish for this subscription to
// hear it. The two wirings need opposite things of the engine: with
// --kv-events the engine binds and kvbus connects to it; with
// --kv-events-bind kvbus binds and the engine must connect to that address
// (vLLM connects to an endpoint without a wildcard, llm-d's simulator always
// connects to its --zmq-endpoint).
func silenceHint(cfg vllmevents.Config) string {
	const topic = "--kv-events-topic must be a prefix of the engine's topic (empty: every topic)"
	if cfg.Bind {
		return "--kv-events-bind binds " + cfg.Endpoint + ": the engine must connect to it, at an address of this worker it can reach: " +
			`vLLM with --enable-prefix-caching and --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://WORKER_HOST:PORT"}' (no wildcard: vLLM binds an endpoint with "*"), ` +
			"llm-d's inference simulator with --enable-kvcache --zmq-endpoint tcp://WORKER_HOST:PORT and POD_IP set; " + topic
	}
	return `start vLLM with --enable-prefix-caching and --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}'; kvbus's --kv-events must reach that endpoint and ` + topic
}

// heldBlocks is what the rank's heartbeat reports it holds: the engine's
// blocks as its KV events say, or the store's.
func (r *Rank) heldBlocks() (used, capacity int64) {
	if r.cfg.EngineCache {
		return int64(r.events.heldBlocks()), 0
	}
	u, c, _ := r.store.Usage()
	blk := int64(r.blockBytes(r.cfg.BlockSize))
	return u / blk, c / blk
}
