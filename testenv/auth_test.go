package testenv_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/internal/logbuf"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/workers"
)

// TestPipelineWithKeys runs the whole pipeline with one key per role and
// the generated subject permissions: conversations keep their cache, a
// group that loses a rank is routed around, the observer key watches it
// all with kvbus top and tap, and an admin key captures the request log and
// replays it. No role logs a permissions violation: each has every subject
// it uses, and (TestPermissionMatrix) nothing more.
func TestPipelineWithKeys(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Ranks: 2, AuthDir: dir})
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()

	// kvbus top and kvbus tap with the observer key, as an operator runs them.
	watcher := c.StartTop(t)
	observer, err := c.Cluster.Connect("kvbus-observer-tap")
	if err != nil {
		t.Fatal(err)
	}
	tapCtx, stopTap := context.WithCancel(t.Context())
	defer stopTap()
	tapErr := make(chan error, 1)
	var tapped logbuf.Buffer
	go func() { tapErr <- replay.Tap(tapCtx, replay.TapConfig{Conn: observer}, &tapped) }()
	// Tap subscribes on its own goroutine: the conversations start once it
	// hears the bus (the ranks' heartbeats), or it may miss the first
	// request (it did, once, on a loaded host).
	testenv.Eventually(t, 10*time.Second, "kvbus tap hearing the bus", func() bool { return tapped.String() != "" })

	for conv := range 2 {
		turns, err := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 900 + conv,
			Headers: map[string]string{"X-Session-ID": fmt.Sprint("keys-", conv)}}.Run(t.Context(), 3)
		if err != nil {
			t.Fatal(err)
		}
		for i, share := range testenv.PreviousShares(turns, 16) {
			if share < 0.95 {
				t.Errorf("conversation %d turn %d: %.2f of the previous prompt cached, want >= 0.95", conv, i+2, share)
			}
		}
	}

	// top saw both groups and the six requests end; tap printed them.
	testenv.Eventually(t, 5*time.Second, "kvbus top's view of the conversations", func() bool {
		snap := watcher.Snapshot(time.Now())
		return len(snap.Groups) == 2 && snap.Finished == 6 && snap.Failed == 0
	})
	testenv.Eventually(t, 10*time.Second, "kvbus tap's lines", func() bool {
		out := tapped.String()
		return strings.Count(out, `"kind":"req"`) == 6 && strings.Count(out, `"kind":"meta"`) >= 6
	})
	stopTap()
	if err := <-tapErr; err != nil {
		t.Errorf("kvbus tap with the observer key: %v", err)
	}

	// Capture the request log and replay it, as an operator with the admin key.
	admin, err := c.Cluster.Connect("admin-capture")
	if err != nil {
		t.Fatal(err)
	}
	var capture bytes.Buffer
	n, err := replay.Capture(t.Context(), replay.CaptureConfig{Conn: admin}, &capture)
	if err != nil || n != 6 {
		t.Fatalf("captured %d requests (%v), want 6", n, err)
	}
	tr, err := replay.ReadTrace(&capture, replay.FormatCapture)
	if err != nil {
		t.Fatal(err)
	}
	r, err := replay.New(replay.Config{Target: c.NATSURL, Conn: admin, Model: c.Model, Timeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	results, _, err := r.Run(t.Context(), tr.Items)
	if err != nil {
		t.Fatal(err)
	}
	for i, res := range results {
		if res.Err != "" {
			t.Errorf("replayed request %d: %s", i, res.Err)
		}
	}

	// A rank dies: its group leaves placement and requests go to the other.
	c.KillRank(t, "g0", 1)
	testenv.Eventually(t, 10*time.Second, "requests served without g0", func() bool {
		status, _, _ := testenv.Send(t, "POST", c.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"after the kill","max_tokens":2}`, c.Model), nil)
		return status == http.StatusOK && len(c.Scheduler.PlaceableGroups(time.Now())) == 1
	})
	if lines := c.Logs.Lines("permissions violation"); len(lines) > 0 {
		t.Errorf("a role used a subject its key may not:\n%v", lines)
	}
}

// TestRoleWithAnotherRolesKeyStopsAtStart starts each role with a key
// `kvbus auth init` wrote for another role (or another worker group): it
// returns at once an error naming a subject it may not use and the key to
// give it, instead of running deaf (a worker logged "rank started" and ran
// for ever; a frontend waited 30 s for JetStream, or served requests that
// never found a scheduler). With its own key the same role starts.
func TestRoleWithAnotherRolesKeyStopsAtStart(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t, "g0", "g2")
	// connect connects with DIR/<key>.nk and the reply inbox of the role
	// (group: a worker's) the connection is for, as the roles do.
	connect := func(t *testing.T, key, role, group string) *nats.Conn {
		t.Helper()
		nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), Name: "kvbus-" + key,
			NKeySeedFile: filepath.Join(dir, key+".nk"), InboxPrefix: bus.InboxPrefix(role, group), Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc
	}
	admin := connect(t, auth.RoleAdmin, auth.RoleAdmin, "")
	profile, err := workers.LookupModelProfile("tiny")
	if err != nil {
		t.Fatal(err)
	}
	engine, err := workers.NewSimEngine(workers.SimConfig{})
	if err != nil {
		t.Fatal(err)
	}
	subj := messages.Subjects{}
	type role struct {
		// name and group say which reply inbox its connection uses.
		name, group string
		// start makes the role on nc and returns its Run and a channel
		// closed once it runs (a heartbeat, an announcement, the
		// frontend's Ready).
		start func(t *testing.T, nc *nats.Conn) (run func(context.Context) error, ready <-chan struct{})
	}
	worker := func(group string) role {
		return role{auth.RoleWorker, group, func(t *testing.T, nc *nats.Conn) (func(context.Context) error, <-chan struct{}) {
			rank, err := workers.NewRank(workers.RankConfig{Conn: nc, Group: group, TPRank: 0, TPSize: 1, EPRank: 0, EPSize: 1,
				Model: "kvbus-sim", Profile: profile, Engine: engine, CapacityBytes: 1 << 30, HeartbeatInterval: 50 * time.Millisecond,
				Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			return rank.Run, seen(t, admin, subj.Heartbeat(group, 0))
		}}
	}
	frontendRole := role{auth.RoleFrontend, "", func(t *testing.T, nc *nats.Conn) (func(context.Context) error, <-chan struct{}) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		fe, err := frontend.New(frontend.Config{Conn: nc, Listener: ln, Models: []string{"kvbus-sim"}, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		return fe.Run, fe.Ready()
	}}
	schedulerRole := role{auth.RoleScheduler, "", func(t *testing.T, nc *nats.Conn) (func(context.Context) error, <-chan struct{}) {
		s, err := scheduler.New(scheduler.Config{Conn: nc, Policy: &scheduler.RoundRobinPolicy{}, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		return s.Run, seen(t, admin, subj.Announce(messages.RoleScheduler, s.ID()))
	}}
	for _, tt := range []struct {
		name      string
		role      role
		key       string   // the wrong key given
		subject   string   // the subject the error names
		advice    []string // the keys it says to give
		rightKeys []string
	}{
		{"worker with the frontend key", worker("g2"), "frontend", "kvbus.meta.g2.>", []string{"worker-g2.nk", "worker.nk"}, []string{"worker", "worker-g2"}},
		{"worker with another group's key", worker("g2"), "worker-g0", "kvbus.meta.g2.>", []string{"worker-g2.nk", "worker.nk"}, nil},
		{"frontend with the worker key", frontendRole, "worker", "kvbus.out.", []string{"frontend.nk"}, []string{"frontend"}},
		{"frontend with the scheduler key", frontendRole, "scheduler", "kvbus.out.", []string{"frontend.nk"}, nil},
		{"scheduler with the worker key", schedulerRole, "worker", "kvbus.kv.>", []string{"scheduler.nk"}, []string{"scheduler"}},
		{"scheduler with the frontend key", schedulerRole, "frontend", "kvbus.hb.>", []string{"scheduler.nk"}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			run, _ := tt.role.start(t, connect(t, tt.key, tt.role.name, tt.role.group))
			start := time.Now()
			errc := make(chan error, 1)
			go func() { errc <- run(t.Context()) }()
			var err error
			select {
			case err = <-errc:
			case <-time.After(10 * time.Second):
				t.Fatal("still running after 10 s with another role's key")
			}
			t.Logf("Run = %v", err)
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("the error took %s, want at start", took)
			}
			if !errors.Is(err, bus.ErrPermission) || !errors.Is(err, nats.ErrPermissionViolation) {
				t.Fatalf("Run = %v, want a bus.ErrPermission", err)
			}
			for _, want := range append([]string{tt.subject, "--nats-nkey"}, tt.advice...) {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("the error does not say %q: %v", want, err)
				}
			}
			for _, key := range tt.rightKeys {
				nc := connect(t, key, tt.role.name, tt.role.group)
				run, ready := tt.role.start(t, nc)
				ctx, cancel := context.WithCancel(t.Context())
				errc := make(chan error, 1)
				go func() { errc <- run(ctx) }()
				select {
				case <-ready:
				case err := <-errc:
					t.Fatalf("with %s.nk: Run = %v", key, err)
				case <-time.After(10 * time.Second):
					t.Fatalf("with %s.nk: not started after 10 s", key)
				}
				cancel()
				if err := <-errc; err != nil {
					t.Errorf("with %s.nk: Run = %v", key, err)
				}
				if err := nc.LastError(); err != nil {
					t.Errorf("with %s.nk: the connection saw %v", key, err)
				}
			}
		})
	}
}

// seen is closed when a message arrives on subject.
func seen(t *testing.T, nc *nats.Conn, subject string) <-chan struct{} {
	t.Helper()
	ch := make(chan struct{})
	var once sync.Once
	sub, err := nc.Subscribe(subject, func(*nats.Msg) { once.Do(func() { close(ch) }) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return ch
}
