package frontend

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// startJetStream starts an embedded NATS server and connects to it.
func startJetStream(t *testing.T) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// TestPublishRefusesADuplicateID: a second request with an id the request
// log holds is refused with errDuplicateID (the client gets a 409), where
// before it was acknowledged as a duplicate and waited for an answer that
// went to the other request's client.
func TestPublishRefusesADuplicateID(t *testing.T) {
	nc, js := startJetStream(t)
	subj := messages.Subjects{}
	if _, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{Subjects: subj}); err != nil {
		t.Fatal(err)
	}
	s := &Server{js: js, cfg: Config{Conn: nc, Subjects: subj, PublishTimeout: 5 * time.Second}}
	req := &messages.Request{RequestID: "abc-1", Model: "m", FrontendID: "fe", ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: []uint32{1, 2}}
	if err := s.publish(t.Context(), req); err != nil {
		t.Fatalf("first publish: %v", err)
	}
	if err := s.publish(t.Context(), req); !errors.Is(err, errDuplicateID) {
		t.Fatalf("second publish of the same id: %v, want errDuplicateID", err)
	}
}

// TestPublishTriesAgainWhenNotAcknowledged: a request the log does not
// acknowledge within PublishTimeout (its leader being elected again after
// a NATS server of a cluster stopped) is published once more under the
// same id; the log's "duplicate" then means the first try was logged, and
// the request is accepted, not refused as another's id. Before, the client
// got a 503 after the first timeout.
func TestPublishTriesAgainWhenNotAcknowledged(t *testing.T) {
	nc, js := startJetStream(t)
	subj := messages.Subjects{}
	// A log that takes the first try but whose acknowledgement is lost.
	var ids []string
	sub, err := nc.SubscribeSync(subj.Request("m"))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for try := 1; try <= 2; try++ {
			m, err := sub.NextMsg(5 * time.Second)
			if err != nil {
				t.Error(err)
				return
			}
			ids = append(ids, m.Header.Get(nats.MsgIdHdr))
			if try == 2 {
				_ = m.Respond([]byte(`{"stream":"KVBUS_REQUESTS","seq":1,"duplicate":true}`))
			}
		}
	}()
	s := &Server{js: js, cfg: Config{Conn: nc, Subjects: subj, PublishTimeout: 200 * time.Millisecond}, log: slog.New(slog.DiscardHandler)}
	req := &messages.Request{RequestID: "abc-1", Model: "m", FrontendID: "fe", ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: []uint32{1, 2}}
	if err := s.publish(t.Context(), req); err != nil {
		t.Fatalf("publish whose first acknowledgement was lost: %v, want accepted", err)
	}
	<-done
	if len(ids) != 2 || ids[0] != "abc-1" || ids[1] != "abc-1" {
		t.Errorf("the log got %q; want the request twice under its id", ids)
	}
	// Not acknowledged twice: the error stands.
	s.cfg.PublishTimeout = 50 * time.Millisecond
	if err := s.publish(t.Context(), req); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("publish never acknowledged: %v, want a deadline error", err)
	}
}

// TestPublishWaitsForTheLogToAnswer: a request log with no responder (its
// leader being elected again, or the log being made again after a NATS
// restart without its store) is published to again within two publish
// timeouts: a log that appears 300 ms later takes the request. Before,
// the client got a 503 at once.
func TestPublishWaitsForTheLogToAnswer(t *testing.T) {
	nc, js := startJetStream(t)
	subj := messages.Subjects{}
	made := make(chan error, 1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		_, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{Subjects: subj})
		made <- err
	}()
	s := &Server{js: js, cfg: Config{Conn: nc, Subjects: subj, PublishTimeout: time.Second}, log: slog.New(slog.DiscardHandler)}
	req := &messages.Request{RequestID: "abc-1", Model: "m", FrontendID: "fe", ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: []uint32{1, 2}}
	start := time.Now()
	if err := s.publish(t.Context(), req); err != nil {
		t.Fatalf("publish while the log was being made: %v after %v", err, time.Since(start))
	}
	if err := <-made; err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(t.Context(), subj.RequestStream())
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Errorf("the log holds %d messages; want the request once", info.State.Msgs)
	}
}
