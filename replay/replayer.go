package replay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
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
	stream  bool // the request streams: its client hears each output
}

// ErrConfig is wrapped when a Config or TapConfig is refused.
var ErrConfig = errors.New("replay: bad configuration")

// Validate checks the configuration without connecting: Speed (--speed) is
// a finite number >= 0 (0: 1), Mode (--mode) is "" (open), ModeOpen or
// ModeSession, Timeout (--timeout) and MaxInflight are >= 0 (0: their
// defaults), Subjects (--subject-prefix) is valid, and Target (--target)
// is nats:// or tls:// with a Conn, or http(s)://HOST[:PORT]. Errors wrap
// ErrConfig. New calls it.
func (c Config) Validate() error {
	if c.Speed < 0 || math.IsNaN(c.Speed) || math.IsInf(c.Speed, 0) {
		return fmt.Errorf("%w: --speed %v must be positive", ErrConfig, c.Speed)
	}
	if c.Mode != "" && c.Mode != ModeOpen && c.Mode != ModeSession {
		return fmt.Errorf("%w: --mode %q must be open or session", ErrConfig, c.Mode)
	}
	if c.Timeout < 0 {
		return fmt.Errorf("%w: --timeout %s must be >= 0 (0: 10m)", ErrConfig, c.Timeout)
	}
	if c.MaxInflight < 0 {
		return fmt.Errorf("%w: MaxInflight %d must be >= 0 (0: 8192)", ErrConfig, c.MaxInflight)
	}
	if err := c.Subjects.Validate(); err != nil {
		return fmt.Errorf("%w: --subject-prefix: %w", ErrConfig, err)
	}
	u, err := ParseTarget(c.Target)
	if err != nil {
		return err
	}
	if (u.Scheme == "nats" || u.Scheme == "tls") && c.Conn == nil {
		return fmt.Errorf("%w: a nats target (--target %s) needs a connection", ErrConfig, bus.RedactURLs(c.Target))
	}
	return nil
}

// ParseTarget reads a replay's --target: nats:// or tls:// (onto the bus),
// or http(s)://HOST[:PORT] (through a frontend). Its error wraps ErrConfig
// and shows no password. Config.Validate calls it, and kvbus replay before
// it connects.
func ParseTarget(target string) (*url.URL, error) {
	u, err := url.Parse(target)
	if err != nil { // url's error quotes the URL, password and all
		return nil, fmt.Errorf("%w: --target %s: not a URL; want nats://HOST:PORT or http://HOST:PORT", ErrConfig, bus.RedactURLs(target))
	}
	switch u.Scheme {
	case "nats", "tls":
	case "http", "https":
		if u.Host == "" {
			return nil, fmt.Errorf("%w: --target %s: no host; want http://HOST:PORT", ErrConfig, bus.RedactURLs(target))
		}
	default:
		return nil, fmt.Errorf("%w: --target %s: want nats://HOST:PORT (onto the bus; tls:// for TLS) or http://HOST:PORT (through the frontend; https:// for TLS)",
			ErrConfig, bus.RedactURLs(target))
	}
	return u, nil
}

// New checks the configuration (cfg.Validate) and prepares the target.
func New(cfg Config) (*Replayer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Speed == 0 {
		cfg.Speed = 1
	}
	if cfg.Mode == "" {
		cfg.Mode = ModeOpen
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Minute
	}
	if cfg.MaxInflight == 0 {
		cfg.MaxInflight = 8192
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	r := &Replayer{cfg: cfg, log: cfg.Logger, frontendID: "replay-" + nuid.Next(), pending: map[string]*pendingReq{}, groups: map[string]string{}, remote: map[string]int{}}
	u, _ := ParseTarget(cfg.Target) // Validate accepted it
	switch u.Scheme {
	case "nats", "tls":
		// The semaphore of MaxInflight bounds outstanding publishes.
		var err error
		if r.js, err = jetstream.New(cfg.Conn, jetstream.WithPublishAsyncMaxPending(cfg.MaxInflight)); err != nil {
			return nil, err
		}
	default: // http, https
		r.httpURL = strings.TrimSuffix(cfg.Target, "/") + "/v1/completions"
		r.http = &http.Client{Timeout: cfg.Timeout, Transport: &http.Transport{MaxIdleConnsPerHost: 1024, MaxConnsPerHost: cfg.MaxInflight}}
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
	// A session is a session of one model, as the schedulers count its
	// turns: the same id sent with another model is another conversation.
	depth := map[conversation]int{}
	for i, it := range items {
		results[i].SessionID = it.SessionID
		results[i].PromptTokens = len(it.Prompt)
		results[i].TurnDepth = 1
		if it.SessionID != "" {
			conv := conversation{r.model(it.capturedModel()), it.SessionID}
			depth[conv]++
			results[i].TurnDepth = depth[conv]
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
		// A conversation is a session of one model, as the turn depths
		// above count it: one id sent with two models is two loops.
		bySession := map[conversation][]int{}
		var order []conversation
		for i, it := range items {
			key := conversation{r.model(it.capturedModel()), it.SessionID}
			if key.session == "" {
				key.session = "\x00" + fmt.Sprint(i) // its own session
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
	req.TimeoutMs = messages.TimeLeftMs(now.Add(r.cfg.Timeout), now) // a captured request's is its frontend's
	return &req
}
