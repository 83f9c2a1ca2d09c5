package auth_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// server starts an embedded nats-server with the authorization block Init
// wrote into dir (keys for groups g0 and g1 too).
func server(t *testing.T) (*bus.Server, string) {
	t.Helper()
	return testenv.StartKeyedNATS(t, "g0", "g1")
}

// client is a connection that records the server's permission errors.
type client struct {
	nc *nats.Conn
}

func connect(t *testing.T, srv *bus.Server, seed string) (*client, error) {
	t.Helper()
	c := &client{}
	opts := []nats.Option{nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}), nats.MaxReconnects(0)}
	if seed != "" {
		o, err := nats.NkeyOptionFromSeed(seed)
		if err != nil {
			t.Fatal(err)
		}
		opts = append(opts, o)
	}
	nc, err := nats.Connect(srv.ClientURL(), opts...)
	if err != nil {
		return nil, err
	}
	t.Cleanup(nc.Close)
	c.nc = nc
	return c, nil
}

// violated reports whether the server answered the last action with a
// permissions violation naming subject: nats.go records it as the
// connection's last error when it reads the -ERR, which precedes the
// flush's PONG.
func (c *client) violated(t *testing.T, subject string) bool {
	t.Helper()
	if err := c.nc.FlushTimeout(2 * time.Second); err != nil {
		t.Fatalf("flush: %v", err)
	}
	err := c.nc.LastError()
	return errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), subject)
}

// TestPermissionMatrix: each cell is a real publish or subscribe by a role's
// key against the server loaded with the generated configuration, which
// either succeeds or gets the server's permissions violation.
func TestPermissionMatrix(t *testing.T) {
	srv, dir := server(t)
	if _, err := connect(t, srv, ""); err == nil || !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Errorf("a client without a key connected (err %v)", err)
	}
	// A key the configuration does not list is refused too.
	kp, _ := nkeys.CreateUser()
	stranger, _ := kp.Seed()
	strangerFile := filepath.Join(t.TempDir(), "stranger.nk")
	if err := os.WriteFile(strangerFile, stranger, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := connect(t, srv, strangerFile); err == nil || !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Errorf("an unknown key connected (err %v)", err)
	}
	const (
		pub = "publish"
		sub = "subscribe"
	)
	cells := []struct {
		key, action, subject string
		allowed              bool
	}{
		// A worker runs requests it is given; it never takes them itself.
		{"worker", pub, "kvbus.req.kvbus-sim", false},
		{"worker", sub, "kvbus.req.>", false},
		{"worker", pub, "$JS.API.STREAM.INFO.KVBUS_REQUESTS", false},
		{"worker", pub, "$JS.API.CONSUMER.CREATE.KVBUS_REQUESTS.mine", false},
		{"worker", sub, "kvbus.out.>", false},
		{"worker", sub, "kvbus.out.fe-1", false},
		{"worker", pub, "kvbus.out.fe-1", true},
		{"worker", pub, "kvbus.kv.g0.0", true},
		{"worker", pub, "kvbus.hb.g0.0", true},
		{"worker", sub, "kvbus.meta.g0.>", true},
		{"worker", pub, "kvbus.meta.g0.s", false},
		{"worker", pub, "kvbus.pool.g1.0", true},
		{"worker", pub, "$KV.KVBUS_RANKS.g0.0", true},
		// One group's worker key: only that group.
		{"worker-g0", sub, "kvbus.meta.g0.>", true},
		{"worker-g0", sub, "kvbus.meta.g1.>", false},
		{"worker-g0", sub, "kvbus.ctl.dump.g1.0", false},
		{"worker-g0", sub, "kvbus.pool.g1.>", false},
		{"worker-g0", pub, "kvbus.kv.g1.0", false},
		{"worker-g0", pub, "kvbus.hb.g1.0", false},
		{"worker-g0", pub, "kvbus.pool.g1.0", true},
		// ...but tells only its own group's ranks what to hand off.
		{"worker-g0", pub, messages.Subjects{}.Drain("g0"), true},
		{"worker-g0", sub, messages.Subjects{}.Drain("g0"), true},
		{"worker-g0", pub, messages.Subjects{}.Drain("g1"), false},
		{"worker-g0", sub, messages.Subjects{}.Drain("g1"), false},
		// --rank auto --group g0: only g0's slots.
		{"worker-g0", pub, "$KV.KVBUS_RANKS.g0.3", true},
		{"worker-g0", pub, "$KV.KVBUS_RANKS.g1.0", false},
		// A frontend publishes requests and reads its outputs.
		{"frontend", pub, "kvbus.req.kvbus-sim", true},
		{"frontend", sub, "kvbus.out.fe-1", true},
		{"frontend", sub, "kvbus.meta.>", false},
		{"frontend", pub, "kvbus.meta.g0.s", false},
		{"frontend", pub, "kvbus.kv.g0.0", false},
		{"frontend", pub, "kvbus.hb.g0.0", false},
		{"frontend", sub, "kvbus.req.>", false},
		{"frontend", pub, "$JS.API.STREAM.MSG.GET.KVBUS_REQUESTS", false},
		{"frontend", pub, "$JS.API.CONSUMER.CREATE.KVBUS_REQUESTS.mine", false},
		// Its create is also its update: the schedulers' alone.
		{"frontend", pub, "$JS.API.CONSUMER.CREATE.KVBUS_REQUESTS.kvbus-scheduler", false},
		{"frontend", pub, "$JS.API.CONSUMER.DURABLE.CREATE.KVBUS_REQUESTS.kvbus-scheduler", false},
		{"scheduler", pub, "$JS.API.CONSUMER.CREATE.KVBUS_REQUESTS.kvbus-scheduler", true},
		{"frontend", pub, "$JS.API.STREAM.DELETE.KVBUS_REQUESTS", false},
		// An update could make the log republish ReqMetas where it reads.
		{"frontend", pub, "$JS.API.STREAM.UPDATE.KVBUS_REQUESTS", false},
		{"frontend", pub, "$JS.API.STREAM.CREATE.KVBUS_REQUESTS", true},
		{"scheduler", pub, "$JS.API.STREAM.UPDATE.KVBUS_REQUESTS", false},
		{"scheduler", pub, "$JS.API.STREAM.PURGE.KVBUS_REQUESTS", true},
		{"admin", pub, "$JS.API.STREAM.UPDATE.KVBUS_REQUESTS", true},
		// A scheduler places; it does not speak for ranks.
		{"scheduler", pub, "kvbus.kv.g0.0", false},
		{"scheduler", pub, "kvbus.hb.g0.0", false},
		{"scheduler", pub, "kvbus.meta.g0.s", true},
		{"scheduler", sub, "kvbus.kv.>", true},
		{"scheduler", pub, "kvbus.req.kvbus-sim", false},
		{"scheduler", pub, "$JS.API.CONSUMER.MSG.NEXT.KVBUS_REQUESTS.kvbus-scheduler", true},
		{"scheduler", pub, "$JS.API.STREAM.MSG.GET.KVBUS_REQUESTS", true},
		{"scheduler", sub, "kvbus.ann.scheduler.sched-1", true},
		{"scheduler", sub, "kvbus.ann.frontend.f1", false},
		{"scheduler", pub, "$JS.API.CONSUMER.CREATE.KVBUS_REQUESTS.mine", false},
		// Reply inboxes: each role reads only its own (bus.InboxPrefix), so
		// no key reads the request log's deliveries to the schedulers, the
		// JetStream API's answers, dumps or pool reads of another.
		{"worker-g1", sub, "_INBOX.>", false},
		{"worker-g1", sub, "_INBOX_scheduler.>", false},
		{"worker-g1", sub, "_INBOX_frontend.>", false},
		{"worker-g1", sub, "_INBOX_worker.>", false},
		{"worker-g1", sub, "_INBOX_worker_g.g0.>", false},
		{"worker-g1", sub, "_INBOX_worker_g.>", false},
		{"worker-g1", sub, "_INBOX_worker_g.g1.>", true},
		{"worker-g1", sub, "_INBOX_worker_g.g1.abc", true},
		{"worker", sub, "_INBOX.>", false},
		{"worker", sub, "_INBOX_scheduler.>", false},
		{"worker", sub, "_INBOX_worker.>", true},
		{"worker", sub, "_INBOX_worker_g.g1.>", true},
		{"frontend", sub, "_INBOX.>", false},
		{"frontend", sub, "_INBOX_scheduler.>", false},
		{"frontend", sub, "_INBOX_frontend.>", true},
		{"scheduler", sub, "_INBOX.>", false},
		{"scheduler", sub, "_INBOX_frontend.>", false},
		{"scheduler", sub, "_INBOX_scheduler.>", true},
		{"admin", sub, "_INBOX.>", true},
		{"admin", sub, "_INBOX_scheduler.>", true},
		// The observer (kvbus top, tap) reads every kvbus subject, prompts
		// and answers included, and can write nothing: no message, no
		// JetStream API call (a consumer it made could deliver the request
		// log onto any subject), no reply inbox of a role.
		{"observer", sub, "kvbus.>", true},
		{"observer", sub, "kvbus.meta.g0.>", true},
		{"observer", sub, "kvbus.out.fe-1", true},
		{"observer", pub, "kvbus.req.kvbus-sim", false},
		{"observer", pub, "kvbus.out.fe-1", false},
		{"observer", pub, "kvbus.kv.g0.0", false},
		{"observer", pub, "kvbus.hb.g0.0", false},
		{"observer", pub, "kvbus.ctl.abort", false},
		// A frontend asks the schedulers which group runs a request that
		// lost outputs, then that group's driver; no other role may ask,
		// and a group's worker hears only its own group's asks (and
		// kvbus.ctl.resend, which a worker before 2026-12-07 read).
		{"frontend", pub, "kvbus.ctl.resend", true},
		{"frontend", pub, "kvbus.ctl.resend.g1", true},
		{"scheduler", sub, "kvbus.ctl.resend", true},
		{"worker-g1", sub, "kvbus.ctl.resend.g1", true},
		{"worker-g1", sub, "kvbus.ctl.resend.g0", false},
		{"worker-g1", sub, "kvbus.ctl.resend", true},
		{"worker", sub, "kvbus.ctl.resend.*", true},
		{"scheduler", pub, "kvbus.ctl.resend", false},
		// It answers a frontend's ask in the frontend's inbox, and no
		// other role's.
		{"scheduler", pub, "_INBOX_frontend.abc.1", true},
		{"scheduler", pub, "_INBOX_worker.abc.1", false},
		{"scheduler", pub, "_INBOX_worker_g.g0.abc", false},
		{"worker", pub, "_INBOX_frontend.abc.1", false},
		{"scheduler", pub, "kvbus.ctl.resend.g1", false},
		{"worker-g1", pub, "kvbus.ctl.resend.g0", false},
		{"observer", pub, "kvbus.ctl.resend", false},
		{"observer", pub, "kvbus.ctl.resend.g0", false},
		{"observer", pub, "$JS.API.INFO", false},
		{"observer", pub, "$JS.API.CONSUMER.CREATE.KVBUS_REQUESTS.mine", false},
		{"observer", pub, "$JS.API.STREAM.MSG.GET.KVBUS_REQUESTS", false},
		{"observer", pub, "$KV.KVBUS_RANKS.g0.0", false},
		{"observer", sub, "_INBOX.>", false},
		{"observer", sub, "_INBOX_scheduler.>", false},
		{"observer", sub, "$JS.API.>", false},
		// Only admin reads the whole request log (capture, replay).
		{"admin", pub, "$JS.API.STREAM.MSG.GET.KVBUS_REQUESTS", true},
		{"admin", pub, "$JS.API.CONSUMER.CREATE.KVBUS_REQUESTS.capture", true},
		{"admin", sub, "kvbus.req.>", true},
		{"admin", sub, ">", true},
	}
	for _, cell := range cells {
		t.Run(cell.key+" "+cell.action+" "+cell.subject, func(t *testing.T) {
			c, err := connect(t, srv, filepath.Join(dir, cell.key+".nk"))
			if err != nil {
				t.Fatalf("%s key refused: %v", cell.key, err)
			}
			if cell.action == pub {
				if err := c.nc.Publish(cell.subject, []byte("x")); err != nil {
					t.Fatal(err)
				}
			} else if _, err := c.nc.SubscribeSync(cell.subject); err != nil {
				t.Fatal(err)
			}
			if got := !c.violated(t, cell.subject); got != cell.allowed {
				t.Errorf("%s may %s %s: %v, want %v", cell.key, cell.action, cell.subject, got, cell.allowed)
			}
		})
	}
}

// TestInitRefusesToOverwrite: keys are rotated only on purpose; seeds are
// private to their owner (0600).
func TestInitRefusesToOverwrite(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadFile(filepath.Join(dir, "worker.nk"))
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); !errors.Is(err, auth.ErrExists) {
		t.Fatalf("second Init: %v, want ErrExists", err)
	}
	if _, err := auth.Init(dir, messages.Subjects{}, nil, true); err != nil {
		t.Fatal(err)
	}
	after, _ := os.ReadFile(filepath.Join(dir, "worker.nk"))
	if string(before) == string(after) {
		t.Error("--force did not rotate the worker key")
	}
	for _, role := range auth.Roles() {
		fi, err := os.Stat(filepath.Join(dir, role+".nk"))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s.nk has mode %v, want 0600", role, fi.Mode().Perm())
		}
	}
	if _, err := auth.Init(t.TempDir(), messages.Subjects{}, []string{"bad group!"}, false); !errors.Is(err, auth.ErrConfig) {
		t.Errorf("a bad group name: %v, want ErrConfig", err)
	}
}

// TestViolationLoggedOnce: a role that keeps using a forbidden subject gets
// the server's error each time but logs it once, with the subject, and its
// connection keeps working.
func TestViolationLoggedOnce(t *testing.T) {
	srv, dir := server(t)
	var logs strings.Builder
	var mu sync.Mutex
	log := newLogger(&mu, &logs)
	nc, err := bus.Connect(context.Background(), bus.Config{URL: srv.ClientURL(), NKeySeedFile: filepath.Join(dir, "worker.nk"), Name: "w", Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	for range 5 {
		if err := nc.Publish("kvbus.req.kvbus-sim", []byte("x")); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Publish("kvbus.kv.g0.0", []byte("x")); err != nil || nc.Flush() != nil || !nc.IsConnected() {
		t.Fatalf("the connection no longer works after violations (%v)", err)
	}
	read := func() string {
		mu.Lock()
		defer mu.Unlock()
		return logs.String()
	}
	// The handler runs on nats.go's callback goroutine.
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(read(), "kvbus.req.kvbus-sim") && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	out := read()
	if n := strings.Count(out, `msg="nats permissions violation`); n != 1 || !strings.Contains(out, "kvbus.req.kvbus-sim") {
		t.Errorf("%d violation lines, want 1 naming the subject:\n%s", n, out)
	}
	// The subject field names it too (nats.go gives the handler no
	// subscription: it was subject="", the subject only inside err).
	if !strings.Contains(out, "subject=kvbus.req.kvbus-sim ") {
		t.Errorf("the violation line's subject field does not name kvbus.req.kvbus-sim:\n%s", out)
	}
}

// TestSchedulerWatchesTheSessionBucketPastFlowControl: a scheduler watches
// the session bucket (other replicas' bindings) with an ordered consumer,
// which the server paces with flow-control messages once ~1 MiB is
// pending; the client answers each on $JS.FC.<stream>.…, which the
// scheduler's key could not publish. The server then stopped delivering
// for good at ~2 MiB: in a compose fault review both schedulers' watches
// stalled 2.5 minutes into the load, and NATS logged a publish violation
// every 10 s from then on. The watch now gets every update.
func TestSchedulerWatchesTheSessionBucketPastFlowControl(t *testing.T) {
	srv, dir := server(t)
	ctx := t.Context()
	conn := func(role string) *nats.Conn {
		nc, err := bus.Connect(ctx, bus.Config{URL: srv.ClientURL(), NKeySeedFile: filepath.Join(dir, role+".nk"), Name: role,
			InboxPrefix: bus.InboxPrefix(role, ""), Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc
	}
	bucket := messages.Subjects{}.SessionBucket()
	js, err := jetstream.New(conn("scheduler"))
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket})
	if err != nil {
		t.Fatal(err)
	}
	w, err := kv.WatchAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = w.Stop() }()
	// Another replica writes 4 MiB of bindings.
	writer, err := jetstream.New(conn("scheduler"))
	if err != nil {
		t.Fatal(err)
	}
	wkv, err := writer.KeyValue(ctx, bucket)
	if err != nil {
		t.Fatal(err)
	}
	const n, size = 128, 32 << 10
	for i := range n {
		if _, err := wkv.Put(ctx, fmt.Sprintf("s%d", i), bytes.Repeat([]byte("x"), size)); err != nil {
			t.Fatal(err)
		}
	}
	got := 0
	timeout := time.After(10 * time.Second)
	for got < n {
		select {
		case e := <-w.Updates():
			if e != nil {
				got++
			}
		case <-timeout:
			t.Fatalf("the watch got %d of %d updates (%d KiB of %d): it stalled", got, n, got*size>>10, n*size>>10)
		}
	}
}

// TestMatrix: `kvbus auth show` prints every key's allow-lists.
func TestMatrix(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g3"}, false); err != nil {
		t.Fatal(err)
	}
	m, err := auth.Matrix(dir, messages.Subjects{})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"frontend (frontend.nk)", "publish:   kvbus.req.>", "worker-g3 (worker-g3.nk)", "kvbus.meta.g3.>",
		"observer (observer.nk)\n  publish:   nothing\n  subscribe: kvbus.>\n", "admin (admin.nk)", "everything else is denied"} {
		if !strings.Contains(m, want) {
			t.Errorf("matrix lacks %q:\n%s", want, m)
		}
	}
	if _, err := auth.Matrix(t.TempDir(), messages.Subjects{}); !errors.Is(err, auth.ErrConfig) {
		t.Errorf("a directory without keys: %v, want ErrConfig", err)
	}
}

// TestRotate: rotating one role's key changes only that seed, and the
// configuration then admits the new key and refuses the old one.
func TestRotate(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	read := func(name string) string { b, _ := os.ReadFile(filepath.Join(dir, name+".nk")); return string(b) }
	oldWorker, oldFrontend := read("worker"), read("frontend")
	oldSeed := filepath.Join(t.TempDir(), "old.nk")
	if err := os.WriteFile(oldSeed, []byte(oldWorker), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := auth.Rotate(dir, messages.Subjects{}, "worker"); err != nil {
		t.Fatal(err)
	}
	if read("worker") == oldWorker || read("frontend") != oldFrontend {
		t.Fatal("Rotate must change the worker's seed and only it")
	}
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), AuthConfig: filepath.Join(dir, auth.ConfigFile)})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	for _, key := range []string{"worker", "frontend"} {
		if _, err := connect(t, srv, filepath.Join(dir, key+".nk")); err != nil {
			t.Errorf("%s's current key refused: %v", key, err)
		}
	}
	if _, err := connect(t, srv, oldSeed); err == nil {
		t.Error("the worker's old key still connects")
	}
	if err := auth.Rotate(dir, messages.Subjects{}, "nobody"); !errors.Is(err, auth.ErrConfig) {
		t.Errorf("rotating an unknown key: %v", err)
	}
}

// TestRotateKeepsThePrefix: rotating one key of a directory written for
// another subject prefix keeps every role's permissions on that prefix,
// without --subject-prefix repeated (it rewrote them for kvbus.*, and after
// the reload every role was refused its real subjects); naming another
// prefix is refused. Matrix reads the recorded prefix too.
func TestRotateKeepsThePrefix(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{Prefix: "prod"}, nil, false); err != nil {
		t.Fatal(err)
	}
	if err := auth.Rotate(dir, messages.Subjects{}, "worker"); err != nil {
		t.Fatal(err)
	}
	conf, err := os.ReadFile(filepath.Join(dir, auth.ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(conf), `"prod.`) || strings.Contains(string(conf), `"kvbus.`) {
		t.Errorf("after a rotation the permissions are not on prod.*:\n%s", conf)
	}
	if err := auth.Rotate(dir, messages.Subjects{Prefix: "kvbus"}, "worker"); !errors.Is(err, auth.ErrConfig) || !strings.Contains(err.Error(), "prod") {
		t.Errorf("rotating with another prefix: %v, want a refusal naming prod", err)
	}
	m, err := auth.Matrix(dir, messages.Subjects{})
	if err != nil || !strings.Contains(m, "prod.") || strings.Contains(m, "kvbus.") {
		t.Errorf("matrix of a prod directory: %v\n%s", err, m)
	}
}

// TestStoredPrefixIsChecked: the subject prefix a directory records
// (PrefixFile) is checked as --subject-prefix is: every permission of
// ConfigFile is written under it, and a hand-edited "*" gave the worker key
// publish on *.meta.> (every prefix's groups). It was taken as written.
func TestStoredPrefixIsChecked(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{Prefix: "prod"}, nil, false); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"*", "prod.>", "a b", "", "  \n"} {
		if err := os.WriteFile(filepath.Join(dir, auth.PrefixFile), []byte(bad+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := auth.Matrix(dir, messages.Subjects{}); !errors.Is(err, auth.ErrConfig) {
			t.Errorf("prefix file %q: matrix %v; want ErrConfig", bad, err)
		}
		if err := auth.Rotate(dir, messages.Subjects{}, "worker"); !errors.Is(err, auth.ErrConfig) {
			t.Errorf("prefix file %q: rotate %v; want ErrConfig", bad, err)
		}
	}
}

// TestForceKeepsThePrefix: `kvbus auth init DIR --force` on a directory
// written for another subject prefix replaces every key on that prefix,
// as a rotation of one key does, without --subject-prefix repeated. Before,
// it rewrote every role's permissions (and DIR's record) for kvbus.*: at
// the next reload every role was refused its real subjects.
func TestForceKeepsThePrefix(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{Prefix: "prod"}, nil, false); err != nil {
		t.Fatal(err)
	}
	if _, err := auth.Init(dir, messages.Subjects{}, nil, true); err != nil {
		t.Fatal(err)
	}
	conf, err := os.ReadFile(filepath.Join(dir, auth.ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(conf), `"prod.`) || strings.Contains(string(conf), `"kvbus.`) {
		t.Errorf("after --force the permissions are not on prod.*:\n%s", conf)
	}
	if m, err := auth.Matrix(dir, messages.Subjects{}); err != nil || !strings.Contains(m, "prod.") || strings.Contains(m, "kvbus.") {
		t.Errorf("matrix after --force: %v\n%s", err, m)
	}
	// Another prefix named on purpose is taken: --force starts anew.
	if _, err := auth.Init(dir, messages.Subjects{Prefix: "staging"}, nil, true); err != nil {
		t.Fatal(err)
	}
	if m, err := auth.Matrix(dir, messages.Subjects{}); err != nil || !strings.Contains(m, "staging.") || strings.Contains(m, "prod.") {
		t.Errorf("matrix after --force --subject-prefix staging: %v\n%s", err, m)
	}
}

// TestInitAddsTheObserverKey: a key directory written before the observer
// role existed gets observer.nk from `kvbus auth init DIR`, every other seed
// kept, and nats-auth.conf lists it (with a deny-all publish: an empty allow
// list would be no restriction to nats-server).
func TestInitAddsTheObserverKey(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, "observer.nk")); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadFile(filepath.Join(dir, "admin.nk"))
	added, err := auth.Init(dir, messages.Subjects{}, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(added) != 1 || added[0].Name() != "observer" {
		t.Errorf("init on an older directory added %v, want the observer key", added)
	}
	if after, _ := os.ReadFile(filepath.Join(dir, "admin.nk")); string(after) != string(before) {
		t.Error("adding the observer key replaced the admin key")
	}
	seed, err := os.ReadFile(filepath.Join(dir, "observer.nk"))
	if err != nil {
		t.Fatal(err)
	}
	kp, err := nkeys.FromSeed(bytes.TrimSpace(seed))
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := kp.PublicKey()
	conf, _ := os.ReadFile(filepath.Join(dir, auth.ConfigFile))
	_, block, ok := strings.Cut(string(conf), "# observer\n")
	block, _, _ = strings.Cut(block, "# ")
	if !ok || !strings.Contains(block, pub) || !strings.Contains(block, `publish: { deny: [">"] }`) {
		t.Errorf("nats-auth.conf does not give the observer key %s a deny-all publish:\n%s", pub, conf)
	}
}

// TestInitAddsGroupKeys: `auth init DIR --groups g0,g1` on a directory of
// keys adds the groups' worker keys and keeps every key it has (the roles
// already running go on), where it refused unless --force replaced them all.
func TestInitAddsGroupKeys(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{Prefix: "prod"}, nil, false); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadFile(filepath.Join(dir, "worker.nk"))
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g0", "g1"}, false); err != nil {
		t.Fatal(err)
	}
	after, _ := os.ReadFile(filepath.Join(dir, "worker.nk"))
	if string(before) != string(after) {
		t.Error("adding group keys replaced the worker key")
	}
	conf, _ := os.ReadFile(filepath.Join(dir, auth.ConfigFile))
	for _, name := range []string{"worker-g0", "worker-g1"} {
		if _, err := os.Stat(filepath.Join(dir, name+".nk")); err != nil {
			t.Errorf("%s.nk: %v", name, err)
		}
	}
	if !strings.Contains(string(conf), "prod.meta.g1.>") || strings.Contains(string(conf), "kvbus.meta") {
		t.Errorf("the config should give worker-g1 prod.meta.g1.> (the directory's prefix):\n%s", conf)
	}
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g1"}, false); !errors.Is(err, auth.ErrExists) {
		t.Errorf("asking again for keys that exist: %v, want ErrExists", err)
	}
}

// TestStrayKeysGetNoPermissions: a *.nk file that names no kvbus identity
// (an old key kept under another name) is listed as stray and left out of
// the config and the matrix; "admin-old.nk" was read as an admin key, and
// "worker-g0.bak.nk" made init fail on its group name.
func TestStrayKeysGetNoPermissions(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	var strayKeys []string
	for _, name := range []string{"admin-old.nk", "frontend-old.nk", "worker-g0.bak.nk", "worker-.nk"} {
		kp, err := nkeys.CreateUser()
		if err != nil {
			t.Fatal(err)
		}
		seed, _ := kp.Seed()
		pub, _ := kp.PublicKey()
		strayKeys = append(strayKeys, pub)
		if err := os.WriteFile(filepath.Join(dir, name), seed, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ids, stray, err := auth.Keys(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != len(auth.Roles()) || len(stray) != 4 {
		t.Errorf("keys %v, stray %v: want every role and 4 stray files", ids, stray)
	}
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g0"}, false); err != nil {
		t.Fatalf("adding a group's key beside stray files: %v", err)
	}
	conf, _ := os.ReadFile(filepath.Join(dir, auth.ConfigFile))
	for _, pub := range strayKeys {
		if strings.Contains(string(conf), pub) {
			t.Errorf("the config gives a stray key permissions:\n%s", conf)
		}
	}
	if !strings.Contains(string(conf), "# worker-g0") {
		t.Errorf("the config lacks worker-g0:\n%s", conf)
	}
	m, err := auth.Matrix(dir, messages.Subjects{})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(m, "old") || strings.Contains(m, "bak") {
		t.Errorf("the matrix lists a stray key:\n%s", m)
	}
}

// TestOlderConfigStopsARoleAtStartUntilInitRewritesIt: a nats-auth.conf
// written by an older `kvbus auth init` lets every role read _INBOX.> and
// none its own inbox: a role fails at start saying to run `kvbus auth init
// DIR` again and restart NATS; doing so keeps every seed, rewrites the
// file, and the role starts.
func TestOlderConfigStopsARoleAtStartUntilInitRewritesIt(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g0"}, false); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, auth.ConfigFile)
	data, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	older := regexp.MustCompile(`"_INBOX_[^"]*"(, "_INBOX_[^"]*")*`).ReplaceAll(data, []byte(`"_INBOX.>"`))
	if !strings.Contains(string(older), `"_INBOX.>"`) || strings.Contains(string(older), "_INBOX_") {
		t.Fatalf("could not write an older configuration:\n%s", older)
	}
	if err := os.WriteFile(conf, older, 0o644); err != nil {
		t.Fatal(err)
	}
	seeds := map[string][]byte{}
	for _, key := range []string{"frontend", "scheduler", "worker", "worker-g0", "admin"} {
		seeds[key], _ = os.ReadFile(filepath.Join(dir, key+".nk"))
	}
	s := messages.Subjects{}
	check := bus.RoleCheck{Role: "worker", Group: "g0", Subscribe: []string{s.MetaGroup("g0"), s.AbortGroup("g0"), s.Dump("g0", 0), s.Pool("g0", 0)}}
	start := func() (*bus.Server, *nats.Conn) {
		srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), AuthConfig: conf})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Shutdown)
		nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), NKeySeedFile: filepath.Join(dir, "worker-g0.nk"),
			InboxPrefix: bus.InboxPrefix("worker", "g0"), Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return srv, nc
	}
	_, nc := start()
	err = bus.CheckPermissions(t.Context(), nc, check)
	if !errors.Is(err, bus.ErrPermission) {
		t.Fatalf("with an older nats-auth.conf: CheckPermissions = %v, want ErrPermission", err)
	}
	for _, want := range []string{"reply inbox _INBOX_worker_g.g0.", "older `kvbus auth init`", "Run `kvbus auth init DIR` again",
		"keeps the keys and rewrites nats-auth.conf", "reload NATS"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}

	changed, err := auth.RewriteConfig(dir, messages.Subjects{})
	if err != nil || !changed {
		t.Fatalf("RewriteConfig = %v, %v; want the older file rewritten", changed, err)
	}
	for key, seed := range seeds {
		if now, _ := os.ReadFile(filepath.Join(dir, key+".nk")); string(now) != string(seed) {
			t.Errorf("%s.nk changed", key)
		}
	}
	_, nc = start() // NATS restarted with the rewritten file
	if err := bus.CheckPermissions(t.Context(), nc, check); err != nil {
		t.Errorf("after the rewrite: %v", err)
	}
	if changed, err := auth.RewriteConfig(dir, messages.Subjects{}); err != nil || changed {
		t.Errorf("RewriteConfig of a current file = %v, %v; want unchanged", changed, err)
	}
}

// TestInitAgainRewritesNothing: `kvbus auth init DIR` again on a directory
// it has just written finds every key there and the config current. It
// compared the config's bytes, and Init writes the users in the roles'
// order while a rewrite lists them in the seed files' order: the second
// run said it "rewrote nats-auth.conf … (an older kvbus auth init wrote
// it)" and to reload NATS and the roles, and `make up` reloaded NATS.
func TestInitAgainRewritesNothing(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g1", "g2"}, false); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, auth.ConfigFile)
	before, _ := os.ReadFile(conf)
	changed, err := auth.RewriteConfig(dir, messages.Subjects{})
	if err != nil {
		t.Fatal(err)
	}
	if after, _ := os.ReadFile(conf); changed || !bytes.Equal(before, after) {
		t.Errorf("RewriteConfig of a directory Init just wrote: changed %v, want the config left as it was", changed)
	}
	// A config that does differ is still rewritten.
	if err := os.WriteFile(conf, bytes.Replace(before, []byte(`"kvbus.drain.g1", `), nil, 1), 0o644); err != nil {
		t.Fatal(err)
	}
	if changed, err := auth.RewriteConfig(dir, messages.Subjects{}); err != nil || !changed {
		t.Errorf("RewriteConfig of an edited config: changed %v, %v; want it rewritten", changed, err)
	}
}

// TestConfigWithAUserAddedFirstIsNotCurrent: a config's users are compared
// whatever their order, but the text before the first of them was not
// compared at all: a user inserted at the top of the list (no "# role"
// line above it, as a hand edit adds one), which nats-server and `kvbus
// nats` both let in, left the config "current": `kvbus auth init` rewrote
// nothing and `kvbus auth show` said nothing.
func TestConfigWithAUserAddedFirstIsNotCurrent(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, []string{"g1"}, false); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, auth.ConfigFile)
	before, _ := os.ReadFile(conf)
	edited := bytes.Replace(before, []byte("  users = [\n"), []byte("  users = [\n    { user: \"ops\", password: \"x\" }\n"), 1)
	if bytes.Equal(edited, before) {
		t.Fatal("no users list in the config")
	}
	if err := os.WriteFile(conf, edited, 0o644); err != nil {
		t.Fatal(err)
	}
	if current, err := auth.ConfigIsCurrent(dir, messages.Subjects{}); err != nil || current {
		t.Errorf("ConfigIsCurrent of a config with a user added first = %v, %v; want false", current, err)
	}
	if changed, err := auth.RewriteConfig(dir, messages.Subjects{}); err != nil || !changed {
		t.Errorf("RewriteConfig of a config with a user added first: changed %v, %v; want it rewritten", changed, err)
	}
	if after, _ := os.ReadFile(conf); bytes.Contains(after, []byte(`"ops"`)) {
		t.Errorf("after the rewrite the config still lets ops in:\n%s", after)
	}
}
