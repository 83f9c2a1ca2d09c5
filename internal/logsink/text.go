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

// TextHandler writes what slog.TextHandler writes, byte for byte, in a
// third of the time for the lines kvbus logs per request: a record whose
// attributes (and those given to WithAttrs) are strings, integers, bools,
// floats or durations is formatted here; any other record, and every record
// of a handler with a group, goes through an slog.TextHandler with the same
// options and attributes.
//
// Each record is one Write to the io.Writer, which must be safe for
// concurrent use and write each call whole (a *Writer, an *os.File). Safe
// for concurrent use. Only Level is taken from the options: kvbus sets no
// ReplaceAttr and no AddSource (with either, every record goes through
// slog.TextHandler).
type TextHandler struct {
	out   io.Writer
	level slog.Leveler
	pre   []byte // the attributes given to WithAttrs, formatted
	fast  bool   // false: every record goes to slow
	// slow is slog.TextHandler with the same options, attributes and
	// groups, made when a record first needs it: a logger made per request
	// with With rarely does.
	slow func() slog.Handler
}

// NewTextHandler returns a TextHandler writing to w; nil opts are the
// defaults, as for slog.NewTextHandler.
func NewTextHandler(w io.Writer, opts *slog.HandlerOptions) *TextHandler {
	if opts == nil {
		opts = &slog.HandlerOptions{}
	}
	slow := slog.NewTextHandler(w, opts)
	h := &TextHandler{out: w, level: opts.Level, fast: opts.ReplaceAttr == nil && !opts.AddSource, slow: func() slog.Handler { return slow }}
	if h.level == nil {
		h.level = slog.LevelInfo
	}
	return h
}

// Enabled reports whether level is at or above the handler's level.
func (h *TextHandler) Enabled(_ context.Context, level slog.Level) bool {
	return level >= h.level.Level()
}

// WithAttrs returns a handler whose records carry attrs.
func (h *TextHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	if len(attrs) == 0 {
		return h
	}
	c := *h
	parent := h.slow
	c.slow = sync.OnceValue(func() slog.Handler { return parent().WithAttrs(attrs) })
	if c.fast {
		c.pre = append([]byte(nil), h.pre...)
		for _, a := range attrs {
			if !fastAttr(a) {
				c.fast, c.pre = false, nil
				break
			}
			c.pre = appendAttr(c.pre, a)
		}
	}
	return &c
}

// WithGroup returns a handler whose records go through slog.TextHandler.
func (h *TextHandler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	parent := h.slow
	return &TextHandler{out: h.out, level: h.level, slow: sync.OnceValue(func() slog.Handler { return parent().WithGroup(name) })}
}

// info writes an Info line of msg and args, if every arg pair is a
// string key and a value of a kind appendAttr takes. It reports false, with
// nothing written, otherwise.
func (h *TextHandler) info(now time.Time, msg string, args []any) (bool, error) {
	if !h.fast || len(args)%2 != 0 {
		return false, nil
	}
	for i := 0; i < len(args); i += 2 {
		if k, ok := args[i].(string); !ok || k == "" || !fastValue(args[i+1]) {
			return false, nil
		}
	}
	bp := bufPool.Get().(*[]byte)
	b := append((*bp)[:0], "time="...)
	b = appendRFC3339Millis(b, now.Round(0))
	b = append(b, " level=INFO msg="...)
	b = appendString(b, msg)
	b = append(b, h.pre...)
	for i := 0; i < len(args); i += 2 {
		b = append(b, ' ')
		b = appendString(b, args[i].(string))
		b = append(b, '=')
		switch v := args[i+1].(type) {
		case string:
			b = appendString(b, v)
		case int:
			b = strconv.AppendInt(b, int64(v), 10)
		case int64:
			b = strconv.AppendInt(b, v, 10)
		case uint64:
			b = strconv.AppendUint(b, v, 10)
		case bool:
			b = strconv.AppendBool(b, v)
		case float64:
			b = strconv.AppendFloat(b, v, 'g', -1, 64)
		case time.Duration:
			b = append(b, v.String()...)
		}
	}
	return true, h.write(bp, b)
}

// fastValue reports whether info formats v as slog.AnyValue(v) would be.
func fastValue(v any) bool {
	switch v.(type) {
	case string, int, int64, uint64, bool, float64, time.Duration:
		return true
	}
	return false
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// Handle writes r as one line.
func (h *TextHandler) Handle(ctx context.Context, r slog.Record) error {
	if !h.fast {
		return h.slow().Handle(ctx, r)
	}
	fast := true
	r.Attrs(func(a slog.Attr) bool {
		fast = fastAttr(a)
		return fast
	})
	if !fast {
		return h.slow().Handle(ctx, r)
	}
	bp := bufPool.Get().(*[]byte)
	b := (*bp)[:0]
	if !r.Time.IsZero() {
		b = append(b, "time="...)
		b = appendRFC3339Millis(b, r.Time.Round(0))
		b = append(b, ' ')
	}
	b = append(b, "level="...)
	b = appendString(b, r.Level.String())
	b = append(b, " msg="...)
	b = appendString(b, r.Message)
	b = append(b, h.pre...)
	r.Attrs(func(a slog.Attr) bool {
		b = appendAttr(b, a)
		return true
	})
	return h.write(bp, b)
}

// write ends the line in b, writes it and gives the buffer back.
func (h *TextHandler) write(bp *[]byte, b []byte) error {
	b = append(b, '\n')
	_, err := h.out.Write(b)
	if cap(b) <= 16<<10 {
		*bp = b
		bufPool.Put(bp)
	}
	return err
}

// fastAttr reports whether a is of a kind appendAttr formats as
// slog.TextHandler does. Empty keys (slog drops or quotes them) are not.
func fastAttr(a slog.Attr) bool {
	if a.Key == "" {
		return false
	}
	switch a.Value.Kind() {
	case slog.KindString, slog.KindInt64, slog.KindUint64, slog.KindBool, slog.KindFloat64, slog.KindDuration:
		return true
	}
	return false
}

// appendAttr appends " key=value" for a, which fastAttr accepts.
func appendAttr(b []byte, a slog.Attr) []byte {
	b = append(b, ' ')
	b = appendString(b, a.Key)
	b = append(b, '=')
	v := a.Value
	switch v.Kind() {
	case slog.KindString:
		return appendString(b, v.String())
	case slog.KindInt64:
		return strconv.AppendInt(b, v.Int64(), 10)
	case slog.KindUint64:
		return strconv.AppendUint(b, v.Uint64(), 10)
	case slog.KindBool:
		return strconv.AppendBool(b, v.Bool())
	case slog.KindFloat64:
		return strconv.AppendFloat(b, v.Float64(), 'g', -1, 64)
	default: // KindDuration
		return append(b, v.Duration().String()...)
	}
}

// appendString appends s, quoted as slog.TextHandler quotes it.
func appendString(b []byte, s string) []byte {
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

// appendRFC3339Millis appends t as slog does: RFC 3339 with exactly three
// fractional digits.
func appendRFC3339Millis(b []byte, t time.Time) []byte {
	const prefixLen = len("2006-01-02T15:04:05.000")
	n := len(b)
	t = t.Truncate(time.Millisecond).Add(time.Millisecond / 10)
	b = t.AppendFormat(b, time.RFC3339Nano)
	return append(b[:n+prefixLen], b[n+prefixLen+1:]...) // drop the 4th digit
}
