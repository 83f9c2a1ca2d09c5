package frontend

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"log/slog"
	"time"

	"github.com/kvbus/kvbus/internal/logevery"
)

// acceptErrorEvery is how often net/http's accept errors are logged.
const acceptErrorEvery = 10 * time.Second

// httpErrorLog is the HTTP server's error log: its lines go to h at warn,
// but "http: Accept error" (out of file descriptors, say) at most once per
// acceptErrorEvery with the count of those left out (those of a burst that
// ended within the interval at its end). net/http logs one per failed
// accept, retrying within milliseconds whenever one succeeds in between:
// ~90 lines a second at the file descriptor limit.
func httpErrorLog(h slog.Handler) *log.Logger {
	return log.New(newErrorLogWriter(h, acceptErrorEvery, time.Now), "", 0)
}

func newErrorLogWriter(h slog.Handler, every time.Duration, now func() time.Time) *errorLogWriter {
	w := &errorLogWriter{h: h, now: now}
	w.accept = logevery.Limiter[string]{Every: every, Now: now, Held: w.acceptHeld}
	return w
}

type errorLogWriter struct {
	h      slog.Handler
	now    func() time.Time
	accept logevery.Limiter[string] // of the accept errors
}

func (w *errorLogWriter) Write(p []byte) (int, error) {
	msg := string(bytes.TrimRight(p, "\n"))
	if bytes.HasPrefix(p, []byte("http: Accept error")) {
		ok, held, over := w.accept.Allow(msg)
		if !ok {
			return len(p), nil
		}
		msg = acceptLine(msg, held, over)
	}
	return len(p), w.warn(msg)
}

// acceptHeld tells of accept errors held back that no later line carried:
// the last of them, and how many more.
func (w *errorLogWriter) acceptHeld(last string, held int, over time.Duration) {
	_ = w.warn(acceptLine(last, held-1, over))
}

func acceptLine(msg string, held int, over time.Duration) string {
	if held > 0 {
		msg += fmt.Sprintf(" (and %d more in the last %s: the process may be out of file descriptors; raise its limit, ulimit -n)", held, over.Round(time.Second))
	}
	return msg
}

func (w *errorLogWriter) warn(msg string) error {
	if !w.h.Enabled(context.Background(), slog.LevelWarn) {
		return nil
	}
	return w.h.Handle(context.Background(), slog.NewRecord(w.now(), slog.LevelWarn, msg, 0))
}
