package frontend

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// reconnectingConn starts a NATS server on a loopback port and connects
// to it with a client that reconnects forever, every 20 ms; it returns the
// server, its address (to start it again on) and the connection.
func reconnectingConn(t *testing.T) (*bus.Server, string, *nats.Conn) {
	t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(srv.ClientURL(), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return srv, srv.Addr().String(), nc
}

// restartNATS stops srv, starts a server at its address (stopped at the
// test's end) and waits until nc reconnected to it.
func restartNATS(t *testing.T, srv *bus.Server, addr string, nc *nats.Conn) *bus.Server {
	t.Helper()
	srv.Shutdown()
	srv2, err := bus.StartServer(bus.ServerConfig{Addr: addr, DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv2.Shutdown)
	for deadline := time.Now().Add(10 * time.Second); nc.Stats().Reconnects == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the connection did not reconnect: the fault did not take effect")
		}
	}
	return srv2
}

// TestOutputsLostAcrossAReconnect: the NATS server restarts under a
// frontend with two requests in flight. One hears an output after the
// reconnect (it is generating); the other hears nothing: its answer ended
// while the frontend was cut off, and the driver's outputs reached a server
// where the frontend had not yet subscribed again. That one ends with a
// 503 output_lost after LostOutputWait; before, it waited for its deadline
// (60 s) with its client hanging. A third hears only a copy of the output
// it had before the restart (its driver sends again what it published just
// before a reconnect): a copy is no sign that its answer goes on, and it is
// judged as the silent one is (before, the copy alone kept it waiting).
// A request of two prompts (two bus requests, one queue) whose first choice
// streams on while its second hears nothing gets the verdict for the
// second: before, the first choice's outputs counted for the whole queue,
// and the silent one waited for its deadline.
func TestOutputsLostAcrossAReconnect(t *testing.T) {
	srv, addr, nc := reconnectingConn(t)
	s := &Server{cfg: Config{Conn: nc, LostOutputWait: 300 * time.Millisecond}, log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		pending: map[string]route{}}
	silent, hearing, repeated := newOutputQueue(1), newOutputQueue(1), newOutputQueue(1)
	s.register("silent", silent, 0)
	s.register("hearing", hearing, 0)
	s.register("repeated", repeated, 0)
	twoPrompts := newOutputQueue(2)
	s.register("two-0", twoPrompts, 0)
	s.register("two-1", twoPrompts, 1)
	first := &messages.Output{ReqID: "repeated", Attempt: 1, Index: 0, Text: "first"}
	repeated.push(0, first)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { s.watchReconnects(ctx) })
	defer func() { cancel(); wg.Wait() }()

	restartNATS(t, srv, addr, nc)
	time.Sleep(2 * reconnectCheckEvery) // the watcher has seen the reconnect
	hearing.push(0, &messages.Output{ReqID: "hearing", Index: 3, Text: "more"})
	repeated.push(0, first)
	twoPrompts.push(0, &messages.Output{ReqID: "two-0", Index: 7, Text: "streaming"})
	late := newOutputQueue(1) // registered after the reconnect
	s.register("late", late, 0)

	time.Sleep(s.cfg.LostOutputWait + 3*reconnectCheckEvery)
	got := silent.pop()
	if len(got) != 1 || got[0].out.Error == nil || got[0].out.Error.Code != "output_lost" {
		t.Fatalf("the silent request's queue holds %+v; want one output_lost error", got)
	}
	if items := repeated.pop(); len(items) != 3 || items[2].out.Error == nil || items[2].out.Error.Code != "output_lost" {
		t.Errorf("the request that heard only a copy holds %d items; want its output, the copy and an output_lost error", len(items))
	}
	if items := hearing.pop(); len(items) != 1 || items[0].out.Error != nil {
		t.Errorf("the request hearing outputs got %d items (first error %v); want only its own output", len(items), items[0].out.Error)
	}
	if items := twoPrompts.pop(); len(items) != 2 || items[0].out.Error != nil || items[1].choice != 1 ||
		items[1].out.ReqID != "two-1" || items[1].out.Error == nil || items[1].out.Error.Code != "output_lost" {
		t.Errorf("the request of two prompts holds %d items; want choice 0's output, then an output_lost error for choice 1 (two-1)", len(items))
		for _, it := range items {
			t.Logf("choice %d: %+v", it.choice, it.out)
		}
	}
	if items := late.pop(); len(items) != 0 {
		t.Errorf("a request sent after the reconnect was ended: %+v", items[0].out)
	}
	// The error ends the choice, whichever attempt it was on.
	c := &choiceState{attempt: 2, started: true, nextIndex: 5}
	if !c.follow(got[0].out) {
		t.Error("the output_lost error is not taken by a choice on attempt 2")
	}
}

// TestRequestWaitsForAReconnect: a request that arrives while the frontend
// is between two NATS servers (one of a cluster stopped) waits for the
// reconnect, up to reconnectWait, instead of a 503 at once; with NATS
// gone for longer it is refused after that wait, and at once on a closed
// connection.
func TestRequestWaitsForAReconnect(t *testing.T) {
	srv, addr, nc := reconnectingConn(t)
	s := &Server{cfg: Config{Conn: nc}}
	srv.Shutdown()
	for nc.IsConnected() {
		time.Sleep(5 * time.Millisecond)
	}
	restarted := make(chan *bus.Server, 1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		srv2, err := bus.StartServer(bus.ServerConfig{Addr: addr, DataDir: t.TempDir()})
		if err != nil {
			t.Error(err)
		}
		restarted <- srv2
	}()
	start := time.Now()
	if !s.connected(t.Context()) {
		t.Fatalf("not connected after %v; want the reconnect waited for", time.Since(start))
	}
	t.Logf("reconnected after %v", time.Since(start))
	// The fault took effect: the connection was down when the request came.
	if nc.Stats().Reconnects == 0 {
		t.Error("no reconnect counted")
	}

	// NATS gone for longer than the wait.
	if srv2 := <-restarted; srv2 != nil {
		srv2.Shutdown()
	}
	for nc.IsConnected() {
		time.Sleep(5 * time.Millisecond)
	}
	start = time.Now()
	if s.connected(t.Context()) {
		t.Fatal("connected with NATS down")
	}
	if waited := time.Since(start); waited < reconnectWait {
		t.Errorf("refused after %v; want a wait of %v", waited, reconnectWait)
	}
	nc.Close()
	start = time.Now()
	if s.connected(t.Context()) || time.Since(start) > reconnectWait/2 {
		t.Errorf("a closed connection was waited for %v", time.Since(start))
	}
}

// TestResendRightAfterAReconnectWaitsForTheDrivers: a frontend back on NATS
// before the schedulers and the drivers asks for a stream's lost outputs,
// and NATS answers "no responders" at once, their subscriptions not being
// back on the server yet. Each ask is repeated until it is answered: here
// a scheduler comes back 200 ms later and names the group, whose driver
// comes back 400 ms later; before, the answer was the "no responders" and
// the stream ended with output_lost though its driver held every output.
// Away from a reconnect, "no responders" is the answer at once (no
// scheduler runs).
func TestResendRightAfterAReconnectWaitsForTheDrivers(t *testing.T) {
	srv, addr, nc := reconnectingConn(t)
	subj := messages.Subjects{}
	s, data := resendAsker(t, nc, 300*time.Millisecond)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { s.watchReconnects(ctx) })
	defer func() { cancel(); wg.Wait() }()
	start := time.Now()
	if _, _, err := s.askDriver(data); !errors.Is(err, nats.ErrNoResponders) || time.Since(start) > resendWait/2 {
		t.Fatalf("no scheduler, no reconnect: %v after %s; want no responders at once", err, time.Since(start))
	}

	srv2 := restartNATS(t, srv, addr, nc)
	if _, err := nc.Request(subj.Resend(), data, time.Second); !errors.Is(err, nats.ErrNoResponders) {
		t.Fatalf("right after the reconnect, a plain request got %v; want no responders (the fault)", err)
	}
	back := make(chan error, 2)
	go answerResendsAfter(t, srv2.ClientURL(), 200*time.Millisecond, subj.Resend(), &messages.ResendReply{Group: "g0"}, back)
	go answerResendsAfter(t, srv2.ClientURL(), 400*time.Millisecond, subj.ResendGroup("g0"), &messages.ResendReply{Resent: 3}, back)
	reply, group, err := s.askDriver(data)
	for range 2 {
		if err := <-back; err != nil {
			t.Fatal(err)
		}
	}
	if err != nil || reply.Resent != 3 || group != "g0" {
		t.Fatalf("asked right after a reconnect, the scheduler back 200 ms later, the driver 400 ms: %+v of group %q, %v; want g0's driver's answer (resent 3)", reply, group, err)
	}
}

// TestResendAnsweredByAnEarlierDriver: a driver before 2026-12-07 reads
// kvbus.ctl.resend and answers there itself (its group's schedulers then
// name no group): its answer is the one taken, during an upgrade.
func TestResendAnsweredByAnEarlierDriver(t *testing.T) {
	srv, _, nc := reconnectingConn(t)
	t.Cleanup(srv.Shutdown)
	subj := messages.Subjects{}
	s, data := resendAsker(t, nc, 0)
	if err := answerResends(nc, subj.Resend(), &messages.ResendReply{Resent: 2, Done: true}); err != nil {
		t.Fatal(err)
	}
	if reply, group, err := s.askDriver(data); err != nil || reply.Resent != 2 || !reply.Done || group != "" {
		t.Fatalf("%+v (group %q), %v; want the earlier driver's answer (resent 2, done), no group named", reply, group, err)
	}
}

// TestResendWaitsForASchedulerThatReconnects: a NATS server of a cluster
// stops under a driver and the scheduler (one replica), not under the
// frontend. The driver, back first, publishes what it buffered, the
// frontend sees an index skipped and asks: the scheduler's subscription is
// not back on a server yet, and NATS answers "no responders" at once. The
// frontend, which did not reconnect, took that as the answer and ended a
// stream whose driver held every output with output_lost (before the asks
// went to the schedulers, that driver answered them itself). A scheduler
// that announced itself within the timeout is reconnecting: the ask is
// repeated until it answers (here 200 ms later). With no scheduler heard,
// "no responders" is still the answer at once.
func TestResendWaitsForASchedulerThatReconnects(t *testing.T) {
	srv, _, nc := reconnectingConn(t)
	t.Cleanup(srv.Shutdown)
	subj := messages.Subjects{}
	s, data := resendAsker(t, nc, 0)
	s.schedulers.timeout = 3 * time.Second
	s.schedulers.observe(&messages.Announcement{ID: "s1", Ready: true}, time.Now())
	if err := answerResends(nc, subj.ResendGroup("g0"), &messages.ResendReply{Resent: 3}); err != nil {
		t.Fatal(err)
	}
	back := make(chan error, 1)
	go answerResendsAfter(t, srv.ClientURL(), 200*time.Millisecond, subj.Resend(), &messages.ResendReply{Group: "g0"}, back)
	reply, _, err := s.askDriver(data)
	if err := <-back; err != nil {
		t.Fatal(err)
	}
	if err != nil || reply.Resent != 3 {
		t.Fatalf("asked while the scheduler reconnects (back 200 ms later): %+v, %v; want the driver's answer (resent 3)", reply, err)
	}
}

// resendAsker is a frontend Server on nc that asks about lost outputs
// (lostOutputWait: Config.LostOutputWait), and the encoded Resend it asks
// with.
func resendAsker(t *testing.T, nc *nats.Conn, lostOutputWait time.Duration) (*Server, []byte) {
	t.Helper()
	data, err := messages.Marshal(&messages.Resend{ReqID: "r", Attempt: 1, FromIndex: 2})
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{cfg: Config{Conn: nc, Subjects: messages.Subjects{}, LostOutputWait: lostOutputWait},
		log: slog.New(slog.DiscardHandler), pending: map[string]route{}}
	return s, data
}

// answerResends answers every Resend on subject, over nc, with reply: a
// stand-in scheduler (reply names a group) or driver.
func answerResends(nc *nats.Conn, subject string, reply *messages.ResendReply) error {
	data, err := messages.Marshal(reply)
	if err != nil {
		return err
	}
	if _, err := nc.Subscribe(subject, func(m *nats.Msg) { _ = m.Respond(data) }); err != nil {
		return err
	}
	return nc.Flush()
}

// answerResendsAfter is answerResends on a connection to url made after d
// (one coming back after a reconnect); back gets the error of setting it
// up.
func answerResendsAfter(t *testing.T, url string, d time.Duration, subject string, reply *messages.ResendReply, back chan<- error) {
	time.Sleep(d)
	c, err := nats.Connect(url)
	if err == nil {
		t.Cleanup(c.Close)
		err = answerResends(c, subject, reply)
	}
	back <- err
}
