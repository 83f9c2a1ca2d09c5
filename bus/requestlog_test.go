package bus_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// newJS starts an embedded server and returns a JetStream context on it.
func newJS(t *testing.T) jetstream.JetStream {
	t.Helper()
	srv := startServer(t, "")
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

func payload(i int) []byte {
	return append([]byte(fmt.Sprintf("request %04d ", i)), bytes.Repeat([]byte{'x'}, 200)...)
}

func TestIsLogFull(t *testing.T) {
	if bus.IsLogFull(nil) || bus.IsLogFull(errors.New("maximum bytes exceeded")) || bus.IsLogFull(jetstream.ErrMsgNotFound) {
		t.Fatal("IsLogFull true for an error that is not a full log")
	}
	if !bus.IsLogFull(fmt.Errorf("publish: %w", bus.ErrLogFull)) {
		t.Fatal("IsLogFull false for a wrapped ErrLogFull")
	}
	tooLarge := &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "message size exceeds maximum allowed"}
	if bus.IsLogFull(tooLarge) {
		t.Fatal("IsLogFull true for a message too large")
	}
}

func TestRequestLogRefusesWhenFull(t *testing.T) {
	js := newJS(t)
	ctx := t.Context()
	st, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{MaxBytes: 4096})
	if err != nil {
		t.Fatal(err)
	}
	if d := st.CachedInfo().Config.Discard; d != jetstream.DiscardNew {
		t.Fatalf("discard policy %v, want DiscardNew", d)
	}
	// A consumer that never acks: every request stays undispatched.
	if _, err := bus.EnsureSchedulerConsumer(ctx, st, 0, 1); err != nil {
		t.Fatal(err)
	}
	var accepted int
	var pubErr error
	for i := range 100 {
		if _, pubErr = js.Publish(ctx, "kvbus.req.m", payload(i), jetstream.WithMsgID(fmt.Sprint("r", i))); pubErr != nil {
			break
		}
		accepted++
	}
	if pubErr == nil {
		t.Fatal("100 publishes of 200+ bytes into a 4096-byte log all succeeded")
	}
	t.Logf("publish into the full log: %v", pubErr)
	if !bus.IsLogFull(pubErr) {
		t.Fatalf("IsLogFull(%v) = false", pubErr)
	}
	if accepted == 0 {
		t.Fatal("the first publish was refused")
	}
	// Still full: a second try is refused the same way.
	if _, err := js.Publish(ctx, "kvbus.req.m", payload(999)); !bus.IsLogFull(err) {
		t.Fatalf("second publish into the full log: %v", err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != uint64(accepted) || info.State.FirstSeq != 1 {
		t.Fatalf("log holds %d messages from seq %d; want all %d accepted from seq 1", info.State.Msgs, info.State.FirstSeq, accepted)
	}
	for i := range accepted {
		m, err := st.GetMsg(ctx, uint64(i+1))
		if err != nil {
			t.Fatalf("accepted message %d lost: %v", i+1, err)
		}
		if !bytes.Equal(m.Data, payload(i)) {
			t.Fatalf("message %d is %q, want %q", i+1, m.Data[:16], payload(i)[:16])
		}
	}
}

func TestTrimHistoryKeepsUnacked(t *testing.T) {
	if b := (bus.StreamConfig{MaxBytes: 1 << 20}).HistoryBound(); b != 1<<19 {
		t.Fatalf("default history bound %d, want half of MaxBytes", b)
	}
	js := newJS(t)
	ctx := t.Context()
	st, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	cons, err := bus.EnsureSchedulerConsumer(ctx, st, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	const total, acked = 40, 30
	for i := range total {
		if _, err := js.Publish(ctx, "kvbus.req.m", payload(i)); err != nil {
			t.Fatal(err)
		}
	}
	// Nothing acknowledged: nothing may go, however small the bound.
	if n, err := bus.TrimHistory(ctx, st, cons, 0); err != nil || n != 0 {
		t.Fatalf("trim with nothing acked: purged %d, %v", n, err)
	}
	batch, err := cons.Fetch(acked, jetstream.FetchMaxWait(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := 0
	for m := range batch.Messages() {
		if err := m.DoubleAck(ctx); err != nil {
			t.Fatal(err)
		}
		got++
	}
	if got != acked {
		t.Fatalf("fetched %d, want %d", got, acked)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	perMsg := info.State.Bytes / total

	// A bound of 15 messages: the 25 oldest (all acked) go.
	bound := int64(15 * perMsg)
	n, err := bus.TrimHistory(ctx, st, cons, bound)
	if err != nil {
		t.Fatal(err)
	}
	info, _ = st.Info(ctx)
	if n != 25 || info.State.FirstSeq != 26 || info.State.Msgs != 15 {
		t.Fatalf("purged %d, log holds %d from seq %d; want 25 purged, 15 from seq 26", n, info.State.Msgs, info.State.FirstSeq)
	}
	if info.State.Bytes > uint64(bound) {
		t.Fatalf("log holds %d bytes after the trim, bound %d", info.State.Bytes, bound)
	}

	// A bound of 2 messages: only the acked ones go, the 10 unacked stay.
	n, err = bus.TrimHistory(ctx, st, cons, int64(2*perMsg))
	if err != nil {
		t.Fatal(err)
	}
	info, _ = st.Info(ctx)
	if n != 5 || info.State.FirstSeq != acked+1 || info.State.Msgs != total-acked {
		t.Fatalf("purged %d, log holds %d from seq %d; want 5 purged, %d from seq %d", n, info.State.Msgs, info.State.FirstSeq, total-acked, acked+1)
	}
	for seq := uint64(acked + 1); seq <= total; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("unacked message %d purged: %v", seq, err)
		}
		if !bytes.Equal(m.Data, payload(int(seq-1))) {
			t.Fatalf("message %d changed", seq)
		}
	}
	// Under the bound: nothing to do.
	if n, err := bus.TrimHistory(ctx, st, cons, 1<<20); err != nil || n != 0 {
		t.Fatalf("trim under the bound: purged %d, %v", n, err)
	}
}

func TestDiscardOldStreamIsSwitchedToDiscardNew(t *testing.T) {
	js := newJS(t)
	ctx := t.Context()
	// A stream as an older kvbus created it.
	old := jetstream.StreamConfig{
		Name: messages.RequestStream, Subjects: []string{"kvbus.req.>"}, Storage: jetstream.FileStorage,
		Retention: jetstream.LimitsPolicy, MaxAge: time.Hour, MaxBytes: 1 << 20, Discard: jetstream.DiscardOld,
		Duplicates: time.Minute,
	}
	if _, err := js.CreateStream(ctx, old); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "kvbus.req.m", []byte("kept")); err != nil {
		t.Fatal(err)
	}
	st, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{MaxBytes: 1 << 30, MaxAge: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c := info.Config
	if c.Discard != jetstream.DiscardNew {
		t.Fatalf("discard %v after EnsureRequestStream, want DiscardNew", c.Discard)
	}
	// Nothing else changes on an existing stream.
	if c.MaxBytes != old.MaxBytes || c.MaxAge != old.MaxAge || c.Duplicates != old.Duplicates || info.State.Msgs != 1 {
		t.Fatalf("existing stream changed beyond its discard policy: %+v, %d messages", c, info.State.Msgs)
	}
	// A second process finds it already switched and leaves it alone.
	ctx2, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := bus.EnsureRequestStream(ctx2, js, bus.StreamConfig{}); err != nil {
		t.Fatal(err)
	}
}

// TestRequestLogLargerThanTheServerFailsSayingSo: a request log whose cap
// the server cannot reserve (its JetStream storage, by default from the
// free space of its store directory, is smaller: a 1 GiB log on a NATS
// volume with less than that free) fails at once, naming the flag and what
// to do. Before, the role retried forever without a word: `kvbus frontend`
// and `kvbus scheduler` hung at start against `kvbus nats` on a 20 MB
// volume, each retry an API error in the server's count.
func TestRequestLogLargerThanTheServerFailsSayingSo(t *testing.T) {
	js := newJS(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	_, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{MaxBytes: 1 << 55}) // 32 PiB: more than any disk
	if ctx.Err() != nil {
		t.Fatalf("EnsureRequestStream retried until its context ended: %v", err)
	}
	if err == nil {
		t.Fatal("a 32 PiB request log was created")
	}
	for _, want := range []string{"--request-log-max-bytes", "--data-dir", "insufficient storage"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("error %q does not say %q", err, want)
		}
	}
}
