package frontend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/messages"
)

// maxRequestIDBytes bounds a client's X-Request-Id and request_id.
const maxRequestIDBytes = 128

// outputQueue collects the Outputs of one HTTP request's bus requests. The
// NATS callback pushes without blocking; the HTTP handler pops.
type outputQueue struct {
	mu     sync.Mutex
	items  []choiceOutput
	signal chan struct{}
	// pushed counts the outputs pushed (lostOutputs compares it across a
	// reconnect).
	pushed atomic.Int64
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

func newOutputQueue() *outputQueue { return &outputQueue{signal: make(chan struct{}, 1)} }

func (q *outputQueue) push(choice int, o *messages.Output) {
	q.pushed.Add(1)
	q.add(choiceOutput{choice: choice, out: o})
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
	stopReason   string // the stop string that ended it, if one did
	usage        messages.Usage
	done         bool
	err          *APIError
	errRaw       []byte // an engine's error body, relayed as it is
	ttftSeen     bool   // its time to first token was observed
	// req is the request as published; askedAgain counts the times it was
	// published again because its answer was lost on the bus (askAgain).
	req        *messages.Request
	askedAgain int
	// hedged, when set, is the bus id of the request busID was asked
	// again for while it may still answer: the first of the two to send an
	// output is followed, the other aborted.
	hedged string
	// resending: the driver was asked to send lost outputs again from
	// nextIndex (resend.go); outputs past it are dropped until they come
	// again, in order. resends counts the asks.
	resending bool
	resends   int
}

// ids returns the bus ids the choice listens to.
func (c *choiceState) ids() []string {
	if c.hedged != "" {
		return []string{c.busID, c.hedged}
	}
	return []string{c.busID}
}

// generation is one HTTP generate request in flight.
type generation struct {
	s         *Server
	endpoint  string
	id        string // response id: chatcmpl-… / cmpl-…
	model     string
	vm        *modelSeries // the model's vLLM metrics
	created   int64
	sessionID string
	log       *slog.Logger
	choices   []*choiceState
	q         *outputQueue
	start     time.Time
	firstByte time.Time // of any choice
	// wholeAnswer: an engine answers the request in one output (--engine
	// openai, not streamed), whose time is the whole request's, not a
	// first token's: no TTFT is recorded for it.
	wholeAnswer bool
	ttftSeen    bool // the request's time to first token was observed
	// engineID and clientID, when set (--engine openai, a client's request
	// id): the answer's id as the engine made it from the bus id it was
	// sent ("chatcmpl-<id>-<nuid>", quoted) and the one the client gets
	// ("chatcmpl-<id>", as vLLM answers a client's X-Request-Id).
	engineID, clientID []byte
}

func (s *Server) serveGenerate(w http.ResponseWriter, r *http.Request, endpoint string) {
	start := time.Now()
	// The model label is a served model's name, or "": a client's unknown
	// names must not make series without bound.
	var model string
	status := s.generate(w, r, endpoint, start, &model)
	s.m.requests.WithLabelValues(endpoint, strconv.Itoa(status), model).Inc()
	s.m.latency.WithLabelValues(endpoint, model).Observe(time.Since(start).Seconds())
}

// generate serves one request and returns the HTTP status it answered; it
// sets *model to the request's model once it is known to be served.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, endpoint string, start time.Time, model *string) int {
	// Refused before reaching the bus: the refusal log tells the operator.
	fail := func(e *APIError) int {
		writeError(w, e)
		s.refusals.note(time.Now(), e)
		return e.Status
	}
	// X-Request-Id is on every response, errors included, from the start:
	// the client's id, or the generated one (README). The body's request_id
	// replaces the generated one once read.
	busBase := nuid.Next()
	hdrID, hdrErr := requestID(r.Header)
	h := w.Header()
	if hdrErr == nil && hdrID != "" {
		h.Set("X-Request-Id", hdrID)
	} else {
		h.Set("X-Request-Id", busBase)
	}
	if n := s.active.Add(1); s.cfg.MaxInflight > 0 && n > int64(s.cfg.MaxInflight) {
		s.active.Add(-1)
		return fail(&APIError{Status: http.StatusTooManyRequests, Type: typeRateLimit, Code: "overloaded", RetryAfter: 1,
			Message: fmt.Sprintf("this frontend is serving its maximum of %d requests (--max-inflight); retry shortly", s.cfg.MaxInflight)})
	}
	defer s.active.Add(-1)
	// Counted before the check: a stop that began after it waits for this
	// request (holdGrace), one that began before answers it the 503.
	s.accepted.Add(1)
	defer s.accepted.Add(-1)
	switch {
	case s.draining.Load():
		s.accepted.Add(-1) // refused, not waited for
		defer s.accepted.Add(1)
		w.Header().Set("Connection", "close")
		return fail(&APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "shutting_down", RetryAfter: 1,
			Message: "this frontend is shutting down; retry on another one"})
	case !s.connected(r.Context()):
		// Fail fast instead of waiting for a publish timeout.
		return fail(&APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "bus_unavailable", RetryAfter: 1,
			Message: "not connected to NATS; retry shortly"})
	}
	if ok, why := s.schedulers.ready(time.Now()); !ok {
		// Nothing would dispatch the request: say so now, not at the timeout.
		return fail(&APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "no_ready_scheduler", RetryAfter: 1,
			Message: why + "; retry shortly"})
	}
	body, apiErr := readBody(w, r, s.cfg.MaxBodyBytes, s.cfg.ReadBodyTimeout)
	if apiErr != nil {
		return fail(apiErr)
	}
	var p *parsedRequest
	opts := parseOptions{passthrough: s.cfg.Passthrough, vocab: s.tok.VocabSize()}
	if endpoint == messages.EndpointChat {
		p, apiErr = parseChat(body, opts)
	} else {
		p, apiErr = parseCompletion(body, opts)
	}
	// vLLM names the request after X-Request-Id, else after the body's
	// request_id. A p with an error holds the request_id when it was valid.
	extID, idParam := hdrID, "X-Request-Id"
	if p != nil && extID == "" && p.requestID != "" {
		extID, idParam = p.requestID, "request_id"
		if hdrErr == nil {
			h.Set("X-Request-Id", extID)
		}
	}
	if apiErr != nil {
		return fail(apiErr)
	}
	sessionID, source, apiErr := ResolveSession(p.session, r.Header, s.cfg.SessionHeaders)
	if apiErr != nil {
		return fail(apiErr)
	}
	// Echoed from here on, on errors too: a client or proxy ties a failed
	// turn to its conversation.
	if sessionID != "" {
		h.Set("X-Session-ID", sessionID)
	}
	if p.model == "" {
		p.model = s.cfg.Models[0]
	}
	// The model on the bus: kvbus's name, whose hash seed the workers
	// index the engines' KV events with, also for a name only the engines
	// serve (the body sent to them keeps the client's).
	busModel := p.model
	if !s.serves(p.model) {
		served, ok := s.engineServes(r.Context(), p.model)
		if !ok {
			return fail(&APIError{Status: http.StatusNotFound, Type: typeNotFound, Param: "model", Code: "model_not_found",
				Message: fmt.Sprintf("The model `%s` does not exist. Served models: %s.", p.model, strings.Join(served, ", "))})
		}
		busModel = s.cfg.Models[0]
	}
	*model = p.model
	if hdrErr != nil {
		return fail(hdrErr)
	}
	prompts, apiErr := s.tokenize(r.Context(), p)
	if apiErr != nil {
		return fail(apiErr)
	}
	if s.cfg.Passthrough {
		// The engine answers the whole body, every prompt of it, in one
		// response: one bus request, placed by its first prompt.
		prompts = prompts[:1]
	}

	g := &generation{s: s, endpoint: endpoint, model: p.model, vm: s.vm.of(p.model), created: start.Unix(), sessionID: sessionID, q: newOutputQueue(), start: start,
		wholeAnswer: s.cfg.Passthrough && !p.stream}
	prefix := "cmpl-"
	if endpoint == messages.EndpointChat {
		prefix = "chatcmpl-"
	}
	// The bus id is the client's id made unique (a client may reuse its
	// X-Request-Id or request_id), or a new id. The whole nuid: its random
	// prefix differs between frontends, and the request log dedupes by this
	// id, so two frontends given one X-Request-Id must not make the same
	// one.
	if extID == "" {
		extID = busBase
	} else {
		busBase = extID + "-" + busBase
	}
	g.id = prefix + extID
	if s.cfg.Passthrough && busBase != extID {
		g.engineID, g.clientID = []byte(`"`+prefix+busBase+`"`), []byte(`"`+g.id+`"`)
	}
	g.log = s.log.With("req_id", busBase, "session_id", sessionID)
	if sessionID != "" {
		g.log.Debug("session resolved", "source", source)
	}
	deadline := start.Add(s.cfg.RequestTimeout)

	// Publish every prompt; each is acknowledged by JetStream before any
	// byte of the response is written.
	for i, prompt := range prompts {
		busID := busBase
		if len(prompts) > 1 {
			busID = busBase + "-" + strconv.Itoa(i)
		}
		req := s.busRequest(p, busID, sessionID, prompt, start, deadline)
		req.Model = busModel
		g.choices = append(g.choices, &choiceState{busID: busID, promptTokens: len(prompt), buffered: !p.stream, req: req})
		s.register(busID, g.q, i)
		if err := s.publish(r.Context(), req); err != nil {
			if r.Context().Err() != nil { // the client left while the request was being logged
				g.log.Info("client disconnected; aborting request")
				g.abort("client disconnected")
				g.unregister()
				return 499
			}
			if errors.Is(err, errDuplicateID) {
				// This prompt's id is another request's: not aborted. The
				// prompts published before it are this request's.
				g.log.Warn("request id already in the request log", "err", err)
				g.abortChoices(g.choices[:i], "request id collision")
				g.unregister()
				return fail(&APIError{Status: http.StatusConflict, Type: typeInvalidRequest, Code: "duplicate_request_id", Param: idParam,
					Message: "a request with this id is still in the request log; send it with another " + idParam})
			}
			g.log.Warn("cannot publish request to the bus", "err", err)
			g.abort("publish failed")
			g.unregister()
			if errors.Is(err, errAboveMaxPayload) {
				return fail(&APIError{Status: http.StatusRequestEntityTooLarge, Type: typeInvalidRequest, Code: "request_too_large",
					Message: fmt.Sprintf("the request is too large for the bus (%v); send a smaller one. "+
						"Operator: raise the NATS server's max_payload (kvbus nats takes 8 MiB), or lower --max-body-bytes below it", err)})
			}
			if errors.Is(err, bus.ErrLogFull) {
				return fail(&APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "request_log_full", RetryAfter: logFullRetryAfter,
					Message: "the request log is full of requests no scheduler has dispatched yet; retry later. " +
						"Operator: add schedulers, or raise --request-log-max-bytes (applies when the log is created)"})
			}
			msg := "the request log is unavailable; retry shortly"
			if errors.Is(err, jetstream.ErrNoStreamResponse) {
				// A server restarted without its store has no log until a
				// scheduler makes it again (within seconds).
				msg = "no request log answered on the NATS server (after a NATS restart, schedulers make it again within seconds); retry shortly"
			}
			return fail(&APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "bus_unavailable", RetryAfter: 1, Message: msg})
		}
	}
	defer g.unregister()
	g.vm.waiting.Inc()
	defer func() {
		if g.firstByte.IsZero() {
			g.vm.waiting.Dec()
		} else {
			g.vm.running.Dec()
		}
	}()

	switch {
	case s.cfg.Passthrough:
		return g.relay(w, r.Context(), deadline, p.stream)
	case p.stream:
		return g.stream(w, r.Context(), deadline, p.includeUsage, p.continuousUsage)
	}
	return g.respond(w, r.Context(), deadline)
}

// reconnectWait is how long a request waits for the frontend to reconnect
// to NATS before it is refused: a server of a cluster that stopped is left
// for another within milliseconds.
const reconnectWait = 2 * time.Second

// connected reports whether the frontend is connected to NATS, waiting up
// to reconnectWait (or while ctx lasts) for a reconnect under way.
func (s *Server) connected(ctx context.Context) bool {
	if s.cfg.Conn.IsConnected() {
		return true
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	timeout := time.NewTimer(reconnectWait)
	defer timeout.Stop()
	for {
		select {
		case <-tick.C:
			if s.cfg.Conn.IsConnected() {
				return true
			}
			if !s.cfg.Conn.IsReconnecting() {
				return false // closed
			}
		case <-timeout.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// engineServes reports whether the engines serve model (their GET
// /v1/models, asked again when the list lacks it and was not asked within
// engineModelsRetry), and the names served.
func (s *Server) engineServes(ctx context.Context, model string) ([]string, bool) {
	served := slices.Clone(s.cfg.Models)
	if s.engineModels == nil {
		return served, false
	}
	_, ids := s.engineModels.list(ctx, engineModelsTTL)
	if !ids[model] {
		_, ids = s.engineModels.list(ctx, engineModelsRetry)
	}
	for _, id := range slices.Sorted(maps.Keys(ids)) {
		if !slices.Contains(served, id) {
			served = append(served, id)
		}
	}
	return served, ids[model]
}

func (s *Server) serves(model string) bool {
	for _, m := range s.cfg.Models {
		if m == model {
			return true
		}
	}
	return false
}

// requestID reads X-Request-Id: empty means none; it must be printable and
// short.
func requestID(h http.Header) (string, *APIError) {
	v := strings.TrimSpace(h.Get("X-Request-Id"))
	if !validRequestID(v) {
		return "", badRequest("X-Request-Id", "X-Request-Id must be at most %d printable ASCII characters", maxRequestIDBytes)
	}
	return v, nil
}

// tokenize turns the request's prompts into token ids and applies
// --max-model-len like vLLM.
func (s *Server) tokenize(ctx context.Context, p *parsedRequest) ([][]uint32, *APIError) {
	var prompts [][]uint32
	param := "prompt"
	switch rt, fromBody := s.tok.(RequestTokenizer); {
	case p.endpoint == messages.EndpointChat:
		param = "messages"
		var ids []uint32
		var err error
		if fromBody {
			ids, err = rt.TokenizeChat(ctx, p.body) // tools and template arguments included
		} else {
			ids, err = s.tok.ApplyChatTemplate(p.turns)
		}
		if err != nil {
			return nil, tokenizeError("messages", err)
		}
		prompts = [][]uint32{ids}
	case p.tokenPrompts != nil:
		prompts = p.tokenPrompts
	default:
		for _, t := range p.texts {
			ids, err := s.tok.Encode(t)
			if err != nil {
				return nil, tokenizeError("prompt", err)
			}
			if len(ids) == 0 {
				return nil, badRequest("prompt", "prompt is empty")
			}
			prompts = append(prompts, ids)
		}
	}
	if p.maxTokensSet && p.params.MinTokens > p.params.MaxTokens { // vLLM's check and words
		return nil, badRequest("min_tokens", "min_tokens must be less than or equal to max_tokens=%d, got %d.", p.params.MaxTokens, p.params.MinTokens)
	}
	if s.cfg.Passthrough {
		// The engine knows its own max_model_len (its --max-model-len, not
		// kvbus's) and answers a prompt too long with vLLM's 400, relayed.
		return prompts, nil
	}
	maxLen := s.cfg.MaxModelLen
	for _, ids := range prompts {
		n := len(ids)
		if n >= maxLen {
			return nil, badRequest(param, "The prompt (total length %d) is too long to fit into the model (context length %d). Make sure that `max_model_len` is no smaller than the number of text tokens plus multimodal tokens.", n, maxLen)
		}
		if p.maxTokensSet && p.params.MaxTokens > maxLen-n { // not n+max_tokens: a huge max_tokens would wrap
			return nil, badRequest(param, "This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the %s, %d in the completion). Please reduce the length of the %s or completion.", maxLen, n+p.params.MaxTokens, n, param, p.params.MaxTokens, param)
		}
	}
	return prompts, nil
}

// tokenizeError is the API error of a failed tokenization: the engine's
// tokenizer unreachable is a 503, anything else the request's fault.
func tokenizeError(param string, err error) *APIError {
	var te *TokenizeError
	switch {
	case errors.As(err, &te):
		return &APIError{Status: te.Status, Type: typeInvalidRequest, Param: param, Message: te.Message}
	case errors.Is(err, ErrTokenizerUnavailable):
		return &APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "tokenizer_unavailable", RetryAfter: 1,
			Message: "cannot tokenize the request: the engine's tokenizer (--tokenizer-url) is unavailable; retry shortly. " + err.Error()}
	}
	return badRequest(param, "cannot tokenize %s: %v", param, err)
}

// busRequest builds the messages.Request of one prompt.
func (s *Server) busRequest(p *parsedRequest, busID, sessionID string, prompt []uint32, start, deadline time.Time) *messages.Request {
	sp := p.params
	if !p.maxTokensSet {
		// vLLM's default for chat; with an engine (passthrough) the prompt
		// may be longer than kvbus's --max-model-len: the engine decides.
		sp.MaxTokens = max(s.cfg.MaxModelLen-len(prompt), 1)
	}
	extra := make(messages.Args, len(p.xargs)+1)
	for k, v := range p.xargs {
		extra[k] = v
	}
	delete(extra, messages.ExtraArgSessionID)
	if sessionID != "" {
		extra[messages.ExtraArgSessionID] = sessionID
	}
	if len(extra) > 0 {
		sp.ExtraArgs = extra
	}
	req := &messages.Request{
		RequestID: busID, SessionID: sessionID, Model: p.model, FrontendID: s.cfg.ID,
		ArrivalUnixMs: start.UnixMilli(), DeadlineUnixMs: deadline.UnixMilli(),
		PromptTokenIDs: prompt, SamplingParams: sp, Stream: p.stream,
		KVTransferParams: p.kvTransfer, Endpoint: p.endpoint,
	}
	if s.cfg.Passthrough {
		req.Body = p.body
	}
	return req
}

// logFullRetryAfter is the Retry-After, in seconds, of a request refused
// because the request log is full: space comes back as schedulers dispatch
// the backlog and the next history trim runs.
const logFullRetryAfter = 5

// publish appends req to the JetStream request log and waits for the ack. A
// publish the full log refused wraps bus.ErrLogFull.
// errDuplicateID: the request log already holds a request with this id.
var errDuplicateID = errors.New("frontend: duplicate request id")

// errAboveMaxPayload: the encoded request is larger than the NATS server
// takes in one message (its max_payload); a retry cannot succeed.
var errAboveMaxPayload = errors.New("frontend: request above the bus's max payload")

// busHeaderRoom is what a published request's headers and protocol line
// take besides its data, at most.
const busHeaderRoom = 1 << 10

// publishTries bounds, in Config.PublishTimeouts, how long a request is
// published again while the request log does not acknowledge it;
// republishPause is the pause between tries that failed at once.
const (
	publishTries   = 2
	republishPause = 250 * time.Millisecond
)

func (s *Server) publish(ctx context.Context, req *messages.Request) error {
	data, err := messages.Marshal(req)
	if err != nil {
		return err
	}
	if limit := s.cfg.Conn.MaxPayload(); limit > 0 && int64(len(data)) > limit-busHeaderRoom {
		return fmt.Errorf("%w: %d bytes on the bus, the NATS server takes %d", errAboveMaxPayload, len(data), limit)
	}
	msg := &nats.Msg{Subject: s.cfg.Subjects.Request(req.Model), Data: data, Header: nats.Header{}}
	var ack *jetstream.PubAck
	// A log whose leader is being elected again (its NATS server of a
	// cluster stopped) acknowledges nothing, or has no responder, for
	// seconds: publish again under the same id (the log keeps one copy)
	// within publishTries publish timeouts.
	budget := time.Now().Add(publishTries * s.cfg.PublishTimeout)
	try := 1
	for ; ; try++ {
		pctx, cancel := context.WithTimeout(ctx, min(s.cfg.PublishTimeout, time.Until(budget)))
		ack, err = s.js.PublishMsg(pctx, msg, jetstream.WithMsgID(req.RequestID))
		cancel()
		noResponder := errors.Is(err, jetstream.ErrNoStreamResponse)
		if !errors.Is(err, context.DeadlineExceeded) && !noResponder || ctx.Err() != nil || time.Until(budget) <= 0 {
			break
		}
		if try == 1 {
			s.log.Warn("the request log did not acknowledge the request; publishing it again", "req_id", req.RequestID,
				"session_id", req.SessionID, "err", err, "for", time.Until(budget).Round(time.Millisecond))
		}
		if noResponder { // at once: wait a little for a leader
			select {
			case <-ctx.Done():
			case <-time.After(republishPause):
			}
		}
	}
	switch {
	case bus.IsLogFull(err):
		return fmt.Errorf("%w (schedulers are behind: add schedulers or raise --request-log-max-bytes): %w", bus.ErrLogFull, err)
	case errors.Is(err, nats.ErrMaxPayload):
		return fmt.Errorf("%w: %w", errAboveMaxPayload, err)
	case err == nil && ack.Duplicate && try > 1:
		// The first try was logged; its acknowledgement was lost.
		return nil
	case err == nil && ack.Duplicate:
		// Another request holds this id in the log's dedupe window; its
		// answer goes to its own client, none would come to this one.
		return fmt.Errorf("frontend: request id %s is already in the request log (an id collision): %w", req.RequestID, errDuplicateID)
	}
	return err
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
	if c.req == nil || c.askedAgain >= maxAskAgain || ctx.Err() != nil ||
		(c.req.DeadlineUnixMs > 0 && time.Now().UnixMilli() >= c.req.DeadlineUnixMs) {
		return false
	}
	old := c.busID
	req := *c.req
	c.askedAgain++
	req.RequestID = c.req.RequestID + "-again" + strconv.Itoa(c.askedAgain)
	g.s.register(req.RequestID, g.q, i)
	if err := g.s.publish(ctx, &req); err != nil {
		g.s.unregister([]string{req.RequestID})
		g.log.Warn("answer lost on the bus; cannot publish the request again, it ends with an error", "choice", i, "why", why, "err", err)
		return false
	}
	if c.hedged != "" { // a third id: the oldest is given up
		g.dropRequest(c.hedged, "asked again as "+req.RequestID)
	}
	c.hedged = ""
	if hedge {
		c.hedged = old
	} else {
		g.dropRequest(old, "answer lost on the bus; asked again as "+req.RequestID)
	}
	g.log.Warn("answer lost on the bus before any of it reached the client; asked again", "choice", i, "why", why,
		"lost_req_id", old, "new_req_id", req.RequestID, "kept", hedge)
	g.s.m.askedAgain.Inc()
	c.busID, c.attempt, c.nextIndex, c.started = req.RequestID, 0, 0, false
	c.text.Reset()
	c.usage = messages.Usage{}
	if g.engineID != nil { // the engine names its answer after the bus id
		g.engineID = bytes.Replace(g.engineID, []byte(old), []byte(req.RequestID), 1)
	}
	return true
}

// settleHedge follows the request that sent the choice's first output
// since it was asked again, and aborts the other.
func (g *generation) settleHedge(c *choiceState, from string) {
	loser := c.hedged
	if from == c.hedged {
		loser = c.busID
		if g.engineID != nil {
			g.engineID = bytes.Replace(g.engineID, []byte(c.busID), []byte(from), 1)
		}
		c.busID = from
	}
	c.hedged = ""
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
		c.attempt, c.nextIndex = o.Attempt, 0
		c.text.Reset()
		c.usage = messages.Usage{}
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
					if c.started && g.resend(it.choice, "nothing heard after a NATS reconnect") {
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
				if started && gap && g.resend(it.choice, "an output index skipped") {
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
					if !c.ttftSeen {
						c.ttftSeen = true
						g.s.m.ttft.WithLabelValues(g.endpoint, g.model).Observe(now.Sub(g.start).Seconds())
					}
					if !g.ttftSeen {
						g.ttftSeen = true
						g.vm.ttft.Observe(now.Sub(g.start).Seconds())
					}
				}
				c.text.WriteString(o.Text)
				if o.Usage != nil {
					c.usage = *o.Usage
				}
				if o.Error != nil {
					c.done, c.err = true, outputError(o.Error.Code, o.Error.Message)
					if o.Error.Status >= 400 && o.Error.Status < 600 { // an engine's own answer
						c.err.Status, c.errRaw = o.Error.Status, o.Error.Raw
					}
				} else if o.FinishReason != "" {
					c.done, c.finish, c.stopReason = true, o.FinishReason, o.StopReason
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
			g.abort("client disconnected")
			return nil, &APIError{Status: 499, Type: typeInvalidRequest, Message: "client disconnected"}
		case <-g.s.stopNow:
			g.log.Warn("request cut off: the frontend stopped before it was answered (--stop-timeout)", "stop_timeout", g.s.cfg.StopTimeout)
			g.abort("frontend stopped")
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

// usageSoFar is one choice's usage on a streamed chunk (vLLM's continuous
// usage stats): its prompt and the completion tokens streamed so far, and
// no prompt_tokens_details, which vLLM leaves out there.
func (c *choiceState) usageSoFar(completion int) *usageJSON {
	return &usageJSON{PromptTokens: c.promptTokens, CompletionTokens: completion, TotalTokens: c.promptTokens + completion}
}

// respond waits for every choice and writes one JSON response.
func (g *generation) respond(w http.ResponseWriter, ctx context.Context, deadline time.Time) int {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for !g.allDone() {
		if _, err := g.next(ctx, timer); err != nil {
			if err.Status != 499 {
				writeError(w, err)
			}
			return err.Status
		}
	}
	for _, c := range g.choices {
		if c.err != nil {
			g.log.Warn("request failed", "code", c.err.Code, "err", c.err.Message)
			writeError(w, c.err)
			return c.err.Status
		}
	}
	resp := completionJSON{ID: g.id, Created: g.created, Model: g.model, Usage: ptr(g.usage())}
	for i, c := range g.choices {
		ch := choiceJSON{Index: i, FinishReason: ptr(c.finish), StopReason: stopReason(c.stopReason)}
		if g.endpoint == messages.EndpointChat {
			resp.Object = "chat.completion"
			ch.Message = &messageJSON{Role: "assistant", Content: ptr(c.text.String())}
		} else {
			resp.Object = "text_completion"
			ch.Text = ptr(c.text.String())
		}
		resp.Choices = append(resp.Choices, ch)
	}
	u := resp.Usage
	g.vm.finished(u.PromptTokens, u.CompletionTokens, u.PromptTokensDetails.CachedTokens, g.choices[0].finish, time.Since(g.start).Seconds())
	logsink.Info(g.log, "request completed", "prompt_tokens", u.PromptTokens, "cached_tokens", u.PromptTokensDetails.CachedTokens,
		"completion_tokens", u.CompletionTokens, "ms", time.Since(g.start).Milliseconds())
	writeJSON(w, http.StatusOK, resp)
	return http.StatusOK
}

// stream writes server-sent events as outputs arrive. The status line, the
// headers and the role chunk wait for the request's first output: an error
// before it (no ready group, overloaded, a timeout) is answered with its
// HTTP status, as without streaming, so that clients and SDKs retry a 503
// or 429 as they would any other.
//
// With continuousUsage every chunk but the usage one carries the usage of
// its choice so far, the role chunk included, as vLLM's do.
func (g *generation) stream(w http.ResponseWriter, ctx context.Context, deadline time.Time, includeUsage, continuousUsage bool) int {
	flusher, _ := w.(http.Flusher)
	send := func(v any) {
		b, _ := json.Marshal(v)
		_, _ = fmt.Fprintf(w, "data: %s\n\n", b)
	}
	flush := func() {
		if flusher != nil {
			flusher.Flush()
		}
	}
	object := "text_completion"
	if g.endpoint == messages.EndpointChat {
		object = "chat.completion.chunk"
	}
	started := false
	begin := func() {
		started = true
		h := w.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("Cache-Control", "no-cache")
		h.Set("Connection", "keep-alive")
		w.WriteHeader(http.StatusOK)
		if g.endpoint == messages.EndpointChat {
			// vLLM and OpenAI open with the role. Like vLLM, it goes out
			// with the first output, in the same write.
			for i, c := range g.choices {
				chunk := completionJSON{ID: g.id, Object: object, Created: g.created, Model: g.model,
					Choices: []choiceJSON{{Index: i, Delta: &messageJSON{Role: "assistant", Content: ptr("")}}}}
				if continuousUsage {
					chunk.Usage = c.usageSoFar(0)
				}
				send(chunk)
			}
		}
	}
	// completion counts each choice's tokens streamed so far.
	var completion []int
	if continuousUsage {
		completion = make([]int, len(g.choices))
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for !g.allDone() {
		items, err := g.next(ctx, timer)
		switch {
		case err != nil && !started:
			if err.Status != 499 {
				writeError(w, err)
			}
			return err.Status
		case err != nil:
			if err.Status != 499 {
				send(err.body())
				_, _ = fmt.Fprint(w, "data: [DONE]\n\n") // flushed with the body's end
			}
			return err.Status
		case !started:
			if e := g.failedFirst(); e != nil {
				g.log.Warn("request failed", "code", e.Code, "err", e.Message)
				writeError(w, e)
				return e.Status
			}
			begin()
		}
		for _, it := range items {
			c, o := g.choices[it.choice], it.out
			if o.Error != nil { // the choice's error (text that came before it in the batch went out)
				g.log.Warn("request failed while streaming", "code", c.err.Code, "err", c.err.Message)
				send(c.err.body())
				continue
			}
			if continuousUsage {
				completion[it.choice] += len(o.TokenIDs)
				if o.FinishReason != "" && o.Usage != nil {
					completion[it.choice] = o.Usage.CompletionTokens // the engine's count
				}
			}
			if o.Text == "" && o.FinishReason == "" {
				continue
			}
			ch := choiceJSON{Index: it.choice}
			if o.FinishReason != "" {
				ch.FinishReason = ptr(o.FinishReason)
			}
			if g.endpoint == messages.EndpointChat {
				ch.Delta = &messageJSON{}
				if o.Text != "" {
					ch.Delta.Content = ptr(o.Text)
				}
				if o.FinishReason != "" { // vLLM sets it on the finishing chunk only
					ch.StopReason = stopReason(o.StopReason)
				}
			} else {
				ch.Text = ptr(o.Text)
				ch.StopReason = stopReason(o.StopReason) // null until the end, on every chunk
			}
			chunk := completionJSON{ID: g.id, Object: object, Created: g.created, Model: g.model, Choices: []choiceJSON{ch}}
			if continuousUsage {
				chunk.Usage = c.usageSoFar(completion[it.choice])
			}
			send(chunk)
		}
		if !g.allDone() { // the last events go out with [DONE], in one write
			flush()
		}
	}
	if !started {
		begin()
	}
	if includeUsage {
		send(completionJSON{ID: g.id, Object: object, Created: g.created, Model: g.model, Choices: []choiceJSON{}, Usage: ptr(g.usage())})
	}
	// Not flushed: net/http flushes it with the chunked body's end when
	// the handler returns, in one write where a flush here made two.
	_, _ = fmt.Fprint(w, "data: [DONE]\n\n")
	u := g.usage()
	msg := "request completed"
	// A stream that ended with an error event counts under that error's
	// status, not the 200 its headers said: an alert on the share of 5xx
	// sees the streams that failed.
	status := http.StatusOK
	for _, c := range g.choices {
		if c.err != nil && status == http.StatusOK { // logged as it went out; this line must not say it completed
			msg = "request ended with an error after its stream began"
			status = c.err.Status
		}
	}
	if msg == "request completed" { // vLLM counts a request that failed in no success series
		g.vm.finished(u.PromptTokens, u.CompletionTokens, u.PromptTokensDetails.CachedTokens, g.choices[0].finish, time.Since(g.start).Seconds())
	}
	logsink.Info(g.log, msg, "stream", true, "prompt_tokens", u.PromptTokens, "cached_tokens", u.PromptTokensDetails.CachedTokens,
		"completion_tokens", u.CompletionTokens, "ms", time.Since(g.start).Milliseconds())
	return status
}

// failedFirst returns the error of a request whose choices all ended in
// errors before any text: nothing was streamed, so its status can still
// say so.
func (g *generation) failedFirst() *APIError {
	for _, c := range g.choices {
		if c.err == nil || c.text.Len() > 0 {
			return nil
		}
	}
	return g.choices[0].err
}

// OpenAI response shapes.
type completionJSON struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []choiceJSON `json:"choices"`
	Usage   *usageJSON   `json:"usage,omitempty"`
}

type choiceJSON struct {
	Index        int          `json:"index"`
	Message      *messageJSON `json:"message,omitempty"`
	Delta        *messageJSON `json:"delta,omitempty"`
	Text         *string      `json:"text,omitempty"`
	Logprobs     *struct{}    `json:"logprobs"`
	FinishReason *string      `json:"finish_reason"`
	// StopReason is vLLM's stop_reason: the stop string or token id that
	// ended the choice, JSON null when it ended otherwise; left out where
	// vLLM leaves it out (a chat chunk that does not finish).
	StopReason json.RawMessage `json:"stop_reason,omitempty"`
}

// stopReason is vLLM's stop_reason of a finished choice: the stop string
// that ended it (the engine says which), else JSON null.
func stopReason(stop string) json.RawMessage {
	if stop != "" {
		if b, err := json.Marshal(stop); err == nil {
			return b
		}
	}
	return json.RawMessage("null")
}

type messageJSON struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type usageJSON struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
	// PromptTokensDetails is on a response's usage, not on a chunk's
	// continuous usage (vLLM's neither).
	PromptTokensDetails *promptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

func ptr[T any](v T) *T { return &v }
