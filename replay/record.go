package replay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
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

// CaptureStats summarises a capture file.
type CaptureStats struct {
	Requests     int            `json:"requests"`
	Span         time.Duration  `json:"span_ns"`
	First, Last  time.Time      `json:"-"`
	Subjects     map[string]int `json:"subjects"`
	Sessions     int            `json:"sessions"`
	PromptTokens struct {
		Min, Max int
		Mean     float64
	} `json:"prompt_tokens"`
	MaxTokensMean float64 `json:"max_tokens_mean"`
	Malformed     int     `json:"malformed"`
}

// Stats reads a capture file and summarises it.
func Stats(r io.Reader) (*CaptureStats, error) {
	cr, err := NewCaptureReader(r)
	if err != nil {
		return nil, err
	}
	s := &CaptureStats{Subjects: map[string]int{}}
	sessions := map[string]bool{}
	var prompt, maxTok int
	for {
		f, err := cr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return s, err
		}
		if s.Requests == 0 {
			s.First = f.Time
		}
		s.Last = f.Time
		s.Requests++
		s.Subjects[f.Subject]++
		req, err := messages.DecodeRequest(f.Payload)
		if err != nil {
			s.Malformed++
			continue
		}
		if req.SessionID != "" {
			sessions[req.SessionID] = true
		}
		n := len(req.PromptTokenIDs)
		if s.Requests-s.Malformed == 1 || n < s.PromptTokens.Min {
			s.PromptTokens.Min = n
		}
		s.PromptTokens.Max = max(s.PromptTokens.Max, n)
		prompt += n
		maxTok += req.SamplingParams.MaxTokens
	}
	s.Span = s.Last.Sub(s.First)
	s.Sessions = len(sessions)
	if ok := s.Requests - s.Malformed; ok > 0 {
		s.PromptTokens.Mean = float64(prompt) / float64(ok)
		s.MaxTokensMean = float64(maxTok) / float64(ok)
	}
	return s, nil
}

// Write prints the stats for a person.
func (s *CaptureStats) Write(w io.Writer) {
	fmt.Fprintf(w, "requests      %d (%d malformed)\n", s.Requests, s.Malformed)
	if s.Requests > 0 {
		fmt.Fprintf(w, "time          %s → %s (%s)\n", s.First.UTC().Format(time.RFC3339Nano), s.Last.UTC().Format(time.RFC3339Nano), s.Span)
	}
	fmt.Fprintf(w, "sessions      %d\n", s.Sessions)
	fmt.Fprintf(w, "prompt tokens min %d, mean %.1f, max %d\n", s.PromptTokens.Min, s.PromptTokens.Mean, s.PromptTokens.Max)
	fmt.Fprintf(w, "max_tokens    mean %.1f\n", s.MaxTokensMean)
	subjects := make([]string, 0, len(s.Subjects))
	for subj := range s.Subjects {
		subjects = append(subjects, subj)
	}
	sort.Strings(subjects)
	for _, subj := range subjects {
		fmt.Fprintf(w, "subject       %s: %d\n", subj, s.Subjects[subj])
	}
}

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

// Tap prints every matching bus message as one JSON line until ctx ends:
// {"subject": …, "kind": …, "msg": {decoded}}.
func Tap(ctx context.Context, cfg TapConfig, w io.Writer) error {
	subject := cfg.Subject
	if subject == "" {
		subject = cfg.Subjects.All()
	}
	enc := json.NewEncoder(w)
	ids := map[string]bool{} // request ids of the session
	prefix := cfg.Subjects.All()
	prefix = prefix[:len(prefix)-1] // "kvbus."
	msgs := make(chan *nats.Msg, 4096)
	sub, err := cfg.Conn.ChanSubscribe(subject, msgs)
	if err != nil {
		return err
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := cfg.Conn.Flush(); err != nil {
		return err
	}
	// A refused subscription is said on the connection, not by Subscribe:
	// without this check tap would wait for ever, printing nothing.
	if err := cfg.Conn.LastError(); errors.Is(err, nats.ErrPermissionViolation) {
		return fmt.Errorf("replay: tap: %w: tap reads every subject it is given; give it the admin key (--nats-nkey admin.nk)", err)
	}
	key := messages.SessionKey(cfg.SessionID)
	for {
		select {
		case <-ctx.Done():
			return nil
		case m := <-msgs:
			kind, v := decodeAny(strings.TrimPrefix(m.Subject, prefix), m.Data)
			if cfg.SessionID != "" && !keepForSession(kind, m.Subject, v, cfg.SessionID, key, ids) {
				continue
			}
			if err := enc.Encode(map[string]any{"subject": m.Subject, "kind": kind, "msg": v}); err != nil {
				// A value JSON cannot hold (a NaN temperature): say so and go on.
				if err := enc.Encode(map[string]any{"subject": m.Subject, "kind": "unprintable", "msg": map[string]string{"error": err.Error()}}); err != nil {
					return err
				}
			}
		}
	}
}

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

// decodeAny decodes a payload by its subject (without the prefix).
func decodeAny(rest string, data []byte) (string, any) {
	kind, _, _ := strings.Cut(rest, ".")
	var (
		v   any
		err error
	)
	switch kind {
	case "req":
		v, err = messages.DecodeRequest(data)
	case "meta":
		v, err = messages.DecodeReqMeta(data)
	case "done":
		v, err = messages.DecodeRankResult(data)
	case "out":
		v, err = messages.DecodeOutput(data)
	case "kv":
		v, err = messages.DecodeKVEventBatch(data)
	case "hb":
		v, err = messages.DecodeHeartbeat(data)
	case "ann":
		kind = "announcement"
		v, err = messages.DecodeAnnouncement(data)
	case "sched":
		kind = "save_plan"
		v, err = messages.DecodeSavePlan(data)
	case "pool":
		switch {
		case strings.HasSuffix(rest, ".drain"):
			kind = "drain_plan"
			v, err = messages.DecodeDrainPlan(data)
		case strings.HasSuffix(rest, ".handoff"): // block bytes: their size only
			kind, v = "handoff", map[string]int{"bytes": len(data)}
		default:
			kind = "pool_read"
			v, err = messages.DecodePoolRead(data)
		}
	case "ctl":
		if strings.HasPrefix(rest, "ctl.abort") {
			kind = "abort"
			v, err = messages.DecodeAbort(data)
		} else {
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
