package bus

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// repeatWindow is how long the server's log keeps quiet about a message it
// just logged for a remote host: a client retrying a refused key or a bad
// certificate 4 times a second gets one line, then one line per window
// with the count of the repeats.
const repeatWindow = 10 * time.Second

// maxRepeatKeys bounds the (host, message) pairs tracked at once; past it a
// message is logged without collapsing, so memory stays bounded under a
// scan from many addresses.
const maxRepeatKeys = 4096

// serverLogger adapts nats-server's Logger interface (Noticef, Warnf,
// Fatalf, Errorf, Debugf, Tracef) to a slog.Logger: notices at info,
// warnings at warn, errors and fatal errors at error, debug and trace
// output at debug (nats-server calls those only with --debug). A message
// about a connection ("ADDR - cid:N - text") carries the remote address
// and connection as attributes, and repeats of it from the same host
// within repeatWindow are counted instead of logged.
type serverLogger struct {
	log *slog.Logger
	// quiet logs notices at debug level: nats-server's start-up banner and
	// shutdown steps, which StartServer and its caller sum up in one line.
	quiet atomic.Bool
	// secrets are replaced by "xxxxx" in every line (redact adds one).
	secrets atomic.Pointer[[]string]
	window  time.Duration

	mu      sync.Mutex
	repeats map[string]*repeat
	closed  bool
}

type repeat struct {
	level  slog.Level
	host   string
	msg    string
	n      int // repeats not logged yet
	timer  *time.Timer
	closed bool
}

// minSecret is the shortest secret redacted from the log: a shorter one
// would mangle words (nats-server logs no password itself).
const minSecret = 6

func newServerLogger(log *slog.Logger, secrets ...string) *serverLogger {
	if log == nil {
		log = slog.Default()
	}
	l := &serverLogger{log: log.With("component", "nats-server"), window: repeatWindow, repeats: map[string]*repeat{}}
	l.secrets.Store(&[]string{})
	for _, s := range secrets {
		l.redact(s)
	}
	l.quiet.Store(true)
	return l
}

// redact adds s to the secrets replaced in every line, unless it is
// shorter than minSecret or there already.
func (l *serverLogger) redact(s string) {
	if l == nil || len(s) < minSecret {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	old := *l.secrets.Load()
	if !slices.Contains(old, s) {
		l.secrets.Store(new(append(slices.Clip(old), s)))
	}
}

func (l *serverLogger) Noticef(format string, v ...any) {
	level := slog.LevelInfo
	if l.quiet.Load() {
		level = slog.LevelDebug
	}
	l.logf(level, format, v...)
}
func (l *serverLogger) Warnf(format string, v ...any)  { l.logf(slog.LevelWarn, format, v...) }
func (l *serverLogger) Errorf(format string, v ...any) { l.logf(slog.LevelError, format, v...) }

// Fatalf logs at error level: an embedded server must not exit the
// process (nats-server's own logger does).
func (l *serverLogger) Fatalf(format string, v ...any) { l.logf(slog.LevelError, format, v...) }
func (l *serverLogger) Debugf(format string, v ...any) { l.logf(slog.LevelDebug, format, v...) }
func (l *serverLogger) Tracef(format string, v ...any) { l.logf(slog.LevelDebug, format, v...) }

// connLine is nats-server's prefix of a connection's messages: the remote
// address, the connection kind and id (cid, rid, lid, gid, wid, mid...),
// and the client's and account's quoted names once known.
var connLine = regexp.MustCompile(`(?s)^(\S+) - ([a-z_]+:\d+)((?: - "(?:[^"\\]|\\.)*")*) - (.*)$`)

func (l *serverLogger) logf(level slog.Level, format string, v ...any) {
	ctx := context.Background()
	if !l.log.Enabled(ctx, level) {
		return
	}
	text := strings.TrimRight(fmt.Sprintf(format, v...), "\n")
	for _, s := range *l.secrets.Load() {
		text = strings.ReplaceAll(text, s, "xxxxx")
	}
	m := connLine.FindStringSubmatch(text)
	if m == nil {
		l.log.Log(ctx, level, text)
		return
	}
	remote, conn, names, msg := m[1], m[2], strings.TrimPrefix(m[3], " - "), m[4]
	host := remote
	if h, _, err := net.SplitHostPort(remote); err == nil {
		host = h
	}
	if level >= slog.LevelInfo && !l.first(level, host, msg) {
		return
	}
	args := []any{"remote", remote, "conn", conn}
	if names != "" {
		args = append(args, "names", names)
	}
	if hint := routeHint(conn, msg); hint != "" {
		args = append(args, "hint", hint)
	}
	l.log.Log(ctx, level, msg, args...)
}

// Hints for nats-server's messages about routes that say what happened but
// not which kvbus nats flag to fix.
const (
	hintClusterPassword = "the two servers have different cluster passwords: give every server of the cluster the same " +
		"--cluster-password-file (after `kvbus auth init DIR --rotate cluster-password`, send every kvbus nats of the cluster SIGHUP, make reload-nats in compose, to read it again)"
	hintServerName = "every server of the cluster needs its own --server-name (the default, kvbus-<port of --addr>, " +
		"is the same on every host using that port)"
	hintRouteCA = "the routes verify each other's certificates against --tls-ca (the system's roots without it): " +
		"give every server a certificate from a CA in every server's --tls-ca"
)

// routeHint is the hint for a message of nats-server about connection
// conn ("rid:7" for a route), or "".
func routeHint(conn, msg string) string {
	route := strings.HasPrefix(conn, "rid:")
	switch {
	case strings.HasPrefix(msg, "Remote server has a duplicate name"), strings.HasPrefix(msg, "Router connection closed: Duplicate Server Name"):
		return hintServerName
	case route && (strings.HasPrefix(msg, "authentication error") || strings.Contains(msg, "'Authorization Violation'")):
		return hintClusterPassword
	case route && strings.Contains(msg, "TLS route handshake error") &&
		(strings.Contains(msg, "unknown authority") || strings.Contains(msg, "bad certificate")):
		return hintRouteCA
	}
	return ""
}

// digits are replaced in the key under which repeats are counted: a
// message that differs only in a port or a count ("Error flushing: writev
// tcp 127.0.0.1:47574->…: broken pipe" once a second from a route refused
// its password) is a repeat.
var digits = regexp.MustCompile(`[0-9]+`)

// first reports whether msg from host is to be logged now: not when the
// same was logged for host within the window, in which case it is counted
// and the count logged at the window's end.
func (l *serverLogger) first(level slog.Level, host, msg string) bool {
	key := host + "\x00" + digits.ReplaceAllString(msg, "#")
	l.mu.Lock()
	defer l.mu.Unlock()
	if r := l.repeats[key]; r != nil {
		r.n++
		return false
	}
	if l.closed || len(l.repeats) >= maxRepeatKeys {
		return true
	}
	r := &repeat{level: level, host: host, msg: msg}
	l.repeats[key] = r
	r.timer = time.AfterFunc(l.window, func() { l.windowEnd(key, r) })
	return true
}

// windowEnd logs how often r repeated in the window that just ended, and
// starts another window if it did; a window without repeats ends the
// collapsing, and the next occurrence is logged in full.
func (l *serverLogger) windowEnd(key string, r *repeat) {
	l.mu.Lock()
	n := r.n
	r.n = 0
	if n > 0 && !r.closed {
		r.timer = time.AfterFunc(l.window, func() { l.windowEnd(key, r) })
	} else if l.repeats[key] == r {
		delete(l.repeats, key)
	}
	l.mu.Unlock()
	if n > 0 {
		l.log.Log(context.Background(), r.level, r.msg, "remote_host", r.host, "repeated", n, "within", l.window.String())
	}
}

// close stops the windows and logs the repeats counted so far.
func (l *serverLogger) close() {
	l.mu.Lock()
	l.closed = true
	var pending []*repeat
	for key, r := range l.repeats {
		r.closed = true
		r.timer.Stop()
		if r.n > 0 {
			pending = append(pending, &repeat{level: r.level, host: r.host, msg: r.msg, n: r.n})
			r.n = 0
		}
		delete(l.repeats, key)
	}
	l.mu.Unlock()
	for _, r := range pending {
		l.log.Log(context.Background(), r.level, r.msg, "remote_host", r.host, "repeated", r.n, "within", l.window.String())
	}
}
