package logsink

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
)

// syncBuffer is a bytes.Buffer that counts the writes it receives.
type syncBuffer struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	writes int
	block  chan struct{} // when non-nil, each write waits for a value
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	if b.block != nil {
		<-b.block
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.writes++
	return b.buf.Write(p)
}

func TestEveryLineArrivesWholeAndInOrderPerWriter(t *testing.T) {
	out := &syncBuffer{}
	w, err := New(Config{Out: out, MaxBuffered: 256}) // small: writers block and resume
	if err != nil {
		t.Fatal(err)
	}
	const writers, lines = 8, 500
	var wg sync.WaitGroup
	for g := range writers {
		wg.Go(func() {
			for i := range lines {
				fmt.Fprintf(w, "g=%d i=%d\n", g, i)
			}
		})
	}
	wg.Wait()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	got := strings.Split(strings.TrimSuffix(out.buf.String(), "\n"), "\n")
	if len(got) != writers*lines {
		t.Fatalf("%d lines arrived, want %d", len(got), writers*lines)
	}
	next := make([]int, writers)
	for _, l := range got {
		var g, i int
		if _, err := fmt.Sscanf(l, "g=%d i=%d", &g, &i); err != nil {
			t.Fatalf("line %q is not whole: %v", l, err)
		}
		if i != next[g] {
			t.Fatalf("writer %d: line %d arrived where %d was due", g, i, next[g])
		}
		next[g]++
	}
	if out.writes >= writers*lines {
		t.Fatalf("%d system writes for %d lines: nothing was batched", out.writes, writers*lines)
	}
}

func TestWritesBatchWhileOutIsBusy(t *testing.T) {
	out := &syncBuffer{block: make(chan struct{})}
	w, err := New(Config{Out: out})
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(w, "first") // the goroutine takes it and blocks in Out
	for i := range 100 {
		fmt.Fprintln(w, "line", i)
	}
	close(out.block) // now let Out write
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(out.buf.String(), "\n"); n != 101 {
		t.Fatalf("%d lines, want 101", n)
	}
	if out.writes > 3 {
		t.Fatalf("%d writes for 101 lines queued behind a busy writer, want at most 3", out.writes)
	}
}

func TestCloseFlushesAndRefusesLaterWrites(t *testing.T) {
	out := &syncBuffer{}
	w, _ := New(Config{Out: out})
	fmt.Fprint(w, "last words\n")
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if out.buf.String() != "last words\n" {
		t.Fatalf("after Close the output is %q", out.buf.String())
	}
	if _, err := w.Write([]byte("late\n")); !errors.Is(err, ErrClosed) {
		t.Fatalf("Write after Close: %v, want ErrClosed", err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

type failing struct{}

func (failing) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func TestCloseReportsTheOutputsError(t *testing.T) {
	w, _ := New(Config{Out: failing{}})
	fmt.Fprintln(w, "x")
	if err := w.Close(); err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("Close = %v, want the output's error", err)
	}
}

func TestValidate(t *testing.T) {
	if _, err := New(Config{}); err == nil {
		t.Fatal("a Writer without Out was accepted")
	}
	if _, err := New(Config{Out: &syncBuffer{}, MaxBuffered: -1}); err == nil {
		t.Fatal("a negative bound was accepted")
	}
}

func BenchmarkWriteParallel(b *testing.B) {
	w, _ := New(Config{Out: &syncBuffer{}})
	line := []byte(`time=2026-12-01T22:08:28.639Z level=INFO msg="store thread" group=g0 tp_rank=3 req_id=x session_id=""` + "\n")
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			_, _ = w.Write(line)
		}
	})
	_ = w.Close()
}

// TestInfoWritesWhatLoggerInfoWrites: the same line as slog's Logger.Info,
// with the logger's own attributes, and nothing below the logger's level.
func TestInfoWritesWhatLoggerInfoWrites(t *testing.T) {
	var a, b bytes.Buffer
	opts := &slog.HandlerOptions{ReplaceAttr: func(_ []string, at slog.Attr) slog.Attr {
		if at.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return at
	}}
	la := slog.New(slog.NewTextHandler(&a, opts)).With("group", "g0", "tp_rank", 1)
	lb := slog.New(slog.NewTextHandler(&b, opts)).With("group", "g0", "tp_rank", 1)
	la.Info("store thread", "req_id", "r 1", "session_id", "abc", "stored_blocks", 3)
	Info(lb, "store thread", "req_id", "r 1", "session_id", "abc", "stored_blocks", 3)
	if a.String() != b.String() || a.Len() == 0 {
		t.Errorf("Info wrote %q, Logger.Info %q", b.String(), a.String())
	}
	quiet := slog.New(slog.NewTextHandler(&b, &slog.HandlerOptions{Level: slog.LevelWarn}))
	b.Reset()
	Info(quiet, "store thread")
	if b.Len() != 0 {
		t.Errorf("a warn-level logger wrote %q", b.String())
	}
}
