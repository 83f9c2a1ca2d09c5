package workers

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvbus/kvbus/messages"
)

// Finish reasons, OpenAI's words.
const (
	FinishStop   = "stop"
	FinishLength = "length"
)

// EngineRequest is what the driver rank hands its engine.
type EngineRequest struct {
	ReqID        string
	PromptTokens []uint32
	// CachedTokens are prompt tokens whose KV was loaded; only the rest is
	// prefilled.
	CachedTokens int
	// RemoteTokens are those of CachedTokens read from another group's
	// segment of the KV pool (charged at RemoteLoadPerToken).
	RemoteTokens int
	// LoadTime is the wall time the rank already spent reading the cached
	// tokens (copies from other groups included). The sim engine charges a
	// load as max(its model, LoadTime): the copy over the bus is the
	// transfer the model stands for, not an extra one.
	LoadTime time.Duration
	Params   messages.SamplingParams
	// For engines that are model servers (OpenAIEngine): the request's
	// model, session id, endpoint (messages.Endpoint*), the client's
	// original body (empty for replayed traces), kv_transfer_params and
	// cache_salt.
	Model            string
	SessionID        string
	Endpoint         string
	Body             []byte
	KVTransferParams messages.Args
	CacheSalt        string
}

// Chunk is a piece of generated output.
type Chunk struct {
	Text     string
	TokenIDs []uint32
	// Raw is a model server's own JSON for the chunk, relayed to the
	// client as it is (Output.Raw); nil from the sim.
	Raw []byte
	// Last marks a chunk the engine knows ends the answer (Generate returns
	// right after it): the driver sends it with the finish reason, one
	// message instead of two.
	Last bool
}

// EngineResult is how a generation ended.
type EngineResult struct {
	FinishReason string
	// StopReason is the stop string that ended the answer, if one did.
	StopReason string
	// StopToken is the stop token id (of the request's stop_token_ids)
	// that ended the answer, if one did.
	StopToken        *uint32
	CompletionTokens int
	// Usage is a model server's own count, cached tokens included; nil
	// from the sim, whose cached tokens are the rank's loads.
	Usage *messages.Usage
}

// Engine produces output tokens on a group's driver rank. Generate may be
// called concurrently for different requests. It calls emit for each chunk,
// in order, from the calling goroutine, and stops with ctx's error when ctx
// ends. An error returned by emit ends the generation with that error.
// prefilled, if not nil, is called once when the prompt's KV exists (after
// prefill), before the first chunk.
type Engine interface {
	Generate(ctx context.Context, req EngineRequest, prefilled func(), emit func(Chunk) error) (EngineResult, error)
}

// SimProfile is the sim engine's cost model. Defaults approximate an 8B
// model on one modern GPU (see the README): prefill 60 µs per uncached
// token, load 5 µs per cached token, decode 10 ms per output token after
// the first (which the prefill yields).
type SimProfile struct {
	PrefillPerToken time.Duration
	LoadPerToken    time.Duration
	// RemoteLoadPerToken is the load time of a token read from another
	// group's segment of the pool; zero means 3 × LoadPerToken.
	RemoteLoadPerToken time.Duration
	DecodePerToken     time.Duration
}

// DefaultSimProfile returns the default cost model (a function, not a
// package variable any importer could change for every other one).
func DefaultSimProfile() SimProfile {
	return SimProfile{
		PrefillPerToken:    60 * time.Microsecond,
		LoadPerToken:       5 * time.Microsecond,
		RemoteLoadPerToken: 15 * time.Microsecond,
		DecodePerToken:     10 * time.Millisecond,
	}
}

// SimConfig configures the sim engine.
type SimConfig struct {
	Profile SimProfile
	// TimeScale multiplies every modelled duration; 0 makes the engine
	// instant (for throughput tests), 1 is real time.
	TimeScale float64
	// DefaultMaxTokens applies when a request sets no max_tokens.
	DefaultMaxTokens int
}

// Validate checks the configuration.
func (c SimConfig) Validate() error {
	if c.TimeScale < 0 {
		return errors.New("workers: --time-scale must be >= 0")
	}
	if c.Profile.PrefillPerToken < 0 || c.Profile.LoadPerToken < 0 || c.Profile.RemoteLoadPerToken < 0 || c.Profile.DecodePerToken < 0 {
		return errors.New("workers: engine profile durations must be >= 0")
	}
	return nil
}

// SimEngine is a deterministic simulated model: the text is a function of
// (prompt, seed), and time follows SimProfile. A group prefills one request
// at a time (FCFS) and decodes any number concurrently.
type SimEngine struct {
	cfg     SimConfig
	prefill chan struct{} // a one-slot semaphore: FCFS prefill
	// freeAt is when the last prefill ended in the model; only the
	// holder of the prefill slot reads or writes it.
	freeAt time.Time
}

// NewSimEngine returns a sim engine.
func NewSimEngine(cfg SimConfig) (*SimEngine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.DefaultMaxTokens <= 0 {
		cfg.DefaultMaxTokens = 16
	}
	return &SimEngine{cfg: cfg, prefill: make(chan struct{}, 1)}, nil
}

// simWords is the sim engine's vocabulary; token id = index + simTokenBase.
var simWords = strings.Fields(`the a of to and in is that for it on with as was at by an be this
from or are have not but all they one had were we which there when your can said use each
she do how their if will up other about out many then them these so some her would make like
him into time has look two more write go see number no way could people my than first water
been call who oil its now find long down day did get come made may part cache block prefix
session token model store load save group rank`)

const (
	simTokenBase = 1000
	simEOSOdds   = 48 // after min_tokens, 1 in simEOSOdds tokens ends the text
	// simEOSToken is the sim model's end-of-sequence token. As in vLLM, it
	// is a generated token: it counts in completion_tokens and max_tokens
	// and is among the output's token ids, but adds no text.
	simEOSToken = 2
	// simInstantChunkTokens: an instant engine emits a request's tokens in
	// chunks of this many, not all at its end, and an engine drops the
	// text it emitted once it is simCompactBytes long: what a request
	// holds does not grow with its max_tokens, which nothing on the bus
	// bounds (an instant driver rank given max_tokens 2^30 grew by ~300 MB
	// a second until it died).
	simInstantChunkTokens = 4096
	simCompactBytes       = 64 << 10
)

// Generate implements Engine.
func (e *SimEngine) Generate(ctx context.Context, req EngineRequest, prefilled func(), emit func(Chunk) error) (EngineResult, error) {
	p := e.cfg.Profile
	// Prefill is FCFS per group: wait for the slot, then load and prefill.
	arrived := time.Now()
	select {
	case e.prefill <- struct{}{}:
	case <-ctx.Done():
		return EngineResult{}, ctx.Err()
	}
	end := prefillEnd(e.freeAt, arrived, e.prefillTime(req))
	err := e.waitUntil(ctx, end)
	if err != nil {
		end = time.Now() // the prefill stopped here
	}
	e.freeAt = end
	<-e.prefill
	if err != nil {
		return EngineResult{}, err
	}
	if prefilled != nil {
		prefilled()
	}

	maxTokens := req.Params.MaxTokens
	if maxTokens <= 0 {
		maxTokens = e.cfg.DefaultMaxTokens
	}
	rng := simSeed(req.PromptTokens, req.Params.Seed)
	stops := req.Params.Stop
	isStopToken := func(id uint32) bool { return slices.Contains(req.Params.StopTokenIDs, id) }
	if ids := req.Params.StopTokenIDs; len(ids) > 16 { // a long list costs one lookup a token, not a scan
		set := make(map[uint32]struct{}, len(ids))
		for _, id := range ids {
			set[id] = struct{}{}
		}
		isStopToken = func(id uint32) bool { _, ok := set[id]; return ok }
	}
	holdBack := 0 // bytes that might start a stop string are held back
	for _, s := range stops {
		holdBack = max(holdBack, len(s)-1)
	}
	var (
		text    strings.Builder // generated text since the last compaction
		sent    int             // bytes of text already emitted
		pending []uint32        // token ids not yet emitted
		n       int
		finish  = FinishLength
	)
	instant := e.cfg.TimeScale == 0 || p.DecodePerToken == 0
	flush := func(upTo int, last bool) error {
		if upTo <= sent && len(pending) == 0 {
			return nil
		}
		c := Chunk{Text: text.String()[sent:upTo], TokenIDs: pending, Last: last}
		sent, pending = upTo, nil
		if sent >= simCompactBytes {
			// What was emitted is needed no more: a stop string starts
			// after it (the bytes that might begin one are held back).
			rest := text.String()[sent:]
			text.Reset()
			text.WriteString(rest)
			sent = 0
		}
		return emit(c)
	}
	for n < maxTokens {
		// The prefill's forward pass yields the first token, as in vLLM;
		// each later one takes a decode step.
		if n > 0 {
			if err := e.sleep(ctx, p.DecodePerToken); err != nil {
				return EngineResult{CompletionTokens: n}, err
			}
		} else if err := ctx.Err(); err != nil {
			return EngineResult{}, err
		}
		rng = splitmix64(rng)
		if n >= req.Params.MinTokens && !req.Params.IgnoreEOS && rng%simEOSOdds == 0 {
			pending = append(pending, simEOSToken)
			n++
			finish = FinishStop
			break
		}
		w := int((rng >> 8) % uint64(len(simWords)))
		id := uint32(simTokenBase + w)
		pending = append(pending, id)
		n++
		if n > req.Params.MinTokens && n < maxTokens && isStopToken(id) {
			// vLLM's stop_token_ids: the token is generated (counted, among
			// the ids) and its text left out unless include_stop_str_in_output.
			// As the max_tokens-th token it ends the answer by length
			// (vLLM's check_stop looks at the length first).
			if req.Params.IncludeStopStr {
				text.WriteString(" " + simWords[w])
			}
			if err := flush(text.Len(), true); err != nil {
				return EngineResult{CompletionTokens: n}, err
			}
			return EngineResult{FinishReason: FinishStop, StopToken: &id, CompletionTokens: n}, nil
		}
		text.WriteString(" " + simWords[w])
		if cut, stop, ok := findStop(text.String(), stops, sent); ok {
			if req.Params.IncludeStopStr {
				cut += len(stop)
			}
			if err := flush(max(cut, sent), true); err != nil {
				return EngineResult{CompletionTokens: n}, err
			}
			return EngineResult{FinishReason: FinishStop, StopReason: stop, CompletionTokens: n}, nil
		}
		if !instant || len(pending) >= simInstantChunkTokens {
			if err := flush(max(sent, text.Len()-holdBack), false); err != nil {
				return EngineResult{CompletionTokens: n}, err
			}
		}
	}
	if err := flush(text.Len(), true); err != nil {
		return EngineResult{CompletionTokens: n}, err
	}
	return EngineResult{FinishReason: finish, CompletionTokens: n}, nil
}

// findStop returns the offset of the first stop string in s that ends after
// from, and which string it is, or false.
func findStop(s string, stops []string, from int) (int, string, bool) {
	best, which, found := len(s), "", false
	for _, st := range stops {
		if st == "" {
			continue
		}
		start := max(0, from-len(st)+1)
		if i := strings.Index(s[start:], st); i >= 0 && start+i < best {
			best, which, found = start+i, st, true
		}
	}
	return best, which, found
}

// prefillTime is the wall time a request holds the group's prefill slot:
// its load (what the model charges beyond the LoadTime the rank already
// spent) and the prefill of its uncached tokens.
func (e *SimEngine) prefillTime(req EngineRequest) time.Duration {
	p := e.cfg.Profile
	cached := min(max(req.CachedTokens, 0), len(req.PromptTokens))
	remote := min(max(req.RemoteTokens, 0), cached)
	remoteCost := p.RemoteLoadPerToken
	if remoteCost == 0 {
		remoteCost = 3 * p.LoadPerToken
	}
	load := e.scaled(time.Duration(cached-remote)*p.LoadPerToken+time.Duration(remote)*remoteCost) - req.LoadTime
	return max(load, 0) + e.scaled(time.Duration(len(req.PromptTokens)-cached)*p.PrefillPerToken)
}

func (e *SimEngine) sleep(ctx context.Context, d time.Duration) error {
	return e.wait(ctx, e.scaled(d))
}

// scaled is a modelled duration in wall time.
func (e *SimEngine) scaled(d time.Duration) time.Duration {
	return time.Duration(float64(d) * e.cfg.TimeScale)
}

// prefillEnd is when a prefill of d ends in the model: it starts when the
// request arrived or when the previous prefill ended (freeAt), whichever is
// later. The queue is kept in modelled time, so a holder that the host woke
// late does not delay the ones behind it: on a busy host that lateness
// would otherwise add up along the queue, which a GPU's does not.
func prefillEnd(freeAt, arrived time.Time, d time.Duration) time.Time {
	if freeAt.After(arrived) {
		return freeAt.Add(d)
	}
	return arrived.Add(d)
}

// waitUntil sleeps until t, or until ctx ends.
func (e *SimEngine) waitUntil(ctx context.Context, t time.Time) error {
	return e.wait(ctx, time.Until(t))
}

// wait sleeps for d of wall time, or until ctx ends.
func (e *SimEngine) wait(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func simSeed(prompt []uint32, seed *int64) uint64 {
	h := xxh3.New()
	var b [8]byte
	for _, t := range prompt {
		binary.LittleEndian.PutUint32(b[:4], t)
		_, _ = h.Write(b[:4])
	}
	if seed != nil {
		binary.LittleEndian.PutUint64(b[:], uint64(*seed))
		_, _ = h.Write(b[:])
	}
	return h.Sum64()
}

// String describes the engine for logs.
func (e *SimEngine) String() string {
	return fmt.Sprintf("sim(time_scale=%g)", e.cfg.TimeScale)
}
