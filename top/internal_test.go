package top

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// feedSessions has w see n sessions of one finished turn each, the last
// ones most recently, ending at now.
func feedSessions(b *testing.B, w *Watcher, n int, now time.Time) {
	b.Helper()
	for i := range n {
		at := now.Add(-time.Duration(n-i) * time.Millisecond)
		id := fmt.Sprintf("r%d", i)
		req, err := messages.Marshal(&messages.Request{RequestID: id, SessionID: fmt.Sprintf("session-%08d", i), Model: "m", FrontendID: "fe",
			ArrivalUnixMs: at.UnixMilli(), PromptTokenIDs: []uint32{1, 2, 3}})
		if err != nil {
			b.Fatal(err)
		}
		out, err := messages.Marshal(&messages.Output{ReqID: id, Text: "x", FinishReason: "stop",
			Usage: &messages.Usage{PromptTokens: 3, CachedTokens: 1}})
		if err != nil {
			b.Fatal(err)
		}
		w.onRequest(&nats.Msg{Data: req}, at)
		w.onOutput(&nats.Msg{Data: out}, at)
	}
}

// BenchmarkSnapshot200kSessions: the cost of a snapshot (twice a second in
// the terminal) after 200,000 sessions were seen within half an hour, and
// the heap the watcher holds for them (heap_MB).
func BenchmarkSnapshot200kSessions(b *testing.B) {
	// Never run: fed directly.
	w, err := New(Config{Conn: &nats.Conn{}})
	if err != nil {
		b.Fatal(err)
	}
	now := time.Now()
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	feedSessions(b, w, 200_000, now)
	w.expire(now) // what a running watcher does every 5 s
	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	heapMB := float64(after.HeapInuse-before.HeapInuse) / (1 << 20)
	b.ResetTimer()
	for range b.N {
		s := w.Snapshot(now)
		if len(s.Sessions) == 0 {
			b.Fatal("no sessions")
		}
	}
	b.ReportMetric(heapMB, "heap_MB")
	runtime.KeepAlive(w)
}

// TestRefreshIsHonoured: a --refresh above 1 s is what the view waits
// (it was silently clamped to 1 s).
func TestRefreshIsHonoured(t *testing.T) {
	w, err := New(Config{Conn: &nats.Conn{}})
	if err != nil {
		t.Fatal(err)
	}
	if m := NewModel(w, 5*time.Second, 10); m.refresh != 5*time.Second {
		t.Errorf("refresh %s, want 5s", m.refresh)
	}
}
