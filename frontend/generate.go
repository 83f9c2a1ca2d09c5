package frontend

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// maxRequestIDBytes bounds a client's X-Request-Id and request_id.
const maxRequestIDBytes = 128

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
	// engineID and clientID, when set (--engine openai, a client's request
	// id): the answer's id as the engine made it from the bus id it was
	// sent ("chatcmpl-<id>-<nuid>") and the one the client gets
	// ("chatcmpl-<id>", as vLLM answers a client's X-Request-Id), as JSON
	// strings, escaped as the engine writes them (jsonString).
	engineID, clientID []byte
}

// writeGrace is how long past a request's deadline its answer may still
// be written: the 504 event that ends a stream at the deadline.
const writeGrace = time.Second

func (s *Server) serveGenerate(w http.ResponseWriter, r *http.Request, endpoint string) {
	start := time.Now()
	// Writing the answer ends with the request: a client that stops reading
	// (its socket full) fails the write a second after the deadline, time
	// for the deadline's 504 event. Without it the handler stayed blocked in
	// its write for as long as the client kept the connection, holding its
	// --max-inflight slot and every output queued for it.
	_ = http.NewResponseController(w).SetWriteDeadline(start.Add(s.cfg.RequestTimeout + writeGrace)) // not every ResponseWriter can
	// The model label is a served model's name, or "": a client's unknown
	// names must not make series without bound.
	var model string
	status := s.generate(w, r, endpoint, start, &model)
	s.m.requests.WithLabelValues(endpoint, strconv.Itoa(status), model).Inc()
	s.m.latency.WithLabelValues(endpoint, model).Observe(time.Since(start).Seconds())
}

// bodyTimeout is how long a generate request's body may take to arrive:
// ReadBodyTimeout, but no later than the request's deadline. The answer
// cannot be written past the deadline (and writeGrace), so a 408 at a
// later body timeout reached no one.
func (s *Server) bodyTimeout(start time.Time) time.Duration {
	left := time.Until(start.Add(s.cfg.RequestTimeout)).Round(time.Millisecond) // said in the 408
	return max(min(s.cfg.ReadBodyTimeout, left), 0)
}

// generate serves one request and returns the HTTP status it answered; it
// sets *model to the request's model once it is known to be served.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, endpoint string, start time.Time, model *string) int {
	h := w.Header()
	var body []byte
	// Refused before reaching the bus: the refusal log tells the operator.
	fail := func(e *APIError) int {
		if h.Get("X-Session-ID") == "" {
			// Refused before its session was resolved (a 400 for another
			// field, a 429, a 503): the echo still ties it to its
			// conversation.
			if id := refusedSession(body, r.Header, s.cfg.SessionHeaders); id != "" {
				h.Set("X-Session-ID", id)
			}
		}
		writeError(w, e)
		s.refusals.note(time.Now(), e)
		return e.Status
	}
	// X-Request-Id is on every response, errors included, from the start:
	// the client's id, or the generated one (README). The body's request_id
	// replaces the generated one once read.
	busBase := nuid.Next()
	hdrID, hdrErr := requestID(r.Header)
	if hdrErr == nil && hdrID != "" {
		h.Set("X-Request-Id", hdrID)
	} else {
		h.Set("X-Request-Id", busBase)
	}
	// The body is read before the request takes a --max-inflight slot: as
	// many clients as slots that stall mid-body would otherwise refuse
	// every other client a 429 for the body timeout. A body being read
	// holds only the bytes sent so far, at most --max-body-bytes: the
	// connections, not the slots, bound what bodies hold.
	var apiErr *APIError
	body, apiErr = readBody(w, r, s.cfg.MaxBodyBytes, s.bodyTimeout(start))
	if apiErr != nil {
		return fail(apiErr)
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
	case s.draining.Load() && !s.cfg.ReusePort:
		// With ReusePort it is served: it came on a connection this
		// frontend had, which its client then leaves (leaveWhenDraining).
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
	if ok, _ := s.schedulers.ready(time.Now()); !ok {
		// Back from a cut-off before watchReconnects saw it: the
		// announcements it missed are no verdict on the schedulers.
		s.schedulers.reconnected(s.cfg.Conn.Stats().Reconnects, time.Now())
		s.schedulers.awaitFirstReady(r.Context(), time.Now())
	}
	var held time.Duration
	if ok, _ := s.schedulers.ready(time.Now()); !ok {
		// Within the request's own time: it is measured from start. A
		// --stop-timeout that passes ends it as it ends a request waiting
		// for its answer: the listener closes then, with no answer.
		wctx, cancel := context.WithDeadline(r.Context(), start.Add(s.cfg.RequestTimeout))
		go func() {
			select {
			case <-s.stopNow:
				cancel()
			case <-wctx.Done():
			}
		}()
		holdStart := time.Now()
		s.schedulers.awaitReadyAgain(wctx, holdStart)
		held = time.Since(holdStart)
		cancel()
		select {
		case <-s.stopNow:
			w.Header().Set("Connection", "close")
			return fail(&APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "shutting_down", RetryAfter: 1,
				Message: fmt.Sprintf("this frontend stopped while no scheduler was ready (--stop-timeout %s); retry the request on another one", s.cfg.StopTimeout)})
		default:
		}
	}
	if ok, why := s.schedulers.ready(time.Now()); !ok {
		// Nothing would dispatch the request: say so now, not at the timeout.
		if held >= time.Millisecond {
			why += fmt.Sprintf(" (held %s for one to be ready again)", held.Round(time.Millisecond))
		}
		return fail(&APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "no_ready_scheduler", RetryAfter: 1,
			Message: why + "; retry shortly"})
	}
	var p *parsedRequest
	opts := parseOptions{passthrough: s.cfg.Passthrough, vocab: s.tok.VocabSize()}
	if s.cfg.Passthrough {
		// The engine knows its vocabulary, as it knows its context length,
		// and refuses an id beyond it itself: kvbus's tokenizer (o200k by
		// default) is no bound on the ids of a token-id prompt.
		opts.vocab = 1 << 32
	}
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
	// serve (the body sent to them keeps the client's): such a frontend
	// serves one --model (Config.Validate). A LoRA adapter's
	// name also seeds its prompts' block hashes (lora: vLLM keys its
	// blocks with it).
	busModel, lora := p.model, ""
	if !s.serves(p.model) {
		served, ok := s.engineServes(r.Context(), p.model)
		if !ok {
			return fail(&APIError{Status: http.StatusNotFound, Type: typeNotFound, Param: "model", Code: "model_not_found",
				Message: fmt.Sprintf("The model `%s` does not exist. Served models: %s.", p.model, strings.Join(served, ", "))})
		}
		busModel = s.cfg.Models[0]
		if s.engineModels.adapter(p.model) {
			lora = p.model
			if len(lora) > messages.MaxLoRANameBytes { // a scheduler would refuse the request, and the client wait for its deadline
				return fail(badRequest("model", "model is a LoRA adapter whose name has %d bytes; kvbus carries at most %d",
					len(lora), messages.MaxLoRANameBytes))
			}
		}
	}
	*model = p.model
	if hdrErr != nil {
		return fail(hdrErr)
	}
	prompts, apiErr := s.tokenize(r.Context(), p)
	if apiErr != nil {
		return fail(apiErr)
	}

	g := &generation{s: s, endpoint: endpoint, model: p.model, vm: s.vm.of(p.model), created: start.Unix(), sessionID: sessionID, q: newOutputQueue(len(prompts)), start: start,
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
		g.engineID, g.clientID = jsonString(prefix+busBase), jsonString(g.id)
	}
	g.log = s.log.With("req_id", busBase, "session_id", sessionID)
	if sessionID != "" {
		g.log.Debug("session resolved", "source", source)
	}
	deadline := start.Add(s.cfg.RequestTimeout)

	// Publish every prompt; each is acknowledged by JetStream before any
	// byte of the response is written.
	for i, prompt := range prompts {
		if i > 0 && time.Now().After(deadline) {
			// Each prompt waits for its acknowledgement: a long list on a
			// slow log must not go on publishing what nobody waits for.
			g.log.Warn("request timed out while its prompts were published", "published", i, "prompts", len(prompts), "timeout", s.cfg.RequestTimeout)
			g.abort(messages.AbortReasonTimeout)
			g.unregister()
			return fail(&APIError{Status: http.StatusGatewayTimeout, Type: typeTimeout, Code: "timeout",
				Message: fmt.Sprintf("request did not complete within %s (--request-timeout): its %d prompts could not all be published in time; send fewer at once", s.cfg.RequestTimeout, len(prompts))})
		}
		busID := busBase
		if len(prompts) > 1 {
			busID = busBase + "-" + strconv.Itoa(i)
		}
		req := s.busRequest(p, busID, sessionID, prompt, start, deadline)
		req.Model, req.LoRAName = busModel, lora
		g.choices = append(g.choices, &choiceState{busID: busID, promptTokens: len(prompt), buffered: !p.stream, req: req})
		s.register(busID, g.q, i)
		if err := s.publish(r.Context(), req); err != nil {
			if r.Context().Err() != nil { // the client left while the request was being logged
				g.log.Info("client disconnected; aborting request")
				g.abort(messages.AbortReasonClientGone)
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
						"Operator: lower --max-body-bytes below the bus's limit (the NATS server's max_payload, at most 8 MiB: kvbus nats takes 8 MiB)", err)})
			}
			if errors.Is(err, bus.ErrLogFull) {
				return fail(&APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "request_log_full", RetryAfter: logFullRetryAfter,
					Message: "the request log is full; retry later. Operator: it holds the requests waiting for a scheduler and the dispatched " +
						"history the schedulers trim every few seconds to --request-log-history-bytes: add schedulers if requests wait, " +
						"or raise --request-log-max-bytes (applies when the log is created)"})
			}
			msg := "the request log did not acknowledge the request; retry shortly. " +
				"Operator: the NATS server's log says why (a full disk under its --data-dir fails every write until it has room); " +
				"if it says nothing, this frontend may be cut off from it (a partition: check the network between them)"
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
		switch cr, renders := s.tok.(ChatRenderer); {
		case fromBody:
			ids, err = rt.TokenizeChat(ctx, p.body) // tools and template arguments included
		case renders:
			// As /tokenize renders it: the generation prompt, or the last
			// message left open, as the body asks.
			ids, err = cr.RenderChat(p.turns, p.generationPrompt && !p.continueFinal, p.continueFinal)
		case (!p.generationPrompt || p.continueFinal) && !s.cfg.Passthrough:
			return nil, badRequest("add_generation_prompt", "the %s tokenizer always ends a chat with the generation prompt", s.tok.Name())
		default:
			ids, err = s.tok.ApplyChatTemplate(p.turns)
		}
		if err != nil {
			return nil, tokenizeError("messages", err)
		}
		prompts = [][]uint32{ids}
	case p.tokenPrompts != nil:
		prompts = p.tokenPrompts
	default:
		texts := p.texts
		if s.cfg.Passthrough {
			// Only the first is on the bus (below): the others are the
			// engine's to tokenize, not one /tokenize call each here.
			texts = texts[:1]
		}
		for _, t := range texts {
			var ids []uint32
			var err error
			if fromBody {
				ids, err = rt.TokenizePrompt(ctx, t, !p.noSpecialTokens) // the body's add_special_tokens
			} else {
				ids, err = s.tok.Encode(t)
			}
			if err != nil {
				return nil, tokenizeError("prompt", err)
			}
			if len(ids) == 0 {
				return nil, badRequest("prompt", "prompt is empty")
			}
			prompts = append(prompts, ids)
		}
	}
	if p.truncateSet {
		if err := s.truncate(p, prompts); err != nil {
			return nil, err
		}
	}
	if p.maxTokensSet && p.params.MinTokens > p.params.MaxTokens { // vLLM's check and words
		return nil, badRequest("min_tokens", "min_tokens must be less than or equal to max_tokens=%d, got %d.", p.params.MaxTokens, p.params.MinTokens)
	}
	if s.cfg.Passthrough {
		// The engine answers the whole body, every prompt of it, in one
		// response: one bus request, placed by its first prompt. It knows
		// its own max_model_len (its --max-model-len, not kvbus's) and
		// answers a prompt too long with vLLM's 400, relayed.
		return prompts[:1], nil
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
		if !p.maxTokensSet && p.params.MinTokens > maxLen-n { // above the default max_tokens (busRequest), as vLLM checks it
			return nil, badRequest("min_tokens", "min_tokens must be less than or equal to max_tokens=%d, got %d.", maxLen-n, p.params.MinTokens)
		}
	}
	return prompts, nil
}

// truncate keeps the last truncate_prompt_tokens of every prompt, as
// vLLM's tokenizer does (truncation from the left, before the length
// checks): the request is charged, hashed into blocks and run on what the
// engine keeps. -1 keeps max_model_len's worth, which vLLM then refuses
// with any max_tokens, as it does; behind --engine openai that is the
// engine's own max_model_len, which the engine applies.
func (s *Server) truncate(p *parsedRequest, prompts [][]uint32) *APIError {
	k := p.truncate
	switch {
	case k == -1 && s.cfg.Passthrough:
		return nil
	case k == -1:
		k = s.cfg.MaxModelLen
	case k > s.cfg.MaxModelLen && !s.cfg.Passthrough: // vLLM's words
		return badRequest("truncate_prompt_tokens", "truncate_prompt_tokens value (%d) is greater than max_model_len (%d). Please request a smaller truncation size.", k, s.cfg.MaxModelLen)
	case k == 0:
		return badRequest("truncate_prompt_tokens", "truncate_prompt_tokens 0 leaves an empty prompt; give at least 1, or -1 for max_model_len")
	}
	for i, ids := range prompts {
		if len(ids) > k {
			prompts[i] = ids[len(ids)-k:]
		}
	}
	return nil
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
		// The time left beside the deadline: the scheduler learns this
		// host's clock from it (a request published now waited nowhere).
		ArrivalUnixMs: start.UnixMilli(), DeadlineUnixMs: deadline.UnixMilli(), TimeoutMs: messages.TimeLeftMs(deadline, time.Now()),
		PromptTokenIDs: prompt, SamplingParams: sp, Stream: p.stream,
		KVTransferParams: p.kvTransfer, Endpoint: p.endpoint, CacheSalt: p.cacheSalt,
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
	// A server whose max_payload is above it still carries no more: the
	// request log's streams (MaxMsgSize) and every decoder refuse it.
	if len(data) > messages.MaxMessageBytes {
		return fmt.Errorf("%w: %d bytes on the bus, kvbus's messages take at most %d", errAboveMaxPayload, len(data), messages.MaxMessageBytes)
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
