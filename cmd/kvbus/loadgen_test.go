package main

import (
	"bytes"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alecthomas/kong"

	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/testenv"
)

// TestLoadgenCountsWhatTheServerServed: loadgen counts exactly the requests
// the frontend answered 200, streaming or not (the requests in flight at
// the end of the run finish and are counted; it missed one per client).
func TestLoadgenCountsWhatTheServerServed(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	served := 0.0
	for _, stream := range []bool{false, true} {
		lg := &loadgenCmd{URLs: []string{c.URL}, Concurrency: 4, Duration: time.Second, Grace: 5 * time.Second, Stream: stream, Model: c.Model, MaxTokens: 4, Prompt: "hello"}
		r, err := lg.measure(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Millisecond) // the cut requests end at the server
		now := testenv.CounterSum(t, c.Registry, "kvbus_frontend_requests_total", map[string]string{"status": "200"})
		got := now - served
		served = now
		if r.Errors != 0 || r.Cut != 0 || float64(r.Requests) != got || r.P50Ms <= 0 || r.P50Ms > r.P99Ms {
			t.Errorf("stream=%v: loadgen %+v, the frontend served %v", stream, r, got)
		}
	}
}

// TestLoadgenFailsWhenNothingSucceeds: a run where every request failed (a
// server that is down, a model it does not serve) exits non-zero and says
// why, where it printed "0 requests" and exited 0.
func TestLoadgenFailsWhenNothingSucceeds(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	lg := &loadgenCmd{URLs: []string{c.URL}, Concurrency: 2, Duration: 300 * time.Millisecond, Grace: 5 * time.Second, Model: "no-such-model", MaxTokens: 4, Prompt: "hello", out: io.Discard}
	err := lg.Run(t.Context())
	if err == nil || !strings.Contains(err.Error(), "status 404") || !strings.Contains(err.Error(), "no-such-model") {
		t.Errorf("Run = %v; want an error with the first failure (a 404 naming the model)", err)
	}
}

// TestLoadgenSendsTheAPIKey: against a frontend run with --api-key,
// loadgen's --api-key is sent as a bearer token and every request is
// served, where every one was a 401; without it the run fails saying so,
// and a wrong key is never printed.
func TestLoadgenSendsTheAPIKey(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{APIKey: "s3cret"})
	lg := &loadgenCmd{URLs: []string{c.URL}, Concurrency: 2, Duration: 300 * time.Millisecond, Grace: 5 * time.Second, Model: c.Model,
		MaxTokens: 4, Prompt: "hello", APIKey: "s3cret"}
	r, err := lg.measure(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if r.Requests == 0 || r.Errors != 0 {
		t.Errorf("with the key: %+v; want every request served", r)
	}
	for _, key := range []string{"", "wr0ng-key-do-not-print"} {
		var out bytes.Buffer
		for _, asJSON := range []bool{false, true} {
			lg := &loadgenCmd{URLs: []string{c.URL}, Concurrency: 1, Duration: 200 * time.Millisecond, Grace: 5 * time.Second, Model: c.Model,
				MaxTokens: 4, Prompt: "hello", APIKey: key, JSON: asJSON, out: &out}
			err := lg.Run(t.Context())
			if err == nil || !strings.Contains(err.Error(), "status 401") || !strings.Contains(err.Error(), "--api-key") {
				t.Errorf("key %q: Run = %v; want a failure naming the 401 and --api-key", key, err)
			}
			if key != "" && (strings.Contains(out.String(), key) || err != nil && strings.Contains(err.Error(), key)) {
				t.Errorf("the key was printed:\n%s\n%v", out.String(), err)
			}
		}
	}
}

// TestLoadgenAPIKeyFromTheEnvironment: --api-key is read from KVBUS_API_KEY,
// else from OPENAI_API_KEY (as the OpenAI clients read it).
func TestLoadgenAPIKeyFromTheEnvironment(t *testing.T) {
	parse := func() string {
		t.Helper()
		var c cli
		p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"), kong.Exit(func(int) {}))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := p.Parse([]string{"loadgen"}); err != nil {
			t.Fatal(err)
		}
		return c.Loadgen.APIKey
	}
	t.Setenv("KVBUS_API_KEY", "")
	_ = os.Unsetenv("KVBUS_API_KEY") // restored by Setenv at the end
	t.Setenv("OPENAI_API_KEY", "from-openai")
	if got := parse(); got != "from-openai" {
		t.Errorf("with OPENAI_API_KEY: --api-key = %q", got)
	}
	t.Setenv("KVBUS_API_KEY", "from-kvbus")
	if got := parse(); got != "from-kvbus" {
		t.Errorf("with both: --api-key = %q; want KVBUS_API_KEY's", got)
	}
}

// TestLoadgenBacksOffAfterFailures: a client whose requests fail waits
// before its next one (5 ms doubling to 1 s), where it sent thousands of
// 404s and 401s a second onto the server.
func TestLoadgenBacksOffAfterFailures(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{APIKey: "s3cret"})
	before := testenv.CounterSum(t, c.Registry, "kvbus_frontend_requests_total", map[string]string{"status": "404"})
	// A model the server does not serve: 404s, counted by the frontend.
	lg := &loadgenCmd{URLs: []string{c.URL}, Concurrency: 2, Duration: 1500 * time.Millisecond, Grace: 5 * time.Second,
		Model: "no-such-model", MaxTokens: 4, Prompt: "hello", APIKey: "s3cret"}
	r, err := lg.measure(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	served := testenv.CounterSum(t, c.Registry, "kvbus_frontend_requests_total", map[string]string{"status": "404"}) - before
	// Per client at most ~11 tries in 1.5 s (the waits, jittered to half,
	// add up to 1.5 s after 10 failures); the first error is reported.
	if r.Errors < 2 || r.Errors > 30 || float64(r.Errors) != served || !strings.Contains(r.FirstError, "status 404") {
		t.Errorf("404s: loadgen %+v, the frontend answered %v 404s; want 2 to 30 of each", r, served)
	}
	// No key: 401s.
	lg.Model, lg.APIKey = c.Model, ""
	if r, err = lg.measure(t.Context()); err != nil {
		t.Fatal(err)
	}
	if r.Errors < 2 || r.Errors > 30 || !strings.Contains(r.FirstError, "status 401") {
		t.Errorf("401s: loadgen %+v; want 2 to 30", r)
	}
}

// TestLoadgenReadsALongStreamedChunk: a streamed chunk longer than
// bufio's 64 KiB line (a chunk with top logprobs) is read, not counted a
// failed request ("token too long") the server answered whole.
func TestLoadgenReadsALongStreamedChunk(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write([]byte(`data: {"choices":[{"index":0,"text":"` + strings.Repeat("x", 200<<10) + `"}]}` + "\n\ndata: [DONE]\n\n"))
	}))
	defer srv.Close()
	lg := &loadgenCmd{URLs: []string{srv.URL}, Concurrency: 1, Stream: true, Model: "m", MaxTokens: 4, Prompt: "hello"}
	if err := lg.once(t.Context(), srv.Client(), srv.URL, []byte(`{}`)); err != nil {
		t.Fatalf("a 200 KiB chunk: %v", err)
	}
}

// TestLoadgenBackoffResetsOnSuccess: a success resets a client's back-off,
// so a server that fails every other request is still driven at speed.
func TestLoadgenBackoffResetsOnSuccess(t *testing.T) {
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if n.Add(1)%2 == 1 {
			http.Error(w, `{"error":{"message":"busy"}}`, http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte(`{"choices":[]}`))
	}))
	defer srv.Close()
	lg := &loadgenCmd{URLs: []string{srv.URL}, Concurrency: 1, Duration: 2 * time.Second, Grace: 5 * time.Second, Model: "m", MaxTokens: 4, Prompt: "hello"}
	r, err := lg.measure(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// Every wait is 2.5-5 ms; without the reset they would reach 1 s (a
	// dozen failures in 2 s).
	if r.Errors < 30 || r.Requests < r.Errors-1 || !strings.Contains(r.FirstError, "status 503") {
		t.Errorf("loadgen %+v; want 30 or more failures, each followed by a success", r)
	}
}

// TestLoadgenRefusesANonHTTPURL: a --url that is not http(s) is refused
// before any request, where each client spun on instant errors.
func TestLoadgenRefusesANonHTTPURL(t *testing.T) {
	for _, u := range []string{"ftp://127.0.0.1:8000", "localhost:8000", "http://", "127.0.0.1:8000", "htp://127.0.0.1:8000"} {
		start := time.Now()
		lg := &loadgenCmd{URLs: []string{u}, Concurrency: 1, Duration: 300 * time.Millisecond, Model: "m", MaxTokens: 4, Prompt: "hello"}
		_, err := lg.measure(t.Context())
		if err == nil || !strings.Contains(err.Error(), "http://") || time.Since(start) > 100*time.Millisecond {
			t.Errorf("--url %s: measure = %v after %s; want a refusal at once saying what a URL looks like", u, err, time.Since(start))
		}
		var c cli
		p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"), kong.Exit(func(int) {}))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := p.Parse([]string{"loadgen", "--url", u}); err == nil || !strings.Contains(err.Error(), "--url") {
			t.Errorf("kvbus loadgen --url %s parsed (%v); want it refused", u, err)
		}
	}
	for _, u := range []string{"http://127.0.0.1:8000", "https://example.com/", "HTTP://127.0.0.1"} {
		if _, err := (&loadgenCmd{URLs: []string{u}, Concurrency: 1, Duration: time.Second}).endpoints(); err != nil {
			t.Errorf("--url %s: %v", u, err)
		}
	}
}

// TestLoadgenLetsRequestsInFlightFinish: at the end of -d no request is
// started and those in flight finish and are counted, so loadgen's count
// is exactly the frontend's 200s and the frontend saw no client go away
// (it counted 499s loadgen never reported, and one more 200 than loadgen).
// With no grace they are cut, and reported as cut: the frontend's 499s.
func TestLoadgenLetsRequestsInFlightFinish(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{TimeScale: 1}) // ~10 ms per output token
	count := func(status string) float64 {
		return testenv.CounterSum(t, c.Registry, "kvbus_frontend_requests_total", map[string]string{"status": status})
	}
	for _, stream := range []bool{false, true} {
		ok0, gone0 := count("200"), count("499")
		lg := &loadgenCmd{URLs: []string{c.URL}, Concurrency: 3, Duration: time.Second, Grace: 5 * time.Second, Stream: stream,
			Model: c.Model, MaxTokens: 12, Prompt: "hello"}
		r, err := lg.measure(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond) // the frontend counts after its last write
		ok, gone := count("200")-ok0, count("499")-gone0
		if r.Errors != 0 || r.Cut != 0 || float64(r.Requests) != ok || gone != 0 {
			t.Errorf("stream=%v: loadgen %+v; the frontend served %v and saw %v clients go away", stream, r, ok, gone)
		}
		if r.Seconds < 1 || r.Seconds > 6 || math.Abs(r.RPS-float64(r.Requests)/r.Seconds) > 1e-9 {
			t.Errorf("stream=%v: measured %.3f s, %.1f req/s for %d requests; want the window from the first request to the last one's end",
				stream, r.Seconds, r.RPS, r.Requests)
		}

		// No grace: the requests in flight at the end are cut, and said
		// to be (in the JSON, or on a line of their own).
		ok0, gone0 = count("200"), count("499")
		lg.Grace, lg.MaxTokens, lg.JSON = 0, 40, stream // ~400 ms each
		if r, err = lg.measure(t.Context()); err != nil {
			t.Fatal(err)
		}
		// A cut request is a 499 at the frontend, or a 200 when its answer
		// was written just before the cancel reached the frontend.
		testenv.Eventually(t, 5*time.Second, "the frontend to count the cut requests", func() bool {
			return count("200")-ok0+count("499")-gone0 >= float64(r.Requests+r.Cut)
		})
		time.Sleep(300 * time.Millisecond)
		ok, gone = count("200")-ok0, count("499")-gone0
		if r.Errors != 0 || r.Cut < 1 || r.Cut > 3 || ok+gone != float64(r.Requests+r.Cut) || gone > float64(r.Cut) || gone < 1 {
			t.Errorf("stream=%v, no grace: loadgen %+v; the frontend served %v and saw %v clients go away", stream, r, ok, gone)
		}
		var out bytes.Buffer
		if err := lg.report(&out, r); err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf(`"cut":%d,`, r.Cut)
		if !stream {
			want = fmt.Sprintf("\ncut: %d requests still in flight 0s after the end of --duration were cancelled", r.Cut)
		}
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report does not say %q:\n%s", want, out.String())
		}
	}
}

// TestLoadgenCountsErrorEventsInAStream: a stream the server ended with an
// error event (a group that failed after the first chunk: 200, then
// data: {"error":…}, then [DONE]) is an error, as the frontend counts it
// (kvbus_frontend_requests_total under the error's status); loadgen
// counted it answered, and a run where every stream failed printed a full
// req/s and exited 0.
func TestLoadgenCountsErrorEventsInAStream(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n"+
			"data: {\"error\":{\"message\":\"the group failed\",\"type\":\"server_error\",\"code\":\"group_failed\"}}\n\n"+
			"data: [DONE]\n\n")
	}))
	defer srv.Close()
	lg := &loadgenCmd{URLs: []string{srv.URL}, Concurrency: 1, Duration: 200 * time.Millisecond, Grace: time.Second, Stream: true,
		Model: "m", MaxTokens: 4, Prompt: "hello", out: io.Discard}
	r, err := lg.measure(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if r.Requests != 0 || r.Errors < 1 || !strings.Contains(r.FirstError, "group_failed") {
		t.Errorf("loadgen %+v; want every stream counted an error, the first naming group_failed", r)
	}
	if err := lg.Run(t.Context()); err == nil || !strings.Contains(err.Error(), "no request succeeded") {
		t.Errorf("Run = %v; want it to fail: no stream succeeded", err)
	}
}

// TestLoadgenWindowEndsWithTheLastCountedRequest: the measured window ends
// with the last request counted, not with the grace that cut one that
// never ended: a server that hangs on one request made a 0.3 s run report
// 1.3 s, and req/s a quarter of what was served.
func TestLoadgenWindowEndsWithTheLastCountedRequest(t *testing.T) {
	var n atomic.Int64
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 { // the first request never ends: it is cut
			select {
			case <-r.Context().Done():
			case <-release:
			}
			return
		}
		_, _ = w.Write([]byte(`{"choices":[]}`))
	}))
	defer srv.Close()
	defer close(release)
	lg := &loadgenCmd{URLs: []string{srv.URL}, Concurrency: 2, Duration: 300 * time.Millisecond, Grace: time.Second, Model: "m", MaxTokens: 4, Prompt: "hello"}
	r, err := lg.measure(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if r.Cut != 1 || r.Requests < 1 || r.Seconds < 0.25 || r.Seconds > 0.8 || math.Abs(r.RPS-float64(r.Requests)/r.Seconds) > 1e-9 {
		t.Errorf("loadgen %+v; want 1 cut and the window to end with the last request served (~0.3 s), not the grace (1.3 s)", r)
	}
}

// TestLoadgenLeaveAbandonsEachRequest: with --leave each client goes away
// at the first text of its streamed answer, and the server ends every one
// of those requests as aborted by its client, none completed (400 tokens
// at the sim's real pace would take seconds); without --stream it is
// refused.
func TestLoadgenLeaveAbandonsEachRequest(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, TimeScale: 1})
	outcome := func(o string) float64 {
		return testenv.CounterSum(t, c.Registry, "kvbus_scheduler_requests_total", map[string]string{"outcome": o})
	}
	lg := &loadgenCmd{URLs: []string{c.URL}, Concurrency: 2, Duration: time.Second, Grace: 5 * time.Second, Stream: true, Leave: true,
		Model: c.Model, MaxTokens: 400, Prompt: "hello"}
	r, err := lg.measure(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if r.Requests < 2 || r.Errors != 0 || r.Cut != 0 || !r.Leave {
		t.Fatalf("%+v: want requests left at their first text, none failed or cut", r)
	}
	testenv.Eventually(t, 5*time.Second, "every request left ended aborted", func() bool { return outcome("aborted") == float64(r.Requests) })
	if got := outcome("completed"); got != 0 {
		t.Errorf("%v requests completed of %d left at their first text of 400 tokens", got, r.Requests)
	}
	if err := (&loadgenCmd{URLs: []string{c.URL}, Concurrency: 1, Duration: time.Second, Leave: true}).Validate(); err == nil || !strings.Contains(err.Error(), "--leave needs --stream") {
		t.Errorf("--leave without --stream: %v", err)
	}
}

// FuzzHasText: any line of a server's stream is read without a panic, and
// only a data line holding a JSON object can have text.
func FuzzHasText(f *testing.F) {
	for _, seed := range []string{
		`data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}`,
		`data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`,
		`data: {"choices":[{"text":"x"}]}`, `data: [DONE]`, `data: {"error":{"message":"x"}}`, `: ping`, ``, `data: {"choices":7}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, line []byte) {
		if hasText(line) && !bytes.HasPrefix(line, []byte("data: {")) {
			t.Errorf("hasText(%q) = true for a line that is no data line with an object", line)
		}
	})
}

func TestHasText(t *testing.T) {
	for line, want := range map[string]bool{
		`data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}`:                  true,
		`data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`: false,
		`data: {"choices":[{"text":"x"}]}`:                                          true,
		`data: [DONE]`:                                                              false,
		`data: {"choices":7}`:                                                       false,
	} {
		if got := hasText([]byte(line)); got != want {
			t.Errorf("hasText(%s) = %v, want %v", line, got, want)
		}
	}
}
