package testenv_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers"
)

// TestWorkerUnderAnEarlierAuthConfigSaysToRewriteIt: a rolling upgrade
// that starts a worker of this kvbus, with its own key, while NATS still
// runs the nats-auth.conf of an earlier `kvbus auth init` (no
// kvbus.drain.<g>: the drain plan was on kvbus.pool.<g>.drain; no
// kvbus.ctl.abort.<g>: every worker read kvbus.ctl.abort) stops the
// worker at start; its error names the subject it lacks, says the
// configuration is older and to run
// `kvbus auth init DIR` again and reload NATS, not that its key is another
// role's. After the rewrite and a reload the same key starts it.
func TestWorkerUnderAnEarlierAuthConfigSaysToRewriteIt(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g0"}, false); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, auth.ConfigFile)
	data, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	// The configurations of earlier kvbus: before 2026-12-06 (no drain
	// plan's subject, nor the group's aborts), and of 2026-12-06 (no
	// group's aborts: every worker read kvbus.ctl.abort). Each stops the
	// worker naming the first subject it lacks.
	earlier := []struct {
		strip, refused string
	}{
		{`, "kvbus\.(drain|ctl\.abort)\.[^"]*"`, "kvbus.ctl.abort.g0"},
		{`, "kvbus\.ctl\.abort\.[^"]*"`, "kvbus.ctl.abort.g0"},
		{`, "kvbus\.drain\.[^"]*"`, "kvbus.drain.g0"},
	}
	write := func(strip string) {
		older := regexp.MustCompile(strip).ReplaceAll(data, nil)
		if bytes.Equal(older, data) {
			t.Fatalf("could not write an earlier configuration without %s", strip)
		}
		if err := os.WriteFile(conf, older, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(earlier[0].strip)
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), AuthConfig: conf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	connect := func(key string) *nats.Conn {
		nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), Name: "kvbus-" + key,
			NKeySeedFile: filepath.Join(dir, key+".nk"), InboxPrefix: bus.InboxPrefix(auth.RoleWorker, "g0"), Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc
	}
	admin := connect(auth.RoleAdmin)
	profile, err := workers.LookupModelProfile("tiny")
	if err != nil {
		t.Fatal(err)
	}
	engine, err := workers.NewSimEngine(workers.SimConfig{})
	if err != nil {
		t.Fatal(err)
	}
	rank := func(nc *nats.Conn) *workers.Rank {
		r, err := workers.NewRank(workers.RankConfig{Conn: nc, Group: "g0", TPRank: 0, TPSize: 1, EPRank: 0, EPSize: 1,
			Model: "kvbus-sim", Profile: profile, Engine: engine, CapacityBytes: 1 << 30, DrainHandoff: 1 << 20,
			HeartbeatInterval: 50 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}

	for i, conf := range earlier {
		if i > 0 {
			write(conf.strip)
			if err := srv.Reload(); err != nil {
				t.Fatal(err)
			}
		}
		for _, key := range []string{"worker-g0", "worker"} {
			errc := make(chan error, 1)
			go func() { errc <- rank(connect(key)).Run(t.Context()) }()
			select {
			case err = <-errc:
			case <-time.After(10 * time.Second):
				t.Fatalf("with %s.nk: still running after 10 s under the earlier configuration", key)
			}
			if !errors.Is(err, bus.ErrPermission) || !errors.Is(err, nats.ErrPermissionViolation) {
				t.Fatalf("with %s.nk: Run = %v, want a bus.ErrPermission", key, err)
			}
			for _, want := range []string{conf.refused, "earlier `kvbus auth init`", "Run `kvbus auth init DIR` again",
				"keeps the keys", "reload NATS", "once the frontends run this kvbus"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("with %s.nk, without %s: the error does not say %q: %v", key, conf.strip, want, err)
				}
			}
			if strings.Contains(err.Error(), "another role's") {
				t.Errorf("with %s.nk: the error says the key is another role's, where it is the worker's: %v", key, err)
			}
		}
	}

	if changed, err := auth.RewriteConfig(dir, messages.Subjects{}); err != nil || !changed {
		t.Fatalf("RewriteConfig = %v, %v; want the earlier file rewritten", changed, err)
	}
	if err := srv.Reload(); err != nil {
		t.Fatal(err)
	}
	nc := connect("worker-g0")
	ready := seen(t, admin, messages.Subjects{}.Heartbeat("g0", 0))
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- rank(nc).Run(ctx) }()
	select {
	case <-ready:
	case err := <-errc:
		t.Fatalf("after the rewrite and a reload: Run = %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("after the rewrite and a reload: no heartbeat in 10 s")
	}
	cancel()
	if err := <-errc; err != nil {
		t.Errorf("after the rewrite: Run = %v", err)
	}
}
