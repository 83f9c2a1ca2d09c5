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
// handlerErrorEvery with the count held back since (a burst that ends
// within the interval is told at its end, with its last error): messages
// that do not decode (malformed, with what to do) apart from other
// failures, so that a flood of the one hides none of the other.
func Logging[M any](log *slog.Logger, name string) Middleware[M] {
	return logging[M](log, name, handlerErrorEvery, time.Now)
}

// logging is Logging at most once every on the clock now.
func logging[M any](log *slog.Logger, name string, every time.Duration, now func() time.Time) Middleware[M] {
	malformed := newFailureLog(log, name, "dropped a bus message its handler could not decode", malformedHint, every, now)
	failed := newFailureLog(log, name, "message handler failed", "", every, now)
	return func(next Handler[M]) Handler[M] {
		return func(ctx context.Context, msg M) error {
			err := next(ctx, msg)
			if err == nil {
				return nil
			}
			if errors.Is(err, messages.ErrMalformed) || errors.Is(err, messages.ErrInvalid) || errors.Is(err, messages.ErrTooLarge) {
				malformed.failed(ctx, subjectOf(msg), err)
			} else {
				failed.failed(ctx, subjectOf(msg), err)
			}
			return err
		}
	}
}

// failureLog logs one kind of a handler's failures through a
// logevery.Limiter.
type failureLog struct {
	log           *slog.Logger
	handler, text string
	hint          string // "": none
	lim           logevery.Limiter[failure]
}

// failure is one failed message: its subject and the handler's error.
type failure struct {
	subject string
	err     error
}

func newFailureLog(log *slog.Logger, handler, text, hint string, every time.Duration, now func() time.Time) *failureLog {
	f := &failureLog{log: log, handler: handler, text: text, hint: hint}
	f.lim = logevery.Limiter[failure]{Every: every, Now: now, Held: f.held}
	return f
}

func (f *failureLog) failed(ctx context.Context, subject string, err error) {
	if ok, held, over := f.lim.Allow(failure{subject, err}); ok {
		f.line(ctx, subject, err, held, over)
	}
}

// held tells of failures held back that no later line carried: the last of
// them, and how many more.
func (f *failureLog) held(last failure, n int, over time.Duration) {
	f.line(context.Background(), last.subject, last.err, n-1, over)
}

func (f *failureLog) line(ctx context.Context, subject string, err error, held int, over time.Duration) {
	args := []any{"handler", f.handler, "subject", subject, "err", err}
	if held > 0 {
		args = append(args, "more", held, "in_last", over.Round(time.Second))
	}
	if f.hint != "" {
		args = append(args, "hint", f.hint)
	}
	f.log.WarnContext(ctx, f.text, args...)
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
