package frontend

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// A generation's outputs: the queue the NATS callback fills, each
// choice's state, and following them — taking a choice's outputs in index
// order, an attempt moved to another group, a request asked again when
// its answer was lost on the bus (askAgain, settleHedge), and aborting
// what the client no longer waits for.

// outputQueue collects the Outputs of one HTTP request's bus requests. The
// NATS callback pushes without blocking; the HTTP handler pops.
type outputQueue struct {
	mu     sync.Mutex
	items  []choiceOutput
	signal chan struct{}
	// latest is, per choice, where each of its bus requests' outputs got
	// to (under mu): a choice has one bus request, two while one asked
	// again may still answer.
	latest [][]outputMark
}

// outputMark is where a bus request's outputs have got to. heard counts
// its outputs pushed that were news: not a copy of one pushed before, as a
// driver sends again after a reconnect the outputs it published just
// before it (watchReconnects compares it across its wait: a copy says
// nothing of whether the answer goes on).
type outputMark struct {
	reqID          string
	attempt, index int
	heard          int64
}

type choiceOutput struct {
	choice int
	out    *messages.Output
	// resend, instead of an output, is the driver's answer to a Resend
	// (resend.go).
	resend *resendOutcome
}

// codeOutputLost is the error code of an answer lost on the bus.
const codeOutputLost = "output_lost"

// newOutputQueue makes the queue of a request of n choices.
func newOutputQueue(n int) *outputQueue {
	return &outputQueue{signal: make(chan struct{}, 1), latest: make([][]outputMark, n)}
}

func (q *outputQueue) push(choice int, o *messages.Output) {
	q.mu.Lock()
	if choice >= len(q.latest) {
		q.latest = append(q.latest, make([][]outputMark, choice+1-len(q.latest))...)
	}
	marks := q.latest[choice]
	i := 0
	for i < len(marks) && marks[i].reqID != o.ReqID {
		i++
	}
	if i == len(marks) {
		q.latest[choice] = append(marks, outputMark{o.ReqID, o.Attempt, o.Index, 1})
	} else if m := &marks[i]; o.Attempt > m.attempt || o.Attempt == m.attempt && o.Index > m.index {
		m.attempt, m.index = o.Attempt, o.Index
		m.heard++
	}
	q.mu.Unlock()
	q.add(choiceOutput{choice: choice, out: o})
}

// heard returns how many outputs of choice's bus request reqID were news.
func (q *outputQueue) heard(choice int, reqID string) int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	if choice < len(q.latest) {
		for _, m := range q.latest[choice] {
			if m.reqID == reqID {
				return m.heard
			}
		}
	}
	return 0
}

// pushResend queues a driver's answer to a Resend for choice.
func (q *outputQueue) pushResend(choice int, r *resendOutcome) {
	q.add(choiceOutput{choice: choice, resend: r})
}

func (q *outputQueue) add(it choiceOutput) {
	q.mu.Lock()
	q.items = append(q.items, it)
	q.mu.Unlock()
	select {
	case q.signal <- struct{}{}:
	default:
	}
}

func (q *outputQueue) pop() []choiceOutput {
	q.mu.Lock()
	defer q.mu.Unlock()
	items := q.items
	q.items = nil
	return items
}

// choiceState follows one choice (one bus request) of an HTTP request.
type choiceState struct {
	busID string
	// attempt is the dispatch attempt whose chunks are taken; started is
	// set once one of them reached the client, which for a buffered choice
	// (a non-streamed answer, sent whole at its end) is never.
	attempt   int
	started   bool
	buffered  bool
	nextIndex int
	text      strings.Builder
	// promptTokens is the prompt's length (continuous usage stats).
	promptTokens int
	finish       string
	stopReason   json.RawMessage // vLLM's stop_reason (stopReason); nil until done
	usage        messages.Usage
	done         bool
	err          *APIError
	errRaw       []byte // an engine's error body, relayed as it is
	ttftSeen     bool   // its time to first token was observed
	// generated counts the tokens of its outputs taken (the vLLM metrics
	// of a choice that ends unfinished).
	generated int
	// req is the request as published; askedAgain counts the times it was
	// published again because its answer was lost on the bus (askAgain).
	req        *messages.Request
	askedAgain int
	// hedged, when set, is the bus id of the request busID was asked
	// again for while it may still answer: the first of the two to send an
	// output is followed, the other aborted. hedgedAt is where its outputs
	// had got to: a whole answer under way has its first output taken
	// (its driver holds the rest for the last), and is followed on from
	// there.
	hedged   string
	hedgedAt followMark
	// resending: the driver was asked to send lost outputs again from
	// nextIndex (resend.go); outputs past it are dropped until they come
	// again, in order. resends numbers the asks; idleProbes counts the
	// probes after a reconnect the driver answered with nothing missing,
	// which spend none of the choice's maxResends.
	resending  bool
	resends    int
	idleProbes int
}

// followMark is where a choice's outputs of one bus request had got to.
type followMark struct {
	attempt, nextIndex, generated int
	text                          string
	usage                         messages.Usage
}

// mark returns where the choice's outputs have got to.
func (c *choiceState) mark() followMark {
	return followMark{attempt: c.attempt, nextIndex: c.nextIndex, generated: c.generated, text: c.text.String(), usage: c.usage}
}

// restore follows on from m (followMark{attempt: a}: attempt a from its
// start).
func (c *choiceState) restore(m followMark) {
	c.attempt, c.nextIndex, c.generated, c.usage = m.attempt, m.nextIndex, m.generated, m.usage
	c.text.Reset()
	c.text.WriteString(m.text)
}

// ids returns the bus ids the choice listens to.
func (c *choiceState) ids() []string {
	if c.hedged != "" {
		return []string{c.busID, c.hedged}
	}
	return []string{c.busID}
}

func (g *generation) unregister() {
	ids := make([]string, 0, len(g.choices))
	for _, c := range g.choices {
		ids = append(ids, c.ids()...)
	}
	g.s.unregister(ids)
}

// abort tells the pipeline to drop the unfinished bus requests.
func (g *generation) abort(reason string) { g.abortChoices(g.choices, reason) }

// abortChoices tells the pipeline to drop the unfinished bus requests of
// choices.
func (g *generation) abortChoices(choices []*choiceState, reason string) {
	for _, c := range choices {
		if c.done {
			continue
		}
		for _, id := range c.ids() {
			g.publishAbort(id, reason)
		}
	}
}

func (g *generation) publishAbort(busID, reason string) {
	data, err := messages.Marshal(&messages.Abort{ReqID: busID, Reason: reason})
	if err == nil {
		err = g.s.cfg.Conn.Publish(g.s.cfg.Subjects.Abort(), data)
	}
	if err != nil {
		g.log.Warn("cannot publish abort", "req_id", busID, "err", err)
	}
}

// maxAskAgain is how many times a choice's request is published again
// because its answer was lost on the bus.
const maxAskAgain = 2

// askAgain publishes choice i's request again, under a new bus id, when
// its answer was lost on the bus (a NATS server of a cluster stopped, or
// the frontend reconnected) before any of it reached the client: the
// client then gets the whole answer, a little later, instead of a 503
// output_lost to retry. A request known to be broken (an output index
// skipped) is aborted and no longer heard; one that only heard nothing
// since a reconnect (hedge) may be queued, not lost, so it is kept, and
// the first of the two to send an output is followed (settleHedge). It
// reports whether the request went out again; not after maxAskAgain
// times, nor when the deadline or the client leaves no time, nor when the
// publish fails.
func (g *generation) askAgain(ctx context.Context, i int, why string, hedge bool) bool {
	c := g.choices[i]
	// Its deadline (busRequest's) on the monotonic clock: a step of this
	// host's clock moves nothing.
	deadline := g.start.Add(g.s.cfg.RequestTimeout)
	if c.req == nil || c.askedAgain >= maxAskAgain || ctx.Err() != nil ||
		(c.req.DeadlineUnixMs > 0 && !time.Now().Before(deadline)) {
		return false
	}
	old := c.busID
	req := *c.req
	if req.DeadlineUnixMs > 0 {
		req.TimeoutMs = messages.TimeLeftMs(deadline, time.Now())
	}
	c.askedAgain++
	req.RequestID = c.req.RequestID + "-again" + strconv.Itoa(c.askedAgain)
	req.AgainOf = c.req.RequestID // the same turn of its session
	g.s.register(req.RequestID, g.q, i)
	if err := g.s.publish(ctx, &req); err != nil {
		g.s.unregister([]string{req.RequestID})
		// The log may have taken it, its acknowledgement not heard (the
		// client left meanwhile, or the log was slow): nobody follows it.
		reason := "publish failed"
		if ctx.Err() != nil {
			reason = messages.AbortReasonClientGone
		}
		g.publishAbort(req.RequestID, reason)
		g.log.Warn("answer lost on the bus; cannot publish the request again, it ends with an error", "choice", i, "why", why, "err", err)
		return false
	}
	if c.hedged != "" { // a third id: the oldest is given up
		g.dropRequest(c.hedged, "asked again as "+req.RequestID)
	}
	c.hedged = ""
	if hedge {
		c.hedged = old
		c.hedgedAt = c.mark()
	} else {
		g.dropRequest(old, "answer lost on the bus; asked again as "+req.RequestID)
	}
	g.log.Warn("answer lost on the bus before any of it reached the client; asked again", "choice", i, "why", why,
		"lost_req_id", old, "new_req_id", req.RequestID, "kept", hedge)
	g.s.m.askedAgain.Inc()
	c.busID, c.started = req.RequestID, false
	c.restore(followMark{})
	g.renameEngineID(old, req.RequestID) // the engine names its answer after the bus id
	return true
}

// settleHedge follows the request that sent the choice's first output
// since it was asked again, and aborts the other.
func (g *generation) settleHedge(c *choiceState, from string) {
	loser := c.hedged
	if from == c.hedged {
		loser = c.busID
		g.renameEngineID(c.busID, from)
		c.busID = from
		c.restore(c.hedgedAt) // followed on from where its outputs had got to
	}
	c.hedged, c.hedgedAt = "", followMark{}
	g.dropRequest(loser, "a copy of it answered first: "+from)
}

// dropRequest stops hearing a bus request and aborts it.
func (g *generation) dropRequest(busID, reason string) {
	g.s.unregister([]string{busID})
	g.publishAbort(busID, reason)
}

// follow decides whether o, of any attempt, belongs to the answer. Chunks
// of an attempt older than the one followed are dropped (its group was
// abandoned); a newer attempt is followed from its index 0 if nothing
// reached the client yet (what a buffered choice holds of the old one is
// dropped); once output started, a newer attempt's chunks cannot be
// spliced into it, so the answer ends with an explicit error (an error
// chunk of any newer attempt ends it too).
func (c *choiceState) follow(o *messages.Output) bool {
	switch {
	case o.Attempt == c.attempt:
	case o.Attempt < c.attempt:
		return false
	case o.Error != nil:
		c.attempt = o.Attempt
	case !c.started:
		c.restore(followMark{attempt: o.Attempt})
	default:
		c.attempt = o.Attempt
		o.Text, o.TokenIDs, o.FinishReason, o.Raw = "", nil, "", nil
		o.Error = &messages.OutputError{Code: "group_failed",
			Message: "the request moved to another worker group after its answer had begun; retry the request"}
	}
	c.started = !c.buffered
	return true
}

// next waits for outputs and applies them; it returns the choices that
// changed, or an error when the client left or the deadline passed.
func (g *generation) next(ctx context.Context, timer *time.Timer) ([]choiceOutput, *APIError) {
	for {
		if items := g.q.pop(); len(items) > 0 {
			var fresh []choiceOutput
			for _, it := range items {
				c := g.choices[it.choice]
				if it.resend != nil {
					if it.out = g.resendAnswered(it.choice, it.resend); it.out == nil {
						continue
					}
				}
				o := it.out
				if c.done || o.ReqID != c.busID && o.ReqID != c.hedged {
					continue // of a request asked again
				}
				if o.Attempt == math.MaxInt32 { // endLost's verdict
					if o.ReqID != c.busID {
						continue // on the copy kept beside the newest: that one is waited for
					}
					// Its driver is asked first: a stream under way
					// for what it missed; a request not started
					// whether it holds it (queued or running: no copy
					// is needed; a copy doubles an overloaded group's
					// queue). Held by none, it is asked again below.
					if g.resend(it.choice, "nothing heard after a NATS reconnect", true) {
						continue
					}
				} else if c.hedged != "" {
					g.settleHedge(c, o.ReqID)
				}
				started := c.started
				if !c.follow(o) || (o.Index < c.nextIndex && !o.Final()) {
					continue // duplicate, late, or of an abandoned attempt
				}
				gap := o.Index > c.nextIndex && o.Error == nil
				if c.resending && o.Error == nil {
					if gap {
						continue // the driver sends it again, after the ones missing
					}
					c.resending = false // caught up
				}
				if started && gap && g.resend(it.choice, "an output index skipped", false) {
					continue
				}
				if !started && (gap || o.Error != nil && o.Error.Code == codeOutputLost) {
					why := "an output index skipped"
					if !gap {
						why = "nothing heard after a NATS reconnect"
					}
					// Nothing heard may be a queued request: kept.
					if g.askAgain(ctx, it.choice, why, !gap) {
						continue
					}
				}
				if gap {
					// Outputs in between were lost on the bus (core NATS
					// keeps order, so a gap is a loss): the answer would
					// silently miss part of its text.
					g.log.Warn("outputs lost on the bus; the answer ends with an error", "choice", it.choice,
						"want_index", c.nextIndex, "got_index", o.Index)
					o.Text, o.TokenIDs, o.FinishReason, o.Raw = "", nil, "", nil
					o.Error = &messages.OutputError{Code: codeOutputLost, Message: "part of the answer was lost on the bus; retry the request"}
				}
				c.nextIndex = o.Index + 1
				if g.engineID != nil && len(o.Raw) > 0 {
					// vLLM names its answer after the X-Request-Id it got:
					// the bus id, unique (see generate). The client gets
					// the id it asked for, as from vLLM itself.
					o.Raw = bytes.Replace(o.Raw, g.engineID, g.clientID, 1)
				}
				now := time.Now()
				if g.firstByte.IsZero() { // the HTTP request's first output
					g.firstByte = now
					g.vm.waiting.Dec()
					g.vm.running.Inc()
				}
				// TTFT is the time to a first token: an error (an engine's
				// 500, group_failed) is none, and an engine's whole answer
				// took the whole request (its e2e latency).
				if o.Error == nil && !g.wholeAnswer {
					// Each prompt of a list is an engine request of its own
					// in vLLM: each has its TTFT.
					if !c.ttftSeen {
						c.ttftSeen = true
						g.s.m.ttft.WithLabelValues(g.endpoint, g.model).Observe(now.Sub(g.start).Seconds())
						g.vm.ttft.Observe(now.Sub(g.start).Seconds())
					}
				}
				c.text.WriteString(o.Text)
				c.generated += len(o.TokenIDs)
				if o.Usage != nil {
					c.usage = *o.Usage
				}
				if o.Error != nil {
					c.done, c.err = true, outputError(o.Error.Code, o.Error.Message)
					if o.Error.Status >= 400 && o.Error.Status < 600 { // an engine's own answer
						c.err.Status, c.errRaw = o.Error.Status, o.Error.Raw
					}
				} else if o.FinishReason != "" {
					c.done, c.finish, c.stopReason = true, o.FinishReason, stopReason(o)
				}
				fresh = append(fresh, it)
			}
			if len(fresh) > 0 {
				return fresh, nil
			}
			continue
		}
		select {
		case <-g.q.signal:
		case <-ctx.Done():
			g.log.Info("client disconnected; aborting request")
			g.abort(messages.AbortReasonClientGone)
			return nil, &APIError{Status: 499, Type: typeInvalidRequest, Message: "client disconnected"}
		case <-g.s.stopNow:
			g.log.Warn("request cut off: the frontend stopped before it was answered (--stop-timeout)", "stop_timeout", g.s.cfg.StopTimeout)
			g.abort(messages.AbortReasonFrontendStopped)
			return nil, &APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "shutting_down", RetryAfter: 1,
				Message: fmt.Sprintf("this frontend stopped before the answer was finished (--stop-timeout %s); retry the request on another one", g.s.cfg.StopTimeout)}
		case <-timer.C:
			g.log.Warn("request timed out", "timeout", g.s.cfg.RequestTimeout)
			g.abort(messages.AbortReasonTimeout)
			return nil, &APIError{Status: http.StatusGatewayTimeout, Type: typeTimeout, Code: "timeout",
				Message: fmt.Sprintf("request did not complete within %s (--request-timeout)", g.s.cfg.RequestTimeout)}
		}
	}
}

func (g *generation) allDone() bool {
	for _, c := range g.choices {
		if !c.done {
			return false
		}
	}
	return true
}

func (g *generation) usage() usageJSON {
	u := usageJSON{PromptTokensDetails: &promptTokensDetails{}}
	for _, c := range g.choices {
		u.PromptTokens += c.usage.PromptTokens
		u.CompletionTokens += c.usage.CompletionTokens
		u.PromptTokensDetails.CachedTokens += c.usage.CachedTokens
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	return u
}

// completed records the generation in the vLLM metrics as vLLM counts a
// prompt list: one engine request per prompt, each that finished under its
// own finish reason, and each its client left unfinished (it went away)
// under "abort". A prompt that ended unfinished (left by its client, or
// failed) after its first token still counts its prompt and the tokens
// generated, as vLLM's engine counts them as it processes them.
func (g *generation) completed() {
	e2e := time.Since(g.start).Seconds()
	for _, c := range g.choices {
		if c.ttftSeen && (!c.done || c.err != nil) {
			g.vm.unfinished(c.promptTokens, c.generated)
		}
		switch {
		case !c.done:
			g.vm.aborted()
		case c.err == nil: // vLLM counts a request that failed in no success series
			g.vm.finished(c.usage.PromptTokens, c.usage.CompletionTokens, c.usage.CachedTokens, c.finish, e2e)
		}
	}
}

// usageSoFar is one choice's usage on a streamed chunk (vLLM's continuous
// usage stats): its prompt and the completion tokens streamed so far, and
// no prompt_tokens_details, which vLLM leaves out there.
func (c *choiceState) usageSoFar(completion int) *usageJSON {
	return &usageJSON{PromptTokens: c.promptTokens, CompletionTokens: completion, TotalTokens: c.promptTokens + completion}
}

// renameEngineID puts bus id to in place of bus id from in g.engineID (the
// engine names its answer after the bus id it was sent): the choice was
// asked again, or its other copy is followed. engineID is a JSON string,
// so the ids are looked for escaped as it holds them (a client's id may
// hold a quote or a backslash).
func (g *generation) renameEngineID(from, to string) {
	if g.engineID != nil {
		f, t := jsonString(from), jsonString(to)
		g.engineID = bytes.Replace(g.engineID, f[1:len(f)-1], t[1:len(t)-1], 1)
	}
}

// jsonString is id as a JSON string, as vLLM writes it in an answer: a
// request id is printable ASCII (validRequestID), of which a quote and a
// backslash are escaped, and not HTML's <, > and & (pydantic does not).
func jsonString(id string) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(id)
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}
