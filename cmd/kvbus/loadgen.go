package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvbus/kvbus/internal/quantile"
)

// loadgenCmd drives an OpenAI-compatible server over HTTP as wrk would:
// --concurrency clients, each sending its next request the moment the
// previous answer ended, for --duration; it prints req/s and latency
// percentiles (`make bench-http` runs it against the real binary).
type loadgenCmd struct {
	URLs        []string      `name:"url" default:"http://127.0.0.1:8000" help:"Base URL of the server (kvbus's frontend, or any OpenAI-compatible server); several, comma-separated, spread the clients over them round-robin."`
	Concurrency int           `name:"concurrency" short:"c" default:"16" help:"Concurrent clients."`
	Duration    time.Duration `name:"duration" short:"d" default:"8s" help:"How long to send."`
	Stream      bool          `name:"stream" help:"Stream the answers (SSE); latency is to the last chunk."`
	Model       string        `name:"model" default:"kvbus-sim" help:"Model name sent."`
	MaxTokens   int           `name:"max-tokens" default:"8" help:"max_tokens of every request (with ignore_eos)."`
	Prompt      string        `name:"prompt" default:"Write one short sentence about caches and prefixes, please." help:"The user message."`
	JSON        bool          `name:"json" help:"Print the result as JSON."`
}

// loadResult is what a load run measured.
type loadResult struct {
	Concurrency int     `json:"concurrency"`
	Stream      bool    `json:"stream"`
	Requests    int     `json:"requests"`
	Errors      int     `json:"errors"`
	Seconds     float64 `json:"seconds"`
	RPS         float64 `json:"rps"`
	P50Ms       float64 `json:"p50_ms"`
	P99Ms       float64 `json:"p99_ms"`
	// FirstError is the first failed request's error, when one failed.
	FirstError string `json:"first_error,omitempty"`
}

func (c *loadgenCmd) Run(ctx context.Context) error {
	r, err := c.measure(ctx)
	if err != nil {
		return err
	}
	if c.JSON {
		if err := json.NewEncoder(os.Stdout).Encode(r); err != nil {
			return err
		}
	} else {
		fmt.Printf("c=%d stream=%v: %d requests (%d errors) in %.1fs: %.0f req/s, p50 %.2f ms, p99 %.2f ms\n",
			r.Concurrency, r.Stream, r.Requests, r.Errors, r.Seconds, r.RPS, r.P50Ms, r.P99Ms)
		if r.Errors > 0 {
			fmt.Printf("first error: %s\n", r.FirstError)
		}
	}
	if r.Requests == 0 && r.Errors > 0 {
		return fmt.Errorf("no request succeeded (%d failed; the first: %s): is the server at %s up, and does it serve --model %q?",
			r.Errors, r.FirstError, strings.Join(c.URLs, ","), c.Model)
	}
	return nil
}

// measure runs the load and returns what it measured.
func (c *loadgenCmd) measure(ctx context.Context) (loadResult, error) {
	if c.Concurrency < 1 || c.Duration <= 0 {
		return loadResult{}, fmt.Errorf("--concurrency must be >= 1 and --duration > 0")
	}
	body, err := json.Marshal(map[string]any{"model": c.Model, "max_tokens": c.MaxTokens, "ignore_eos": true, "stream": c.Stream,
		"messages": []map[string]string{{"role": "user", "content": c.Prompt}}})
	if err != nil {
		return loadResult{}, err
	}
	if len(c.URLs) == 0 {
		return loadResult{}, fmt.Errorf("--url: give at least one server")
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: c.Concurrency, MaxConnsPerHost: c.Concurrency}, Timeout: time.Minute}
	defer client.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, c.Duration)
	defer cancel()
	var (
		mu        sync.Mutex
		latencies []time.Duration
		errs      int
		firstErr  error
		wg        sync.WaitGroup
	)
	start := time.Now()
	for i := range c.Concurrency {
		url := strings.TrimRight(c.URLs[i%len(c.URLs)], "/") + "/v1/chat/completions"
		wg.Go(func() {
			for ctx.Err() == nil {
				t0 := time.Now()
				err := c.once(ctx, client, url, body)
				d := time.Since(t0)
				if ctx.Err() != nil {
					return // cut by the end of the run: not counted
				}
				mu.Lock()
				if err != nil {
					errs++
					if firstErr == nil {
						firstErr = err
					}
				} else {
					latencies = append(latencies, d)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	slices.Sort(latencies)
	q := func(p float64) float64 { return float64(quantile.NearestRank(latencies, p).Microseconds()) / 1000 }
	r := loadResult{Concurrency: c.Concurrency, Stream: c.Stream, Requests: len(latencies), Errors: errs, Seconds: elapsed.Seconds(),
		RPS: float64(len(latencies)) / elapsed.Seconds(), P50Ms: q(0.5), P99Ms: q(0.99)}
	if firstErr != nil {
		r.FirstError = firstErr.Error()
	}
	return r, nil
}

// once sends one request and reads its whole answer.
func (c *loadgenCmd) once(ctx context.Context, client *http.Client, url string, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
		_, _ = io.Copy(io.Discard, resp.Body)
		return fmt.Errorf("status %d: %s", resp.StatusCode, strings.TrimSpace(string(msg)))
	}
	if !c.Stream {
		_, err = io.Copy(io.Discard, resp.Body)
		return err
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if sc.Text() == "data: [DONE]" {
			return nil
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return io.ErrUnexpectedEOF
}
