package auth_test

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// snapshot reads every file of dir.
func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, e := range entries {
		if e.IsDir() {
			out[e.Name()] = "<dir>"
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = string(b)
	}
	return out
}

func sameFiles(t *testing.T, what string, before, after map[string]string) {
	t.Helper()
	for name, b := range before {
		if after[name] != b {
			t.Errorf("%s changed %s", what, name)
		}
	}
	for name := range after {
		if _, ok := before[name]; !ok {
			t.Errorf("%s left %s behind", what, name)
		}
	}
}

// TestRotateWithABadSeedWritesNothing: rotating one key of a directory
// where another seed file is bad fails and changes no file. Before, the
// rotated key's new seed was written first and nats-auth.conf never was:
// its old seed was lost and its new one not in the config, so the role was
// locked out at the next NATS reload.
func TestRotateWithABadSeedWritesNothing(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	// The seeds are read in name order: frontend's is renewed before
	// scheduler's is read.
	if err := os.WriteFile(filepath.Join(dir, "scheduler.nk"), []byte("not a seed\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, dir)
	err := auth.Rotate(dir, messages.Subjects{}, "frontend")
	if err == nil || !strings.Contains(err.Error(), "scheduler.nk") {
		t.Fatalf("rotating beside a bad scheduler.nk: %v, want an error naming it", err)
	}
	sameFiles(t, "a failed rotation", before, snapshot(t, dir))
}

// TestInitGroupsWritesNothingOnFailure: adding a group's key when the
// configuration cannot be written (here: nats-auth.conf is a directory)
// fails without writing the group's seed. Before, worker-g0.nk was written
// first, with no permissions in any nats-auth.conf.
func TestInitGroupsWritesNothingOnFailure(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, auth.ConfigFile)
	if err := os.Remove(conf); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(conf, 0o700); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, dir)
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g0"}, false); err == nil {
		t.Fatal("adding a group's key with nats-auth.conf a directory succeeded")
	}
	sameFiles(t, "a failed init --groups", before, snapshot(t, dir))
}

// TestInitWritesTheClusterPassword: init writes the routes' password
// (0600) and keeps it; a directory without one gets it from a second init,
// keys unchanged; --rotate cluster-password replaces only it.
func TestInitWritesTheClusterPassword(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, auth.ClusterPasswordFile)
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("%s: mode %v, want 0600", path, fi.Mode().Perm())
	}
	pw, _ := os.ReadFile(path)
	if len(strings.TrimSpace(string(pw))) < 32 {
		t.Errorf("cluster password %q: too short", pw)
	}
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g0"}, false); err != nil {
		t.Fatal(err)
	}
	if again, _ := os.ReadFile(path); string(again) != string(pw) {
		t.Error("adding a group's key replaced the cluster password")
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, dir)
	written, err := auth.Init(dir, messages.Subjects{}, nil, false)
	if err != nil || len(written) != 0 {
		t.Fatalf("init of a directory without a cluster password: %v, wrote %v", err, written)
	}
	after := snapshot(t, dir)
	if after[auth.ClusterPasswordFile] == "" {
		t.Error("no cluster password written")
	}
	delete(after, auth.ClusterPasswordFile)
	sameFiles(t, "writing the cluster password", before, after)
	pw, _ = os.ReadFile(path)
	before = snapshot(t, dir)
	if err := auth.Rotate(dir, messages.Subjects{}, auth.ClusterPasswordFile); err != nil {
		t.Fatal(err)
	}
	after = snapshot(t, dir)
	if after[auth.ClusterPasswordFile] == string(pw) {
		t.Error("--rotate cluster-password kept the password")
	}
	after[auth.ClusterPasswordFile] = before[auth.ClusterPasswordFile]
	sameFiles(t, "rotating the cluster password", before, after)
}

// TestConfigRewrittenInPlace: nats-auth.conf is rewritten in place by a
// rotation or an added key, the same file (inode) holding the new text:
// compose mounts this one file into the NATS container, which keeps the
// inode it started with, so a file replaced by a rename never reached the
// server's reload (SIGHUP; `make top` adding the observer key found it
// refused after the reload).
func TestConfigRewrittenInPlace(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, auth.ConfigFile)
	inode := func() uint64 {
		t.Helper()
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		return fi.Sys().(*syscall.Stat_t).Ino
	}
	before := inode()
	for step, rewrite := range map[string]func() error{
		"a rotation": func() error { return auth.Rotate(dir, messages.Subjects{}, "worker") },
		"a group's key added": func() error {
			_, err := auth.Init(dir, messages.Subjects{}, []string{"g0"}, false)
			return err
		},
	} {
		text := readFile(t, path)
		if err := rewrite(); err != nil {
			t.Fatal(err)
		}
		if after := readFile(t, path); after == text {
			t.Fatalf("%s: nats-auth.conf not rewritten", step)
		}
		if after := inode(); after != before {
			t.Errorf("%s: nats-auth.conf is inode %d, was %d: a container mounting it sees the old text", step, after, before)
		}
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestForceReplacesTheGroupKeysToo: `kvbus auth init DIR --force` without
// --groups on a directory with worker-g0.nk replaces that key too, as it
// replaces every other. Before, worker-g0.nk kept its old seed, left out
// of nats-auth.conf (its workers were refused at the next reload), and the
// next rotation of any key wrote the old seed's key back into the
// configuration: a key the operator had replaced connected again.
func TestForceReplacesTheGroupKeysToo(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g0"}, false); err != nil {
		t.Fatal(err)
	}
	seed := filepath.Join(dir, "worker-g0.nk")
	old, err := os.ReadFile(seed)
	if err != nil {
		t.Fatal(err)
	}
	oldSeed := filepath.Join(t.TempDir(), "old.nk")
	if err := os.WriteFile(oldSeed, old, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := auth.Init(dir, messages.Subjects{}, nil, true); err != nil {
		t.Fatal(err)
	}
	if now, _ := os.ReadFile(seed); string(now) == string(old) {
		t.Error("--force kept worker-g0.nk's seed")
	}
	// Any later rotation rewrites the configuration from the seeds in DIR.
	if err := auth.Rotate(dir, messages.Subjects{}, "observer"); err != nil {
		t.Fatal(err)
	}
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), AuthConfig: filepath.Join(dir, auth.ConfigFile)})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	if _, err := connect(t, srv, seed); err != nil {
		t.Errorf("worker-g0's current key refused: %v", err)
	}
	if _, err := connect(t, srv, oldSeed); err == nil {
		t.Error("worker-g0's key from before --force connects")
	}
}
