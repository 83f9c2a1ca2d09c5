package bus

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// records is a slog.Handler keeping every record as one line of text: its
// message and its attributes' values.
type records struct {
	mu    sync.Mutex
	lines []string
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *records) WithGroup(string) slog.Handler            { return r }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	var b strings.Builder
	b.WriteString(rec.Message)
	rec.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value.Any())
		return true
	})
	r.mu.Lock()
	r.lines = append(r.lines, b.String())
	r.mu.Unlock()
	return nil
}

// FuzzServerLog: nats-server's log lines carry what clients send (their
// names, subjects, the bytes of a bad protocol line), and serverLogger
// parses them. Whatever the line: it never panics, never lets a redacted
// secret through, and a line said twice is told twice in all: at once and
// again, or at once and as one repeat counted (a connection's line).
func FuzzServerLog(f *testing.F) {
	for _, line := range []string{
		`127.0.0.1:53712 - cid:7 - "v1.55.0:go:kvbus-frontend" - authentication error - User "UABC"`,
		`127.0.0.1:53712 - cid:7 - "v1.55.0:go:kvbus-frontend" - "$G" - Publish Violation - User "UABC", Subject "kvbus.req.m"`,
		`10.0.0.2:6222 - rid:3 - Router connection closed: Duplicate Server Name`,
		`10.0.0.2:6222 - rid:3 - authentication error`,
		`10.0.0.2:6222 - rid:3 - TLS route handshake error: x509: certificate signed by unknown authority`,
		`[::1]:4222 - cid:12 - "\"quoted\\" name" - Error flushing: writev tcp 127.0.0.1:47574->127.0.0.1:4222: broken pipe`,
		"Server is ready",
		"Starting nats-server\nwith a second line",
		"",
	} {
		f.Add(line, 0)
		f.Add(line, len(line)/2)
	}
	const secret = "s3cr3tPassw0rd" // no 'x' and no border: redacting it cannot make another
	f.Fuzz(func(t *testing.T, line string, at int) {
		if at < 0 || at > len(line) {
			at = len(line)
		}
		line = line[:at] + secret + line[at:]
		for _, level := range []string{"debug", "warn"} {
			var got records
			l := newServerLogger(slog.New(&got), secret)
			l.window = time.Hour // the repeat is counted, not told, until close
			say := l.Warnf
			if level == "debug" {
				say = l.Debugf // no repeats counted below info
			}
			say("%s", line)
			say("%s", line)
			l.close()
			if len(got.lines) != 2 {
				t.Errorf("%s %q twice: %d records, want 2: %q", level, line, len(got.lines), got.lines)
			}
			for _, rec := range got.lines {
				if strings.Contains(rec, secret) {
					t.Errorf("%s %q: the secret was logged: %q", level, line, rec)
				}
			}
		}
	})
}
