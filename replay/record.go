package replay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// CaptureConfig says what to copy from the request log.
type CaptureConfig struct {
	Conn     *nats.Conn
	Subjects messages.Subjects
	// Follow keeps capturing new requests until the context ends; without
	// Since or FromSeq it starts at the first new request.
	Follow bool
	// Since or FromSeq start at a time or a stream sequence of the log;
	// neither means the whole log.
	Since   time.Time
	FromSeq uint64
	// Until stops at requests logged after this time (zero: no bound).
	Until time.Time
}

// Capture copies Requests from the JetStream request log into w as a capture
// file, with their log times and byte-exact payloads, and returns how many
// it wrote. Without Follow it stops at the end of the log as it was when the
// capture began.
func Capture(ctx context.Context, cfg CaptureConfig, w io.Writer) (int, error) {
	js, err := jetstream.New(cfg.Conn)
	if err != nil {
		return 0, err
	}
	names, err := bus.ResolveNames(ctx, js, cfg.Subjects)
	if err != nil {
		return 0, fmt.Errorf("replay: request log %s: %w", names.RequestStream, err)
	}
	st, err := js.Stream(ctx, names.RequestStream)
	if err != nil {
		return 0, fmt.Errorf("replay: request log %s: %w (has a frontend or scheduler run on this bus, with this --subject-prefix?)", names.RequestStream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return 0, err
	}
	last := info.State.LastSeq
	occ := jetstream.OrderedConsumerConfig{FilterSubjects: []string{cfg.Subjects.RequestAll()}, DeliverPolicy: jetstream.DeliverAllPolicy}
	switch {
	case cfg.FromSeq > 0:
		occ.DeliverPolicy, occ.OptStartSeq = jetstream.DeliverByStartSequencePolicy, cfg.FromSeq
	case !cfg.Since.IsZero():
		occ.DeliverPolicy, occ.OptStartTime = jetstream.DeliverByStartTimePolicy, &cfg.Since
	case cfg.Follow:
		// From the first request after the log's current end. (Not
		// DeliverNew: an ordered consumer that is re-created before its
		// first message would skip what arrived in between.)
		occ.DeliverPolicy, occ.OptStartSeq = jetstream.DeliverByStartSequencePolicy, last+1
	}
	if !cfg.Follow && (last == 0 || (cfg.FromSeq > last)) {
		cw, err := NewCaptureWriter(w)
		if err != nil {
			return 0, err
		}
		return 0, cw.Flush()
	}
	cons, err := st.OrderedConsumer(ctx, occ)
	if err != nil {
		return 0, err
	}
	cw, err := NewCaptureWriter(w)
	if err != nil {
		return 0, err
	}
	for {
		batch, err := cons.Fetch(256, jetstream.FetchMaxWait(500*time.Millisecond))
		if err != nil {
			if ctx.Err() != nil {
				return cw.Frames(), cw.Flush()
			}
			return cw.Frames(), err
		}
		got, done := 0, false
		var werr error
		for m := range batch.Messages() {
			// Read the batch to its end even when done: its fetch ends then.
			if done {
				continue
			}
			got++
			md, err := m.Metadata()
			if err != nil {
				done, werr = true, err
				continue
			}
			if !cfg.Until.IsZero() && md.Timestamp.After(cfg.Until) {
				done = true
				continue
			}
			if err := cw.Write(Frame{Time: md.Timestamp, Subject: m.Subject(), Payload: m.Data()}); err != nil {
				done, werr = true, err
				continue
			}
			if !cfg.Follow && md.Sequence.Stream >= last {
				done = true
			}
		}
		if done {
			if werr != nil {
				return cw.Frames(), werr
			}
			return cw.Frames(), cw.Flush()
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			return cw.Frames(), err
		}
		if err := cw.Flush(); err != nil {
			return cw.Frames(), err
		}
		if ctx.Err() != nil {
			return cw.Frames(), nil
		}
		if got == 0 && !cfg.Follow {
			return cw.Frames(), nil // the log ended earlier than its last seq (a filtered subject)
		}
	}
}
