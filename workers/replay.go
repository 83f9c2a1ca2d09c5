package workers

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// Outputs resumed after a loss on the bus. Outputs go to the frontend over
// core NATS: when a NATS server of a cluster stops, or a role reconnects,
// the outputs in flight through it are lost. Two cases:
//
//   - The frontend's side: a stream already under way at the client cannot
//     be asked again from the start (the client has its first chunks). So
//     the driver rank keeps the encoded outputs of every streamed request,
//     while it runs and for RankConfig.ReplayAge after, within
//     RankConfig.ReplayBytes, and publishes them again from an index when
//     the frontend asks (messages.Resend on kvbus.ctl.resend.<group>, where
//     a scheduler sent it); the frontend drops what it already has, and the
//     client's stream goes on where it was cut.
//   - The driver's side: outputs the driver wrote to its connection just
//     before its server stopped never left that server, and the frontend,
//     whose own connection stayed up, cannot tell an answer lost from one
//     still being computed: it waited for --request-timeout. So the driver
//     also keeps every answer, streamed or not, until its server confirmed
//     it (a flush's PONG, every deliveryCheckEvery) plus deliveryMargin,
//     and for RankConfig.ReplayAge after its end, for the frontend's ask,
//     and after a reconnect publishes again every output published since
//     the last confirmation less that margin (watchDelivery). The frontend
//     drops the duplicates (an index it has, or a request it answered).

// Defaults of RankConfig.ReplayBytes and ReplayAge. The age is above the
// frontend's wait before it judges a request silent after a reconnect
// (3 s) plus its ask (2 s) and a reconnect to another server of a cluster;
// longer costs the GC (a 30 s memory cost 3.5% of streaming c=64 on a
// 2-core host, 10 s nothing measurable). The bytes hold ~400k outputs of a
// token each.
const (
	defaultReplayBytes = 64 << 20
	defaultReplayAge   = 10 * time.Second
)

// deliveryCheckEvery is how often a driver asks its server to confirm what
// it published (a PING, answered once the server read everything before
// it), and looks for a reconnect.
const deliveryCheckEvery = 250 * time.Millisecond

// deliveryMargin is how long before its last confirmation an output may
// still have been lost: a server that read it may stop before it passed it
// on (to a route, or to the frontend's socket), which takes it
// milliseconds.
const deliveryMargin = time.Second

// replayEntryBytes is what one kept request costs beyond its outputs'
// bytes (the entry, its map slot): counted against the budget.
const replayEntryBytes = 160

// outputReplay is a driver's memory of the outputs it published. Its
// methods are safe for concurrent use; one lock covers both the memory and
// the publishing, so that outputs sent again and outputs sent for the first
// time reach the bus in index order.
type outputReplay struct {
	mu       sync.Mutex
	base     time.Time // outputs' times are milliseconds since
	byID     map[string]*replayed
	ended    []*replayed // ended streams, oldest first
	answered []*replayed // ended answers not streamed, oldest first
	bytes    int64
	budget   int64
	age      time.Duration
	// confirmed: every output published before it reached the server.
	confirmed time.Time
	clock     func() time.Time // when an output is published
}

// replayed is one request's kept outputs.
type replayed struct {
	id, session, subject string
	attempt              int
	stream               bool
	// outputs holds the encoded outputs by index, each after the time it
	// was published (milliseconds since the memory's base) and its length,
	// as uvarints: one allocation the GC does not scan, where a slice per
	// output made a heap object each to mark for as long as it was kept.
	outputs []byte
	count   int   // outputs kept
	lastMs  int64 // when the last one was published
	bytes   int64
	endedAt time.Time
	done    bool // the request's last output was published
	cut     bool // over the budget: its outputs were dropped
	// [resentLo, resentHi) holds the indexes sent again since resentAt,
	// the first resend of the current resendWindow (see resend).
	resentLo, resentHi int
	resentAt           time.Time
}

// resendWindow is how long outputs sent again are not sent again for
// another ask: below the frontend's wait before it checks that they came
// and asks once more (2 s), so its asks are all served.
const resendWindow = time.Second

func newOutputReplay(budget int64, age time.Duration) *outputReplay {
	return &outputReplay{byID: map[string]*replayed{}, budget: budget, age: age, base: time.Now(), clock: time.Now}
}

// begin starts keeping the outputs of a request's attempt, published on
// subject; it replaces what an earlier attempt kept. The driver starts
// each attempt on a goroutine of its own, so a superseded attempt may get
// here after the newer one: its entry is kept apart, never asked for.
func (m *outputReplay) begin(meta *messages.ReqMeta, subject string) *replayed {
	e := &replayed{id: meta.ReqID, session: meta.SessionID, subject: subject, attempt: meta.Attempt, stream: meta.Stream}
	m.mu.Lock()
	defer m.mu.Unlock()
	if old := m.byID[e.id]; old != nil {
		if old.attempt > e.attempt {
			return e
		}
		m.drop(old)
	}
	m.byID[e.id] = e
	return e
}

// publish keeps data as e's next output and sends it with send, under the
// lock.
func (m *outputReplay) publish(e *replayed, data []byte, send func([]byte)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !e.cut {
		before := int64(cap(e.outputs))
		if e.count == 0 {
			before = -replayEntryBytes
		}
		e.lastMs = m.clock().Sub(m.base).Milliseconds()
		e.outputs = binary.AppendUvarint(e.outputs, uint64(e.lastMs))
		e.outputs = binary.AppendUvarint(e.outputs, uint64(len(data)))
		e.outputs = append(e.outputs, data...)
		e.count++
		n := int64(cap(e.outputs)) - before
		e.bytes += n
		m.bytes += n
		m.fit(e)
	}
	send(data)
}

// fit frees ended requests' outputs, answers first, oldest first, until
// the memory is within its budget; if the running ones alone exceed it,
// e's are dropped.
func (m *outputReplay) fit(e *replayed) {
	for m.bytes > m.budget && len(m.answered) > 0 {
		m.answered = m.forgetFirst(m.answered)
	}
	for m.bytes > m.budget && len(m.ended) > 0 {
		m.ended = m.forgetFirst(m.ended)
	}
	if m.bytes > m.budget {
		m.drop(e)
		e.cut = true
	}
}

// end marks e's request ended: its outputs are kept for the memory's age,
// and until its server confirmed them.
func (m *outputReplay) end(e *replayed, now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e.done, e.endedAt = true, now
	if e.stream {
		m.ended = append(m.ended, e)
	} else {
		m.answered = append(m.answered, e)
	}
	m.expireLocked(now)
}

// confirm records that every output published before at reached the
// server, and forgets what needs keeping no longer.
func (m *outputReplay) confirm(at time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if at.After(m.confirmed) {
		m.confirmed = at
	}
	m.expireLocked(time.Now())
}

// expire forgets the ended requests that need keeping no longer.
func (m *outputReplay) expire(now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.expireLocked(now)
}

// expireLocked forgets ended requests, streamed or not, that ended before
// the last confirmation less deliveryMargin and are older than the
// memory's age. A confirmation says the server read an answer, not that
// the frontend heard it: across a NATS restart a driver's connection comes
// back before the frontend's subscription, and the answer it published
// then is dropped; the frontend asks for it 3 s later, and an answer
// forgotten at the confirmation was computed again (5 s more).
func (m *outputReplay) expireLocked(now time.Time) {
	settled := m.confirmed.Add(-deliveryMargin)
	for len(m.answered) > 0 && m.answered[0].endedAt.Before(settled) && now.Sub(m.answered[0].endedAt) > m.age {
		m.answered = m.forgetFirst(m.answered)
	}
	for len(m.ended) > 0 && m.ended[0].endedAt.Before(settled) && now.Sub(m.ended[0].endedAt) > m.age {
		m.ended = m.forgetFirst(m.ended)
	}
}

// forgetFirst removes the first request of an ended list from the memory
// and returns the rest.
func (m *outputReplay) forgetFirst(list []*replayed) []*replayed {
	e := list[0]
	m.drop(e)
	if m.byID[e.id] == e {
		delete(m.byID, e.id)
	}
	list[0] = nil
	if len(list) == 1 {
		return nil // let the backing array go
	}
	return list[1:]
}

// drop frees e's outputs.
func (m *outputReplay) drop(e *replayed) {
	m.bytes -= e.bytes
	e.outputs, e.count, e.bytes = nil, 0, 0
}

// each calls f with every kept output of e, its index and when it was
// published (milliseconds since the memory's base), in order.
func (e *replayed) each(f func(i int, ms int64, data []byte)) {
	b := e.outputs
	for i := 0; i < e.count; i++ {
		ms, w := binary.Uvarint(b)
		b = b[w:]
		n, w := binary.Uvarint(b)
		f(i, int64(ms), b[w:w+int(n)])
		b = b[w+int(n):]
	}
}

// errReplayCut is why outputs cannot be sent again.
var errReplayCut = errors.New("the outputs of this stream are no longer kept (over the driver's --stream-replay budget)")

// resent is what resend did for a known request.
type resent struct {
	n       int  // outputs sent again
	done    bool // the request's last output was among those kept
	session string
}

// resend sends the outputs of the request's attempt from index from on,
// with send, under the lock. known is false when the memory has no such
// request or attempt (another driver's, or forgotten); err says why a
// known one's outputs cannot be sent.
func (m *outputReplay) resend(id string, attempt, from int, send func(subject string, data []byte)) (res resent, known bool, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.byID[id]
	if e == nil || e.attempt != attempt {
		return resent{}, false, nil
	}
	res = resent{done: e.done, session: e.session}
	if e.cut {
		return res, true, errReplayCut
	}
	// Within a window each output is sent again once, whatever is asked:
	// an ask is a few bytes, and the outputs sent for it a whole stream.
	// Asks repeated by a forged or broken frontend made the driver publish
	// the stream again each time. Those already sent again in the window
	// count as sent for this ask: they are on their way.
	// (A frontend asks from the first output it lacks, so the indexes
	// between two of its asks in a window, counted as sent, it has.)
	now := m.clock()
	from = max(from, 0)
	if now.Sub(e.resentAt) >= resendWindow {
		e.resentLo, e.resentHi, e.resentAt = from, from, now
	}
	e.each(func(i int, _ int64, data []byte) {
		if i >= from {
			if i < e.resentLo || i >= e.resentHi {
				send(e.subject, data)
			}
			res.n++
		}
	})
	if from < e.count {
		e.resentLo, e.resentHi = min(e.resentLo, from), max(e.resentHi, e.count)
	}
	return res, true, nil
}

// unconfirmed sends again, with send, every kept output published since
// the last confirmation less deliveryMargin, under the lock; it returns
// how many outputs of how many requests.
func (m *outputReplay) unconfirmed(send func(subject string, data []byte)) (outputs, requests int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	since := m.confirmed.Add(-deliveryMargin).Sub(m.base).Milliseconds()
	for _, e := range m.byID {
		if e.cut || e.count == 0 || e.lastMs < since {
			continue
		}
		requests++
		e.each(func(_ int, ms int64, data []byte) {
			if ms >= since {
				send(e.subject, data)
				outputs++
			}
		})
	}
	return outputs, requests
}

// watchDelivery runs on a driver that keeps its outputs, until ctx ends:
// every deliveryCheckEvery it has its server confirm what it published,
// and after a reconnect it publishes again what the server may have lost
// (see the top of this file).
func (r *Rank) watchDelivery(ctx context.Context) {
	nc := r.cfg.Conn
	seen := nc.Stats().Reconnects
	tick := time.NewTicker(deliveryCheckEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if n := nc.Stats().Reconnects; n != seen {
			seen = n
			r.republish()
		}
		if !nc.IsConnected() {
			// Only a flush after the reconnect could be answered, and it
			// confirms nothing (below); it held a rank stopping with its
			// server gone for the flush's timeout.
			continue
		}
		at := time.Now()
		// A reconnect during the flush confirms nothing: what was
		// written before at may have gone down with the old connection.
		if err := nc.FlushTimeout(4 * deliveryCheckEvery); err == nil && nc.Stats().Reconnects == seen {
			r.replay.confirm(at)
		}
	}
}

// republish publishes again the outputs its server may have lost when the
// driver's connection broke.
func (r *Rank) republish() {
	var perr error
	outputs, requests := r.replay.unconfirmed(func(subject string, data []byte) {
		if e := r.cfg.Conn.Publish(subject, data); e != nil && perr == nil {
			perr = e
		}
	})
	if perr != nil {
		r.log.Error("reconnected to NATS: publishing again the outputs sent just before failed; their requests wait for their deadline", "requests", requests, "err", perr)
		return
	}
	r.series.republished.Add(float64(outputs))
	r.log.Info("reconnected to NATS: outputs published just before it sent again, in case the server lost them",
		"outputs", outputs, "requests", requests)
}

// onResend answers a frontend that lost outputs of a stream under way, or
// heard nothing of a request after a NATS reconnect: the driver that holds
// the request publishes its outputs again from the index asked for (none
// yet, if it has not started), then replies; any other rank says nothing.
func (r *Rank) onResend(_ context.Context, m *nats.Msg) error {
	rs, err := messages.DecodeResend(m.Data)
	if err != nil {
		return err
	}
	var perr error
	res, known, err := r.replay.resend(rs.ReqID, rs.Attempt, rs.FromIndex, func(subject string, data []byte) {
		if e := r.cfg.Conn.Publish(subject, data); e != nil && perr == nil {
			perr = e
		}
	})
	if !known {
		// Not driven yet (its ReqMeta came; it waits for its load): it
		// runs, and nothing was published to send again.
		r.mu.Lock()
		rr := r.active[rs.ReqID]
		r.mu.Unlock()
		if rr == nil || rr.meta.Attempt != rs.Attempt {
			return nil
		}
		res.session = rr.meta.SessionID
	}
	reply := &messages.ResendReply{Resent: res.n, Done: res.done}
	switch {
	case err != nil:
		reply.Error = err.Error()
		r.log.Warn("outputs lost on the bus cannot be sent again", "req_id", rs.ReqID, "session_id", res.session, "from_index", rs.FromIndex, "err", err)
	case perr != nil:
		reply.Error = "publish: " + perr.Error()
		r.log.Error("outputs lost on the bus: sending them again failed", "req_id", rs.ReqID, "session_id", res.session, "err", perr)
	default:
		r.series.resent.Add(float64(res.n))
		r.log.Info("outputs lost on the bus sent again", "req_id", rs.ReqID, "session_id", res.session, "from_index", rs.FromIndex, "outputs", res.n, "done", res.done)
	}
	data, err := messages.Marshal(reply)
	if err != nil {
		return err
	}
	return m.Respond(data)
}

// subscribeResend subscribes the driver to its group's Resends, and has
// its heartbeats say so: the schedulers send frontends there only then (a
// driver before 2026-12-07 answers on kvbus.ctl.resend itself). A server
// whose permissions predate the subject (a nats-auth.conf written by an
// older `kvbus auth init`) refuses it: the rank runs on without, and says
// how to mend it (nil subscription).
func (r *Rank) subscribeResend(ctx context.Context, nc *nats.Conn) (*nats.Subscription, error) {
	subject := r.cfg.Subjects.ResendGroup(r.cfg.Group)
	check := bus.RoleCheck{Role: "worker", Group: r.cfg.Group, Subscribe: []string{subject}}
	if err := bus.CheckPermissions(ctx, nc, check); err != nil {
		r.log.Warn("the NATS server does not let this worker hear "+subject+": streams that lose outputs on the bus end with output_lost. "+
			"The server's nats-auth.conf predates it: run `kvbus auth init DIR` again (it keeps the keys) and reload NATS", "err", err)
		return nil, nil
	}
	sub, err := bus.Subscribe(bus.WithLogger(context.Background(), r.log), nc, subject, bus.Wrap(r.onResend, r.log, r.cfg.HandlerMetrics, "worker_resend"))
	if err != nil {
		return nil, fmt.Errorf("workers: subscribe %s: %w", subject, err)
	}
	r.resendByGroup.Store(true)
	return sub, nil
}
