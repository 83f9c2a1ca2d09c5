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

// smallVolume mounts a tmpfs of size bytes on a new directory, or skips
// the test where mounting is not allowed (no CAP_SYS_ADMIN).
func smallVolume(t *testing.T, size string) string {
	t.Helper()
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+size); err != nil {
		t.Skipf("cannot mount a small tmpfs here (%v): the test needs to fill a disk", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

// fill writes a file on dir's volume until leave bytes are free.
func fill(t *testing.T, dir string, leave uint64) string {
	t.Helper()
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	free := st.Bavail * uint64(st.Bsize)
	if free <= leave {
		t.Fatalf("%d bytes free on %s, want more than %d", free, dir, leave)
	}
	path := filepath.Join(dir, "filler")
	if err := os.WriteFile(path, make([]byte, free-leave), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestStreamOfAFullDiskWritesAgainOnceThereIsRoom: the disk under the
// JetStream store fills (here a 16 MiB volume), and the request log's
// writes fail: nats-server marks the stream failed ("critical write
// error") and refuses every later publish, even once the disk has room
// again, until the server restarts. kvbus's server says so in an error
// naming the store directory, and restarts JetStream itself once the
// volume has room, its clients staying connected: publishing works again
// within seconds of freeing the disk.
func TestStreamOfAFullDiskWritesAgainOnceThereIsRoom(t *testing.T) {
	dir := smallVolume(t, "16m")
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
		Storage: jetstream.FileStorage, MaxBytes: 4 << 20, Discard: jetstream.DiscardNew}); err != nil {
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
	filler := fill(t, dir, 64<<10)
	acked, failed := 1, false
	for i := 0; i < 2000 && !failed; i++ {
		failed = publish() != nil
		if !failed {
			acked++
		}
	}
	if !failed {
		t.Fatal("every publish was stored on a full disk: the test did not fill it")
	}
	waitFor(t, 20*time.Second, "an error naming the full store", func() bool {
		return strings.Contains(logs.String(), "cannot write its store")
	})
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
			t.Fatalf("publishing still fails 30 s after the disk has room again: %v\n%s", last, logs.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
	if !nc.IsConnected() {
		t.Errorf("the client's connection did not stay up")
	}
	// Nothing the log acknowledged was lost: the stream was read back.
	st, err := js.Stream(ctx, "LOG")
	if err != nil {
		t.Fatal(err)
	}
	if n := st.CachedInfo().State.Msgs; n < uint64(acked+1) {
		t.Errorf("the stream holds %d messages after the restart; %d were acknowledged", n, acked+1)
	}
}
