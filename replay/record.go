package replay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// ErrCaptureFlags is wrapped when a CaptureConfig asks for two things that
// exclude each other.
var ErrCaptureFlags = errors.New("replay: capture")

// CaptureConfig says what to copy from the request log.
type CaptureConfig struct {
	Conn     *nats.Conn
	Subjects messages.Subjects
	// Follow keeps capturing new requests until the context ends (or
	// Until passes); without Since or FromSeq it starts at the first new
	// request. A follow outlives NATS restarts: it resumes after the last
	// request it wrote.
	Follow bool
	// Since or FromSeq (not both) start at a time or a stream sequence of
	// the log; neither means the whole log.
	Since   time.Time
	FromSeq uint64
	// Until stops at requests logged after this time (zero: no bound).
	Until time.Time
	// Logger says when a follow resumes (nil: slog.Default()).
	Logger *slog.Logger
}

// Validate reports a configuration Capture refuses.
func (c CaptureConfig) Validate() error {
	switch {
	case c.FromSeq > 0 && !c.Since.IsZero():
		return fmt.Errorf("%w: give --since or --from-seq, not both", ErrCaptureFlags)
	case !c.Until.IsZero() && !c.Since.IsZero() && !c.Until.After(c.Since):
		return fmt.Errorf("%w: --until (%s) is not after --since (%s)", ErrCaptureFlags, c.Until.Format(time.RFC3339), c.Since.Format(time.RFC3339))
	}
	return nil
}

// adminHint is said where a capture's JetStream calls go unanswered or are
// refused.
const adminHint = "with `kvbus auth` keys, capture needs the admin key (--nats-nkey admin.nk)"

// Capture copies Requests from the JetStream request log into w as a capture
// file, with their log times and byte-exact payloads, and returns how many
// it wrote. Without Follow it stops at the end of the log as it was when the
// capture began.
func Capture(ctx context.Context, cfg CaptureConfig, w io.Writer) (int, error) {
	if err := cfg.Validate(); err != nil {
		return 0, err
	}
	if cfg.Conn == nil {
		return 0, fmt.Errorf("%w: no NATS connection", ErrCaptureFlags)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if err := canReadReplies(cfg.Conn); err != nil {
		return 0, err
	}
	js, err := jetstream.New(cfg.Conn)
	if err != nil {
		return 0, err
	}
	names, err := bus.ResolveNames(ctx, js, cfg.Subjects)
	if err != nil {
		return 0, refused(cfg.Conn, fmt.Errorf("replay: request log %s: %w", names.RequestStream, err))
	}
	st, err := js.Stream(ctx, names.RequestStream)
	if err != nil {
		return 0, refused(cfg.Conn, fmt.Errorf("replay: request log %s: %w (has a frontend or scheduler run on this bus, with this --subject-prefix? %s)",
			names.RequestStream, err, adminHint))
	}
	info, err := st.Info(ctx)
	if err != nil {
		return 0, refused(cfg.Conn, err)
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
	cw, err := NewCaptureWriter(w)
	if err != nil {
		return 0, err
	}
	if !cfg.Follow && (last == 0 || (cfg.FromSeq > last)) {
		return 0, cw.Flush()
	}
	c := &capturer{cfg: cfg, cw: cw, last: last, st: st, created: info.Created}
	for {
		cons, err := st.OrderedConsumer(ctx, occ)
		if err == nil {
			err = c.copy(ctx, cons)
		}
		switch {
		case err == nil, ctx.Err() != nil:
			return cw.Frames(), cw.Flush()
		case !cfg.Follow:
			return cw.Frames(), refused(cfg.Conn, err)
		case errors.Is(refused(cfg.Conn, err), nats.ErrPermissionViolation):
			return cw.Frames(), refused(cfg.Conn, err)
		}
		if ferr := cw.Flush(); ferr != nil {
			return cw.Frames(), ferr
		}
		// Following: wait out the outage (a NATS restart) and resume
		// after the last request written.
		cfg.Logger.Warn("capture interrupted; resuming after the last request written", "requests", cw.Frames(), "after_seq", c.seq, "err", err)
		select {
		case <-ctx.Done():
			return cw.Frames(), nil
		case <-time.After(time.Second):
		}
		occ.DeliverPolicy, occ.OptStartTime, occ.OptStartSeq = jetstream.DeliverByStartSequencePolicy, nil, c.seq+1
		if c.seq == 0 {
			occ = c.resumeAtStart(occ)
		}
		if info, err := st.Info(ctx); err == nil && (!info.Created.Equal(c.created) || occ.OptStartSeq > info.State.LastSeq+1) {
			// The log was made again (a server restarted without its
			// store): its sequences start over.
			cfg.Logger.Warn("the request log starts over (made again after a NATS restart); capturing it from its start", "after_seq", c.seq)
			occ.DeliverPolicy, occ.OptStartTime = jetstream.DeliverByStartSequencePolicy, nil
			occ.OptStartSeq, c.seq, c.last, c.created = 1, 0, 0, info.Created
		}
	}
}

// capturer copies from one ordered consumer; seq is the stream sequence of
// the last request written.
type capturer struct {
	cfg  CaptureConfig
	cw   *CaptureWriter
	last uint64 // the log's end when the capture began (without Follow)
	seq  uint64
	// st and created tell a log made again (a NATS server restarted
	// without its store) while a follow waits: the ordered consumer would
	// wait for sequences the new log reaches only much later.
	st        jetstream.Stream
	created   time.Time
	lastCheck time.Time
}

// errLogRemade: the request log was made again under a follow.
var errLogRemade = errors.New("replay: the request log was made again")

// resumeAtStart keeps the original start of a follow that has written
// nothing yet.
func (c *capturer) resumeAtStart(occ jetstream.OrderedConsumerConfig) jetstream.OrderedConsumerConfig {
	switch {
	case c.cfg.FromSeq > 0:
		occ.OptStartSeq = c.cfg.FromSeq
	case !c.cfg.Since.IsZero():
		occ.DeliverPolicy, occ.OptStartSeq, occ.OptStartTime = jetstream.DeliverByStartTimePolicy, 0, &c.cfg.Since
	default:
		occ.OptStartSeq = c.last + 1
	}
	return occ
}

// copy fetches and writes until the capture is done (nil), ctx ends (nil)
// or a fetch fails.
func (c *capturer) copy(ctx context.Context, cons jetstream.Consumer) error {
	for {
		batch, err := cons.Fetch(256, jetstream.FetchMaxWait(500*time.Millisecond))
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
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
			if !c.cfg.Until.IsZero() && md.Timestamp.After(c.cfg.Until) {
				done = true
				continue
			}
			if err := c.cw.Write(Frame{Time: md.Timestamp, Subject: m.Subject(), Payload: m.Data()}); err != nil {
				done, werr = true, err
				continue
			}
			c.seq = md.Sequence.Stream
			if !c.cfg.Follow && md.Sequence.Stream >= c.last {
				done = true
			}
		}
		if done {
			return werr
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			return err
		}
		if err := c.cw.Flush(); err != nil {
			return err
		}
		switch {
		case ctx.Err() != nil:
			return nil
		case got == 0 && !c.cfg.Follow:
			return nil // the log ended earlier than its last seq (a filtered subject)
		case c.cfg.Follow && !c.cfg.Until.IsZero() && time.Now().After(c.cfg.Until):
			return nil // an idle log: nothing later can be logged before Until
		case got == 0 && c.cfg.Follow:
			// A follow whose fetches the server refuses gets nothing
			// back, not an error: say so instead of waiting.
			if err := c.cfg.Conn.LastError(); errors.Is(err, nats.ErrPermissionViolation) {
				return err
			}
			if time.Since(c.lastCheck) >= time.Second {
				c.lastCheck = time.Now()
				if info, err := c.st.Info(ctx); err == nil && !info.Created.Equal(c.created) {
					return errLogRemade
				}
			}
		}
	}
}

// canReadReplies subscribes the connection's reply inbox once: every
// JetStream answer a capture waits for comes there. A key that may not read
// it (the observer's, a role's) is said at once; else each call waited for
// its timeout and failed as "context deadline exceeded".
func canReadReplies(nc *nats.Conn) error {
	sub, err := nc.SubscribeSync(nc.NewInbox())
	if err != nil {
		return err
	}
	defer sub.Unsubscribe()
	if err := nc.Flush(); err != nil {
		return err
	}
	if err := nc.LastError(); errors.Is(err, nats.ErrPermissionViolation) {
		return fmt.Errorf("replay: capture: %w: capture reads the request log through JetStream, whose answers come on its _INBOX; %s", err, adminHint)
	}
	return nil
}

// refused adds the admin-key hint to err when the connection saw a
// permission violation (a key that may not read the request log: its
// JetStream calls are refused, and they fail as unanswered).
func refused(nc *nats.Conn, err error) error {
	if lerr := nc.LastError(); errors.Is(lerr, nats.ErrPermissionViolation) && !errors.Is(err, nats.ErrPermissionViolation) {
		return fmt.Errorf("%w (%w: %s)", err, lerr, adminHint)
	}
	if errors.Is(err, nats.ErrPermissionViolation) {
		return fmt.Errorf("%w: %s", err, adminHint)
	}
	return err
}
