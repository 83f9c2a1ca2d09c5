package frontend

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"log/slog"
	"sync"
	"time"
)

// acceptErrorEvery is how often net/http's accept errors are logged.
const acceptErrorEvery = 10 * time.Second

// httpErrorLog is the HTTP server's error log: its lines go to h at warn,
// but "http: Accept error" (out of file descriptors, say) at most once per
// acceptErrorEvery with the count of those left out. net/http logs one per
// failed accept, retrying within milliseconds whenever one succeeds in
// between: ~90 lines a second at the file descriptor limit.
func httpErrorLog(h slog.Handler) *log.Logger {
	return log.New(&errorLogWriter{h: h, now: time.Now}, "", 0)
}

type errorLogWriter struct {
	h   slog.Handler
	now func() time.Time

	mu      sync.Mutex
	last    time.Time // the last accept error logged
	skipped int       // accept errors since, not logged
}

func (w *errorLogWriter) Write(p []byte) (int, error) {
	msg := string(bytes.TrimRight(p, "\n"))
	now := w.now()
	if bytes.HasPrefix(p, []byte("http: Accept error")) {
		w.mu.Lock()
		if !w.last.IsZero() && now.Sub(w.last) < acceptErrorEvery {
			w.skipped++
			w.mu.Unlock()
			return len(p), nil
		}
		if w.skipped > 0 {
			msg += fmt.Sprintf(" (and %d more in the last %s: the process may be out of file descriptors; raise its limit, ulimit -n)", w.skipped, now.Sub(w.last).Round(time.Second))
		}
		w.last, w.skipped = now, 0
		w.mu.Unlock()
	}
	if !w.h.Enabled(context.Background(), slog.LevelWarn) {
		return len(p), nil
	}
	return len(p), w.h.Handle(context.Background(), slog.NewRecord(now, slog.LevelWarn, msg, 0))
}
