package bus_test

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// keyedConn connects to srv with the key DIR/<key>.nk and the reply inbox
// prefix of the role the connection is for (bus.InboxPrefix).
func keyedConn(t *testing.T, srv *bus.Server, dir, key, inbox string) *nats.Conn {
	t.Helper()
	nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), NKeySeedFile: filepath.Join(dir, key+".nk"),
		InboxPrefix: inbox, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// TestCheckPermissions: a key refused one of the role's subjects fails the
// check, naming the first subject refused and the key to give; the role's
// own key, a bus without keys, and a violation of a subject that is not
// the role's pass; the check leaves no subscription behind.
func TestCheckPermissions(t *testing.T) {
	s := messages.Subjects{}
	worker := bus.RoleCheck{Role: "worker", Group: "g2",
		Subscribe: []string{s.MetaGroup("g2"), s.AbortGroup("g2"), s.Dump("g2", 0), s.Pool("g2", 0)}}

	open := testenv.Connect(t, testenv.StartNATS(t))
	if err := bus.CheckPermissions(t.Context(), open, worker); err != nil {
		t.Errorf("on a bus without keys: %v", err)
	}
	if n := open.NumSubscriptions(); n != 0 {
		t.Errorf("%d subscriptions left behind", n)
	}

	srv, dir := testenv.StartKeyedNATS(t, "g0")
	for _, key := range []string{"worker", "admin"} {
		nc := keyedConn(t, srv, dir, key, bus.InboxPrefix("worker", "g2"))
		// A refused publish of another role's subject is not the check's.
		if err := nc.Publish(s.Request("m"), nil); err != nil {
			t.Fatal(err)
		}
		if err := bus.CheckPermissions(t.Context(), nc, worker); err != nil {
			t.Errorf("with %s.nk: %v", key, err)
		}
	}
	for _, key := range []string{"frontend", "worker-g0"} {
		nc := keyedConn(t, srv, dir, key, bus.InboxPrefix("worker", "g2"))
		start := time.Now()
		err := bus.CheckPermissions(t.Context(), nc, worker)
		if !errors.Is(err, bus.ErrPermission) || !errors.Is(err, nats.ErrPermissionViolation) {
			t.Fatalf("with %s.nk: %v, want ErrPermission", key, err)
		}
		if took := time.Since(start); took > time.Second {
			t.Errorf("with %s.nk: the check took %s", key, took)
		}
		// Each subject of g2's worker is refused to these keys (g0's
		// worker reads kvbus.ctl.abort.g0, not g2's): the first refused is
		// named.
		for _, want := range []string{"worker of group g2", `subscribe to kvbus.meta.g2.>`, "--nats-nkey DIR/worker-g2.nk", "DIR/worker.nk"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("with %s.nk: the error does not say %q: %v", key, want, err)
			}
		}
		if n := nc.NumSubscriptions(); n != 0 {
			t.Errorf("with %s.nk: %d subscriptions left behind", key, n)
		}
	}
}

// TestEnsureRequestStreamWithoutJetStreamPermission: a key the server
// refuses the request log's JetStream API fails in one attempt (3 s), not
// after the whole setup timeout, and says so rather than asking whether
// JetStream is enabled.
func TestEnsureRequestStreamWithoutJetStreamPermission(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t)
	js, err := jetstream.New(keyedConn(t, srv, dir, "worker", bus.InboxPrefix("frontend", "")))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second) // as the roles give it
	defer cancel()
	start := time.Now()
	_, err = bus.EnsureRequestStream(ctx, js, bus.StreamConfig{})
	if took := time.Since(start); took > 6*time.Second {
		t.Errorf("took %s, want one attempt", took)
	}
	if !errors.Is(err, bus.ErrPermission) {
		t.Fatalf("EnsureRequestStream = %v, want ErrPermission", err)
	}
	for _, want := range []string{"$JS.API.STREAM.INFO.KVBUS_REQUESTS", "no JetStream permission", "kvbus auth init"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}
	if strings.Contains(err.Error(), "is JetStream enabled") {
		t.Errorf("the error asks whether JetStream is enabled: %v", err)
	}
	// With its own key the same call succeeds.
	js, err = jetstream.New(keyedConn(t, srv, dir, "frontend", bus.InboxPrefix("frontend", "")))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{}); err != nil {
		t.Errorf("with frontend.nk: %v", err)
	}
}

// TestCheckPermissionsWithTheObserverKey: a role given the observer key
// (kvbus top and tap's), which reads every kvbus subject and may make no
// request, is told its key is wrong and which to give. Before, since every
// subject of the role passed and only its reply inbox was refused, it was
// told that nats-auth.conf came from an older kvbus auth init and to run
// it again, which changes nothing.
func TestCheckPermissionsWithTheObserverKey(t *testing.T) {
	s := messages.Subjects{}
	srv, dir := testenv.StartKeyedNATS(t)
	frontend := bus.RoleCheck{Role: "frontend", Subscribe: []string{s.Out("fe-1"), s.AnnounceRole(messages.RoleScheduler)}}
	nc := keyedConn(t, srv, dir, "observer", bus.InboxPrefix("frontend", ""))
	err := bus.CheckPermissions(t.Context(), nc, frontend)
	if !errors.Is(err, bus.ErrPermission) {
		t.Fatalf("with observer.nk: %v, want ErrPermission", err)
	}
	for _, want := range []string{"observer", "--nats-nkey DIR/frontend.nk"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("with observer.nk: the error does not say %q: %v", want, err)
		}
	}
	if strings.Contains(err.Error(), "older") {
		t.Errorf("with observer.nk: the error blames an older nats-auth.conf: %v", err)
	}
	if n := nc.NumSubscriptions(); n != 0 {
		t.Errorf("%d subscriptions left behind", n)
	}
}

// TestRefusedLogUpdateIsNoLaterPermissionError: a frontend key is refused
// switching an older DiscardOld request log (only admin may) and goes on
// with the log as it is; that refusal stays the connection's last error,
// and a later JetStream call that fails for another reason (here, its
// time ran out) is that reason, not a permission error. Before, every
// later failure on the stream was reported as ErrPermission, which the
// roles' retries give up on.
func TestRefusedLogUpdateIsNoLaterPermissionError(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t)
	ctx := t.Context()
	admin, err := jetstream.New(keyedConn(t, srv, dir, "admin", ""))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CreateStream(ctx, jetstream.StreamConfig{Name: messages.RequestStream, Subjects: []string{"kvbus.req.>"},
		Storage: jetstream.FileStorage, MaxBytes: 1 << 20, Discard: jetstream.DiscardOld}); err != nil {
		t.Fatal(err)
	}
	nc := keyedConn(t, srv, dir, "frontend", bus.InboxPrefix("frontend", ""))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{}); err != nil {
		t.Fatalf("with the log's update refused: %v", err)
	}
	if err := nc.LastError(); !errors.Is(err, nats.ErrPermissionViolation) || !strings.Contains(err.Error(), "STREAM.UPDATE") {
		t.Fatalf("the update was not refused: last error %v", err)
	}
	short, cancel := context.WithTimeout(ctx, time.Nanosecond)
	defer cancel()
	<-short.Done()
	_, err = bus.EnsureRequestStream(short, js, bus.StreamConfig{})
	if err == nil {
		t.Fatal("EnsureRequestStream succeeded with its time run out")
	}
	if errors.Is(err, bus.ErrPermission) {
		t.Fatalf("a call that ran out of time is reported as a permission error: %v", err)
	}
}
