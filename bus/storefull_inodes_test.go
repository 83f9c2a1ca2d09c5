//go:build linux

package bus_test

import (
	"context"
	"errors"
	"fmt"
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

// TestStoreRestartThatFailsIsTriedAgain: a volume out of inodes (its bytes
// free) fails the stream's next block file, and the in-place restart of
// JetStream too (nats-server checks that its store directory takes a new
// file). The server says the restart failed and tries it again until one
// succeeds: once files can be made on the volume again, publishing works.
// Before, the failed restart left JetStream half started (no API, no
// streams), the next check found no write error and logged "JetStream
// writes its store again", and nothing was tried again: every publish
// failed until the server was restarted.
func TestStoreRestartThatFailsIsTriedAgain(t *testing.T) {
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=64m,nr_inodes=256"); err != nil {
		t.Skipf("cannot mount a small tmpfs here (%v): the test needs to fill a disk", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
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
		Storage: jetstream.FileStorage, MaxBytes: 8 << 20, Discard: jetstream.DiscardNew}); err != nil {
		t.Fatal(err)
	}
	publish := func() error {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := js.Publish(pctx, "log.x", make([]byte, 2048))
		return err
	}
	if err := publish(); err != nil {
		t.Fatal(err)
	}
	// Every inode taken: the next block file cannot be made.
	fillers := filepath.Join(dir, "fillers")
	if err := os.Mkdir(fillers, 0o755); err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		f, err := os.Create(filepath.Join(fillers, fmt.Sprint(i)))
		if errors.Is(err, syscall.ENOSPC) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	failed := false
	for i := 0; i < 4000 && !failed; i++ {
		failed = publish() != nil
	}
	if !failed {
		t.Fatal("every publish was stored without an inode free: the test did not fill the volume")
	}
	waitFor(t, 20*time.Second, "the failed restart to be said", func() bool {
		return strings.Contains(logs.String(), "cannot restart JetStream")
	})
	if err := os.RemoveAll(fillers); err != nil {
		t.Fatal(err)
	}
	var last error
	deadline := time.Now().Add(30 * time.Second)
	for {
		if last = publish(); last == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("publishing still fails 30 s after the volume takes files again: %v\n%s", last, logs.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
}
