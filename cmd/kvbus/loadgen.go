package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	neturl "net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/internal/quantile"
)

// loadgenCmd drives an OpenAI-compatible server over HTTP as wrk would:
// --concurrency clients, each sending its next request the moment the
// previous answer ended, for --duration; it prints req/s and latency
// percentiles (`make bench-http` runs it against the real binary). A client
// whose request failed backs off before its next one (5 ms doubling to 1 s,
// reset by a success), so a wrong key, model or URL does not flood a shared
// server with errors. At the end of --duration no request is started; those
// in flight get --grace to finish and are counted.
type loadgenCmd struct {
	URLs        []string      `name:"url" default:"http://127.0.0.1:8000" help:"Base URL of the server (kvbus's frontend, or any OpenAI-compatible server), http:// or https://; several, comma-separated, spread the clients over them round-robin."`
	Concurrency int           `name:"concurrency" short:"c" default:"16" help:"Concurrent clients."`
	Duration    time.Duration `name:"duration" short:"d" default:"8s" help:"How long to start requests."`
	Grace       time.Duration `name:"grace" default:"5s" help:"At the end of --duration, how long the requests in flight may take to finish (they are counted); those still running then are cancelled and reported as cut."`
	Stream      bool          `name:"stream" help:"Stream the answers (SSE); latency is to the last chunk."`
	Leave       bool          `name:"leave" help:"With --stream: each client goes away once the first text of its answer arrives (latency is to that chunk), as clients that give up do: measures what abandoned requests cost the server."`
	Model       string        `name:"model" default:"kvbus-sim" help:"Model name sent."`
	MaxTokens   int           `name:"max-tokens" positive:"" default:"8" help:"max_tokens of every request (with ignore_eos)."`
	Prompt      string        `name:"prompt" default:"Write one short sentence about caches and prefixes, please." help:"The user message."`
	APIKey      string        `name:"api-key" env:"KVBUS_API_KEY,OPENAI_API_KEY" help:"Send Authorization: Bearer <key>, for a server run with --api-key (never printed)."`
	JSON        bool          `name:"json" help:"Print the result as JSON."`

	// out receives the result; nil means standard output (tests set it).
	out io.Writer
}

// Back-off of a client after a failed request: from loadgenMinBackoff,
// doubling, to loadgenMaxBackoff; a success resets it.
const (
	loadgenMinBackoff = 5 * time.Millisecond
	loadgenMaxBackoff = time.Second
	// loadgenRequestTimeout bounds one request.
	loadgenRequestTimeout = time.Minute
)

// loadResult is what a load run measured.
type loadResult struct {
	Concurrency int  `json:"concurrency"`
	Stream      bool `json:"stream"`
	Leave       bool `json:"leave,omitempty"`
	// Requests were answered in full (200), Errors failed; both include
	// the requests that finished within the grace after --duration.
	Requests int `json:"requests"`
	Errors   int `json:"errors"`
	// Cut were still in flight when the grace ended (or the run was
	// interrupted): cancelled, and in neither Requests nor Errors.
	Cut int `json:"cut"`
	// Seconds is the measured window: from the start of the first request
	// to the end of the last one counted (--duration, plus the tail of the
	// requests in flight at its end); RPS is Requests / Seconds.
	Seconds float64 `json:"seconds"`
	RPS     float64 `json:"rps"`
	P50Ms   float64 `json:"p50_ms"`
	P99Ms   float64 `json:"p99_ms"`
	// FirstError is the first failed request's error, when one failed.
	FirstError string `json:"first_error,omitempty"`
}

// Validate refuses what cannot make a run (kong calls it after parsing, so
// a bad --url is refused before any request).
func (c *loadgenCmd) Validate() error {
	if c.Concurrency < 1 {
		return fmt.Errorf("--concurrency must be at least 1 (got %d)", c.Concurrency)
	}
	if c.Duration <= 0 {
		return fmt.Errorf("--duration must be positive (got %s), e.g. 8s", c.Duration)
	}
	if c.Leave && !c.Stream {
		return errors.New("--leave needs --stream: a client leaves a streamed answer once its first text arrived")
	}
	if c.Grace < 0 {
		return fmt.Errorf("--grace must be 0 or more (got %s): how long requests in flight at the end may take, e.g. 5s", c.Grace)
	}
	_, err := c.endpoints()
	return err
}

// endpoints are the chat completions URLs of --url, one per server.
func (c *loadgenCmd) endpoints() ([]string, error) {
	if len(c.URLs) == 0 {
		return nil, errors.New("--url: give at least one server, such as http://127.0.0.1:8000")
	}
	out := make([]string, 0, len(c.URLs))
	for _, raw := range c.URLs {
		u, err := neturl.Parse(strings.TrimSpace(raw))
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("--url %q is not an http:// or https:// URL with a host: give the server's base URL, such as http://127.0.0.1:8000",
				bus.RedactURLs(raw))
		}
		out = append(out, strings.TrimRight(u.String(), "/")+"/v1/chat/completions")
	}
	return out, nil
}

func (c *loadgenCmd) Run(ctx context.Context) error {
	r, err := c.measure(ctx)
	if err != nil {
		return err
	}
	out := c.out
	if out == nil {
		out = os.Stdout
	}
	if err := c.report(out, r); err != nil {
		return err
	}
	switch {
	case r.Requests > 0:
		return nil
	case r.Errors > 0:
		return fmt.Errorf("no request succeeded (%d failed; the first: %s): is the server at %s up, does it serve --model %q, and does it want --api-key?",
			r.Errors, r.FirstError, bus.RedactURLs(strings.Join(c.URLs, ",")), c.Model)
	case r.Cut > 0:
		return fmt.Errorf("no request finished within --duration %s and --grace %s (%d cut): raise them, or lower --max-tokens", c.Duration, c.Grace, r.Cut)
	}
	return errors.New("no request was sent: the run was interrupted")
}

// report prints r: a line (and the cut requests and first error on lines
// of their own), or JSON with --json.
func (c *loadgenCmd) report(out io.Writer, r loadResult) error {
	if c.JSON {
		return json.NewEncoder(out).Encode(r)
	}
	left := ""
	if r.Leave {
		left = " (left at the first text)"
	}
	if _, err := fmt.Fprintf(out, "c=%d stream=%v: %d requests%s (%d errors) in %.1fs: %.0f req/s, p50 %.2f ms, p99 %.2f ms\n",
		r.Concurrency, r.Stream, r.Requests, left, r.Errors, r.Seconds, r.RPS, r.P50Ms, r.P99Ms); err != nil {
		return err
	}
	if r.Cut > 0 {
		if _, err := fmt.Fprintf(out, "cut: %d requests still in flight %s after the end of --duration were cancelled (not counted; raise --grace to let them finish)\n",
			r.Cut, c.Grace); err != nil {
			return err
		}
	}
	if r.Errors > 0 {
		if _, err := fmt.Fprintf(out, "first error: %s\n", r.FirstError); err != nil {
			return err
		}
	}
	return nil
}

// statusError is a request the server answered with another status than
// 200, or a 200 stream it ended with an error event (inStream).
type statusError struct {
	code     int
	msg      string
	inStream bool
}

func (e *statusError) Error() string {
	if e.inStream {
		return "error event in the stream: " + e.msg
	}
	return fmt.Sprintf("status %d: %s", e.code, e.msg)
}

// measure runs the load and returns what it measured.
func (c *loadgenCmd) measure(ctx context.Context) (loadResult, error) {
	if err := c.Validate(); err != nil {
		return loadResult{}, err
	}
	urls, err := c.endpoints()
	if err != nil {
		return loadResult{}, err
	}
	body, err := json.Marshal(map[string]any{"model": c.Model, "max_tokens": c.MaxTokens, "ignore_eos": true, "stream": c.Stream,
		"messages": []map[string]string{{"role": "user", "content": c.Prompt}}})
	if err != nil {
		return loadResult{}, err
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: c.Concurrency, MaxConnsPerHost: c.Concurrency}, Timeout: loadgenRequestTimeout}
	defer client.CloseIdleConnections()
	// sending ends at --duration: no request is started after it. inflight
	// ends --grace later (or with ctx): the requests still running then
	// are cancelled.
	sending, stopSending := context.WithTimeout(ctx, c.Duration)
	defer stopSending()
	inflight, cancelInflight := context.WithCancel(ctx)
	defer cancelInflight()
	graceOver := make(chan struct{})
	go func() {
		defer close(graceOver)
		<-sending.Done()
		t := time.NewTimer(c.Grace)
		defer t.Stop()
		select {
		case <-t.C:
			cancelInflight()
		case <-inflight.Done():
		}
	}()
	var (
		mu        sync.Mutex
		latencies []time.Duration
		errs, cut int
		firstErr  error
		lastEnd   time.Time // the end of the last request counted
		wg        sync.WaitGroup
	)
	start := time.Now()
	for i := range c.Concurrency {
		url := urls[i%len(urls)]
		wg.Go(func() {
			var backoff time.Duration
			for sending.Err() == nil {
				t0 := time.Now()
				err := c.once(inflight, client, url, body)
				d := time.Since(t0)
				var se *statusError
				cancelled := err != nil && inflight.Err() != nil && !errors.As(err, &se)
				mu.Lock()
				if !cancelled {
					lastEnd = t0.Add(d)
				}
				switch {
				case cancelled:
					cut++
				case err != nil:
					errs++
					if firstErr == nil {
						firstErr = err
					}
				default:
					latencies = append(latencies, d)
				}
				mu.Unlock()
				if err == nil {
					backoff = 0
					continue
				}
				// Failed: wait before the next request, jittered so
				// that clients failing together do not retry together.
				backoff = min(max(2*backoff, loadgenMinBackoff), loadgenMaxBackoff)
				wait := backoff/2 + rand.N(backoff/2+1)
				t := time.NewTimer(wait)
				select {
				case <-t.C:
				case <-sending.Done():
					t.Stop()
				}
			}
		})
	}
	wg.Wait()
	// The window ends with the last request counted: the requests cut at
	// the end of --grace are not, and neither is the wait for them.
	elapsed := time.Since(start)
	if !lastEnd.IsZero() {
		elapsed = lastEnd.Sub(start)
	}
	cancelInflight()
	<-graceOver
	slices.Sort(latencies)
	q := func(p float64) float64 { return float64(quantile.NearestRank(latencies, p).Microseconds()) / 1000 }
	r := loadResult{Concurrency: c.Concurrency, Stream: c.Stream, Leave: c.Leave, Requests: len(latencies), Errors: errs, Cut: cut, Seconds: elapsed.Seconds(),
		RPS: float64(len(latencies)) / elapsed.Seconds(), P50Ms: q(0.5), P99Ms: q(0.99)}
	if firstErr != nil {
		r.FirstError = firstErr.Error()
	}
	return r, nil
}

// maxLoadgenEventBytes bounds one line of a streamed answer, as replay
// reads them.
const maxLoadgenEventBytes = 16 << 20

// once sends one request and reads its whole answer (with --leave, up to
// its first text, and closes the connection).
func (c *loadgenCmd) once(ctx context.Context, client *http.Client, url string, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if c.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.APIKey)
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
		_, _ = io.Copy(io.Discard, resp.Body)
		return &statusError{code: resp.StatusCode, msg: strings.TrimSpace(string(msg))}
	}
	if !c.Stream {
		_, err = io.Copy(io.Discard, resp.Body)
		return err
	}
	// A stream that failed after it began ends with an error event
	// (data: {"error": …}), then [DONE]: the request failed.
	var streamErr error
	sc := bufio.NewScanner(resp.Body)
	// One event is one chunk of the engine's (with logprobs, well above
	// bufio's 64 KiB); one message on the bus carries at most 8 MiB.
	sc.Buffer(make([]byte, 0, 64<<10), maxLoadgenEventBytes)
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.HasPrefix(line, []byte(`data: {"error"`)) && streamErr == nil {
			streamErr = &statusError{code: resp.StatusCode, msg: strings.TrimSpace(string(line[len("data: "):])), inStream: true}
		}
		if string(line) == "data: [DONE]" {
			return streamErr
		}
		if c.Leave && streamErr == nil && hasText(line) {
			return nil // the deferred Close drops the connection: the server sees the client go
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return io.ErrUnexpectedEOF
}

// hasText reports whether an SSE line is a chunk with text in a choice (a
// chat delta's content, or a completion's text).
func hasText(line []byte) bool {
	data, ok := bytes.CutPrefix(line, []byte("data: "))
	if !ok || !bytes.HasPrefix(data, []byte("{")) {
		return false
	}
	var chunk struct {
		Choices []struct {
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
			Text string `json:"text"`
		} `json:"choices"`
	}
	if json.Unmarshal(data, &chunk) != nil {
		return false
	}
	for _, ch := range chunk.Choices {
		if ch.Delta.Content != "" || ch.Text != "" {
			return true
		}
	}
	return false
}
