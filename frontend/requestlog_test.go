package frontend_test

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// standalone is a frontend on loopback against an embedded NATS server,
// with no scheduler or worker: nothing it publishes is ever dispatched.
type standalone struct {
	url     string
	natsURL string
	js      jetstream.JetStream
	// stop ends the frontend's Run context (a SIGTERM); cleanup waits for
	// Run to return.
	stop context.CancelFunc
}

// startFrontend runs a frontend whose Config edit adjusts; everything stops
// at cleanup.
func startFrontend(t *testing.T, edit func(*frontend.Config)) *standalone {
	return startStandalone(t, true, edit)
}

// startStandalone is startFrontend; with announce, a stand-in scheduler
// announces itself ready every 100 ms (it never consumes the log).
func startStandalone(t *testing.T, announce bool, edit func(*frontend.Config)) *standalone {
	t.Helper()
	return startStandaloneOn(t, bus.ServerConfig{}, announce, edit)
}

// startStandaloneOn is startStandalone with a server of config sc (its
// address and data directory are the test's).
func startStandaloneOn(t *testing.T, sc bus.ServerConfig, announce bool, edit func(*frontend.Config)) *standalone {
	t.Helper()
	sc.Addr, sc.DataDir = "127.0.0.1:0", t.TempDir()
	srv, err := bus.StartServer(sc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if announce {
		announceScheduler(t, nc)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg := frontend.Config{
		Conn: nc, Subjects: messages.Subjects{Prefix: "kvbus"}, Listener: ln, Models: []string{"kvbus-sim"},
		Logger: slog.New(slog.DiscardHandler),
	}
	edit(&cfg)
	fe, err := frontend.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fe.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("frontend Run: %v", err)
		}
	})
	select {
	case <-fe.Ready():
	case err := <-done:
		t.Fatalf("frontend Run: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("frontend not ready after 10 s")
	}
	if announce {
		deadline := time.Now().Add(10 * time.Second)
		for ok, why := fe.Healthy(); !ok; ok, why = fe.Healthy() {
			if time.Now().After(deadline) {
				t.Fatalf("frontend not healthy after 10 s: %s", why)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return &standalone{url: "http://" + fe.Addr().String(), natsURL: srv.ClientURL(), js: js, stop: cancel}
}

func (s *standalone) post(t *testing.T, path, body string) response {
	t.Helper()
	status, header, b := testenv.Send(t, http.MethodPost, s.url+path, body, nil)
	return response{status, header, b}
}

func (s *standalone) logState(t *testing.T) jetstream.StreamState {
	t.Helper()
	st, err := s.js.Stream(t.Context(), messages.RequestStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return info.State
}

func TestRequestLogFullIsA503(t *testing.T) {
	const logBytes = 8 << 10
	fe := startFrontend(t, func(c *frontend.Config) {
		c.RequestLogMaxBytes = logBytes
		c.RequestTimeout = 300 * time.Millisecond // nothing answers: accepted requests time out
	})
	const chat = `{"model":"kvbus-sim","messages":[{"role":"user","content":"hello there"}]}`

	// With room in the log a request is published (and times out, as no
	// scheduler runs).
	if r := fe.post(t, "/v1/chat/completions", chat); r.status != http.StatusGatewayTimeout {
		t.Fatalf("request into a log with room: %d %s, want 504", r.status, r.body)
	}
	if s := fe.logState(t); s.Msgs != 1 {
		t.Fatalf("log holds %d messages after one accepted request, want 1", s.Msgs)
	}

	// Fill the log to the last byte: big fillers, then one-byte ones, until
	// the server refuses even those.
	for _, size := range []int{512, 1} {
		for i := 0; ; i++ {
			_, err := fe.js.Publish(t.Context(), "kvbus.req.filler", bytes.Repeat([]byte{'f'}, size))
			if bus.IsLogFull(err) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if i > logBytes {
				t.Fatalf("the %d-byte log took %d fillers of %d bytes", logBytes, i, size)
			}
		}
	}
	before := fe.logState(t)

	r := fe.post(t, "/v1/chat/completions", chat)
	if r.status != http.StatusServiceUnavailable {
		t.Fatalf("request into a full log: %d %s, want 503", r.status, r.body)
	}
	body := decode(t, r.body)
	if code := path(t, body, "error", "code"); code != "request_log_full" {
		t.Fatalf("error code %v, want request_log_full: %s", code, r.body)
	}
	if typ := path(t, body, "error", "type"); typ != "service_unavailable_error" {
		t.Fatalf("error type %v: %s", typ, r.body)
	}
	if msg, _ := path(t, body, "error", "message").(string); !strings.Contains(msg, "--request-log-max-bytes") {
		t.Fatalf("error message does not tell the operator what to do: %q", msg)
	}
	if ra, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || ra <= 0 {
		t.Fatalf("Retry-After %q, want a positive number of seconds", r.header.Get("Retry-After"))
	}
	after := fe.logState(t)
	if after.Msgs != before.Msgs || after.LastSeq != before.LastSeq || after.FirstSeq != 1 {
		t.Fatalf("the refused request changed the log: %d msgs seq %d..%d before, %d msgs seq %d..%d after",
			before.Msgs, before.FirstSeq, before.LastSeq, after.Msgs, after.FirstSeq, after.LastSeq)
	}
}

// announceScheduler announces a ready scheduler every 100 ms until cleanup.
func announceScheduler(t *testing.T, nc *nats.Conn) {
	stop := make(chan struct{})
	done := make(chan struct{})
	subj := messages.Subjects{}.Announce(messages.RoleScheduler, "stand-in")
	publish := func() {
		data, _ := messages.Marshal(&messages.Announcement{Role: messages.RoleScheduler, ID: "stand-in", Ready: true, UnixMs: time.Now().UnixMilli()})
		_ = nc.Publish(subj, data)
	}
	go func() {
		defer close(done)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			publish()
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
}
