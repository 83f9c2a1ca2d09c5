package auth_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// roleConn connects with a role's key and that role's inbox prefix, as the
// roles do.
func roleConn(t *testing.T, url, dir string, id auth.Identity) *nats.Conn {
	t.Helper()
	o, err := nats.NkeyOptionFromSeed(filepath.Join(dir, id.Name()+".nk"))
	if err != nil {
		t.Fatal(err)
	}
	opts := []nats.Option{o, nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})}
	if p := bus.InboxPrefix(id.Role, id.Group); p != "" {
		opts = append(opts, nats.CustomInboxPrefix(p))
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// TestStreamEchoesAreNotMessages: the server sends a stream's messages to
// whatever subject the requester names (a direct get's reply, a push
// consumer's deliver subject, a republish destination) without checking
// its publish permissions. A worker-g0 key wrote a value into its own slot
// of KVBUS_RANKS and had a direct get answer it on kvbus.meta.g1.<session>
// — a ReqMeta for another group, which it may not publish; a frontend
// key had its request republished there by updating the request log (it
// may no longer: TestFrontendCannotUpdateTheRequestLog; here the
// admin key, which still may, does it). The
// messages still reach the subject (the raw subscription sees both), but a
// role's handler (bus.Subscribe) drops them and runs for the scheduler's
// real one. Before, the g1 worker's handler ran for both.
func TestStreamEchoesAreNotMessages(t *testing.T) {
	srv, dir := server(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s := messages.Subjects{}
	url := srv.ClientURL()

	victim := roleConn(t, url, dir, auth.Identity{Role: auth.RoleWorker, Group: "g1"})
	var mu sync.Mutex
	var handled []string
	marker := make(chan struct{}, 1)
	if _, err := bus.Subscribe(ctx, victim, s.MetaGroup("g1"), func(_ context.Context, m *nats.Msg) error {
		mu.Lock()
		handled = append(handled, string(m.Data))
		mu.Unlock()
		if string(m.Data) == "REAL" {
			marker <- struct{}{}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	raw, err := victim.SubscribeSync(s.MetaGroup("g1"))
	if err != nil {
		t.Fatal(err)
	}
	if err := victim.Flush(); err != nil {
		t.Fatal(err)
	}

	// The forger's own slot: allowed, as --rank auto --group g0 needs.
	w0 := roleConn(t, url, dir, auth.Identity{Role: auth.RoleWorker, Group: "g0"})
	js, err := jetstream.New(w0)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: s.SlotBucket(), Storage: jetstream.MemoryStorage})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "g0.9", []byte("FORGED-DIRECT-GET")); err != nil {
		t.Fatal(err)
	}
	target := s.Meta("g1", "victim")
	if err := w0.PublishMsg(&nats.Msg{Subject: "$JS.API.DIRECT.GET.KV_" + s.SlotBucket() + ".$KV." + s.SlotBucket() + ".g0.9", Reply: target}); err != nil {
		t.Fatal(err)
	}
	// A key that may update the request log (only admin's now) has it
	// republish a request as a ReqMeta.
	sjs, err := jetstream.New(roleConn(t, url, dir, auth.Identity{Role: auth.RoleAdmin}))
	if err != nil {
		t.Fatal(err)
	}
	st, err := bus.EnsureRequestStream(ctx, sjs, bus.StreamConfig{Subjects: s, MaxAge: time.Hour, MaxBytes: 1 << 26, Replicas: 1, DuplicateWindow: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.RePublish = &jetstream.RePublish{Source: s.RequestAll(), Destination: s.MetaAll()}
	if _, err := sjs.UpdateStream(ctx, cfg); err != nil {
		t.Fatalf("admin may update the request log: %v", err)
	}
	fe := roleConn(t, url, dir, auth.Identity{Role: auth.RoleFrontend})
	if err := fe.Publish(strings.TrimSuffix(s.RequestAll(), ">")+strings.TrimPrefix(target, strings.TrimSuffix(s.MetaAll(), ">")), []byte("FORGED-REPUBLISH")); err != nil {
		t.Fatal(err)
	}

	// The attacks reached the subject...
	want := map[string]bool{"FORGED-DIRECT-GET": true, "FORGED-REPUBLISH": true}
	for range want {
		m, err := raw.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("the forgeries did not reach %s (%v): the server no longer sends them, so this test shows nothing", target, err)
		}
		if !want[string(m.Data)] || m.Header.Get(jetstream.StreamHeader) == "" {
			t.Fatalf("on %s: %q (stream %q), want a forgery sent out of a stream", m.Subject, m.Data, m.Header.Get(jetstream.StreamHeader))
		}
	}
	// ...and then the scheduler's real ReqMeta.
	sc := roleConn(t, url, dir, auth.Identity{Role: auth.RoleScheduler})
	if err := sc.Publish(target, []byte("REAL")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-marker:
	case <-time.After(10 * time.Second):
		t.Fatal("the scheduler's ReqMeta never reached the worker's handler")
	}
	mu.Lock()
	defer mu.Unlock()
	for _, d := range handled {
		if want[d] {
			t.Errorf("the g1 worker's handler ran for %q, which the server sent out of a stream at another key's asking", d)
		}
	}
	if len(handled) == 0 || handled[len(handled)-1] != "REAL" {
		t.Errorf("handled %q, want the scheduler's REAL last", handled)
	}
}

// TestRequestsAnsweredOnlyOnAnInbox: every role may answer the requests it
// receives wherever their reply subject says (allow_responses; no deny list
// limits it), so a worker-g0 key sent a g1 rank a pool read whose reply
// was kvbus.req.<model>, and the rank's answer went into the request log
// (and onto kvbus.kv.g1.0, kvbus.sched.plan.<id>, … likewise). A role's
// handler (bus.Subscribe) now drops a request whose reply is no inbox; one
// asked with an inbox, as a rank's pool client asks, is answered.
func TestRequestsAnsweredOnlyOnAnInbox(t *testing.T) {
	srv, dir := server(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s := messages.Subjects{}
	url := srv.ClientURL()

	admin := roleConn(t, url, dir, auth.Identity{Role: auth.RoleAdmin})
	logged, err := admin.SubscribeSync(s.RequestAll())
	if err != nil {
		t.Fatal(err)
	}
	if err := admin.Flush(); err != nil {
		t.Fatal(err)
	}
	g1 := roleConn(t, url, dir, auth.Identity{Role: auth.RoleWorker, Group: "g1"})
	if _, err := bus.Subscribe(ctx, g1, s.PoolGroup("g1"), func(_ context.Context, m *nats.Msg) error {
		return m.Respond([]byte("POOL-PART"))
	}); err != nil {
		t.Fatal(err)
	}
	if err := g1.Flush(); err != nil {
		t.Fatal(err)
	}
	g0 := roleConn(t, url, dir, auth.Identity{Role: auth.RoleWorker, Group: "g0"})
	if err := g0.PublishRequest(s.Pool("g1", 0), s.Request("kvbus-sim"), []byte("read")); err != nil {
		t.Fatal(err)
	}
	answer, err := g0.Request(s.Pool("g1", 0), []byte("read"), 5*time.Second)
	if err != nil || string(answer.Data) != "POOL-PART" {
		t.Fatalf("a pool read with an inbox: %v %v, want POOL-PART", answer, err)
	}
	// Everything g1 published has reached the server, and admin read
	// what the server routed it before its PONG.
	if err := g1.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := admin.Flush(); err != nil {
		t.Fatal(err)
	}
	if n, _, _ := logged.Pending(); n != 0 {
		m, _ := logged.NextMsg(time.Second)
		t.Errorf("%d message(s) on %s: %q — a g1 rank answered a worker-g0 key's pool read into the request log", n, m.Subject, m.Data)
	}
}

// TestFrontendCannotUpdateTheRequestLog: a frontend key updated the
// request log to log kvbus.meta.> too and republish it onto
// kvbus.out.<group>, which it may read, and so read every ReqMeta of g1.
// The update is now refused; the frontend still creates the log and
// publishes requests into it.
func TestFrontendCannotUpdateTheRequestLog(t *testing.T) {
	srv, dir := server(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s := messages.Subjects{}
	fe := roleConn(t, srv.ClientURL(), dir, auth.Identity{Role: auth.RoleFrontend})
	js, err := jetstream.New(fe)
	if err != nil {
		t.Fatal(err)
	}
	st, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{Subjects: s, MaxAge: time.Hour, MaxBytes: 1 << 26, Replicas: 1, DuplicateWindow: time.Minute})
	if err != nil {
		t.Fatalf("a frontend creates the request log: %v", err)
	}
	if _, err := js.Publish(ctx, s.Request("kvbus-sim"), []byte("request")); err != nil {
		t.Fatalf("a frontend logs a request: %v", err)
	}
	cfg := st.CachedInfo().Config
	cfg.Subjects = append(cfg.Subjects, s.MetaAll())
	// kvbus.meta.<group>.<session> onto kvbus.out.<group>.
	cfg.RePublish = &jetstream.RePublish{Source: strings.TrimSuffix(s.MetaGroup("*"), ">") + "*", Destination: s.Out("{{wildcard(1)}}")}
	short, cancelShort := context.WithTimeout(ctx, 2*time.Second)
	defer cancelShort()
	_, updateErr := js.UpdateStream(short, cfg)
	out, err := fe.SubscribeSync(s.Out("g1"))
	if err != nil {
		t.Fatal(err)
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	sc := roleConn(t, srv.ClientURL(), dir, auth.Identity{Role: auth.RoleScheduler})
	if err := sc.Publish(s.Meta("g1", "victim"), []byte("G1-REQMETA")); err != nil {
		t.Fatal(err)
	}
	if err := sc.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	if m, err := out.NextMsg(500 * time.Millisecond); err == nil {
		t.Errorf("a frontend key read g1's ReqMeta on %s: %q (update: %v)", m.Subject, m.Data, updateErr)
	}
	if updateErr == nil {
		t.Errorf("a frontend key updated the request log")
	} else if !errors.Is(updateErr, context.DeadlineExceeded) {
		t.Errorf("update: %v, want the refused request's timeout", updateErr)
	}
}

// TestSchedulerCannotUpdateTheRequestLog: a scheduler key updated the
// request log to log kvbus.out.> too and republish it onto
// kvbus.sched.plan.<frontend>, which it reads, and so read every answer.
// The update is now refused (admin's alone); the scheduler still creates
// the log, reads it through its consumer and trims it.
func TestSchedulerCannotUpdateTheRequestLog(t *testing.T) {
	srv, dir := server(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s := messages.Subjects{}
	sc := roleConn(t, srv.ClientURL(), dir, auth.Identity{Role: auth.RoleScheduler})
	js, err := jetstream.New(sc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{Subjects: s, MaxAge: time.Hour, MaxBytes: 1 << 26, Replicas: 1, DuplicateWindow: time.Minute})
	if err != nil {
		t.Fatalf("a scheduler creates the request log: %v", err)
	}
	cons, err := bus.EnsureSchedulerConsumer(ctx, st, time.Minute, 1)
	if err != nil {
		t.Fatalf("a scheduler creates its consumer: %v", err)
	}
	if _, err := bus.TrimHistory(ctx, st, cons, 1<<20); err != nil {
		t.Fatalf("a scheduler trims the log: %v", err)
	}
	cfg := st.CachedInfo().Config
	cfg.Subjects = append(cfg.Subjects, s.OutAll())
	cfg.RePublish = &jetstream.RePublish{Source: s.OutAll(), Destination: s.Plan("{{wildcard(1)}}")}
	short, cancelShort := context.WithTimeout(ctx, 2*time.Second)
	defer cancelShort()
	_, updateErr := js.UpdateStream(short, cfg)
	plans, err := sc.SubscribeSync(s.PlanAll())
	if err != nil {
		t.Fatal(err)
	}
	if err := sc.Flush(); err != nil {
		t.Fatal(err)
	}
	w := roleConn(t, srv.ClientURL(), dir, auth.Identity{Role: auth.RoleWorker, Group: "g0"})
	if err := w.Publish(s.Out("fe-1"), []byte("ANSWER")); err != nil {
		t.Fatal(err)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if m, err := plans.NextMsg(500 * time.Millisecond); err == nil {
		t.Errorf("a scheduler key read an answer on %s: %q (update: %v)", m.Subject, m.Data, updateErr)
	}
	if updateErr == nil {
		t.Errorf("a scheduler key updated the request log")
	} else if !errors.Is(updateErr, context.DeadlineExceeded) {
		t.Errorf("update: %v, want the refused request's timeout", updateErr)
	}
}

// TestFrontendCannotChangeTheSchedulersConsumer: a consumer's create is
// also its update (the action is in the request's body), and a frontend
// key, allowed to create the schedulers' consumer, pointed it at a subject
// no request is logged on, so that no scheduler got another request. A
// frontend key may no longer create it (the schedulers do, DeliverAll, so
// requests logged before the first one started are not missed); it still
// creates the log and logs requests.
func TestFrontendCannotChangeTheSchedulersConsumer(t *testing.T) {
	srv, dir := server(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s := messages.Subjects{}
	fe := roleConn(t, srv.ClientURL(), dir, auth.Identity{Role: auth.RoleFrontend})
	fjs, err := jetstream.New(fe)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bus.EnsureRequestStream(ctx, fjs, bus.StreamConfig{Subjects: s, MaxAge: time.Hour, MaxBytes: 1 << 26, Replicas: 1, DuplicateWindow: time.Minute}); err != nil {
		t.Fatalf("a frontend creates the request log: %v", err)
	}
	if _, err := fjs.Publish(ctx, s.Request("kvbus-sim"), []byte("before any scheduler")); err != nil {
		t.Fatalf("a frontend logs a request: %v", err)
	}
	sjs, err := jetstream.New(roleConn(t, srv.ClientURL(), dir, auth.Identity{Role: auth.RoleScheduler}))
	if err != nil {
		t.Fatal(err)
	}
	sst, err := sjs.Stream(ctx, s.RequestStream())
	if err != nil {
		t.Fatal(err)
	}
	cons, err := bus.EnsureSchedulerConsumer(ctx, sst, time.Minute, 1)
	if err != nil {
		t.Fatalf("a scheduler creates its consumer: %v", err)
	}
	fst, err := fjs.Stream(ctx, s.RequestStream())
	if err != nil {
		t.Fatal(err)
	}
	short, cancelShort := context.WithTimeout(ctx, 2*time.Second)
	defer cancelShort()
	_, updateErr := fst.CreateOrUpdateConsumer(short, jetstream.ConsumerConfig{Durable: bus.SchedulerConsumer,
		DeliverPolicy: jetstream.DeliverAllPolicy, AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: s.Request("nothing")})
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Config.FilterSubject != "" {
		t.Errorf("a frontend key set the schedulers' consumer's filter to %q (update: %v)", info.Config.FilterSubject, updateErr)
	}
	if updateErr == nil {
		t.Errorf("a frontend key updated the schedulers' consumer")
	}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for m := range batch.Messages() {
		got = append(got, string(m.Data()))
	}
	if len(got) != 1 || got[0] != "before any scheduler" {
		t.Errorf("the scheduler fetched %q, want the request logged before it started", got)
	}
}
