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
// acceptErrorEvery with the count of those left out. net/http logs one per
// failed accept, retrying within milliseconds whenever one succeeds in
// between: ~90 lines a second at the file descriptor limit.
func httpErrorLog(h slog.Handler) *log.Logger {
	return log.New(newErrorLogWriter(h, time.Now), "", 0)
}

func newErrorLogWriter(h slog.Handler, now func() time.Time) *errorLogWriter {
	return &errorLogWriter{h: h, now: now, accept: logevery.Limiter{Every: acceptErrorEvery, Now: now}}
}

type errorLogWriter struct {
	h      slog.Handler
	now    func() time.Time
	accept logevery.Limiter // of the accept errors
}

func (w *errorLogWriter) Write(p []byte) (int, error) {
	msg := string(bytes.TrimRight(p, "\n"))
	now := w.now()
	if bytes.HasPrefix(p, []byte("http: Accept error")) {
		ok, held, over := w.accept.Allow()
		if !ok {
			return len(p), nil
		}
		if held > 0 {
			msg += fmt.Sprintf(" (and %d more in the last %s: the process may be out of file descriptors; raise its limit, ulimit -n)", held, over.Round(time.Second))
		}
	}
	if !w.h.Enabled(context.Background(), slog.LevelWarn) {
		return len(p), nil
	}
	return len(p), w.h.Handle(context.Background(), slog.NewRecord(now, slog.LevelWarn, msg, 0))
}
