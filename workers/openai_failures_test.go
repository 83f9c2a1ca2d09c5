package workers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/internal/logbuf"
	"github.com/kvbus/kvbus/messages"
)

// newLogLines returns a log buffer and a logger writing to it.
func newLogLines() (*logbuf.Buffer, *slog.Logger) {
	l := &logbuf.Buffer{}
	return l, slog.New(slog.NewTextHandler(l, nil))
}

// TestOpenAIGenerate5xxOfAHealthyEngine proves that a 500 or 503 the engine
// answers a request while its /health answers 200 is the request's own:
// it reaches the caller at once as an *EngineError with the engine's
// status and body (as vLLM answers its client), the engine is sent the
// request once, and its health does not move (no "not healthy" line).
// It failed before: the request marked the engine unhealthy, the health
// watcher found /health passing within a millisecond, and the request was
// sent again, about 40 times a second, until its deadline.
func TestOpenAIGenerate5xxOfAHealthyEngine(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusInternalServerError, http.StatusServiceUnavailable} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			t.Parallel()
			body := fmt.Sprintf(`{"error":{"message":"something in this request broke the model","type":"InternalServerError","code":%d}}`, status)
			stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(status)
				_, _ = io.WriteString(w, body)
			})
			logs, log := newLogLines()
			e := newOpenAI(t, OpenAIConfig{URL: stub.URL, HealthInterval: 20 * time.Millisecond, Logger: log})
			seen := watchHealth(t, e)
			awaitHealth(t, seen, true)
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			start := time.Now()
			r := generate(ctx, e, EngineRequest{ReqID: "r-5xx", SessionID: "s-5xx", Endpoint: messages.EndpointChat,
				Body: []byte(`{"messages":[{"role":"user","content":"hi"}],"stream":true}`)})
			took := time.Since(start)
			var ee *EngineError
			if !errors.As(r.err, &ee) || ee.Status != status || string(ee.Body) != body {
				t.Fatalf("Generate = %v after %s, want *EngineError{%d, the engine's body}", r.err, took.Round(time.Millisecond), status)
			}
			if errors.Is(r.err, ErrEngineUnavailable) {
				t.Errorf("error %v is ErrEngineUnavailable", r.err)
			}
			if took > 2*time.Second {
				t.Errorf("the 5xx took %s to reach the caller", took)
			}
			if n := len(stub.requests()); n != 1 {
				t.Errorf("the engine got the request %d times, want once", n)
			}
			if len(r.chunks) != 0 || r.prefilled != 0 {
				t.Errorf("%d chunks, prefilled %d times: want none", len(r.chunks), r.prefilled)
			}
			time.Sleep(100 * time.Millisecond) // a few polls: health stays as it was
			select {
			case h := <-seen:
				t.Errorf("health changed to %v after a request's 5xx", h)
			default:
			}
			if ok, why := e.Healthy(); !ok {
				t.Errorf("engine unhealthy after a request's 5xx: %s", why)
			}
			if n := len(logs.Lines("engine not healthy")); n != 0 {
				t.Errorf("%d \"engine not healthy\" lines", n)
			}
			if l := logs.Lines("req_id=r-5xx", "session_id=s-5xx", "relayed"); len(l) != 1 {
				t.Errorf("want one line naming the request and its 5xx, got %q", l)
			}
		})
	}
}

// TestOpenAIGenerateRetriesAreBounded proves that a request whose
// connection the engine keeps dropping, while its /health passes, is sent
// maxEngineAttempts times, with a backoff between the attempts, and then
// fails with ErrEngineUnavailable saying how often it was sent; the engine
// stays healthy.
func TestOpenAIGenerateRetriesAreBounded(t *testing.T) {
	t.Parallel()
	stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = conn.Close()
		}
	})
	e := healthyOpenAI(t, OpenAIConfig{URL: stub.URL, HealthInterval: 20 * time.Millisecond})
	seen := watchHealth(t, e)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	start := time.Now()
	r := generate(ctx, e, EngineRequest{ReqID: "r", Endpoint: messages.EndpointCompletions, Body: []byte(`{"prompt":"p"}`)})
	took := time.Since(start)
	if !errors.Is(r.err, ErrEngineUnavailable) || ctx.Err() != nil || !strings.Contains(r.err.Error(), "sent 3 times") {
		t.Fatalf("Generate = %v after %s, want ErrEngineUnavailable saying it was sent 3 times", r.err, took)
	}
	if n := len(stub.requests()); n != maxEngineAttempts {
		t.Errorf("the engine got the request %d times, want %d", n, maxEngineAttempts)
	}
	if min := engineRetryBackoff + 2*engineRetryBackoff; took < min {
		t.Errorf("%d attempts in %s, want a backoff of at least %s in all", maxEngineAttempts, took, min)
	}
	select {
	case h := <-seen:
		t.Errorf("health changed to %v: /health passed throughout", h)
	default:
	}
}

// TestOpenAIGenerateGivesUpOnADeadEngine proves that a request whose
// engine died (the connection is refused, /health too) does not wait for
// it beyond UnavailableWait: it fails with ErrEngineUnavailable naming the
// failure and the wait, so that the client hears at once instead of at
// its deadline. It failed before: the request waited until its context
// ended (the client's 60 s).
func TestOpenAIGenerateGivesUpOnADeadEngine(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close() // nothing listens there now
	const wait = 300 * time.Millisecond
	e := healthyOpenAI(t, OpenAIConfig{URL: url, UnavailableWait: wait})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	start := time.Now()
	r := generate(ctx, e, EngineRequest{ReqID: "r", Endpoint: messages.EndpointChat, Body: []byte(`{"messages":[]}`)})
	took := time.Since(start)
	if !errors.Is(r.err, ErrEngineUnavailable) || ctx.Err() != nil {
		t.Fatalf("Generate = %v after %s, want ErrEngineUnavailable", r.err, took)
	}
	for _, want := range []string{"POST /v1/chat/completions", "GET /health", "300ms"} {
		if !strings.Contains(r.err.Error(), want) {
			t.Errorf("error %q does not name %q", r.err, want)
		}
	}
	if took < wait || took > 5*time.Second {
		t.Errorf("Generate gave up after %s, want about %s", took, wait)
	}
	if ok, _ := e.Healthy(); ok {
		t.Error("engine healthy after the refused request")
	}
	if len(r.chunks) != 0 {
		t.Error("a chunk was emitted")
	}
}

// TestOpenAIWatchHealthWaitsForTheNextPoll proves that an engine a request
// found down (its failure confirmed by /health) stays unhealthy until the
// next regular poll, even if /health passes at once: the watcher does not
// poll again on the request's word, which made the engine's health flip
// back within a millisecond and the request be sent again at once.
func TestOpenAIWatchHealthWaitsForTheNextPoll(t *testing.T) {
	t.Parallel()
	stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {})
	e := newOpenAI(t, OpenAIConfig{URL: stub.URL, HealthInterval: time.Second})
	seen := watchHealth(t, e)
	awaitHealth(t, seen, true)
	e.setHealth(false, "a request found the engine down")
	awaitHealth(t, seen, false) // the cluster hears of it at once
	changed := time.Now()
	awaitHealth(t, seen, true)
	if took := time.Since(changed); took < 100*time.Millisecond {
		t.Errorf("healthy again %s after a request marked it down: the watcher polled at once", took)
	}
}

// TestOpenAIWarnsOnceOnTokenCountMismatch proves that when the engine
// counts a prompt kvbus sent as text with another number of tokens than
// kvbus's tokenizer did, the engine's log says so once, with both counts,
// the request and what to do; and that requests whose count the engine may
// rightly make otherwise (token ids sent as they are, several prompts,
// truncate_prompt_tokens, images) or that agree say nothing.
func TestOpenAIWarnsOnceOnTokenCountMismatch(t *testing.T) {
	t.Parallel()
	const answer = `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":209,"completion_tokens":1,"total_tokens":210}}`
	stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {
		if strings.Contains(r.Header.Get("Accept"), "event-stream") {
			sse(w, "data: "+answer, "", "data: [DONE]", "")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, answer)
	})
	logs, log := newLogLines()
	e := healthyOpenAI(t, OpenAIConfig{URL: stub.URL, Logger: log})
	ids := func(n int) []uint32 { return make([]uint32, n) }
	chat, completions := messages.EndpointChat, messages.EndpointCompletions
	send := func(id, endpoint, body string, tokens int) {
		t.Helper()
		r := generate(t.Context(), e, EngineRequest{ReqID: id, SessionID: "s-" + id, Endpoint: endpoint, Body: []byte(body),
			PromptTokens: ids(tokens), Params: messages.SamplingParams{MaxTokens: 1}})
		if r.err != nil {
			t.Fatalf("%s: %v", id, r.err)
		}
	}
	const warning = "tokenizer"
	send("same-count", chat, `{"messages":[{"role":"user","content":"hi"}]}`, 209)
	send("trace", "", "", 415) // token ids: the engine took kvbus's
	send("two-prompts", completions, `{"prompt":["a","b"]}`, 415)
	send("truncated", completions, `{"prompt":"a","truncate_prompt_tokens":10}`, 415)
	send("image", chat, `{"messages":[{"role":"user","content":[{"type":"text","text":"what?"},{"type":"image_url","image_url":{"url":"http://x/y.png"}}]}]}`, 415)
	if l := logs.Lines(warning); len(l) != 0 {
		t.Fatalf("warned on a request whose count may rightly differ: %q", l)
	}
	send("mismatch", chat, `{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"stream":true}`, 415)
	send("again", completions, `{"prompt":"hello"}`, 415)
	send("again-ids", completions, `{"prompt":[1,2,3]}`, 415)
	l := logs.Lines(warning)
	if len(l) != 1 {
		t.Fatalf("want one warning, got %q", l)
	}
	for _, want := range []string{"level=WARN", "req_id=mismatch", "session_id=s-mismatch", "kvbus_prompt_tokens=415",
		"engine_prompt_tokens=209", "--tokenizer engine"} {
		if !strings.Contains(l[0], want) {
			t.Errorf("warning %q lacks %q", l[0], want)
		}
	}
}

// TestOpenAIWatchHealthToleratesSlowAndFailedPolls proves that a healthy
// engine is not marked unhealthy by a /health that answers slower than the
// poll interval (within HealthTimeout) or by one or two failed polls: it
// takes engineHealthFailures failed polls in a row. An engine that refuses
// the connection is marked unhealthy by the first poll. It failed before:
// a poll timed out after the interval, and one failed poll marked the
// engine unhealthy, so vLLM's /health slowing down under load moved every
// request on it not yet answered.
func TestOpenAIWatchHealthToleratesSlowAndFailedPolls(t *testing.T) {
	t.Parallel()
	// healthServer answers /health after delay, 503 for the first
	// failFirst polls (or all of them with failFirst < 0), and counts them.
	type healthServer struct {
		url   string
		polls *atomic.Int32
	}
	start := func(t *testing.T, delay time.Duration, failFirst int32) healthServer {
		var polls atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n := polls.Add(1)
			select {
			case <-time.After(delay):
			case <-r.Context().Done():
				return
			}
			if failFirst < 0 || n <= failFirst {
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		}))
		t.Cleanup(srv.Close)
		return healthServer{srv.URL, &polls}
	}
	// stays runs the watcher until the engine was polled polls times and
	// fails if it was ever marked unhealthy.
	stays := func(t *testing.T, e *OpenAIEngine, s healthServer, polls int32) {
		seen := watchHealth(t, e)
		deadline := time.Now().Add(20 * time.Second)
		for s.polls.Load() < polls && time.Now().Before(deadline) {
			select {
			case ok := <-seen:
				if !ok {
					_, why := e.Healthy()
					t.Fatalf("marked unhealthy after %d polls: %s", s.polls.Load(), why)
				}
			case <-time.After(10 * time.Millisecond):
			}
		}
		if ok, why := e.Healthy(); !ok {
			t.Fatalf("unhealthy after %d polls: %s", s.polls.Load(), why)
		}
	}
	t.Run("slow", func(t *testing.T) {
		t.Parallel()
		s := start(t, 300*time.Millisecond, 0)
		e := healthyOpenAI(t, OpenAIConfig{URL: s.url, HealthInterval: 50 * time.Millisecond})
		stays(t, e, s, 5)
	})
	t.Run("two failed polls", func(t *testing.T) {
		t.Parallel()
		s := start(t, 0, 2)
		e := healthyOpenAI(t, OpenAIConfig{URL: s.url, HealthInterval: 50 * time.Millisecond})
		stays(t, e, s, 6)
	})
	t.Run("three failed polls", func(t *testing.T) {
		t.Parallel()
		s := start(t, 0, -1)
		e := healthyOpenAI(t, OpenAIConfig{URL: s.url, HealthInterval: 50 * time.Millisecond})
		seen := watchHealth(t, e)
		awaitHealth(t, seen, false)
		if n := s.polls.Load(); n < engineHealthFailures {
			t.Errorf("unhealthy after %d polls, want %d failed in a row", n, engineHealthFailures)
		}
		if _, why := e.Healthy(); !strings.Contains(why, "answered 503") || !strings.Contains(why, "3 polls in a row") {
			t.Errorf("reason %q does not name the status and the polls", why)
		}
	})
	t.Run("refused", func(t *testing.T) {
		t.Parallel()
		srv := httptest.NewServer(http.NotFoundHandler())
		url := srv.URL
		srv.Close()
		// One poll in the test's time: the first, as the watcher starts.
		e := healthyOpenAI(t, OpenAIConfig{URL: url, HealthInterval: time.Hour})
		awaitHealth(t, watchHealth(t, e), false)
	})
}

// TestOpenAIGenerateStreamErrorChunkKeepsItsStatus proves that an error
// event inside a stream (vLLM's create_streaming_error_response, a 200
// stream whose data is {"error": {..., "code": 400}}) is relayed with the
// status its code names, and 500 only when it names none: vLLM raises a
// request's validation errors inside the stream generator, before any
// output, with code 400. It failed before: every error chunk was a 500,
// which the OpenAI SDKs retry (twice by default) and which counted as the
// server's failure, for a request the engine refused as invalid.
func TestOpenAIGenerateStreamErrorChunkKeepsItsStatus(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name   string
		chunk  string
		status int
	}{
		{"code 400", `{"error":{"message":"max_tokens is too large","type":"BadRequestError","param":null,"code":400}}`, 400},
		{"code 503", `{"error":{"message":"overloaded","type":"ServiceUnavailableError","code":503}}`, 503},
		{"no code", `{"error":{"message":"EngineCore died","type":"InternalServerError"}}`, 500},
		{"code not a status", `{"error":{"message":"x","type":"X","code":"bad_request"}}`, 500},
		{"code out of range", `{"error":{"message":"x","type":"X","code":200}}`, 500},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {
				w.Header().Set("Content-Type", "text/event-stream")
				sse(w, "data: "+tt.chunk, "", "data: [DONE]", "")
			})
			e := healthyOpenAI(t, OpenAIConfig{URL: stub.URL})
			_, err := e.Generate(t.Context(), EngineRequest{ReqID: "r", Endpoint: messages.EndpointChat, Body: []byte(`{"stream":true}`)},
				nil, func(Chunk) error { return nil })
			var ee *EngineError
			if !errors.As(err, &ee) || errors.Is(err, ErrEngineUnavailable) {
				t.Fatalf("error %v, want an *EngineError", err)
			}
			if ee.Status != tt.status || string(ee.Body) != tt.chunk {
				t.Errorf("*EngineError{%d, %s}, want {%d, %s}", ee.Status, ee.Body, tt.status, tt.chunk)
			}
			if n := len(stub.requests()); n != 1 {
				t.Errorf("engine got %d requests, want 1", n)
			}
		})
	}
}

// TestOpenAIGenerateMalformedStreamIsNotRetried: a stream the engine will
// send the same way every time (an event above the line limit, a 200
// answer that is no event stream) ends the request at once with an error
// saying so. Before, either was taken for an engine that went away before
// any output: the request was sent three times, then failed with 503
// group_failed.
func TestOpenAIGenerateMalformedStreamIsNotRetried(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, body, want string
	}{
		{"event too long", "data: {\"choices\":[{\"text\":\"" + strings.Repeat("x", maxEngineLine) + "\"}]}\n\n", "exceeds"},
		{"not an event stream", `{"choices":[{"index":0,"text":"hi","finish_reason":"stop"}]}`, "not a stream of server-sent events"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {
				w.Header().Set("Content-Type", "text/event-stream")
				_, _ = io.WriteString(w, tt.body)
			})
			e := healthyOpenAI(t, OpenAIConfig{URL: stub.URL})
			_, err := e.Generate(t.Context(), EngineRequest{ReqID: "r", Endpoint: messages.EndpointChat, Body: []byte(`{"stream":true}`)},
				nil, func(Chunk) error { return nil })
			if err == nil || errors.Is(err, ErrEngineUnavailable) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one saying %q, not an engine unavailable", err, tt.want)
			}
			if n := len(stub.requests()); n != 1 {
				t.Errorf("engine got %d requests, want 1", n)
			}
		})
	}
}

// TestOpenAIGenerateEngineTimeoutSaysSo: a request the engine holds past
// --engine-timeout fails with ErrEngineTimeout, a deadline, naming the
// flag. Before, it was a bare context deadline, and the client was told its
// own request deadline had passed during generation.
func TestOpenAIGenerateEngineTimeoutSaysSo(t *testing.T) {
	t.Parallel()
	stub := newStubEngine(t, func(w http.ResponseWriter, r *http.Request, n int) {
		select {
		case <-r.Context().Done():
		case <-time.After(10 * time.Second):
		}
	})
	e := healthyOpenAI(t, OpenAIConfig{URL: stub.URL, Timeout: 200 * time.Millisecond})
	_, err := e.Generate(t.Context(), EngineRequest{ReqID: "r", Endpoint: messages.EndpointChat, Body: []byte(`{}`)},
		nil, func(Chunk) error { return nil })
	if !errors.Is(err, ErrEngineTimeout) || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "--engine-timeout (200ms)") {
		t.Fatalf("error %v, want ErrEngineTimeout naming --engine-timeout (200ms), a deadline", err)
	}
}
