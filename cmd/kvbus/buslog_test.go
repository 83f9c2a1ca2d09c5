package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestForgeryWarningsAreInTheRolesLog: what the bus layer logs of a role's
// subscriptions — a message the server sent out of a stream, a request whose
// reply is no inbox, both forgeries a key's holder can send — is in the
// role's own log, in its --log-format. It went to slog's default logger,
// which no role sets: a scheduler run with --log-format json, sent a
// heartbeat out of KVBUS_RANKS by a worker-g1 key, wrote
// `2026/12/07 12:40:49 WARN bus: dropped a message the server sent out of a
// stream …` in Go's text format among its JSON lines, past its log sink.
func TestForgeryWarningsAreInTheRolesLog(t *testing.T) {
	srv := testenv.StartNATS(t)
	c := parseCLI(t, "scheduler", "--nats-url", srv.ClientURL(), "--metrics-addr=", "--log-format", "json")
	logs := &testenv.LogBuffer{}
	c.Scheduler.out = logs
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- c.Scheduler.Run(ctx) }()
	defer func() { cancel(); <-done }()

	nc := testenv.Connect(t, srv)
	s := messages.Subjects{}
	// The scheduler subscribes to the heartbeats once its request log is
	// made: a stream echo and an off-inbox request, again until both are
	// logged (the first ones may come before it subscribed).
	testenv.Eventually(t, 10*time.Second, "both forgeries logged by the scheduler", func() bool {
		echo := &nats.Msg{Subject: s.Heartbeat("g9", 0), Header: nats.Header{}, Data: []byte("x")}
		echo.Header.Set("Nats-Stream", "KV_KVBUS_RANKS")
		_ = nc.PublishMsg(echo)
		_ = nc.PublishMsg(&nats.Msg{Subject: s.Heartbeat("g9", 0), Reply: s.Request("kvbus-sim"), Data: []byte("x")})
		_ = nc.Flush()
		time.Sleep(50 * time.Millisecond)
		return len(logs.Lines("dropped a message the server sent out of a stream")) > 0 &&
			len(logs.Lines("dropped a request whose answer would go onto")) > 0
	})
	for _, l := range append(logs.Lines("dropped a message the server sent out of a stream"), logs.Lines("dropped a request whose answer")...) {
		var line map[string]any
		if err := json.Unmarshal([]byte(strings.TrimSpace(l)), &line); err != nil || line["level"] != "WARN" {
			t.Errorf("not a JSON warning in the scheduler's --log-format json: %q (%v)", l, err)
		}
	}
}
