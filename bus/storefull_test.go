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

// A full disk under the JetStream store (server_store.go). Each test
// mounts a small tmpfs, so they run only where mounting is allowed.

// smallVolume mounts a tmpfs with the given options (size=16m, …) on a new
// directory, or skips the test where mounting is not allowed (no
// CAP_SYS_ADMIN).
func smallVolume(t *testing.T, options string) string {
	t.Helper()
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, options); err != nil {
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

// storeLog starts a server whose store is under dir, connects to it and
// makes a file stream LOG of maxBytes. It returns the server's log, the
// client, and a publish of one message of size bytes onto LOG.
func storeLog(t *testing.T, dir string, maxBytes int64, size int) (*syncBuffer, jetstream.JetStream, func() error) {
	t.Helper()
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
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "LOG", Subjects: []string{"log.>"},
		Storage: jetstream.FileStorage, MaxBytes: maxBytes, Discard: jetstream.DiscardNew}); err != nil {
		t.Fatal(err)
	}
	return logs, js, func() error {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := js.Publish(pctx, "log.x", make([]byte, size))
		return err
	}
}

// publishUntilRefused publishes until one is refused, and returns how many
// were acknowledged; it fails the test if none was refused (the volume was
// not full).
func publishUntilRefused(t *testing.T, publish func() error) (acked int) {
	t.Helper()
	for range 4000 {
		if publish() != nil {
			return acked
		}
		acked++
	}
	t.Fatal("every publish was stored: the test did not fill the volume")
	return acked
}

// publishAgain publishes until one is acknowledged, failing the test after
// 30 s.
func publishAgain(t *testing.T, publish func() error, logs *syncBuffer, dir string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := publish()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			var fs syscall.Statfs_t
			_ = syscall.Statfs(dir, &fs)
			t.Fatalf("publishing still fails 30 s after the volume has room again (%d bytes free): %v\n%s", fs.Bavail*uint64(fs.Bsize), err, logs.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
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
	dir := smallVolume(t, "size=16m")
	logs, js, publish := storeLog(t, dir, 4<<20, 2048)
	if err := publish(); err != nil {
		t.Fatal(err)
	}
	filler := fill(t, dir, 64<<10)
	acked := 1 + publishUntilRefused(t, publish)
	waitFor(t, 20*time.Second, "an error naming the full store", func() bool {
		return strings.Contains(logs.String(), "cannot write its store")
	})
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	publishAgain(t, publish, logs, dir)
	// Nothing the log acknowledged was lost: the stream was read back.
	st, err := js.Stream(t.Context(), "LOG")
	if err != nil {
		t.Fatal(err)
	}
	if n := st.CachedInfo().State.Msgs; n < uint64(acked+1) {
		t.Errorf("the stream holds %d messages after the restart; %d were acknowledged", n, acked+1)
	}
}

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
	dir := smallVolume(t, "size=64m,nr_inodes=256")
	logs, _, publish := storeLog(t, dir, 8<<20, 2048)
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
	publishUntilRefused(t, publish)
	waitFor(t, 20*time.Second, "the failed restart to be said", func() bool {
		return strings.Contains(logs.String(), "cannot restart JetStream")
	})
	if err := os.RemoveAll(fillers); err != nil {
		t.Fatal(err)
	}
	publishAgain(t, publish, logs, dir)
}

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
	dir := smallVolume(t, "size=64m")
	logs, _, publish := storeLog(t, dir, 40<<20, 8192)
	// The log holds 24 MiB when the disk fills.
	for range 24 << 20 / 8192 {
		if err := publish(); err != nil {
			t.Fatal(err)
		}
	}
	filler := fill(t, dir, 64<<10)
	publishUntilRefused(t, publish)
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
	publishAgain(t, publish, logs, dir)
}
