package replay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// TapConfig says what to print.
type TapConfig struct {
	Conn     *nats.Conn
	Subjects messages.Subjects
	// SessionID, if set, keeps only that session's messages: its requests,
	// ReqMetas, results and outputs.
	SessionID string
	// Subject, if set, is the subject to tap (default every kvbus subject).
	Subject string
}

// Validate checks that there is a Conn, that Subjects (--subject-prefix)
// is valid and that Subject (--subject), if set, is a NATS subject (dot-
// separated tokens, wildcards allowed); the zero SessionID and Subject are
// every session and every kvbus subject. Errors wrap ErrConfig. Tap calls
// it.
func (c TapConfig) Validate() error {
	if c.Conn == nil {
		return fmt.Errorf("%w: tap needs a NATS connection (TapConfig.Conn)", ErrConfig)
	}
	if err := c.Subjects.Validate(); err != nil {
		return fmt.Errorf("%w: --subject-prefix: %w", ErrConfig, err)
	}
	return CheckTapSubject(c.Subject)
}

// CheckTapSubject refuses a tap --subject that NATS would refuse, by the
// server's own rule (NATS itself says only "nats: invalid subject", naming
// no flag); "" is every kvbus subject. The error wraps ErrConfig.
// TapConfig.Validate calls it, and kvbus tap before it connects.
func CheckTapSubject(subject string) error {
	if subject != "" && !server.IsValidSubject(subject) {
		return fmt.Errorf("%w: --subject %q is not a NATS subject: give dot-separated tokens, none empty or with spaces, * for one token and > only as the last (kvbus.meta.>)", ErrConfig, subject)
	}
	return nil
}

// Tap prints every matching bus message as one JSON line until ctx ends:
// {"subject": …, "kind": …, "msg": {decoded}}. It calls cfg.Validate first.
func Tap(ctx context.Context, cfg TapConfig, w io.Writer) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	subject := cfg.Subject
	if subject == "" {
		subject = cfg.Subjects.All()
	}
	enc := json.NewEncoder(w)
	ids := map[string]bool{} // request ids of the session
	// Queued in the client while the output is slower than the bus (a
	// terminal, a pipe to jq): a channel of 4,096 dropped the rest of a
	// burst. Bounded all the same, and a loss is said.
	sub, err := cfg.Conn.SubscribeSync(subject)
	if err != nil {
		return err
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := sub.SetPendingLimits(tapPendingMsgs, tapPendingBytes); err != nil {
		return err
	}
	if err := cfg.Conn.Flush(); err != nil {
		return err
	}
	// A refused subscription is said on the connection, not by Subscribe:
	// without this check tap would wait for ever, printing nothing.
	if err := cfg.Conn.LastError(); errors.Is(err, nats.ErrPermissionViolation) {
		return fmt.Errorf("replay: tap: %w: tap reads every subject it is given; give it the observer key (--nats-nkey DIR/observer.nk, "+
			"written by `kvbus auth init DIR`) or the admin key", err)
	}
	// The session as the frontend resolved it: trimmed, as it trims ids.
	cfg.SessionID = strings.TrimSpace(cfg.SessionID)
	key := messages.SessionKey(cfg.SessionID)
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if ctx.Err() != nil {
			if n, _ := sub.Dropped(); n > 0 {
				return fmt.Errorf("replay: tap: %d messages were dropped: the output fell %d messages behind the bus; write to a file, or narrow --subject or --session", n, tapPendingMsgs)
			}
			return nil
		}
		if err != nil {
			if errors.Is(err, nats.ErrSlowConsumer) {
				continue // counted in Dropped, said at the end
			}
			return err
		}
		kind, v := decodeAny(cfg.Subjects, m.Subject, m.Data)
		if cfg.SessionID != "" && !keepForSession(kind, m.Subject, v, cfg.SessionID, key, ids) {
			continue
		}
		if err := tapLine(enc, m.Subject, kind, v); err != nil {
			return err
		}
	}
}

// tapLine writes one message's line, or for a value JSON cannot hold (a
// NaN temperature) a line saying so: an error is the writer's.
func tapLine(enc *json.Encoder, subject, kind string, v any) error {
	if err := enc.Encode(map[string]any{"subject": subject, "kind": kind, "msg": v}); err != nil {
		return enc.Encode(map[string]any{"subject": subject, "kind": "unprintable", "msg": map[string]string{"error": err.Error()}})
	}
	return nil
}

// How far tap's output may fall behind the bus before messages are
// dropped.
const (
	tapPendingMsgs  = 1 << 20
	tapPendingBytes = 1 << 30
)

func keepForSession(kind, subject string, v any, sessionID, key string, ids map[string]bool) bool {
	switch m := v.(type) {
	case *messages.Request:
		if m.SessionID == sessionID || m.SamplingParams.SessionFromExtraArgs() == sessionID {
			ids[m.RequestID] = true
			return true
		}
	case *messages.ReqMeta:
		if strings.HasSuffix(subject, "."+key) {
			ids[m.ReqID] = true
			return true
		}
	case *messages.RankResult:
		return ids[m.ReqID]
	case *messages.Output:
		return ids[m.ReqID]
	case *messages.Abort:
		return ids[m.ReqID]
	}
	return false
}

// decodeAny decodes a payload by its subject.
func decodeAny(s messages.Subjects, subject string, data []byte) (string, any) {
	kind, rest := s.Kind(subject)
	var (
		v   any
		err error
	)
	switch kind {
	case messages.KindRequest:
		v, err = messages.DecodeRequest(data)
	case messages.KindMeta:
		v, err = messages.DecodeReqMeta(data)
	case messages.KindDone:
		v, err = messages.DecodeRankResult(data)
	case messages.KindOut:
		var o *messages.Output
		if o, err = messages.DecodeOutput(data); err == nil && o.ReqID == messages.FrontendProbeReqID {
			kind = "frontend_probe" // a scheduler asking whether the frontend lives, once a second: no answer's output
		}
		v = o
	case messages.KindKV:
		v, err = messages.DecodeKVEventBatch(data)
	case messages.KindHeartbeat:
		v, err = messages.DecodeHeartbeat(data)
	case messages.KindAnnounce:
		kind = "announcement"
		v, err = messages.DecodeAnnouncement(data)
	case messages.KindScheduler:
		kind = "save_plan"
		v, err = messages.DecodeSavePlan(data)
	case messages.KindDrain:
		kind = "drain_plan"
		v, err = messages.DecodeDrainPlan(data)
	case messages.KindPool:
		switch {
		case strings.HasSuffix(rest, ".handoff"): // block bytes: their size only
			kind, v = "handoff", map[string]int{"bytes": len(data)}
		default:
			kind = "pool_read"
			v, err = messages.DecodePoolRead(data)
		}
	case messages.KindControl:
		switch {
		case subject == s.Abort(), strings.HasPrefix(subject, s.Abort()+"."): // a client's, or one group's
			kind = "abort"
			v, err = messages.DecodeAbort(data)
		case subject == s.Resend(), strings.HasPrefix(subject, s.Resend()+"."): // to the schedulers, or to one group's driver
			kind = "resend"
			v, err = messages.DecodeResend(data)
		default:
			kind, v = "dump_request", map[string]int{"bytes": len(data)}
		}
	default:
		kind, v = "unknown", map[string]int{"bytes": len(data)}
	}
	if err != nil {
		return "malformed", map[string]string{"error": err.Error()}
	}
	return kind, v
}
