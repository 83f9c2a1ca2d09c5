package workers

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

func newSim(t *testing.T, cfg SimConfig) *SimEngine {
	t.Helper()
	e, err := NewSimEngine(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// prompt returns a deterministic prompt of n tokens that differs by seed.
func prompt(seed, n int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32((seed*7919 + i*104729) % 128000)
	}
	return p
}

func seed(v int64) *int64 { return &v }

type genRun struct {
	text      string
	chunks    []Chunk
	tokens    []uint32
	res       EngineResult
	err       error
	prefilled int
	// prefilledBeforeChunk is false if a chunk came before prefilled.
	prefilledBeforeChunk bool
}

func generate(ctx context.Context, e Engine, req EngineRequest) genRun {
	var r genRun
	r.prefilledBeforeChunk = true
	r.res, r.err = e.Generate(ctx, req, func() { r.prefilled++ }, func(c Chunk) error {
		if r.prefilled == 0 {
			r.prefilledBeforeChunk = false
		}
		r.chunks = append(r.chunks, c)
		r.text += c.Text
		r.tokens = append(r.tokens, c.TokenIDs...)
		return nil
	})
	return r
}

func TestSimConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		cfg  SimConfig
		ok   bool
	}{
		{"zero", SimConfig{}, true},
		{"default profile, real time", SimConfig{Profile: DefaultSimProfile(), TimeScale: 1}, true},
		{"negative time scale", SimConfig{TimeScale: -0.5}, false},
		{"negative prefill", SimConfig{Profile: SimProfile{PrefillPerToken: -1}}, false},
		{"negative load", SimConfig{Profile: SimProfile{LoadPerToken: -1}}, false},
		{"negative decode", SimConfig{Profile: SimProfile{DecodePerToken: -1}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if (err == nil) != tt.ok {
				t.Errorf("Validate() = %v, want ok=%v", err, tt.ok)
			}
			e, err := NewSimEngine(tt.cfg)
			if (err == nil) != tt.ok || (e == nil) == tt.ok {
				t.Errorf("NewSimEngine() = %v, %v, want ok=%v", e, err, tt.ok)
			}
		})
	}
}

func TestSimEngineDeterministic(t *testing.T) {
	ctx := t.Context()
	e := newSim(t, SimConfig{})
	p := prompt(1, 100)
	params := messages.SamplingParams{MaxTokens: 40, IgnoreEOS: true, Seed: seed(7)}
	a := generate(ctx, e, EngineRequest{PromptTokens: p, Params: params})
	b := generate(ctx, e, EngineRequest{PromptTokens: p, Params: params})
	if a.err != nil || b.err != nil {
		t.Fatal(a.err, b.err)
	}
	if a.text == "" || a.text != b.text || fmt.Sprint(a.tokens) != fmt.Sprint(b.tokens) || a.res != b.res {
		t.Fatalf("same prompt and seed gave different outputs:\n%q %+v\n%q %+v", a.text, a.res, b.text, b.res)
	}
	if got := len(a.tokens); got != 40 {
		t.Errorf("%d token ids for 40 tokens", got)
	}
	if got := len(strings.Fields(a.text)); got != 40 {
		t.Errorf("%d words for 40 tokens: %q", got, a.text)
	}
	// Cached tokens change the cost, not the text.
	if c := generate(ctx, e, EngineRequest{PromptTokens: p, CachedTokens: 64, Params: params}); c.text != a.text {
		t.Errorf("cached tokens changed the text")
	}
	others := map[string]EngineRequest{
		"another seed":   {PromptTokens: p, Params: messages.SamplingParams{MaxTokens: 40, IgnoreEOS: true, Seed: seed(8)}},
		"no seed":        {PromptTokens: p, Params: messages.SamplingParams{MaxTokens: 40, IgnoreEOS: true}},
		"another prompt": {PromptTokens: prompt(2, 100), Params: params},
	}
	for name, req := range others {
		if o := generate(ctx, e, req); o.err != nil || o.text == a.text {
			t.Errorf("%s: same text %q (err %v)", name, o.text, o.err)
		}
	}
}

func TestSimEngineMaxTokens(t *testing.T) {
	ctx := t.Context()
	e := newSim(t, SimConfig{DefaultMaxTokens: 5})
	tests := []struct {
		name   string
		params messages.SamplingParams
		want   int
	}{
		{"ignore_eos", messages.SamplingParams{MaxTokens: 17, IgnoreEOS: true}, 17},
		{"ignore_eos and min_tokens", messages.SamplingParams{MaxTokens: 30, MinTokens: 10, IgnoreEOS: true}, 30},
		{"min_tokens = max_tokens", messages.SamplingParams{MaxTokens: 25, MinTokens: 25}, 25},
		{"default max_tokens", messages.SamplingParams{IgnoreEOS: true}, 5},
		{"one token", messages.SamplingParams{MaxTokens: 1, IgnoreEOS: true}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for i := range 20 {
				r := generate(ctx, e, EngineRequest{PromptTokens: prompt(i, 33), Params: tt.params})
				if r.err != nil {
					t.Fatal(r.err)
				}
				if r.res.FinishReason != FinishLength || r.res.CompletionTokens != tt.want || len(r.tokens) != tt.want {
					t.Fatalf("prompt %d: %+v with %d token ids, want finish %q and %d tokens", i, r.res, len(r.tokens), FinishLength, tt.want)
				}
			}
		})
	}
}

// TestSimEngineHugeMaxTokensHoldsLittle: what the sim engine holds while it
// generates does not grow with max_tokens. The bus bounds no request's
// max_tokens, and an instant engine (--time-scale 0) kept a request's whole
// text and token ids until its end: one Request of max_tokens 2^30 on
// kvbus.req grew the driver rank by ~300 MB a second until it died.
func TestSimEngineHugeMaxTokensHoldsLittle(t *testing.T) {
	const maxTokens = 4 << 20
	e := newSim(t, SimConfig{})
	params := messages.SamplingParams{MaxTokens: maxTokens, IgnoreEOS: true}
	var before, at runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var tokens, biggest int
	var grew uint64
	res, err := e.Generate(t.Context(), EngineRequest{PromptTokens: prompt(1, 32), Params: params}, func() {}, func(c Chunk) error {
		tokens += len(c.TokenIDs)
		biggest = max(biggest, len(c.TokenIDs))
		runtime.ReadMemStats(&at)
		if at.HeapAlloc > before.HeapAlloc {
			grew = max(grew, at.HeapAlloc-before.HeapAlloc)
		}
		return nil
	})
	if err != nil || res.CompletionTokens != maxTokens || tokens != maxTokens {
		t.Fatalf("%+v %v, %d token ids; want %d tokens", res, err, tokens, maxTokens)
	}
	if biggest > 1<<16 || grew > 16<<20 {
		t.Fatalf("a chunk of %d token ids, the heap %d MiB larger while generating %d tokens: the engine holds what it generated",
			biggest, grew>>20, maxTokens)
	}
	t.Logf("largest chunk %d token ids, heap at most %d KiB larger", biggest, grew>>10)
}

func TestSimEngineStopsEarlyWithoutIgnoreEOS(t *testing.T) {
	ctx := t.Context()
	e := newSim(t, SimConfig{})
	const maxTokens = 100
	stopped := 0
	for i := range 50 {
		r := generate(ctx, e, EngineRequest{PromptTokens: prompt(i, 20), Params: messages.SamplingParams{MaxTokens: maxTokens, MinTokens: 3}})
		if r.err != nil {
			t.Fatal(r.err)
		}
		n := r.res.CompletionTokens
		if n != len(r.tokens) {
			t.Fatalf("prompt %d: CompletionTokens %d but %d token ids", i, n, len(r.tokens))
		}
		switch {
		case n < 3:
			t.Fatalf("prompt %d: %d tokens, below min_tokens 3", i, n)
		case r.res.FinishReason == FinishStop && n <= maxTokens:
			// vLLM counts the EOS token: it is the last token id and
			// adds no text.
			if r.tokens[n-1] != simEOSToken || len(strings.Fields(r.text)) != n-1 {
				t.Fatalf("prompt %d: stopped with token ids ending %d and %d words for %d tokens; want the EOS token %d last and one word per other token",
					i, r.tokens[n-1], len(strings.Fields(r.text)), n, simEOSToken)
			}
			stopped++
		case r.res.FinishReason == FinishLength && n == maxTokens:
		default:
			t.Fatalf("prompt %d: finish %q after %d of %d tokens", i, r.res.FinishReason, n, maxTokens)
		}
	}
	// EOS comes with probability 1/48 per token after min_tokens: about
	// 87% of 100-token runs (43.5 of 50, sd 2.4) stop early. The text is a
	// function of the prompt, so the count is fixed; the bound only says
	// the odds are what the comment claims.
	if stopped < 36 || stopped == 50 {
		t.Fatalf("%d of 50 prompts finished with stop before max_tokens; want about 43", stopped)
	}
}

// stopCase finds a prompt whose unstopped text has a word in its middle and
// returns the prompt, the text and that word as the stop string.
func stopCase(t *testing.T, e *SimEngine, params messages.SamplingParams) (p []uint32, text, stop string) {
	t.Helper()
	for i := range 100 {
		p = prompt(1000+i, 50)
		r := generate(t.Context(), e, EngineRequest{PromptTokens: p, Params: params})
		if r.err != nil {
			t.Fatal(r.err)
		}
		words := strings.Fields(r.text)
		w := words[len(words)/2]
		if len(w) < 3 { // skip short words such as "a" that hide in others
			continue
		}
		return p, r.text, w
	}
	t.Fatal("no prompt with a usable stop word")
	return nil, "", ""
}

func TestSimEngineStopStrings(t *testing.T) {
	ctx := t.Context()
	params := messages.SamplingParams{MaxTokens: 60, IgnoreEOS: true, Seed: seed(3)}
	instant := newSim(t, SimConfig{})
	p, full, stop := stopCase(t, instant, params)
	cut := strings.Index(full, stop)
	want := full[:cut]
	t.Logf("stop %q in %q", stop, full)

	stopParams := params
	stopParams.Stop = []string{"zzz-never", stop}
	r := generate(ctx, instant, EngineRequest{PromptTokens: p, Params: stopParams})
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.text != want {
		t.Fatalf("with stop %q:\n got %q\nwant %q", stop, r.text, want)
	}
	if r.res.FinishReason != FinishStop || r.res.StopReason != stop {
		t.Errorf("finish = %q, stop reason %q; want %q, %q", r.res.FinishReason, r.res.StopReason, FinishStop, stop)
	}
	if r.res.CompletionTokens >= params.MaxTokens {
		t.Errorf("%d completion tokens: the stop string did not end the generation", r.res.CompletionTokens)
	}

	// Streaming: chunks come one decode step at a time.
	streaming := newSim(t, SimConfig{Profile: SimProfile{DecodePerToken: time.Microsecond}, TimeScale: 1})
	s := generate(ctx, streaming, EngineRequest{PromptTokens: p, Params: stopParams})
	if s.err != nil {
		t.Fatal(s.err)
	}
	if len(s.chunks) < 2 {
		t.Fatalf("streaming engine sent %d chunks", len(s.chunks))
	}
	if s.text != r.text || s.res != r.res {
		t.Errorf("streamed %q %+v, non-streamed %q %+v", s.text, s.res, r.text, r.res)
	}
	for i, c := range s.chunks {
		if strings.Contains(c.Text, stop) {
			t.Errorf("chunk %d %q contains the stop string", i, c.Text)
		}
	}
	if strings.Contains(s.text, stop) {
		t.Errorf("streamed text %q contains the stop string %q", s.text, stop)
	}

	// Without a stop string the streamed chunks also add up to the whole text.
	u := generate(ctx, streaming, EngineRequest{PromptTokens: p, Params: params})
	if u.err != nil || u.text != full || len(u.chunks) != params.MaxTokens {
		t.Errorf("unstopped stream: %d chunks, %q, %v; want %d chunks of %q", len(u.chunks), u.text, u.err, params.MaxTokens, full)
	}
}

func TestSimEngineStopStringAcrossChunks(t *testing.T) {
	// A stop string of two words spans two decode steps: the first word must
	// be held back, never streamed.
	ctx := t.Context()
	params := messages.SamplingParams{MaxTokens: 60, IgnoreEOS: true}
	instant := newSim(t, SimConfig{})
	p := prompt(5, 40)
	full := generate(ctx, instant, EngineRequest{PromptTokens: p, Params: params}).text
	words := strings.Fields(full)
	stop := words[30] + " " + words[31]
	params.Stop = []string{stop}
	want := full[:strings.Index(full, stop)]
	streaming := newSim(t, SimConfig{Profile: SimProfile{DecodePerToken: time.Microsecond}, TimeScale: 1})
	for name, e := range map[string]*SimEngine{"instant": instant, "streaming": streaming} {
		r := generate(ctx, e, EngineRequest{PromptTokens: p, Params: params})
		if r.err != nil || r.text != want || r.res.FinishReason != FinishStop {
			t.Errorf("%s: %q %+v %v, want %q", name, r.text, r.res, r.err, want)
		}
		for i, c := range r.chunks {
			if strings.Contains(c.Text, stop) {
				t.Errorf("%s: chunk %d %q contains the stop string", name, i, c.Text)
			}
		}
		// include_stop_str_in_output: the text ends with the whole stop
		// string.
		inc := params
		inc.IncludeStopStr = true
		r = generate(ctx, e, EngineRequest{PromptTokens: p, Params: inc})
		if r.err != nil || r.text != want+stop || r.res.FinishReason != FinishStop || r.res.StopReason != stop {
			t.Errorf("%s, stop string included: %q %+v %v, want %q", name, r.text, r.res, r.err, want+stop)
		}
	}
}

func TestSimEnginePrefilledOnce(t *testing.T) {
	ctx := t.Context()
	for name, cfg := range map[string]SimConfig{
		"instant":   {},
		"streaming": {Profile: SimProfile{PrefillPerToken: time.Microsecond, DecodePerToken: time.Microsecond}, TimeScale: 1},
	} {
		t.Run(name, func(t *testing.T) {
			e := newSim(t, cfg)
			r := generate(ctx, e, EngineRequest{PromptTokens: prompt(1, 64), Params: messages.SamplingParams{MaxTokens: 10, IgnoreEOS: true}})
			if r.err != nil {
				t.Fatal(r.err)
			}
			if r.prefilled != 1 || !r.prefilledBeforeChunk || len(r.chunks) == 0 {
				t.Errorf("prefilled called %d times, before the first chunk: %v, %d chunks", r.prefilled, r.prefilledBeforeChunk, len(r.chunks))
			}
			// A nil prefilled callback is allowed.
			if _, err := e.Generate(ctx, EngineRequest{PromptTokens: prompt(1, 8)}, nil, func(Chunk) error { return nil }); err != nil {
				t.Error(err)
			}
		})
	}
}

func TestSimEngineEmitErrorStops(t *testing.T) {
	e := newSim(t, SimConfig{Profile: SimProfile{DecodePerToken: time.Microsecond}, TimeScale: 1})
	errStop := errors.New("client gone")
	calls := 0
	res, err := e.Generate(t.Context(), EngineRequest{PromptTokens: prompt(1, 8), Params: messages.SamplingParams{MaxTokens: 50, IgnoreEOS: true}},
		nil, func(Chunk) error {
			calls++
			if calls == 3 {
				return errStop
			}
			return nil
		})
	if !errors.Is(err, errStop) || calls != 3 || res.CompletionTokens != 3 {
		t.Errorf("Generate = %+v, %v after %d emits; want the emit error after 3", res, err, calls)
	}
}

func TestSimEngineCancel(t *testing.T) {
	// Every modelled step takes an hour: only cancellation can end them.
	slow := SimConfig{Profile: SimProfile{PrefillPerToken: time.Hour, DecodePerToken: time.Hour}, TimeScale: 1}
	tests := []struct {
		name string
		// cancelAt: "before" the call, or "decode" (from the prefilled
		// callback, so during the first decode step).
		cancelAt string
		profile  SimProfile
	}{
		{"before start", "before", slow.Profile},
		{"during decode", "decode", SimProfile{DecodePerToken: time.Hour}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newSim(t, SimConfig{Profile: tt.profile, TimeScale: 1})
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			if tt.cancelAt == "before" {
				cancel()
			}
			start := time.Now()
			_, err := e.Generate(ctx, EngineRequest{PromptTokens: prompt(1, 10), Params: messages.SamplingParams{MaxTokens: 5}},
				func() {
					if tt.cancelAt == "decode" {
						cancel()
					}
				}, func(Chunk) error { return nil })
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("Generate after cancel = %v, want context.Canceled", err)
			}
			if d := time.Since(start); d > 10*time.Second {
				t.Errorf("Generate took %s to notice cancellation", d)
			}
		})
	}

	t.Run("during prefill and while waiting for the prefill slot", func(t *testing.T) {
		e := newSim(t, slow)
		ctx, cancel := context.WithCancel(t.Context())
		errs := make(chan error, 2)
		for range 2 { // one prefills for hours, the other waits for the slot
			go func() {
				_, err := e.Generate(ctx, EngineRequest{PromptTokens: prompt(1, 10)}, nil, func(Chunk) error { return nil })
				errs <- err
			}()
		}
		cancel()
		for range 2 {
			select {
			case err := <-errs:
				if !errors.Is(err, context.Canceled) {
					t.Errorf("Generate = %v, want context.Canceled", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("Generate did not return after cancel")
			}
		}
	})
}

func TestSimEnginePrefillSlotReleasedAfterCancel(t *testing.T) {
	e := newSim(t, SimConfig{Profile: SimProfile{PrefillPerToken: time.Hour}, TimeScale: 1})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := e.Generate(ctx, EngineRequest{PromptTokens: prompt(1, 10)}, nil, func(Chunk) error { return nil })
		done <- err
	}()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Generate = %v", err)
	}
	// An empty prompt prefills in no time, but still needs the slot: if the
	// cancelled request had kept it, this would block until the test times out.
	r := generate(t.Context(), e, EngineRequest{Params: messages.SamplingParams{MaxTokens: 2, IgnoreEOS: true}})
	if r.err != nil || r.res.CompletionTokens != 2 {
		t.Errorf("after a cancelled prefill: %+v, %v", r.res, r.err)
	}
}

func TestSimEnginePrefillIsFCFS(t *testing.T) {
	// Two requests of 1000 uncached tokens at 100 µs per token: each prefill
	// takes at least 100 ms. Prefills run one at a time, so the later of the
	// two prefilled callbacks comes at least 200 ms after both started. If
	// they overlapped it would come after about 100 ms. Timers never fire
	// early, so this lower bound cannot flake.
	const (
		tokens   = 1000
		perToken = 100 * time.Microsecond
		each     = tokens * perToken
	)
	e := newSim(t, SimConfig{Profile: SimProfile{PrefillPerToken: perToken, LoadPerToken: 0}, TimeScale: 1})
	start := time.Now()
	var (
		wg        sync.WaitGroup
		mu        sync.Mutex
		prefilled []time.Duration
	)
	for i := range 2 {
		wg.Go(func() {
			_, err := e.Generate(t.Context(), EngineRequest{ReqID: fmt.Sprint(i), PromptTokens: prompt(i, tokens),
				Params: messages.SamplingParams{MaxTokens: 1, IgnoreEOS: true}},
				func() {
					mu.Lock()
					prefilled = append(prefilled, time.Since(start))
					mu.Unlock()
				}, func(Chunk) error { return nil })
			if err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if len(prefilled) != 2 {
		t.Fatalf("%d prefilled callbacks", len(prefilled))
	}
	first, second := min(prefilled[0], prefilled[1]), max(prefilled[0], prefilled[1])
	if first < each {
		t.Errorf("first prefill done after %s, shorter than its %s", first, each)
	}
	if second < 2*each {
		t.Errorf("second prefill done after %s: prefills overlapped (want >= %s for two in a row)", second, 2*each)
	}

	// Cached tokens are loaded at LoadPerToken instead of prefilled: a fully
	// cached prompt with free loads finishes well before one prefill.
	e2 := newSim(t, SimConfig{Profile: SimProfile{PrefillPerToken: time.Hour}, TimeScale: 1})
	r := generate(t.Context(), e2, EngineRequest{PromptTokens: prompt(1, 10), CachedTokens: 10, Params: messages.SamplingParams{MaxTokens: 1}})
	if r.err != nil || r.prefilled != 1 {
		t.Errorf("fully cached prompt: %v, prefilled %d", r.err, r.prefilled)
	}
}

func TestSimEngineString(t *testing.T) {
	if got := newSim(t, SimConfig{TimeScale: 0.5}).String(); got != "sim(time_scale=0.5)" {
		t.Errorf("String() = %q", got)
	}
}

// TestSimPrefillTime: the slot holds load + prefill, in wall time; a load
// the rank already spent reading (a copy over the bus) counts against the
// model's load, never against the prefill.
func TestSimPrefillTime(t *testing.T) {
	e, err := NewSimEngine(SimConfig{Profile: SimProfile{PrefillPerToken: 60 * time.Microsecond, LoadPerToken: 5 * time.Microsecond,
		RemoteLoadPerToken: 15 * time.Microsecond}, TimeScale: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	prompt := make([]uint32, 1000)
	for _, tc := range []struct {
		name           string
		cached, remote int
		loadTime       time.Duration
		want           time.Duration
	}{
		{"nothing cached", 0, 0, 0, 30 * time.Millisecond},                              // 1000 × 60 µs × 0.5
		{"local hits", 600, 0, 0, (1500 + 12000) * time.Microsecond},                    // 600 × 5 + 400 × 60, halved
		{"remote hits", 600, 400, 0, (500 + 3000 + 12000) * time.Microsecond},           // 200 × 5 + 400 × 15 + 400 × 60, halved
		{"load partly spent", 600, 400, 1500 * time.Microsecond, 14 * time.Millisecond}, // 3.5 ms of load, 1.5 ms spent
		{"load all spent", 600, 400, time.Second, 12 * time.Millisecond},                // prefill only
	} {
		got := e.prefillTime(EngineRequest{PromptTokens: prompt, CachedTokens: tc.cached, RemoteTokens: tc.remote, LoadTime: tc.loadTime})
		if got != tc.want {
			t.Errorf("%s: prefillTime = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestSimPrefillEnd: the prefill queue runs in modelled time. A prefill
// starts when it arrived or when the previous one ended in the model,
// whichever is later — never when the host got round to waking it.
func TestSimPrefillEnd(t *testing.T) {
	t0 := time.Unix(1000, 0)
	ms := time.Millisecond
	for _, tc := range []struct {
		name            string
		freeAt, arrived time.Time
		want            time.Time
	}{
		{"idle group", time.Time{}, t0, t0.Add(10 * ms)},
		{"previous ended before it arrived", t0.Add(-5 * ms), t0, t0.Add(10 * ms)},
		{"queued behind a prefill", t0.Add(30 * ms), t0, t0.Add(40 * ms)},
	} {
		if got := prefillEnd(tc.freeAt, tc.arrived, 10*ms); !got.Equal(tc.want) {
			t.Errorf("%s: prefillEnd = %v, want %v", tc.name, got.Sub(t0), tc.want.Sub(t0))
		}
	}
}

// TestSimEngineFirstTokenAtPrefillEnd: the prefill yields the first token,
// as vLLM's does; only later tokens wait for a decode step. With decode
// steps of an hour, the first chunk still arrives, and the second never
// does before the request is cancelled.
func TestSimEngineFirstTokenAtPrefillEnd(t *testing.T) {
	e := newSim(t, SimConfig{Profile: SimProfile{DecodePerToken: time.Hour}, TimeScale: 1})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var chunks []Chunk
	res, err := e.Generate(ctx, EngineRequest{PromptTokens: prompt(1, 10), Params: messages.SamplingParams{MaxTokens: 3, IgnoreEOS: true}},
		nil, func(c Chunk) error {
			chunks = append(chunks, c)
			cancel() // the second token would take an hour
			return nil
		})
	if !errors.Is(err, context.Canceled) || len(chunks) != 1 || len(chunks[0].TokenIDs) != 1 || res.CompletionTokens != 1 {
		t.Errorf("Generate = %+v, %v with %d chunks; want one chunk of one token, then the cancellation", res, err, len(chunks))
	}
}

// TestSimEngineStopTokenIDs: vLLM's stop_token_ids end the answer at the
// first such token once min_tokens are out: finish_reason stop, the id as
// stop_reason, the token counted and among the ids, its text left out
// unless include_stop_str_in_output. The sim ignored them: the answer ran
// on to max_tokens.
func TestSimEngineStopTokenIDs(t *testing.T) {
	ctx := t.Context()
	params := messages.SamplingParams{MaxTokens: 40, IgnoreEOS: true}
	p := prompt(7, 40)
	for name, e := range map[string]*SimEngine{
		"instant":   newSim(t, SimConfig{}),
		"streaming": newSim(t, SimConfig{Profile: SimProfile{DecodePerToken: time.Microsecond}, TimeScale: 1}),
	} {
		full := generate(ctx, e, EngineRequest{PromptTokens: p, Params: params})
		words := strings.Fields(full.text)
		if full.err != nil || len(full.tokens) != 40 || len(words) != 40 {
			t.Fatalf("%s: %d tokens, %d words, %v", name, len(full.tokens), len(words), full.err)
		}
		// The first token from the 6th on that was not generated before.
		k := 5
		for slices.Contains(full.tokens[:k], full.tokens[k]) {
			k++
		}
		stopID := full.tokens[k]
		want := strings.Join(words[:k], " ")
		for _, tc := range []struct {
			name string
			edit func(*messages.SamplingParams)
			text string
			n    int
			stop bool
		}{
			{"stops", func(sp *messages.SamplingParams) {}, want, k + 1, true},
			{"included", func(sp *messages.SamplingParams) { sp.IncludeStopStr = true }, want + " " + words[k], k + 1, true},
			// A long list is looked up, not scanned; same answer.
			{"long list", func(sp *messages.SamplingParams) {
				for id := uint32(1 << 20); id < 1<<20+100; id++ {
					sp.StopTokenIDs = append(sp.StopTokenIDs, id)
				}
			}, want, k + 1, true},
			// Not before min_tokens: the answer runs on (to the token's next
			// occurrence or max_tokens).
			{"min_tokens", func(sp *messages.SamplingParams) { sp.MinTokens = 40 }, strings.TrimSpace(full.text), 40, false},
			// As the max_tokens-th token it ends the answer by length, its
			// text kept (vLLM checks the length first).
			{"last token", func(sp *messages.SamplingParams) { sp.MaxTokens = k + 1 }, want + " " + words[k], k + 1, false},
		} {
			sp := params
			sp.StopTokenIDs = messages.TokenIDs{stopID}
			tc.edit(&sp)
			r := generate(ctx, e, EngineRequest{PromptTokens: p, Params: sp})
			if r.err != nil || strings.TrimSpace(r.text) != tc.text || r.res.CompletionTokens != tc.n || len(r.tokens) != tc.n {
				t.Errorf("%s, %s: %q, %d tokens (%d ids), %v; want %q, %d tokens", name, tc.name, r.text, r.res.CompletionTokens, len(r.tokens), r.err, tc.text, tc.n)
			}
			if tc.stop {
				if r.res.FinishReason != FinishStop || r.res.StopToken == nil || *r.res.StopToken != stopID || r.tokens[len(r.tokens)-1] != stopID {
					t.Errorf("%s, %s: %+v; want finish stop by token %d, the last id", name, tc.name, r.res, stopID)
				}
			} else if r.res.FinishReason != FinishLength || r.res.StopToken != nil {
				t.Errorf("%s, %s: %+v; want finish length, no stop token", name, tc.name, r.res)
			}
		}
	}
}
