package workers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// drive runs the engine for a request on the driver rank and streams its
// output to the frontend.
func (r *Rank) drive(rr *rankReq) {
	meta := rr.meta
	outSubj := r.cfg.Subjects.Out(meta.FrontendID)
	index := 0
	var kept *replayed // the outputs, kept to be sent again (replay.go)
	var send func([]byte)
	if r.replay != nil {
		kept = r.replay.begin(meta, outSubj)
		defer func() { r.replay.end(kept, time.Now()) }()
		send = func(data []byte) { r.publishData(outSubj, data, meta) }
	}
	var sentAt time.Time // when the last output went out
	publish := func(o *messages.Output) {
		o.ReqID, o.Index, o.Attempt = meta.ReqID, index, meta.Attempt
		index++
		sentAt = time.Now()
		if kept == nil {
			r.publish(outSubj, o, meta)
			return
		}
		data, err := messages.Marshal(o)
		if err != nil {
			r.log.Error("encode failed", "subject", outSubj, "req_id", meta.ReqID, "session_id", meta.SessionID, "err", err)
			return
		}
		r.replay.publish(kept, data, send)
	}
	// fit makes o fit in one message on the bus: an engine's whole answer
	// too large for one goes in parts (splitAnswer), all but the last
	// published here. It returns fitsBus's error when o cannot be split.
	fit := func(o *messages.Output) error {
		err := r.fitsBus(o)
		if err == nil {
			return nil
		}
		parts, ok := r.splitAnswer(o, meta.Stream)
		if !ok {
			return err
		}
		for _, p := range parts {
			publish(p)
		}
		return nil
	}
	// A request that does not stream is answered whole: its text and token
	// ids after the first output are held here and go with the last, or
	// heldWait after the output before (heldAnswer).
	var held heldAnswer
	// hold keeps o's text and ids with what is held, when the request does
	// not stream, its first output (its time to first token) went out, and
	// o is not an engine's own answer; what is held is published first when
	// o would not fit beside it on the bus. It reports whether o was kept.
	hold := func(o *messages.Output) bool {
		if meta.Stream || index == 0 || len(o.Raw) > 0 {
			return false
		}
		if !held.empty() && r.fitsSize(held.size()+o.Msgsize()) != nil {
			publish(held.take())
		}
		if held.empty() && r.fitsBus(o) != nil {
			return false // too large alone: fit says so
		}
		held.add(o)
		return true
	}
	// flushHeld publishes what is held, before an output that does not
	// take it.
	flushHeld := func() {
		if !held.empty() {
			publish(held.take())
		}
	}
	cached := min(rr.loaded, max(meta.TokenLen-1, 0)) // at least one token is computed
	storeQueued := false
	var last *Chunk // the answer's last chunk, when the engine marks it
	r.prefills.enter(rr, time.Now())
	res, err := r.cfg.Engine.Generate(rr.ctx, EngineRequest{
		ReqID: meta.ReqID, PromptTokens: meta.TokenIDs, CachedTokens: cached, RemoteTokens: min(rr.remote, cached),
		LoadTime: time.Duration(rr.loadUs) * time.Microsecond, Params: meta.SamplingParams,
		Model: meta.Model, SessionID: meta.SessionID, Endpoint: meta.Endpoint, Body: meta.Body, KVTransferParams: meta.KVTransferParams,
		CacheSalt: meta.CacheSalt,
	}, func() {
		storeQueued = true
		prefillTime := r.prefills.prefilled(rr, time.Now())
		if len(meta.Body) > 0 && !meta.Stream {
			// A model server's whole answer: reported as the request
			// reached it (OpenAIEngine), its prefill time unknown, so it
			// teaches the schedulers no pace (PrefillUs 0).
			prefillTime = 0
		}
		r.donePrefill(rr)
		// Tell every scheduler replica at once that the group's prefill
		// queue shrank: the client's next turn follows this answer, and
		// must not be placed on a stale load that makes its cache look
		// expensive.
		r.heartbeat()
		r.pushStore(rr)
		prefilled := r.resultOf(meta)
		prefilled.Prefilled, prefilled.PrefillUs = true, prefillTime.Microseconds()
		r.publish(meta.ResultSubject, &prefilled, meta)
	}, func(c Chunk) error {
		if c.Last && last == nil {
			last = &c // sent with the finish reason below
			return nil
		}
		o := &messages.Output{Text: c.Text, TokenIDs: c.TokenIDs, Raw: c.Raw}
		if hold(o) {
			if time.Since(sentAt) >= heldWait {
				flushHeld()
			}
			return nil
		}
		flushHeld()
		if err := fit(o); err != nil {
			return err // the generation ends with it, and the client hears why
		}
		publish(o)
		return nil
	})
	// The prompt's blocks are stored (and their KV events published) before
	// the final chunk, so a client's next turn finds them.
	if !storeQueued { // it ended without a prefill
		r.prefills.leave(rr, time.Now())
		close(rr.storeDone)
	}
	<-rr.storeDone
	usage := &messages.Usage{PromptTokens: meta.TokenLen, CompletionTokens: res.CompletionTokens, CachedTokens: rr.loaded,
		RemoteCachedTokens: min(rr.remote, rr.loaded)}
	if res.Usage != nil {
		// A model server counts its own cache: what it found is what the
		// request loaded.
		usage = res.Usage
		rr.loaded = res.Usage.CachedTokens
	}
	var engineErr *EngineError
	if err != nil {
		flushHeld() // the text before the error, as a stream would have had it
	}
	switch cause := context.Cause(rr.ctx); {
	case err == nil:
		if bs := r.cfg.BlockSize; r.cfg.KVEvents != nil && bs > 0 && usage.PromptTokens/bs > usage.CachedTokens/bs {
			r.blockAnswered.CompareAndSwap(0, time.Now().UnixNano()) // see watchEngineSilence
		}
		if res.FinishReason == "" {
			res.FinishReason = FinishStop // an engine that named no reason
		}
		final := &messages.Output{FinishReason: res.FinishReason, StopReason: res.StopReason, StopToken: res.StopToken, Usage: usage}
		if last != nil && !hold(&messages.Output{Text: last.Text, TokenIDs: last.TokenIDs, Raw: last.Raw}) {
			flushHeld()
			final.Text, final.TokenIDs, final.Raw = last.Text, last.TokenIDs, last.Raw
			if err := fit(final); err != nil {
				final = &messages.Output{Usage: usage, Error: &messages.OutputError{Code: "engine_error", Message: err.Error()}}
			}
		}
		if !held.empty() && r.fitsSize(held.size()+final.Msgsize()) == nil {
			h := held.take()
			final.Text, final.TokenIDs = h.Text, h.TokenIDs
		}
		flushHeld()
		publish(final)
	case errors.Is(err, ErrEngineUnavailable) && cause == nil:
		// The engine is down (or kept failing the request) and nothing
		// moved the request in time: the client hears now, not at its
		// deadline, with the code of a group that failed (503, Retry-After).
		publish(&messages.Output{Usage: usage, Error: &messages.OutputError{Code: "group_failed",
			Message: fmt.Sprintf("the worker group's engine did not take the request (%s); retry the request",
				strings.TrimPrefix(err.Error(), ErrEngineUnavailable.Error()+": "))}})
	case errors.Is(err, ErrEngineDied) && cause == nil:
		// The engine died after the answer began: it cannot move, and the
		// client hears of a group that failed (retry the request), as for a
		// worker that died, not of a model error.
		publish(&messages.Output{Usage: usage, Error: &messages.OutputError{Code: "group_failed",
			Message: fmt.Sprintf("generation stopped: the worker group's engine died during this answer (%s); retry the request",
				strings.TrimPrefix(err.Error(), ErrEngineDied.Error()+": "))}})
	case errors.As(err, &engineErr) && cause == nil:
		// The engine refused the request (a field it does not take, a
		// prompt too long) or failed it (a 5xx while its /health passes):
		// the client gets the engine's own answer.
		o := &messages.Output{Usage: usage, Error: &messages.OutputError{Code: "engine_error", Message: engineErr.Error(),
			Status: engineErr.Status, Raw: engineErr.Body}}
		if err := r.fitsBus(o); err != nil {
			// The client gets the engine's status and message, not its
			// whole body (a validation error may echo a huge input).
			r.log.Warn("the engine's error body is too large for the bus: the client gets its status and message only",
				"req_id", meta.ReqID, "session_id", meta.SessionID, "err", err)
			o.Error.Raw = nil
		}
		publish(o)
	case errors.Is(cause, errAborted):
		// The client is gone; nobody is listening.
	case errors.Is(cause, errSuperseded):
		// A newer attempt runs here: the frontend follows it from its
		// first output, and an error of this one would end the answer.
	case errors.Is(cause, errShutdown):
		// The group stops and this request outlived the drain. Its client
		// saw nothing of it yet (no output before the prefill): the
		// scheduler dispatches it again on another group, if one is ready,
		// and withdraws it here; this attempt then says nothing. Otherwise
		// the client hears of a group that stopped, which a retry answers
		// (503 with Retry-After), not of a model that failed (500).
		if !storeQueued && r.awaitWithdraw(rr) {
			break
		}
		publish(&messages.Output{Usage: usage, Error: &messages.OutputError{Code: "group_failed",
			Message: fmt.Sprintf("the worker group %s stopped (scaled down or restarted) before this answer was finished: its drain ran past --shutdown-timeout (%s); retry the request",
				r.cfg.Group, r.cfg.ShutdownTimeout)}})
	case errors.Is(cause, context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		msg := "request deadline passed during generation"
		if cause == nil && errors.Is(err, ErrEngineTimeout) {
			msg = err.Error() + "; retry the request, or raise --engine-timeout"
		}
		publish(&messages.Output{Usage: usage, Error: &messages.OutputError{Code: "timeout", Message: msg}})
	default:
		why := err // what the engine did; a cancel cause says more
		if cause != nil {
			why = cause
		}
		publish(&messages.Output{Usage: usage, Error: &messages.OutputError{Code: "engine_error", Message: fmt.Sprintf("generation stopped: %v", why)}})
	}
	rr.result.CompletionTokens = res.CompletionTokens
	if err != nil {
		rr.result.Error, rr.result.ErrorCode = err.Error(), rankErrCode(context.Cause(rr.ctx), err)
	}
	r.report(rr)
}

// outputRoom is what an Output's ids, index and attempt (set by publish)
// and NATS's protocol line take besides the fields fitsBus measures.
const outputRoom = 1 << 10

// splitAnswer splits an engine's whole (not streamed) answer that is too
// large for one message on the bus: it returns the Outputs that carry its
// body's first parts, each as large as the server's max payload takes, and
// leaves the last part in o: none when the body alone fits (the text and
// token ids beside it are dropped). The frontend writes the parts of an
// attempt's answer one after the other (frontend/relay.go). A stream's
// chunk is one server-sent event and is not split: false, as for an answer
// that has no body, or a max payload too small to carry any of it.
func (r *Rank) splitAnswer(o *messages.Output, stream bool) ([]*messages.Output, bool) {
	if stream || len(o.Raw) == 0 {
		return nil, false
	}
	raw, text, ids := o.Raw, o.Text, o.TokenIDs
	// The body is the answer: the text and token ids it holds go no
	// further than the frontend, which writes only the body.
	o.Text, o.TokenIDs, o.Raw = "", nil, nil
	room := int(busLimit(r.cfg.Conn)) - outputRoom - o.Msgsize() - 16 // 16: the body's bin header, and some
	if room < 1<<10 {
		o.Text, o.TokenIDs, o.Raw = text, ids, raw
		return nil, false
	}
	var parts []*messages.Output
	for len(raw) > room {
		parts = append(parts, &messages.Output{Raw: raw[:room:room]})
		raw = raw[room:]
	}
	o.Raw = raw
	return parts, true
}

// fitsBus reports an error when o is too large for a message on the bus
// (busLimit): publishing it would fail, or its reader would refuse it, the
// client would miss that part of its answer, and the frontend would ask
// for the whole request again.
func (r *Rank) fitsBus(o *messages.Output) error {
	return r.fitsSize(o.Msgsize())
}

// fitsSize is fitsBus for an Output whose fields take size bytes.
func (r *Rank) fitsSize(size int) error {
	limit := busLimit(r.cfg.Conn)
	if n := int64(size) + outputRoom; limit > 0 && n > limit {
		return fmt.Errorf("workers: an output of the engine's answer takes %d bytes on the bus, above the %d a message may take (the NATS server's max payload, at most %d: raise the server's max_payload up to that, or ask for less: fewer choices or logprobs)", n, limit, messages.MaxMessageBytes)
	}
	return nil
}

// heldWait is the longest a driver holds the answer of a request that does
// not stream while its engine gives tokens: what it holds goes out once
// the last output is that old. A frontend that reconnected to NATS takes a
// request that hears nothing for 3 s (its LostOutputWait) for lost, and
// asks its driver about it or publishes it again; an answer under way is
// heard well within that, as a stream is.
const heldWait = time.Second

// heldAnswer is the text and token ids of a request that does not stream,
// which its driver holds from the answer's second output on and sends with
// the last (or at least every heldWait). Its client reads the answer only
// whole (OpenAI's response that does not stream), and the first output,
// which carries its time to first token, went out already; an engine
// pacing its tokens (the sim at --time-scale > 0) would otherwise cost the
// bus, the frontend and the driver's memory of outputs to send again one
// message per token. It is used by the one goroutine driving the request.
type heldAnswer struct {
	text []byte
	ids  messages.TokenIDs
}

func (h *heldAnswer) empty() bool { return len(h.text) == 0 && len(h.ids) == 0 }

// size is what the held text and ids take in an Output on the bus.
func (h *heldAnswer) size() int { return len(h.text) + h.ids.Msgsize() }

func (h *heldAnswer) add(o *messages.Output) {
	h.text = append(h.text, o.Text...)
	h.ids = append(h.ids, o.TokenIDs...)
}

// take returns what is held as an Output and holds nothing.
func (h *heldAnswer) take() *messages.Output {
	o := &messages.Output{Text: string(h.text), TokenIDs: h.ids}
	h.text, h.ids = h.text[:0], nil
	return o
}
