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
	h := logging[*nats.Msg](slog.New(slog.NewTextHandler(&logs, nil)), "h", func() time.Time { return now })(func(context.Context, *nats.Msg) error { return fail })
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
