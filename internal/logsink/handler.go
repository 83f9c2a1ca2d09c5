package logsink

import (
	"context"
	"io"
	"log/slog"
	"strconv"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"
)

// Handler writes what slog.TextHandler (NewTextHandler) or
// slog.JSONHandler (NewJSONHandler) writes, byte for byte, in half the time
// or less for the lines kvbus logs per request: a record whose attributes
// (and those given to WithAttrs) are strings, integers, bools, durations
// or, in text, floats is formatted here; any other record, and every record
// of a handler with a group, goes through slog's own handler with the same
// options and attributes.
//
// Each record is one Write to the io.Writer, which must be safe for
// concurrent use and write each call whole (a *Writer, an *os.File). Safe
// for concurrent use. Only Level is taken from the options: kvbus sets no
// ReplaceAttr and no AddSource (with either, every record goes through
// slog's handler).
type Handler struct {
	out   io.Writer
	json  bool
	level slog.Leveler
	pre   []byte // the attributes given to WithAttrs, formatted
	fast  bool   // false: every record goes to slow
	// slow is slog's handler with the same options, attributes and groups,
	// made when a record first needs it: a logger made per request with
	// With rarely does.
	slow func() slog.Handler
}

// NewTextHandler returns a Handler writing slog.TextHandler's format to w;
// nil opts are the defaults, as for slog.NewTextHandler.
func NewTextHandler(w io.Writer, opts *slog.HandlerOptions) *Handler {
	if opts == nil {
		opts = &slog.HandlerOptions{}
	}
	return newHandler(w, opts, false, slog.NewTextHandler(w, opts))
}

// NewJSONHandler returns a Handler writing slog.JSONHandler's format to w;
// nil opts are the defaults, as for slog.NewJSONHandler.
func NewJSONHandler(w io.Writer, opts *slog.HandlerOptions) *Handler {
	if opts == nil {
		opts = &slog.HandlerOptions{}
	}
	return newHandler(w, opts, true, slog.NewJSONHandler(w, opts))
}

func newHandler(w io.Writer, opts *slog.HandlerOptions, json bool, slow slog.Handler) *Handler {
	h := &Handler{out: w, json: json, level: opts.Level, fast: opts.ReplaceAttr == nil && !opts.AddSource,
		slow: func() slog.Handler { return slow }}
	if h.level == nil {
		h.level = slog.LevelInfo
	}
	return h
}

// Enabled reports whether level is at or above the handler's level.
func (h *Handler) Enabled(_ context.Context, level slog.Level) bool {
	return level >= h.level.Level()
}

// WithAttrs returns a handler whose records carry attrs.
func (h *Handler) WithAttrs(attrs []slog.Attr) slog.Handler {
	if len(attrs) == 0 {
		return h
	}
	c := *h
	parent := h.slow
	c.slow = sync.OnceValue(func() slog.Handler { return parent().WithAttrs(attrs) })
	for _, a := range attrs {
		if !h.fastAttr(a) {
			// slog formats (and resolves) such a value now, not when a
			// record is logged: so does this handler.
			slow := parent().WithAttrs(attrs)
			c.slow, c.fast, c.pre = func() slog.Handler { return slow }, false, nil
			return &c
		}
	}
	if c.fast {
		c.pre = append([]byte(nil), h.pre...)
		for _, a := range attrs {
			c.pre = h.appendAttr(c.pre, a)
		}
	}
	return &c
}

// WithGroup returns a handler whose records go through slog's handler
// (an empty name too: slog's handlers do not ignore it, though slog.Logger
// does).
func (h *Handler) WithGroup(name string) slog.Handler {
	parent := h.slow
	return &Handler{out: h.out, json: h.json, level: h.level, slow: sync.OnceValue(func() slog.Handler { return parent().WithGroup(name) })}
}

// Handle writes r as one line.
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	if !h.fast || !h.fastTime(r.Time) {
		return h.slow().Handle(ctx, r)
	}
	fast := true
	r.Attrs(func(a slog.Attr) bool {
		fast = h.fastAttr(a)
		return fast
	})
	if !fast {
		return h.slow().Handle(ctx, r)
	}
	bp := bufPool.Get().(*[]byte)
	b := h.appendHead((*bp)[:0], r.Time, r.Level, r.Message)
	r.Attrs(func(a slog.Attr) bool {
		b = h.appendAttr(b, a)
		return true
	})
	return h.write(bp, b)
}

// info writes an Info line of msg and args, if every arg pair is a string
// key and a value of a kind the handler formats. It reports false, with
// nothing written, otherwise.
func (h *Handler) info(now time.Time, msg string, args []any) (bool, error) {
	if !h.fast || len(args)%2 != 0 || !h.fastTime(now) {
		return false, nil
	}
	for i := 0; i < len(args); i += 2 {
		if k, ok := args[i].(string); !ok || k == "" || !h.fastValue(args[i+1]) {
			return false, nil
		}
	}
	bp := bufPool.Get().(*[]byte)
	b := h.appendHead((*bp)[:0], now, slog.LevelInfo, msg)
	for i := 0; i < len(args); i += 2 {
		b = h.appendKey(b, args[i].(string))
		switch v := args[i+1].(type) {
		case string:
			b = h.appendString(b, v)
		case int:
			b = strconv.AppendInt(b, int64(v), 10)
		case int64:
			b = strconv.AppendInt(b, v, 10)
		case uint64:
			b = strconv.AppendUint(b, v, 10)
		case bool:
			b = strconv.AppendBool(b, v)
		case float64: // text only
			b = strconv.AppendFloat(b, v, 'g', -1, 64)
		case time.Duration:
			b = h.appendDuration(b, v)
		}
	}
	return true, h.write(bp, b)
}

// fastTime reports whether t is written here: slog's JSON handler reports
// a year it cannot write.
func (h *Handler) fastTime(t time.Time) bool {
	y := t.Year()
	return !h.json || t.IsZero() || (y >= 0 && y < 10000)
}

// fastValue reports whether info formats v as slog.AnyValue(v) would be.
func (h *Handler) fastValue(v any) bool {
	switch v.(type) {
	case string, int, int64, uint64, bool, time.Duration:
		return true
	case float64:
		return !h.json // slog writes JSON floats as encoding/json does
	}
	return false
}

// fastAttr reports whether a is of a kind appendAttr formats as slog does.
// Empty keys (slog drops or quotes them) are not.
func (h *Handler) fastAttr(a slog.Attr) bool {
	if a.Key == "" {
		return false
	}
	switch a.Value.Kind() {
	case slog.KindString, slog.KindInt64, slog.KindUint64, slog.KindBool, slog.KindDuration:
		return true
	case slog.KindFloat64:
		return !h.json
	}
	return false
}

// appendHead starts a line: time, level and message.
func (h *Handler) appendHead(b []byte, t time.Time, level slog.Level, msg string) []byte {
	if h.json {
		b = append(b, '{')
		if !t.IsZero() {
			b = append(b, `"time":"`...)
			b = t.Round(0).AppendFormat(b, time.RFC3339Nano)
			b = append(b, `",`...)
		}
		b = append(b, `"level":`...)
		b = appendJSONString(b, level.String())
		b = append(b, `,"msg":`...)
		b = appendJSONString(b, msg)
	} else {
		if !t.IsZero() {
			b = append(b, "time="...)
			b = appendRFC3339Millis(b, t.Round(0))
			b = append(b, ' ')
		}
		b = append(b, "level="...)
		b = appendTextString(b, level.String())
		b = append(b, " msg="...)
		b = appendTextString(b, msg)
	}
	return append(b, h.pre...)
}

// appendKey appends the separator and key of an attribute.
func (h *Handler) appendKey(b []byte, key string) []byte {
	if h.json {
		b = append(b, ',')
		b = appendJSONString(b, key)
		return append(b, ':')
	}
	b = append(b, ' ')
	b = appendTextString(b, key)
	return append(b, '=')
}

// appendAttr appends a, which fastAttr accepts.
func (h *Handler) appendAttr(b []byte, a slog.Attr) []byte {
	b = h.appendKey(b, a.Key)
	v := a.Value
	switch v.Kind() {
	case slog.KindString:
		return h.appendString(b, v.String())
	case slog.KindInt64:
		return strconv.AppendInt(b, v.Int64(), 10)
	case slog.KindUint64:
		return strconv.AppendUint(b, v.Uint64(), 10)
	case slog.KindBool:
		return strconv.AppendBool(b, v.Bool())
	case slog.KindFloat64: // text only
		return strconv.AppendFloat(b, v.Float64(), 'g', -1, 64)
	default: // KindDuration
		return h.appendDuration(b, v.Duration())
	}
}

func (h *Handler) appendString(b []byte, s string) []byte {
	if h.json {
		return appendJSONString(b, s)
	}
	return appendTextString(b, s)
}

// appendDuration writes d as slog does: its String in text, nanoseconds in
// JSON (as encoding/json would).
func (h *Handler) appendDuration(b []byte, d time.Duration) []byte {
	if h.json {
		return strconv.AppendInt(b, int64(d), 10)
	}
	return append(b, d.String()...)
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// write ends the line in b, writes it and gives the buffer back.
func (h *Handler) write(bp *[]byte, b []byte) error {
	if h.json {
		b = append(b, '}')
	}
	b = append(b, '\n')
	_, err := h.out.Write(b)
	if cap(b) <= 16<<10 {
		*bp = b
		bufPool.Put(bp)
	}
	return err
}

// appendTextString appends s, quoted as slog.TextHandler quotes it.
func appendTextString(b []byte, s string) []byte {
	if needsQuoting(s) {
		return strconv.AppendQuote(b, s)
	}
	return append(b, s...)
}

// needsQuoting is slog's rule: empty, or holding a space, '=', a control
// character, a double quote, or a rune that is invalid, a space or not
// printable.
func needsQuoting(s string) bool {
	if s == "" {
		return true
	}
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if quoteASCII[c] {
				return true
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError || unicode.IsSpace(r) || !unicode.IsPrint(r) {
			return true
		}
		i += size
	}
	return false
}

// quoteASCII marks the ASCII bytes needsQuoting quotes for.
var quoteASCII = func() (q [utf8.RuneSelf]bool) {
	for c := range q {
		q[c] = c <= ' ' || c == '=' || c == '"'
	}
	return q
}()

// appendJSONString appends s as a JSON string, escaped as slog.JSONHandler
// escapes it: quotes, backslashes and control characters; invalid UTF-8
// as U+FFFD; U+2028 and U+2029; no HTML escaping.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= ' ' && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
		case r == '\u2028' || r == '\u2029':
			b = append(b, s[start:i]...)
			b = append(b, `\u202`...)
			b = append(b, hex[r&0xF])
		default:
			i += size
			continue
		}
		i += size
		start = i
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// appendRFC3339Millis appends t as slog's text handler does: RFC 3339 with
// exactly three fractional digits.
func appendRFC3339Millis(b []byte, t time.Time) []byte {
	const prefixLen = len("2006-01-02T15:04:05.000")
	n := len(b)
	t = t.Truncate(time.Millisecond).Add(time.Millisecond / 10)
	b = t.AppendFormat(b, time.RFC3339Nano)
	return append(b[:n+prefixLen], b[n+prefixLen+1:]...) // drop the 4th digit
}
