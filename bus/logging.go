package bus

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/kvbus/kvbus/internal/logevery"
	"github.com/kvbus/kvbus/messages"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// handlerErrorEvery is how often a handler's failures are logged.
const handlerErrorEvery = 10 * time.Second

// malformedHint is what to do about messages a handler cannot decode.
const malformedHint = "something publishes on this subject what kvbus cannot decode (a stray client, a tool, " +
	"a kvbus of another wire version): find it with kvbus tap or the NATS server's connection list (its monitoring port's /connz?subs=1) and stop it; " +
	"with kvbus auth keys, rotate the key it uses (kvbus auth init --force). Each is counted in kvbus_bus_messages_total{outcome=\"malformed\"}"

// Logging logs a handler's errors at warn level with the handler's name and
// the message's subject. Handlers log what they do themselves, with req_id
// and session_id. Whoever may publish on a subject can make a handler fail
// as often as it likes, so the first failure is logged, then at most one a
// handlerErrorEvery with the count held back since: messages that do not
// decode (malformed, with what to do) apart from other failures, so that a
// flood of the one hides none of the other.
func Logging[M any](log *slog.Logger, name string) Middleware[M] {
	return logging[M](log, name, time.Now)
}

// logging is Logging on the clock now.
func logging[M any](log *slog.Logger, name string, now func() time.Time) Middleware[M] {
	malformed := &logevery.Limiter{Every: handlerErrorEvery, Now: now}
	failed := &logevery.Limiter{Every: handlerErrorEvery, Now: now}
	return func(next Handler[M]) Handler[M] {
		return func(ctx context.Context, msg M) error {
			err := next(ctx, msg)
			if err == nil {
				return nil
			}
			bad := errors.Is(err, messages.ErrMalformed) || errors.Is(err, messages.ErrInvalid) || errors.Is(err, messages.ErrTooLarge)
			lim, text := failed, "message handler failed"
			if bad {
				lim, text = malformed, "dropped a bus message its handler could not decode"
			}
			ok, held, over := lim.Allow()
			if !ok {
				return err
			}
			args := []any{"handler", name, "subject", subjectOf(msg), "err", err}
			if held > 0 {
				args = append(args, "more", held, "in_last", over.Round(time.Second))
			}
			if bad {
				args = append(args, "hint", malformedHint)
			}
			log.WarnContext(ctx, text, args...)
			return err
		}
	}
}

// subjectOf is the subject msg came on, "" for a type it does not know.
func subjectOf(msg any) string {
	switch m := msg.(type) {
	case *nats.Msg:
		return m.Subject
	case jetstream.Msg:
		return m.Subject()
	}
	return ""
}
