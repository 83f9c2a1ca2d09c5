package bus

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Handler handles one message from the bus. M is *nats.Msg for core NATS
// subscriptions or jetstream.Msg for JetStream consumers. A returned error
// is logged and counted by middleware; the message is not retried by core
// NATS, so a handler that must not lose a message uses JetStream and decides
// itself whether to Ack or Nak.
type Handler[M any] func(ctx context.Context, msg M) error

// Middleware wraps a Handler, in the manner of Watermill's router.
type Middleware[M any] func(next Handler[M]) Handler[M]

// Chain applies middleware so that the first one listed runs outermost.
func Chain[M any](h Handler[M], mw ...Middleware[M]) Handler[M] {
	for i := len(mw) - 1; i >= 0; i-- {
		h = mw[i](h)
	}
	return h
}

type loggerKey struct{}

// WithLogger returns ctx carrying log, the role's logger: what the bus
// itself logs under ctx (Subscribe's dropped forgeries, EnsureRequestStream's
// advice) is written there, in the role's --log-format and --log-level and
// through its log sink. Without one it went to slog.Default(), which no
// role sets: Go's own text format on standard error, a plain line among a
// --log-format json role's JSON.
func WithLogger(ctx context.Context, log *slog.Logger) context.Context {
	if log == nil {
		return ctx
	}
	return context.WithValue(ctx, loggerKey{}, log)
}

// Logger returns the logger ctx carries (WithLogger), or slog.Default().
func Logger(ctx context.Context) *slog.Logger {
	if log, ok := ctx.Value(loggerKey{}).(*slog.Logger); ok {
		return log
	}
	return slog.Default()
}

// Subscribe runs h for every message on subject, with ctx as the parent of
// each call's context. The subscription ends when the caller unsubscribes or
// drains the connection.
//
// A message the server sent out of a stream (FromStream) is dropped, and
// logged once per subscription: no kvbus role publishes one onto its subjects,
// and the server sends them wherever a client asks, past its permissions.
// So is a request whose reply subject is no inbox (_INBOX…): every role
// may answer the requests it receives wherever their reply says (the
// server's allow_responses, which no deny list limits), and a worker-g0
// key sent g1's ranks pool reads answered onto kvbus.req.<model> (into the
// request log), kvbus.kv.g1.0 or kvbus.sched.plan.<id>.
func Subscribe(ctx context.Context, nc *nats.Conn, subject string, h Handler[*nats.Msg]) (*nats.Subscription, error) {
	// Whether a stream's message, or a request answered off an inbox, was
	// dropped: each is logged once per subscription (forged subjects are
	// without number).
	var echoed, offInbox atomic.Bool
	return nc.Subscribe(subject, func(m *nats.Msg) {
		if stream, ok := FromStream(m); ok {
			if echoed.CompareAndSwap(false, true) {
				Logger(ctx).WarnContext(ctx, "bus: dropped a message the server sent out of a stream onto a kvbus subject; "+
					"a key allowed that stream's API forged it: rotate that role's key (kvbus auth init --force)",
					"subject", m.Subject, "stream", stream, "reply", m.Reply)
			}
			return
		}
		if m.Reply != "" && !strings.HasPrefix(m.Reply, inboxRoot) {
			if offInbox.CompareAndSwap(false, true) {
				Logger(ctx).WarnContext(ctx, "bus: dropped a request whose answer would go onto "+m.Reply+", not a reply inbox; "+
					"a key that may publish to "+m.Subject+" sent it: rotate that role's key (kvbus auth init --force)",
					"subject", m.Subject, "reply", m.Reply)
			}
			return
		}
		_ = h(ctx, m)
	})
}

// FromStream reports whether the server sent m out of a JetStream stream,
// and which (or the reply's $JS subject): a direct get's answer or a
// republished message (a Nats-Stream header), a push consumer's delivery
// ($JS.ACK… reply, which no client may set) or its flow control and
// heartbeats (a Status header). The server sends those to any subject the
// requester names — a direct get's reply, a consumer's deliver subject, a
// stream's republish destination — without checking the requester's
// publish permissions, so a key allowed to write and read a bucket or a
// stream can have what it wrote published on any subject: a worker-g0 key,
// a value of its slot in KVBUS_RANKS onto kvbus.meta.g1.<session>.
func FromStream(m *nats.Msg) (string, bool) {
	if s := m.Header.Get(jetstream.StreamHeader); s != "" {
		return s, true
	}
	if strings.HasPrefix(m.Reply, "$JS.") {
		return m.Reply, true
	}
	if m.Header.Get("Status") != "" {
		return "status " + m.Header.Get("Status"), true
	}
	return "", false
}

// Wrap applies the standard middleware to a handler: errors logged and
// counted under name, panics recovered into errors.
func Wrap[M any](h Handler[M], log *slog.Logger, m *HandlerMetrics, name string) Handler[M] {
	return Chain(h, Logging[M](log, name), Metrics[M](m, name), Recover[M]())
}
