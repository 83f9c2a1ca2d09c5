package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/alecthomas/kong"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/messages"
)

// TestAuthInitHelpNamesEveryRole: `kvbus auth init --help` lists the keys
// it writes, one per role of auth.Roles(); it named four, leaving out the
// observer key that top and tap use.
func TestAuthInitHelpNamesEveryRole(t *testing.T) {
	var c cli
	p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"), kong.Exit(func(int) {}))
	if err != nil {
		t.Fatal(err)
	}
	var help string
	for _, n := range p.Model.Node.Children {
		if n.Name != "auth" {
			continue
		}
		for _, ch := range n.Children {
			if ch.Name == "init" {
				help = ch.Help
			}
		}
	}
	if help == "" {
		t.Fatal("kvbus auth init has no help")
	}
	for _, role := range auth.Roles() {
		if !strings.Contains(help, role) {
			t.Errorf("kvbus auth init --help does not name the %s key it writes: %q", role, help)
		}
	}
}

// TestAuthProbeChecksTheSubjectFirst: `kvbus auth probe --publish` with
// something no client can publish to is refused at once, naming the flag;
// it was found out only after the connection (10 s of retries when NATS
// was not there, then advice to start one).
func TestAuthProbeChecksTheSubjectFirst(t *testing.T) {
	for _, bad := range []string{"a b", "a..b", "", "kvbus.req.>", "kvbus.*.g0"} {
		c := parseCLI(t, "auth", "probe", "--publish", bad, "--nats-url", "nats://127.0.0.1:1")
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		start := time.Now()
		err := c.Auth.Probe.Run(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "--publish") || time.Since(start) > time.Second {
			t.Errorf("--publish %q: %v after %v; want an error at once naming --publish", bad, err, time.Since(start).Round(time.Millisecond))
		}
	}
}

// TestAuthRotateRefusesForceAndGroups: `kvbus auth init DIR --rotate K`
// with --groups or --force is refused, and rotates nothing: --rotate did
// its one key alone, writing no key for --groups and replacing no other
// for --force, and said only "new key K".
func TestAuthRotateRefusesForceAndGroups(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	seed, _ := os.ReadFile(filepath.Join(dir, "worker.nk"))
	for _, c := range []*authInitCmd{{Dir: dir, Rotate: "worker", Groups: []string{"g5"}}, {Dir: dir, Rotate: "worker", Force: true}} {
		err := c.Run()
		if err == nil || !strings.Contains(err.Error(), "--rotate") || (!strings.Contains(err.Error(), "--groups") || !strings.Contains(err.Error(), "--force")) {
			t.Errorf("--rotate with --groups %v, --force %v: %v; want it refused naming the flags", c.Groups, c.Force, err)
		}
	}
	if again, _ := os.ReadFile(filepath.Join(dir, "worker.nk")); string(again) != string(seed) {
		t.Error("worker.nk was rotated by a refused command")
	}
	if _, err := os.Stat(filepath.Join(dir, "worker-g5.nk")); err == nil {
		t.Error("worker-g5.nk was written by a refused command")
	}
}

// TestAuthInitGroupNamedTwice: `kvbus auth init DIR --groups g0,g0` writes
// g0's key once; it failed with "rename …worker-g0.nk.tmp: no such file or
// directory".
func TestAuthInitGroupNamedTwice(t *testing.T) {
	dir := t.TempDir()
	if err := (&authInitCmd{Dir: dir, Groups: []string{"g0", "g1", "g0"}}).Run(); err != nil {
		t.Fatalf("auth init --groups g0,g1,g0: %v", err)
	}
	for _, g := range []string{"g0", "g1"} {
		if _, err := os.Stat(filepath.Join(dir, "worker-"+g+".nk")); err != nil {
			t.Errorf("worker-%s.nk: %v", g, err)
		}
	}
}
