package bus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/kvbus/kvbus/internal/logbuf"
	"github.com/kvbus/kvbus/messages"
	"github.com/nats-io/nats.go"
)

// TestHandlerFailuresLoggedOncePerWindow: of 500 malformed messages in a
// window one line is logged; the first after the window carries the 499
// held back; another failure, during the flood of malformed ones, is
// logged all the same.
func TestHandlerFailuresLoggedOncePerWindow(t *testing.T) {
	now := time.Unix(1000, 0)
	var logs logbuf.Buffer
	var fail error
	h := logging[*nats.Msg](slog.New(slog.NewTextHandler(&logs, nil)), "h", handlerErrorEvery, func() time.Time { return now })(func(context.Context, *nats.Msg) error { return fail })
	m := &nats.Msg{Subject: "kvbus.ctl.abort"}
	fail = fmt.Errorf("*messages.Abort: %w: truncated", messages.ErrMalformed)
	for range 500 {
		_ = h(t.Context(), m)
	}
	fail = errors.New("publish: nats: connection closed")
	_ = h(t.Context(), m)
	if got := len(logs.Lines("could not decode")); got != 1 {
		t.Errorf("%d lines for 500 malformed messages in the window, want 1:\n%s", got, logs.String())
	}
	if got := len(logs.Lines("message handler failed", "connection closed", "subject=kvbus.ctl.abort")); got != 1 {
		t.Errorf("the other failure logged %d times, want 1:\n%s", got, logs.String())
	}
	now = now.Add(handlerErrorEvery)
	fail = fmt.Errorf("*messages.Abort: %w: truncated", messages.ErrMalformed)
	_ = h(t.Context(), m)
	if got := len(logs.Lines("could not decode", "more=499")); got != 1 {
		t.Errorf("after the window, %d lines counting the 499 held back, want 1:\n%s", got, logs.String())
	}
}

// TestAFloodThatEndsWithinTheWindowIsCounted: 300 malformed messages that
// all come within one window are logged as the first, and at the window's
// end as one line with the last one's subject and error and the 298 more
// held back; nothing more follows. (A flood that ended within the window was
// counted in kvbus_bus_messages_total but told in the log as one message.)
func TestAFloodThatEndsWithinTheWindowIsCounted(t *testing.T) {
	var logs logbuf.Buffer
	const every = 200 * time.Millisecond
	h := logging[*nats.Msg](slog.New(slog.NewTextHandler(&logs, nil)), "h", every, time.Now)(func(_ context.Context, m *nats.Msg) error {
		return fmt.Errorf("*messages.Abort: %w: truncated at %s", messages.ErrMalformed, m.Reply)
	})
	for i := range 300 {
		_ = h(t.Context(), &nats.Msg{Subject: "kvbus.ctl.abort", Reply: fmt.Sprint(i)})
	}
	if got := len(logs.Lines("could not decode")); got != 1 {
		t.Fatalf("%d lines within the window, want 1:\n%s", got, logs.String())
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(logs.Lines("could not decode", "more=298", "subject=kvbus.ctl.abort", "truncated at 299")) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no line told of the 299 held back (the last and 298 more) 5 s after the flood ended:\n%s", logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(3 * every)
	if got := len(logs.Lines("could not decode")); got != 2 {
		t.Errorf("%d lines in all, want the first and the one of those held back:\n%s", got, logs.String())
	}
}
