package logsink

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

// formats pairs slog's handlers with this package's.
var formats = []struct {
	name       string
	slog, fast func(io.Writer, *slog.HandlerOptions) slog.Handler
}{
	{"text", func(w io.Writer, o *slog.HandlerOptions) slog.Handler { return slog.NewTextHandler(w, o) },
		func(w io.Writer, o *slog.HandlerOptions) slog.Handler { return NewTextHandler(w, o) }},
	{"json", func(w io.Writer, o *slog.HandlerOptions) slog.Handler { return slog.NewJSONHandler(w, o) },
		func(w io.Writer, o *slog.HandlerOptions) slog.Handler { return NewJSONHandler(w, o) }},
}

// sameAsSlog logs one record through slog's handler and through a Handler,
// in each format, each with the same With chain, and fails if the lines
// differ.
func sameAsSlog(t *testing.T, level slog.Level, with [][]any, msg string, args ...any) {
	t.Helper()
	for _, f := range formats {
		var want, got bytes.Buffer
		opts := &slog.HandlerOptions{Level: slog.LevelDebug}
		ref, fast := slog.New(f.slog(&want, opts)), slog.New(f.fast(&got, opts))
		for _, w := range with {
			ref, fast = ref.With(w...), fast.With(w...)
		}
		at := time.Date(2026, 12, 2, 9, 4, 25, 414_999_999, time.FixedZone("x", 3600))
		for _, l := range []*slog.Logger{ref, fast} {
			r := slog.NewRecord(at, level, msg, 0)
			r.Add(args...)
			if err := l.Handler().Handle(context.Background(), r); err != nil {
				t.Fatal(err)
			}
		}
		if got.String() != want.String() {
			t.Fatalf("%s: Handler wrote\n%q\nslog wrote\n%q", f.name, got.String(), want.String())
		}
	}
}

func TestHandlerWritesWhatSlogWrites(t *testing.T) {
	sameAsSlog(t, slog.LevelInfo, [][]any{{"group", "g0", "tp_rank", 1, "ep_rank", 1}}, "store thread",
		"req_id", "fy5yI7OB6D9riQVJwIwvrc", "session_id", "", "stored_blocks", 3, "loaded_tokens", uint64(16), "ok", true)
	sameAsSlog(t, slog.LevelWarn, nil, "two words", "s", "a b", "q", `say "hi"`, "eq", "k=v", "bs", `back\slash`, "nl", "a\nb",
		"d", 1500*time.Microsecond, "f", 0.25, "big", math.Inf(1), "neg", -7, "del", "\x7f", "uni", "héllo wörld", "nbsp", "a\u00a0b",
		"bad", "\xff", "zw", "a\u200bb")
	sameAsSlog(t, slog.LevelDebug-2, nil, "")
	sameAsSlog(t, slog.LevelError+1, [][]any{{"k", "v"}, {"k2", 2}}, "m")
	// What goes through slog.TextHandler: other kinds, groups, empty keys.
	sameAsSlog(t, slog.LevelInfo, nil, "error", "err", errors.New("boom: x=1"), "t", time.Unix(0, 0).UTC(), "any", []int{1, 2})
	sameAsSlog(t, slog.LevelInfo, [][]any{{"err", errors.New("e")}}, "with an error first", "n", 1)
	sameAsSlog(t, slog.LevelInfo, [][]any{{"a", 1}, {"b", "x y"}}, "fast With, then an error", "err", errors.New("e"))
	sameAsSlog(t, slog.LevelInfo, nil, "group", slog.Group("g", "a", 1), "b", 2)
	sameAsSlog(t, slog.LevelInfo, nil, "empty key", slog.Int("", 3), slog.Attr{}, "b", 2)
	sameAsSlog(t, slog.LevelInfo, nil, "odd args", "alone")

	for _, f := range formats {
		var want, got bytes.Buffer
		ref := slog.New(f.slog(&want, nil)).WithGroup("grp").With("a", 1)
		fast := slog.New(f.fast(&got, nil)).WithGroup("grp").With("a", 1)
		ref.Info("in a group", "b", 2)
		fast.Info("in a group", "b", 2)
		if _, w, _ := strings.Cut(want.String(), "level"); !strings.HasSuffix(got.String(), w) {
			t.Fatalf("%s, with a group: got %q, want %q", f.name, got.String(), want.String())
		}
		if fast.Enabled(context.Background(), slog.LevelDebug) || !fast.Enabled(context.Background(), slog.LevelInfo) {
			t.Fatalf("%s: a handler without options must log from Info up", f.name)
		}
	}
}

// sameInfo logs through Info with a Handler and through slog's own Info
// with slog's handler, in each format, and fails if the lines differ past
// their time.
func sameInfo(t *testing.T, with []any, msg string, args ...any) {
	t.Helper()
	for _, f := range formats {
		var want, got bytes.Buffer
		ref, fast := slog.New(f.slog(&want, nil)), slog.New(f.fast(&got, nil))
		if with != nil {
			ref, fast = ref.With(with...), fast.With(with...)
		}
		ref.Info(msg, args...)
		Info(fast, msg, args...)
		_, w, _ := strings.Cut(want.String(), "level")
		t0, g, _ := strings.Cut(got.String(), "level")
		if !strings.Contains(t0, "time") || g != w {
			t.Fatalf("%s: Info through a Handler wrote\n%q\nslog wrote\n%q", f.name, got.String(), want.String())
		}
	}
}

func TestInfoWritesWhatSlogWrites(t *testing.T) {
	sameInfo(t, []any{"group", "g0", "tp_rank", 1}, "store thread", "req_id", "r1", "session_id", "", "stored_blocks", 3,
		"n64", int64(-2), "u", uint64(7), "ok", false, "f", 1e21, "d", 2*time.Second, "q", "a=b c")
	// Args info does not take, formatted by slog: another int type, an
	// error, a missing value, an Attr, a non-string key.
	sameInfo(t, nil, "m", "i32", int32(4))
	sameInfo(t, nil, "m", "err", errors.New("x"))
	sameInfo(t, nil, "m", "alone")
	sameInfo(t, nil, "m", slog.Int("a", 1))
	sameInfo(t, nil, "m", 5, "v")
	sameInfo(t, []any{"err", errors.New("e")}, "a With that is not fast", "n", 1)
}

type counter struct{ N int }

type lazyValue struct{ calls *int }

func (v lazyValue) LogValue() slog.Value { *v.calls++; return slog.IntValue(*v.calls) }

// TestHandlerFormatsWithAttrsWhenSlogDoes: slog formats a With value, and
// resolves a LogValuer, when With is called; a value changed later is not
// what the line shows.
func TestHandlerFormatsWithAttrsWhenSlogDoes(t *testing.T) {
	for _, f := range formats {
		var want, got bytes.Buffer
		c1, c2 := &counter{}, &counter{}
		var calls1, calls2 int
		ref := slog.New(f.slog(&want, nil)).With("c", c1, "v", lazyValue{&calls1})
		fast := slog.New(f.fast(&got, nil)).With("c", c2, "v", lazyValue{&calls2})
		c1.N, c2.N = 42, 42
		ref.Info("m", "n", 1)
		fast.Info("m", "n", 1)
		_, w, _ := strings.Cut(want.String(), "level")
		if _, g, _ := strings.Cut(got.String(), "level"); g != w {
			t.Fatalf("%s: Handler wrote %q, slog %q", f.name, got.String(), want.String())
		}
	}
	// A group named "" at the handler (slog.Logger drops it before).
	for _, f := range formats {
		var want, got bytes.Buffer
		at := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
		r := slog.NewRecord(at, slog.LevelInfo, "m", 0)
		r.Add("a", 1)
		_ = f.slog(&want, nil).WithGroup("").Handle(context.Background(), r)
		_ = f.fast(&got, nil).WithGroup("").Handle(context.Background(), r)
		if got.String() != want.String() {
			t.Fatalf("%s: WithGroup(\"\"): Handler wrote %q, slog %q", f.name, got.String(), want.String())
		}
	}
}

func TestHandlerRandomStrings(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []rune("ab =\"\\\n\t\x00\x7f\u00a0é\u200b\u2028日😀")
	for range 2000 {
		s := make([]rune, rng.IntN(6))
		for i := range s {
			s[i] = alphabet[rng.IntN(len(alphabet))]
		}
		sameAsSlog(t, slog.LevelInfo, [][]any{{string(s), string(s)}}, string(s), string(s), string(s))
	}
}

func FuzzHandler(f *testing.F) {
	f.Add("store thread", "req_id", "abc", int64(3), 0.5, int64(time.Millisecond))
	f.Add("", "a b", "\xff", int64(-1), math.NaN(), int64(0))
	f.Fuzz(func(t *testing.T, msg, key, val string, n int64, x float64, d int64) {
		sameAsSlog(t, slog.LevelInfo, [][]any{{key, val}}, msg, key, val, "n", n, "x", x, "d", time.Duration(d), "u", uint64(n))
		sameInfo(t, []any{key, val}, msg, key, val, "n", n, "x", x, "d", time.Duration(d), "u", uint64(n), "i", int(n))
	})
}

func BenchmarkHandler(b *testing.B) {
	for _, bc := range []struct {
		name string
		h    func(*bytes.Buffer) slog.Handler
	}{
		{"slog", func(w *bytes.Buffer) slog.Handler { return slog.NewTextHandler(w, nil) }},
		{"logsink", func(w *bytes.Buffer) slog.Handler { return NewTextHandler(w, nil) }},
		{"slog-json", func(w *bytes.Buffer) slog.Handler { return slog.NewJSONHandler(w, nil) }},
		{"logsink-json", func(w *bytes.Buffer) slog.Handler { return NewJSONHandler(w, nil) }},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var buf bytes.Buffer
			l := slog.New(bc.h(&buf)).With("group", "g0", "tp_rank", 1, "ep_rank", 1)
			b.ReportAllocs()
			for b.Loop() {
				buf.Reset()
				Info(l, "store thread", "req_id", "fy5yI7OB6D9riQVJwIwvrc", "session_id", "sess-1", "stored_blocks", 0,
					"skipped_blocks", 0, "loaded_tokens", 16, "token_len", 18)
			}
		})
	}
}
