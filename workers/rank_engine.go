package workers

import (
	"context"
	"errors"
	"time"

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

// runEngineEvents turns the engine's KV events into the rank's, until ctx
// ends: the group's blocks in the scheduler's index are the engine's. A
// gap the engine cannot replay, or an engine restart, clears the rank's
// blocks (the scheduler's index follows); blocks of another size than
// kvbus's are reported once, with what to do.
func (r *Rank) runEngineEvents(ctx context.Context) {
	cfg := *r.cfg.KVEvents
	tr, err := vllmevents.NewTranslator(vllmevents.TranslatorConfig{BlockSize: r.cfg.BlockSize, Hash: chainedHash(r.cfg.Model)})
	if err != nil {
		r.log.Error("engine KV events: cannot translate", "err", err)
		return
	}
	cfg.Logger = r.log.With("kv_events", cfg.Endpoint)
	cfg.OnGap = func(from, to uint64) {
		if to < from {
			r.log.Warn("engine KV events: the engine's sequence went back (it restarted): its blocks are cleared", "from", from, "to", to)
		} else {
			r.log.Warn("engine KV events lost and not replayed: the engine's blocks are cleared until it stores them again",
				"from_seq", from, "to_seq", to, "hint", "give --kv-events-replay the engine's replay endpoint to recover lost batches")
		}
		r.events.publish(tr.Reset())
	}
	sub, err := vllmevents.New(cfg)
	if err != nil {
		r.log.Error("engine KV events: bad configuration", "err", err)
		return
	}
	reported := map[error]bool{}
	handle := func(_ uint64, b *vllmevents.Batch) error {
		evs, err := tr.Translate(b)
		for _, kind := range []error{vllmevents.ErrBlockSize, vllmevents.ErrUnknownParent, vllmevents.ErrMalformed} {
			if errors.Is(err, kind) && !reported[kind] {
				reported[kind] = true
				hint := "reported once; the engine's KV event stream may be incomplete"
				if kind == vllmevents.ErrBlockSize {
					hint = "set kvbus's --block-size to the engine's --block-size: until then the engine's blocks are not indexed"
				}
				r.log.Error("engine KV events: blocks skipped", "err", err, "hint", hint)
			}
		}
		r.events.publish(evs)
		return nil
	}
	r.log.Info("engine KV events: subscribing", "endpoint", cfg.Endpoint, "bind", cfg.Bind, "topic", cfg.Topic, "replay", cfg.ReplayEndpoint)
	for {
		err := sub.Run(ctx, handle)
		if ctx.Err() != nil {
			return
		}
		r.log.Error("engine KV events: subscriber stopped; subscribing again", "err", err, "retry_in", engineEventsRetry)
		r.events.publish(tr.Reset())
		select {
		case <-ctx.Done():
			return
		case <-time.After(engineEventsRetry):
		}
	}
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
