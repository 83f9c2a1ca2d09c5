package bus

import (
	"context"
	"log/slog"

	"github.com/nats-io/nats.go"
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

// Subscribe runs h for every message on subject, with ctx as the parent of
// each call's context. The subscription ends when the caller unsubscribes or
// drains the connection.
func Subscribe(ctx context.Context, nc *nats.Conn, subject string, h Handler[*nats.Msg]) (*nats.Subscription, error) {
	return nc.Subscribe(subject, func(m *nats.Msg) { _ = h(ctx, m) })
}

// Wrap applies the standard middleware to a handler: errors logged and
// counted under name, panics recovered into errors.
func Wrap[M any](h Handler[M], log *slog.Logger, m *HandlerMetrics, name string) Handler[M] {
	return Chain(h, Logging[M](log, name), Metrics[M](m, name), Recover[M]())
}
