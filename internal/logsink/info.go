package logsink

import (
	"context"
	"log/slog"
	"time"
)

// Info logs msg and args at slog.LevelInfo through l, as l.Info does, but
// without the caller's program counter: slog.Logger takes it with
// runtime.Callers for every line, a fifth of a short line's cost, and no
// kvbus handler prints it (none sets AddSource). Through a Handler, a
// line whose values are strings, numbers, bools or durations is formatted
// straight from args, without a Record. For lines logged once per request
// per rank; elsewhere l.Info reads better.
func Info(l *slog.Logger, msg string, args ...any) {
	ctx := context.Background()
	if !l.Enabled(ctx, slog.LevelInfo) {
		return
	}
	now := time.Now()
	if h, ok := l.Handler().(*Handler); ok {
		if done, _ := h.info(now, msg, args); done {
			return
		}
	}
	r := slog.NewRecord(now, slog.LevelInfo, msg, 0)
	r.Add(args...)
	_ = l.Handler().Handle(ctx, r)
}
