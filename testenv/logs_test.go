package testenv_test

import (
	"bytes"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// serialWriter counts the Write calls that overlapped another one.
type serialWriter struct {
	inside, overlaps, storeLines atomic.Int64
}

func (w *serialWriter) Write(p []byte) (int, error) {
	if w.inside.Add(1) > 1 {
		w.overlaps.Add(1)
	}
	if bytes.Contains(p, []byte(`msg="store thread"`)) {
		w.storeLines.Add(1)
	}
	time.Sleep(50 * time.Microsecond) // widen the window an overlap needs
	w.inside.Add(-1)
	return len(p), nil
}

// TestLogToGetsOneLineAtATime: a ClusterConfig.LogTo writer need not be
// safe for concurrent use, though every role logs from many goroutines.
func TestLogToGetsOneLineAtATime(t *testing.T) {
	w := &serialWriter{}
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, Ranks: 4, LogTo: w})
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	if _, err := (testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 7}).Run(t.Context(), 2); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "a store thread line per rank and turn", func() bool { return w.storeLines.Load() >= 8 })
	if n := w.overlaps.Load(); n != 0 {
		t.Fatalf("%d writes to LogTo overlapped another", n)
	}
}
