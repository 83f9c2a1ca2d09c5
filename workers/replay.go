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

// Streams resumed after a loss on the bus. Outputs go to the frontend over
// core NATS: when a NATS server of a cluster stops, or the frontend
// reconnects, the outputs in flight through it are lost, and a stream
// already under way at the client cannot be asked again from the start
// (the client has its first chunks). So the driver rank keeps the encoded
// outputs of every streamed request, while it runs and for
// RankConfig.ReplayAge after, within RankConfig.ReplayBytes, and publishes
// them again from an index when the frontend asks (messages.Resend on
// kvbus.ctl.resend); the frontend drops what it already has, and the
// client's stream goes on where it was cut.

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

// replayEntryBytes is what one kept request costs beyond its outputs'
// bytes (the entry, its map slot): counted against the budget.
const replayEntryBytes = 160

// streamReplay is a driver's memory of the outputs of its streamed
// requests. Its methods are safe for concurrent use; one lock covers both
// the memory and the publishing, so that outputs sent again and outputs
// sent for the first time reach the bus in index order.
type streamReplay struct {
	mu     sync.Mutex
	byID   map[string]*replayed
	ended  []*replayed // ended requests, oldest first
	bytes  int64
	budget int64
	age    time.Duration
}

// replayed is one request's kept outputs.
type replayed struct {
	id, session, subject string
	attempt              int
	// outputs holds the encoded outputs by index, each after its length as
	// a uvarint: one allocation the GC does not scan, where a slice per
	// output made a heap object each to mark for as long as it was kept.
	outputs []byte
	count   int // outputs kept
	bytes   int64
	endedAt time.Time
	done    bool // the request's last output was published
	cut     bool // over the budget: its outputs were dropped
}

func newStreamReplay(budget int64, age time.Duration) *streamReplay {
	return &streamReplay{byID: map[string]*replayed{}, budget: budget, age: age}
}

// begin starts keeping the outputs of a request's attempt, published on
// subject; it replaces what an earlier attempt kept.
func (m *streamReplay) begin(meta *messages.ReqMeta, subject string) *replayed {
	e := &replayed{id: meta.ReqID, session: meta.SessionID, subject: subject, attempt: meta.Attempt}
	m.mu.Lock()
	if old := m.byID[e.id]; old != nil {
		m.drop(old)
	}
	m.byID[e.id] = e
	m.mu.Unlock()
	return e
}

// publish keeps data as e's next output and sends it with send, under the
// lock.
func (m *streamReplay) publish(e *replayed, data []byte, send func([]byte)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !e.cut {
		before := int64(cap(e.outputs))
		if e.count == 0 {
			before = -replayEntryBytes
		}
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

// fit frees ended requests' outputs, oldest first, until the memory is
// within its budget; if the running ones alone exceed it, e's are dropped.
func (m *streamReplay) fit(e *replayed) {
	for m.bytes > m.budget && len(m.ended) > 0 {
		m.forget(m.ended[0])
		m.ended[0] = nil
		m.ended = m.ended[1:]
	}
	if m.bytes > m.budget {
		m.drop(e)
		e.cut = true
	}
}

// end marks e's request ended: its outputs are kept for the memory's age.
func (m *streamReplay) end(e *replayed, now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e.done, e.endedAt = true, now
	m.ended = append(m.ended, e)
	m.expireLocked(now)
}

// expire forgets the ended requests older than the memory's age.
func (m *streamReplay) expire(now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.expireLocked(now)
}

func (m *streamReplay) expireLocked(now time.Time) {
	for len(m.ended) > 0 && now.Sub(m.ended[0].endedAt) > m.age {
		m.forget(m.ended[0])
		m.ended[0] = nil
		m.ended = m.ended[1:]
	}
	if len(m.ended) == 0 {
		m.ended = nil // let the backing array go
	}
}

// forget removes an ended request from the memory.
func (m *streamReplay) forget(e *replayed) {
	m.drop(e)
	if m.byID[e.id] == e {
		delete(m.byID, e.id)
	}
}

// drop frees e's outputs.
func (m *streamReplay) drop(e *replayed) {
	m.bytes -= e.bytes
	e.outputs, e.count, e.bytes = nil, 0, 0
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
func (m *streamReplay) resend(id string, attempt, from int, send func(subject string, data []byte)) (res resent, known bool, err error) {
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
	b := e.outputs
	for i := 0; i < e.count; i++ {
		n, w := binary.Uvarint(b)
		data := b[w : w+int(n)]
		b = b[w+int(n):]
		if i >= from {
			send(e.subject, data)
			res.n++
		}
	}
	return res, true, nil
}

// onResend answers a frontend that lost outputs of a stream under way: the
// driver that holds the request publishes them again from the index asked
// for, then replies; any other rank says nothing.
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
		return nil
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

// subscribeResend subscribes the driver to Resends. A server whose
// permissions predate them (a nats-auth.conf written by an older `kvbus
// auth init`) refuses the subject: the rank runs on without, and says how
// to mend it (nil subscription).
func (r *Rank) subscribeResend(ctx context.Context, nc *nats.Conn) (*nats.Subscription, error) {
	subject := r.cfg.Subjects.Resend()
	check := bus.RoleCheck{Role: "worker", Group: r.cfg.Group, Subscribe: []string{subject}}
	if err := bus.CheckPermissions(ctx, nc, check); err != nil {
		r.log.Warn("the NATS server does not let this worker hear "+subject+": streams that lose outputs on the bus end with output_lost. "+
			"The server's nats-auth.conf predates it: run `kvbus auth init DIR` again (it keeps the keys) and reload NATS", "err", err)
		return nil, nil
	}
	sub, err := bus.Subscribe(context.Background(), nc, subject, bus.Wrap(r.onResend, r.log, r.cfg.HandlerMetrics, "worker_resend"))
	if err != nil {
		return nil, fmt.Errorf("workers: subscribe %s: %w", subject, err)
	}
	return sub, nil
}
