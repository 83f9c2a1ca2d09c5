package replay

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"github.com/schollz/progressbar/v3"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// Replay modes.
const (
	// ModeOpen sends every request at its trace time / speed, whatever
	// happened to the others.
	ModeOpen = "open"
	// ModeSession runs each session closed loop: a turn waits for the
	// previous turn's answer plus the original gap / speed.
	ModeSession = "session"
)

// ExtraArgOriginalID is the extra_args key that keeps a replayed request's
// original id.
const ExtraArgOriginalID = "original_request_id"

// DefaultModel is the model a trace's requests ask for when Config.Model
// is empty.
const DefaultModel = "kvbus-sim"

// Config configures a replay.
type Config struct {
	// Target is nats://HOST:PORT (publish Requests into the request log) or
	// http://HOST:PORT (POST /v1/completions with token-id prompts).
	Target string
	// Conn, for a nats target, is the connection to use; nil means connect
	// to Target. With an http target, a non-nil Conn is only used to learn
	// each request's group from ReqMeta subjects.
	Conn     *nats.Conn
	Subjects messages.Subjects
	// Model is the model name every request asks for: a capture's too (a
	// production capture replayed on a cluster that serves another name).
	// Empty: a captured request asks for its own model, a trace's for
	// DefaultModel.
	Model string
	Speed float64 // trace clock divided by Speed (default 1)
	Mode  string  // ModeOpen (default) or ModeSession
	// Timeout bounds one request (default 10 min).
	Timeout time.Duration
	// MaxInflight bounds concurrent requests (default 8192).
	MaxInflight int
	// NoWait, with a nats target, only publishes: a request is done when
	// the request log acknowledged it (to load a cluster, or to measure the
	// publisher).
	NoWait bool
	// APIKey, with an http target, is sent as a bearer token (the
	// frontend's --api-key); empty sends none.
	APIKey string
	// Progress, if set, shows a progress bar there (a terminal).
	Progress io.Writer
	Logger   *slog.Logger
}

// Replayer replays traces.
type Replayer struct {
	cfg        Config
	log        *slog.Logger
	frontendID string
	http       *http.Client
	httpURL    string
	js         jetstream.JetStream

	mu      sync.Mutex
	pending map[string]*pendingReq // by request id (nats target)
	groups  map[string]string      // request id → group, from ReqMeta subjects
	// remote is, through HTTP, each request's cached tokens read from
	// another group, from its final Output on the bus: the frontend's
	// usage does not tell them.
	remote map[string]int
}

type pendingReq struct {
	res     *Result
	done    chan struct{}
	got     bool // an output came
	attempt int  // the newest attempt heard
}

// New checks the configuration and prepares the target.
func New(cfg Config) (*Replayer, error) {
	if cfg.Speed == 0 {
		cfg.Speed = 1
	}
	if cfg.Speed < 0 {
		return nil, errors.New("replay: --speed must be positive")
	}
	if cfg.Mode == "" {
		cfg.Mode = ModeOpen
	}
	if cfg.Mode != ModeOpen && cfg.Mode != ModeSession {
		return nil, fmt.Errorf("replay: --mode %q must be open or session", cfg.Mode)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Minute
	}
	if cfg.MaxInflight <= 0 {
		cfg.MaxInflight = 8192
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	r := &Replayer{cfg: cfg, log: cfg.Logger, frontendID: "replay-" + nuid.Next(), pending: map[string]*pendingReq{}, groups: map[string]string{}, remote: map[string]int{}}
	u, err := url.Parse(cfg.Target)
	if err != nil { // url's error quotes the URL, password and all
		return nil, fmt.Errorf("replay: --target %s: not a URL; want nats://HOST:PORT or http://HOST:PORT", bus.RedactURLs(cfg.Target))
	}
	switch u.Scheme {
	case "nats", "tls":
		if cfg.Conn == nil {
			return nil, errors.New("replay: a nats target needs a connection")
		}
		// The semaphore of MaxInflight bounds outstanding publishes.
		if r.js, err = jetstream.New(cfg.Conn, jetstream.WithPublishAsyncMaxPending(cfg.MaxInflight)); err != nil {
			return nil, err
		}
	case "http", "https":
		r.httpURL = strings.TrimSuffix(cfg.Target, "/") + "/v1/completions"
		r.http = &http.Client{Timeout: cfg.Timeout, Transport: &http.Transport{MaxIdleConnsPerHost: 1024, MaxConnsPerHost: cfg.MaxInflight}}
	default:
		return nil, fmt.Errorf("replay: --target %s: want nats://HOST:PORT or http://HOST:PORT", bus.RedactURLs(cfg.Target))
	}
	return r, nil
}

// Run replays items and returns one Result per item, in item order.
func (r *Replayer) Run(ctx context.Context, items []Item) ([]Result, time.Duration, error) {
	if r.cfg.Conn != nil {
		subs, err := r.subscribe(ctx)
		if err != nil {
			return nil, 0, err
		}
		defer func() {
			for _, s := range subs {
				_ = s.Unsubscribe()
			}
		}()
	}
	if r.js != nil && !r.cfg.NoWait {
		stop, err := r.warnWithoutScheduler(ctx, schedulerGrace)
		if err != nil {
			return nil, 0, err
		}
		defer stop()
	}
	if r.http != nil {
		defer r.http.CloseIdleConnections()
	}
	results := make([]Result, len(items))
	depth := map[string]int{}
	for i, it := range items {
		results[i].SessionID = it.SessionID
		results[i].PromptTokens = len(it.Prompt)
		results[i].TurnDepth = 1
		if it.SessionID != "" {
			depth[it.SessionID]++
			results[i].TurnDepth = depth[it.SessionID]
		}
	}
	var bar *progressbar.ProgressBar
	if r.cfg.Progress != nil {
		bar = progressbar.NewOptions(len(items), progressbar.OptionSetWriter(r.cfg.Progress),
			progressbar.OptionSetDescription("replay"), progressbar.OptionShowCount(), progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionClearOnFinish())
	}
	sem := make(chan struct{}, r.cfg.MaxInflight)
	var wg sync.WaitGroup
	start := time.Now()
	send := func(i int) {
		// A request still waiting for its turn when the replay is stopped
		// is not sent (its result says so, below).
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		if ctx.Err() != nil {
			<-sem
			return
		}
		r.do(ctx, &items[i], &results[i])
		<-sem
		if bar != nil {
			_ = bar.Add(1)
		}
	}
	at := func(d time.Duration) time.Time { return start.Add(time.Duration(float64(d) / r.cfg.Speed)) }
	if r.cfg.Mode == ModeOpen {
		for i := range items {
			if !sleepUntil(ctx, at(items[i].At)) {
				break
			}
			wg.Go(func() { send(i) })
		}
	} else {
		bySession := map[string][]int{}
		var order []string
		for i, it := range items {
			key := it.SessionID
			if key == "" {
				key = "\x00" + fmt.Sprint(i) // its own session
			}
			if _, ok := bySession[key]; !ok {
				order = append(order, key)
			}
			bySession[key] = append(bySession[key], i)
		}
		for _, key := range order {
			idx := bySession[key]
			wg.Go(func() {
				if !sleepUntil(ctx, at(items[idx[0]].At)) {
					return
				}
				for k, i := range idx {
					if k > 0 {
						gap := time.Duration(float64(items[i].At-items[idx[k-1]].At) / r.cfg.Speed)
						if !sleepUntil(ctx, time.Now().Add(gap)) {
							return
						}
					}
					send(i)
				}
			})
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	if bar != nil {
		_ = bar.Finish()
	}
	if r.cfg.Conn != nil && !r.cfg.NoWait {
		r.awaitBus(ctx, results)
	}
	r.mu.Lock()
	for i := range results {
		if g, ok := r.groups[results[i].ReqID]; ok {
			results[i].Group = g
		}
		if r.http != nil {
			remote, ok := r.remote[results[i].ReqID]
			results[i].RemoteTokens, results[i].RemoteUnknown = remote, !ok
		}
		if results[i].ReqID == "" && results[i].Err == "" {
			results[i].Err = "not sent: the replay was stopped"
		}
	}
	r.mu.Unlock()
	return results, elapsed, ctx.Err()
}

// busGrace bounds how long a replay waits for the bus to tell what it
// learns there of requests already answered.
const busGrace = time.Second

// awaitBus waits, up to busGrace, until the ReqMeta of every answered
// request, and through HTTP its final Output, have been read from the bus:
// through HTTP they can come after the answer, and the subscriptions
// deliver apart, so an Output read says nothing of its ReqMeta.
func (r *Replayer) awaitBus(ctx context.Context, results []Result) {
	deadline := time.Now().Add(busGrace)
	for {
		missing := false
		r.mu.Lock()
		for i := range results {
			if results[i].Err != "" || results[i].E2E <= 0 {
				continue
			}
			_, group := r.groups[results[i].ReqID]
			_, remote := r.remote[results[i].ReqID]
			if !group || (r.http != nil && !remote) {
				missing = true
				break
			}
		}
		r.mu.Unlock()
		if !missing || !sleepUntil(ctx, time.Now().Add(10*time.Millisecond)) || time.Now().After(deadline) {
			return
		}
	}
}

func sleepUntil(ctx context.Context, t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err() == nil
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// subscribe listens for outputs (nats target) and ReqMetas (to learn
// groups).
func (r *Replayer) subscribe(ctx context.Context) ([]*nats.Subscription, error) {
	nc, subj := r.cfg.Conn, r.cfg.Subjects
	var subs []*nats.Subscription
	meta, err := nc.Subscribe(subj.MetaGroup("*"), func(m *nats.Msg) {
		// kvbus.meta.<group>.<key>: decode only the id, cheaply.
		parts := strings.Split(m.Subject, ".")
		id := reqIDOf(m.Data)
		if len(parts) >= 4 && id != "" {
			r.mu.Lock()
			r.groups[id] = parts[len(parts)-2]
			if client := clientRequestID(id); client != "" {
				r.groups[client] = parts[len(parts)-2]
			}
			r.mu.Unlock()
		}
	})
	if err != nil {
		return nil, err
	}
	meta.SetPendingLimits(-1, -1)
	subs = append(subs, meta)
	if r.js != nil {
		out, err := nc.Subscribe(subj.Out(r.frontendID), func(m *nats.Msg) { r.onOutput(m) })
		if err != nil {
			return subs, err
		}
		out.SetPendingLimits(-1, -1)
		subs = append(subs, out)
	} else {
		// Through HTTP, the frontends' outputs tell how much of each
		// request's cache was read from another group.
		out, err := nc.Subscribe(subj.Out("*"), func(m *nats.Msg) {
			id, u := usageOf(m.Data)
			if u == nil || !strings.HasPrefix(id, "rp-") {
				return // not the end of a replayed request
			}
			r.mu.Lock()
			r.remote[id] = u.RemoteCachedTokens
			if client := clientRequestID(id); client != "" {
				r.remote[client] = u.RemoteCachedTokens
			}
			r.mu.Unlock()
		})
		if err != nil {
			return subs, err
		}
		out.SetPendingLimits(-1, -1)
		subs = append(subs, out)
	}
	if r.js != nil {
		// The request log acknowledges each publish on this connection's
		// inbox: a key that may not read it (the observer's, which may
		// publish no request either) would wait for every acknowledgement
		// until the replay's context ends.
		inbox, err := nc.SubscribeSync(nc.NewInbox())
		if err != nil {
			return subs, err
		}
		subs = append(subs, inbox)
	}
	if err := nc.Flush(); err != nil {
		return subs, err
	}
	// A refused subscription is said on the connection, not by Subscribe:
	// onto the bus, the replay would wait for answers it cannot read
	// until --timeout, blaming the scheduler.
	if err := nc.LastError(); errors.Is(err, nats.ErrPermissionViolation) {
		if r.js != nil {
			return subs, fmt.Errorf("replay: %w: a replay onto the bus publishes requests and reads the answers (kvbus.out.*), ReqMetas and the request log's acknowledgements (its _INBOX); give it the admin key (--nats-nkey admin.nk)", err)
		}
		r.log.Warn("the bus refused to let replay read ReqMetas: the groups that served the requests will not be reported (give it the admin key, --nats-nkey admin.nk)", "err", err)
	}
	return subs, nil
}

// schedulerGrace is how long a replay onto the bus waits for a ready
// scheduler's announcement before it warns that none answers.
const schedulerGrace = 3 * time.Second

// warnWithoutScheduler warns when no scheduler announces itself ready
// within grace: published requests would then wait out their timeout in
// silence. It does not delay the replay.
func (r *Replayer) warnWithoutScheduler(ctx context.Context, grace time.Duration) (stop func(), err error) {
	ready := make(chan struct{})
	var once sync.Once
	sub, err := r.cfg.Conn.Subscribe(r.cfg.Subjects.AnnounceRole(messages.RoleScheduler), func(m *nats.Msg) {
		if a, err := messages.DecodeAnnouncement(m.Data); err == nil && a.Ready {
			once.Do(func() { close(ready) })
		}
	})
	if err != nil {
		return nil, err
	}
	wctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-ready:
		case <-wctx.Done():
		case <-t.C:
			r.log.Warn("no ready scheduler has announced itself on this bus: requests wait until one comes, or until --timeout",
				"subject", r.cfg.Subjects.AnnounceRole(messages.RoleScheduler), "timeout", r.cfg.Timeout)
		}
	})
	return func() { cancel(); wg.Wait(); _ = sub.Unsubscribe() }, nil
}

// usageOf reads req_id and usage from an Output without decoding its
// text or token ids; usage is nil but on a request's final Output.
func usageOf(data []byte) (string, *messages.Usage) {
	var m struct {
		ReqID string          `msgpack:"req_id"`
		Usage *messages.Usage `msgpack:"usage"`
	}
	if messages.Unmarshal(data, &m) != nil {
		return "", nil
	}
	return m.ReqID, m.Usage
}

// clientRequestID is the X-Request-Id a frontend's bus request id was made
// from ("" if none): the frontend suffixes it with "-" and an id of its
// own, and a request it publishes again (its answer lost on the bus) with
// "-again" and a count besides.
func clientRequestID(busID string) string {
	if i := strings.LastIndex(busID, "-again"); i > 0 && isDigits(busID[i+len("-again"):]) {
		busID = busID[:i]
	}
	if i := strings.LastIndexByte(busID, '-'); i > 0 {
		return busID[:i]
	}
	return ""
}

func isDigits(s string) bool {
	for _, c := range []byte(s) {
		if c < '0' || c > '9' {
			return false
		}
	}
	return s != ""
}

// reqIDOf reads req_id from a ReqMeta without decoding its token ids.
func reqIDOf(data []byte) string {
	var m struct {
		ReqID string `msgpack:"req_id"`
	}
	if messages.Unmarshal(data, &m) != nil {
		return ""
	}
	return m.ReqID
}

func (r *Replayer) onOutput(m *nats.Msg) {
	now := time.Now()
	o, err := messages.DecodeOutput(m.Data)
	if err != nil {
		r.log.Warn("replay: malformed output", "err", err)
		return
	}
	// The result is written under the lock, so that abandon (a timeout)
	// and this never both finish a request.
	r.mu.Lock()
	p := r.pending[o.ReqID]
	if p == nil {
		r.mu.Unlock()
		return
	}
	switch {
	case o.Attempt < p.attempt:
		// Of an attempt given up (its group failed; a newer one superseded
		// it, and may end it with an error): a frontend drops it too.
		r.mu.Unlock()
		return
	case o.Attempt > p.attempt && p.got && o.Error == nil:
		// Moved after its answer began: a frontend cannot splice the new
		// attempt into what its client has, and ends the answer so.
		o = &messages.Output{ReqID: o.ReqID, Attempt: o.Attempt, Error: &messages.OutputError{Code: "group_failed",
			Message: "the request moved to another worker group after its answer had begun"}}
	}
	p.attempt = o.Attempt
	if !p.got {
		p.got = true
		p.res.TTFT = now.Sub(p.res.Sent)
	}
	final := o.Final()
	if final {
		delete(r.pending, o.ReqID)
		p.res.E2E = now.Sub(p.res.Sent)
		if u := o.Usage; u != nil {
			p.res.CachedTokens, p.res.RemoteTokens = u.CachedTokens, u.RemoteCachedTokens
			// An engine (--engine openai) may count the prompt in its own
			// tokens: the bound is the larger count.
			if prompt := max(p.res.PromptTokens, u.PromptTokens); u.CachedTokens < 0 || u.CachedTokens > prompt ||
				u.RemoteCachedTokens < 0 || u.RemoteCachedTokens > u.CachedTokens {
				// A count that would put a hit ratio over 1: as readStream.
				p.res.Err = fmt.Sprintf("usage: %d cached tokens (%d remote) of a prompt of %d: the engine's count is wrong",
					u.CachedTokens, u.RemoteCachedTokens, prompt)
				p.res.CachedTokens, p.res.RemoteTokens = 0, 0
			}
		}
		if o.Error != nil {
			p.res.Err = o.Error.Code + ": " + o.Error.Message
		}
	}
	r.mu.Unlock()
	if final {
		close(p.done)
	}
}

// do sends one item and waits for its answer.
func (r *Replayer) do(ctx context.Context, it *Item, res *Result) {
	res.ReqID = "rp-" + nuid.Next()
	req := r.request(it, res.ReqID)
	if r.js != nil {
		r.doNATS(ctx, req, res)
	} else {
		r.doHTTP(ctx, req, res)
	}
}

// model is the model to request for an item that asked for captured
// ("" for a trace's): Config.Model when given, else captured, else
// DefaultModel.
func (r *Replayer) model(captured string) string {
	return cmp.Or(r.cfg.Model, captured, DefaultModel)
}

// request builds the bus request of an item: a new id, the original one in
// extra_args, the model to request, exact output length for traces.
func (r *Replayer) request(it *Item, id string) *messages.Request {
	var req messages.Request
	if it.Request != nil {
		req = *it.Request
		req.Model = r.model(it.Request.Model)
		if req.Model != it.Request.Model {
			req.LoRAName = "" // an adapter of the captured model, not of this one
		}
		// A new request of the replay, not a publish again of one it sent
		// (the scheduler would take it for the same turn as its first).
		req.AgainOf = ""
		req.SamplingParams.ExtraArgs = make(messages.Args, len(it.Request.SamplingParams.ExtraArgs)+1)
		for k, v := range it.Request.SamplingParams.ExtraArgs {
			req.SamplingParams.ExtraArgs[k] = v
		}
		// A captured request without a session gets the one inferred for
		// it (--infer-sessions), as a trace's item does.
		if it.SessionID != "" && req.SessionID == "" && req.SamplingParams.SessionFromExtraArgs() == "" {
			req.SessionID = it.SessionID
			req.SamplingParams.ExtraArgs[messages.ExtraArgSessionID] = it.SessionID
		}
	} else {
		req = messages.Request{
			Model: r.model(""), PromptTokenIDs: it.Prompt, SessionID: it.SessionID, Endpoint: messages.EndpointCompletions,
			SamplingParams: messages.SamplingParams{MaxTokens: max(it.OutputTokens, 1), MinTokens: it.OutputTokens, IgnoreEOS: true, Temperature: 1, TopP: 1},
		}
		req.SamplingParams.ExtraArgs = messages.Args{}
		if it.SessionID != "" {
			req.SamplingParams.ExtraArgs[messages.ExtraArgSessionID] = it.SessionID
		}
	}
	if it.OriginalID != "" {
		req.SamplingParams.ExtraArgs[ExtraArgOriginalID] = it.OriginalID
	}
	now := time.Now()
	req.RequestID, req.FrontendID = id, r.frontendID
	req.ArrivalUnixMs, req.DeadlineUnixMs = now.UnixMilli(), now.Add(r.cfg.Timeout).UnixMilli()
	return &req
}

func (r *Replayer) doNATS(ctx context.Context, req *messages.Request, res *Result) {
	data, err := messages.Marshal(req)
	if err != nil {
		res.Err = err.Error()
		return
	}
	p := &pendingReq{res: res, done: make(chan struct{})}
	r.mu.Lock()
	r.pending[req.RequestID] = p
	r.mu.Unlock()
	res.Sent = time.Now()
	ack, err := r.js.PublishMsgAsync(&nats.Msg{Subject: r.cfg.Subjects.Request(req.Model), Data: data, Header: nats.Header{}},
		jetstream.WithMsgID(req.RequestID))
	if err == nil {
		select {
		case <-ack.Ok():
		case err = <-ack.Err():
		case <-ctx.Done():
			err = ctx.Err()
		}
	}
	if err != nil || r.cfg.NoWait {
		r.mu.Lock()
		delete(r.pending, req.RequestID)
		r.mu.Unlock()
		switch {
		case errors.Is(err, jetstream.ErrNoStreamResponse):
			res.Err = fmt.Sprintf("publish: no request log takes %s: give the cluster's --subject-prefix, or start its frontend or scheduler first (%v)",
				r.cfg.Subjects.Request(req.Model), err)
		case err != nil:
			res.Err = "publish: " + err.Error()
		default:
			res.E2E = time.Since(res.Sent) // acknowledged by the log
		}
		return
	}
	timer := time.NewTimer(r.cfg.Timeout)
	defer timer.Stop()
	select {
	case <-p.done:
	case <-timer.C:
		r.abandon(req.RequestID, res, messages.AbortReasonTimeout+": no answer within "+r.cfg.Timeout.String())
	case <-ctx.Done():
		r.abandon(req.RequestID, res, "stopped: "+ctx.Err().Error())
	}
}

func (r *Replayer) abandon(id string, res *Result, why string) {
	r.mu.Lock()
	_, waiting := r.pending[id]
	delete(r.pending, id)
	if waiting {
		res.Err = why
	}
	r.mu.Unlock()
	if waiting {
		if data, err := messages.Marshal(&messages.Abort{ReqID: id, Reason: why}); err == nil {
			_ = r.cfg.Conn.Publish(r.cfg.Subjects.Abort(), data)
		}
	}
}

// doHTTP sends a streaming /v1/completions request with a token-id prompt.
func (r *Replayer) doHTTP(ctx context.Context, req *messages.Request, res *Result) {
	sp := req.SamplingParams
	body := map[string]any{
		"model": cmp.Or(req.LoRAName, req.Model), "prompt": req.PromptTokenIDs, "max_tokens": max(sp.MaxTokens, 1),
		"stream": true, "stream_options": map[string]bool{"include_usage": true},
	}
	if sp.MinTokens > 0 {
		body["min_tokens"] = sp.MinTokens
	}
	if sp.IgnoreEOS {
		body["ignore_eos"] = true
	}
	if len(sp.ExtraArgs) > 0 {
		body["vllm_xargs"] = sp.ExtraArgs // carries session_id and original_request_id
	}
	if len(sp.Stop) > 0 {
		body["stop"] = sp.Stop
	}
	if sp.Seed != nil {
		body["seed"] = *sp.Seed
	}
	if req.CacheSalt != "" {
		body["cache_salt"] = req.CacheSalt
	}
	data, err := json.Marshal(body)
	if err != nil {
		res.Err = err.Error()
		return
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, r.httpURL, bytes.NewReader(data))
	if err != nil {
		res.Err = err.Error()
		return
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set("X-Request-Id", req.RequestID)
	if r.cfg.APIKey != "" {
		hreq.Header.Set("Authorization", "Bearer "+r.cfg.APIKey)
	}
	res.Sent = time.Now()
	resp, err := r.http.Do(hreq)
	if err != nil {
		res.Err = "http: " + err.Error()
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		res.Err = fmt.Sprintf("http %d: %s", resp.StatusCode, bytes.TrimSpace(b))
		return
	}
	readStream(resp.Body, len(req.PromptTokenIDs), res)
}

// readStream reads a streamed /v1/completions answer (server-sent events)
// into res: TTFT at the first event, E2E at [DONE], the cached tokens of
// the usage chunk, an error chunk's code and message. res.Sent is when the
// request was sent. An answer without [DONE], or whose usage has cached
// tokens outside the prompt's (a server's bug, which would put a hit ratio
// over 1), is a failure.
func readStream(body io.Reader, promptTokens int, res *Result) {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 1<<16), 16<<20)
	for sc.Scan() {
		line, ok := bytes.CutPrefix(sc.Bytes(), []byte("data: "))
		if !ok {
			continue
		}
		if res.TTFT == 0 {
			res.TTFT = max(time.Since(res.Sent), 1)
		}
		if string(line) == "[DONE]" {
			res.E2E = max(time.Since(res.Sent), res.TTFT)
			return
		}
		var chunk struct {
			Usage *struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
			Error *struct {
				Message string `json:"message"`
				Code    string `json:"code"`
			} `json:"error"`
		}
		if json.Unmarshal(line, &chunk) != nil {
			continue
		}
		if chunk.Usage != nil {
			res.CachedTokens = chunk.Usage.Details.Cached
			// The prompt was sent as token ids: the server's has as many.
			if res.CachedTokens < 0 || res.CachedTokens > promptTokens {
				res.Err = fmt.Sprintf("usage: %d cached tokens of a prompt of %d: the server's count is wrong", res.CachedTokens, promptTokens)
				res.CachedTokens = 0
			}
		}
		if chunk.Error != nil {
			res.Err = chunk.Error.Code + ": " + chunk.Error.Message
		}
	}
	if res.Err == "" {
		res.Err = "stream ended without [DONE]"
		if err := sc.Err(); err != nil {
			res.Err += ": " + err.Error()
		}
	}
}
