package frontend

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// TestPublishRefusesADuplicateID: a second request with an id the request
// log holds is refused with errDuplicateID (the client gets a 409), where
// before it was acknowledged as a duplicate and waited for an answer that
// went to the other request's client.
func TestPublishRefusesADuplicateID(t *testing.T) {
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
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
