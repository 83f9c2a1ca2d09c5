package scheduler

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
)

// The request log from a replica's side: the stream, the schedulers'
// durable consumer on it and this replica's pull. A NATS server that
// restarts without its store (kvbus nats without --data-dir) comes back
// with neither, and every request would be refused as bus_unavailable
// while the replica still said it was ready. watch looks every
// logCheckEvery: a log or consumer gone is made again, and the replica is
// not ready until it consumes again.

// logCheckEvery is how often a replica checks that the request log and its
// consumer exist.
const logCheckEvery = 2 * time.Second

// trimEvery is how often a replica trims the log's dispatched history.
const trimEvery = 5 * time.Second

// requestLog holds a replica's stream, consumer and consume context. Its
// methods are safe for concurrent use; consuming is true while a consume
// context runs on a consumer that exists.
type requestLog struct {
	js        jetstream.JetStream
	cfg       bus.StreamConfig
	ackWait   time.Duration
	onMsg     func(jetstream.Msg)
	log       *slog.Logger
	consuming *atomic.Bool
	m         *metrics // the request log gauges; nil: none
	// remade is called after the log was made again (the session bucket
	// went with it).
	remade func(ctx context.Context)

	mu      sync.Mutex
	st      jetstream.Stream
	created time.Time // st's creation: another one under its name is a log made again
	cons    jetstream.Consumer
	cc      jetstream.ConsumeContext // nil until consume
}

// ensure makes the stream and the consumer unless they exist.
func (l *requestLog) ensure(ctx context.Context) error {
	st, err := bus.EnsureRequestStream(bus.WithLogger(ctx, l.log), l.js, l.cfg)
	if err != nil {
		return err
	}
	cons, err := bus.EnsureSchedulerConsumer(ctx, st, l.ackWait, l.cfg.Replicas)
	if err != nil {
		return err
	}
	l.mu.Lock()
	l.st, l.cons, l.created = st, cons, st.CachedInfo().Created
	l.mu.Unlock()
	return nil
}

// get reads the message at seq from the log.
func (l *requestLog) get(ctx context.Context, seq uint64) (*jetstream.RawStreamMsg, error) {
	l.mu.Lock()
	st := l.st
	l.mu.Unlock()
	return st.GetMsg(ctx, seq)
}

// consume starts pulling requests from the consumer ensure found.
func (l *requestLog) consume() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	cc, err := l.cons.Consume(l.onMsg,
		jetstream.PullMaxMessages(512),
		// Pulls expire every 5 s: a replica notices a stream that was
		// recreated or a consumer it lost within that, not after 30 s.
		jetstream.PullExpiry(5*time.Second),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if !errors.Is(err, jetstream.ErrNoHeartbeat) {
				l.log.Warn("request consumer", "err", err)
			}
		}))
	if err != nil {
		return err
	}
	l.cc = cc
	l.consuming.Store(true)
	return nil
}

// watch checks the log every logCheckEvery and trims its history every
// trimEvery, until ctx ends.
func (l *requestLog) watch(ctx context.Context) {
	check := time.NewTicker(logCheckEvery)
	defer check.Stop()
	trim := time.NewTicker(trimEvery)
	defer trim.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-check.C:
			l.check(ctx)
		case <-trim.C:
			l.trim(ctx)
		}
	}
}

// check makes the log and the consumer again when the server has lost
// them, and consumes again while an earlier try failed. A server that does
// not answer is not a lost log: the connection's own reconnect handles
// that. The session bucket is made again before consuming, and the line
// saying so is logged before the first request can be answered.
func (l *requestLog) check(ctx context.Context) {
	if l.consuming.Load() {
		l.mu.Lock()
		cons := l.cons
		l.mu.Unlock()
		cctx, cancel := context.WithTimeout(ctx, logCheckEvery)
		info, err := cons.Info(cctx)
		again := false // another replica made the log again first
		if err == nil {
			again = l.observe(cctx, info)
		}
		cancel()
		switch {
		case again:
			// Its consumer has this one's name, and the session bucket was
			// made again with it: this replica consumes anew and watches
			// the new bucket (its watcher on the lost one heard nothing
			// more, and the other replica's bindings went unseen).
			l.log.Warn("the request log was made again by another scheduler replica (the NATS server lost it); consuming the new one",
				"stream", l.cfg.Subjects.RequestStream())
		case errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrStreamNotFound):
			l.log.Warn("the request log or its consumer is gone from the NATS server (a server restarted without --data-dir loses both, "+
				"with the requests not yet dispatched); making them again", "stream", l.cfg.Subjects.RequestStream(), "err", err)
		default:
			return
		}
		l.consuming.Store(false)
		l.mu.Lock()
		if l.cc != nil {
			l.cc.Stop()
			l.cc = nil
		}
		l.mu.Unlock()
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := l.ensure(rctx); err != nil {
		l.log.Warn("cannot make the request log again; retrying", "err", err)
		return
	}
	if l.remade != nil {
		l.remade(rctx)
	}
	l.log.Info("request log made again; consuming")
	if err := l.consume(); err != nil {
		l.log.Warn("cannot consume the request log made again; retrying", "err", err)
	}
}

// observe sets the request log gauges from the consumer's info and the
// stream's, and reports whether the stream is another than the one ensure
// found: made again (by another replica) since.
func (l *requestLog) observe(ctx context.Context, info *jetstream.ConsumerInfo) (again bool) {
	l.mu.Lock()
	st, created := l.st, l.created
	l.mu.Unlock()
	si, err := st.Info(ctx)
	if err != nil {
		return false
	}
	if l.m != nil {
		l.m.logPending.Set(float64(info.NumPending))
		l.m.logBytes.Set(float64(si.State.Bytes))
		l.m.logLimit.Set(float64(si.Config.MaxBytes))
	}
	return !si.Created.Equal(created)
}

// trim keeps the log's dispatched history within its bound, so that a full
// log means undispatched requests, not history.
func (l *requestLog) trim(ctx context.Context) {
	if !l.consuming.Load() {
		return
	}
	l.mu.Lock()
	st, cons := l.st, l.cons
	l.mu.Unlock()
	bound := l.cfg.HistoryBound()
	if l.cfg.HistoryBytes == 0 && st != nil {
		// The default, half the max, is of the log's own cap: the role
		// that created it may have had another --request-log-max-bytes.
		if si := st.CachedInfo(); si != nil && si.Config.MaxBytes > 0 {
			bound = si.Config.MaxBytes / 2 // as of the last Info: every trim's
		}
	}
	purged, err := bus.TrimHistory(ctx, st, cons, bound)
	switch {
	case err != nil && ctx.Err() == nil:
		l.log.Warn("cannot trim the request log's history", "err", err)
	case purged > 0:
		l.log.Info("trimmed the request log's history", "purged", purged, "history_bytes", bound)
	}
}

// stop stops consuming: it lets the requests fetched finish (drain) when
// connected, and waits for that at most 5 s.
func (l *requestLog) stop(connected bool) {
	l.consuming.Store(false)
	l.mu.Lock()
	cc := l.cc
	l.mu.Unlock()
	if cc == nil {
		return
	}
	if !connected {
		cc.Stop() // NATS is gone: nothing to drain
	} else {
		cc.Drain()
	}
	select {
	case <-cc.Closed():
	case <-time.After(5 * time.Second):
		cc.Stop()
	}
}
