//go:build linux

package bus_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
)

// TestStoreRestartKeepsTheServersStorageLimit: JetStream restarted in
// place once a full volume has the room the server waits for keeps the
// storage limit it had (by default three quarters of what --data-dir had
// free at start, plus what its streams held), and the request log takes
// requests again. Before, the restart took a new limit from the volume's
// free space at that moment: three quarters of the log's own bytes and of
// the little room freed, below what the log already held, so every
// publish was refused as "insufficient resources" — no write error, so
// nothing restarted JetStream again however much room the volume then
// had, until the server was restarted.
func TestStoreRestartKeepsTheServersStorageLimit(t *testing.T) {
	dir := smallVolume(t, "64m")
	log, logs := captureLogger(slog.LevelInfo)
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: filepath.Join(dir, "js"), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := nats.Connect(srv.ClientURL(), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "LOG", Subjects: []string{"log.>"},
		Storage: jetstream.FileStorage, MaxBytes: 40 << 20, Discard: jetstream.DiscardNew}); err != nil {
		t.Fatal(err)
	}
	publish := func() error {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := js.Publish(pctx, "log.x", make([]byte, 8192))
		return err
	}
	// The log holds 24 MiB when the disk fills.
	for range 24 << 20 / 8192 {
		if err := publish(); err != nil {
			t.Fatal(err)
		}
	}
	filler := fill(t, dir, 64<<10)
	failed := false
	for i := 0; i < 4000 && !failed; i++ {
		failed = publish() != nil
	}
	if !failed {
		t.Fatal("every publish was stored on a full disk: the test did not fill it")
	}
	waitFor(t, 20*time.Second, "an error naming the full store", func() bool {
		return strings.Contains(logs.String(), "cannot write its store")
	})
	// The operator frees a little more than the room the server waits for
	// (a tenth of the volume): 7 MiB.
	st, err := os.Stat(filler)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filler, st.Size()-7<<20); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "JetStream restarted", func() bool {
		return strings.Contains(logs.String(), "JetStream restarted in place")
	})
	// Then all of it.
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	var last error
	deadline := time.Now().Add(30 * time.Second)
	for {
		if last = publish(); last == nil {
			break
		}
		if time.Now().After(deadline) {
			var fs syscall.Statfs_t
			_ = syscall.Statfs(dir, &fs)
			t.Fatalf("publishing still fails 30 s after the volume has room (%d bytes free): %v\n%s", fs.Bavail*uint64(fs.Bsize), last, logs.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
}
