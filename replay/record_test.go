package replay_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

// publishRequests logs n requests with ids prefix-0… in the request log.
func publishRequests(t *testing.T, js jetstream.JetStream, prefix string, n int) {
	t.Helper()
	subj := messages.Subjects{}
	for i := range n {
		data, err := messages.Marshal(&messages.Request{RequestID: prefix + "-" + string(rune('a'+i)), Model: "m", FrontendID: "fe", PromptTokenIDs: []uint32{1, 2, 3}})
		if err != nil {
			t.Fatal(err)
		}
		testenv.Eventually(t, 10*time.Second, "a request logged", func() bool {
			_, err := js.Publish(t.Context(), subj.Request("m"), data)
			return err == nil
		})
	}
}

// requestLog starts a NATS server with this deployment's request log.
func requestLog(t *testing.T) (*bus.Server, *nats.Conn, jetstream.JetStream) {
	t.Helper()
	srv := testenv.StartNATS(t)
	nc := testenv.Connect(t, srv)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{Subjects: messages.Subjects{}}); err != nil {
		t.Fatal(err)
	}
	return srv, nc, js
}

// TestCaptureFollowOutlivesNATSRestarts: a --follow capture goes on when
// the NATS server restarts, from the request after the last it wrote, and
// when the server comes back without its store (the log made again,
// sequences starting over) it captures the new log from its start.
func TestCaptureFollowOutlivesNATSRestarts(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	dir := t.TempDir()
	start := func(store string) *bus.Server {
		srv, err := bus.StartServer(bus.ServerConfig{Addr: addr, DataDir: filepath.Join(dir, store)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Shutdown)
		return srv
	}
	srv := start("a")
	nc, err := nats.Connect("nats://"+addr, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ensure := func() {
		if _, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{Subjects: messages.Subjects{}}); err != nil {
			t.Fatal(err)
		}
	}
	ensure()
	publishRequests(t, js, "old", 3) // before the capture: not followed

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	out := &testenv.LogBuffer{}
	logs := &testenv.LogBuffer{}
	done := make(chan error, 1)
	go func() {
		_, err := replay.Capture(ctx, replay.CaptureConfig{Conn: nc, Follow: true, Logger: slog.New(slog.NewTextHandler(logs, nil))}, out)
		done <- err
	}()
	captured := func(n int) func() bool {
		return func() bool { return strings.Count(out.String(), "kvbus.req.") == n }
	}
	time.Sleep(300 * time.Millisecond) // the capture's consumer exists
	publishRequests(t, js, "one", 2)
	testenv.Eventually(t, 10*time.Second, "2 requests followed", captured(2))

	srv.Shutdown() // a restart that keeps the store
	srv = start("a")
	publishRequests(t, js, "two", 2)
	testenv.Eventually(t, 20*time.Second, "2 more after a restart", captured(4))

	srv.Shutdown() // a restart that loses it
	start("b")
	ensure()
	publishRequests(t, js, "three", 2)
	testenv.Eventually(t, 20*time.Second, "2 more in a log made again", captured(6))
	if !strings.Contains(logs.String(), "capture interrupted") || !strings.Contains(logs.String(), "starts over") {
		t.Errorf("the capture did not say it resumed and that the log started over:\n%s", logs)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	tr, err := replay.ReadTrace(strings.NewReader(out.String()), replay.FormatCapture)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, it := range tr.Items {
		ids = append(ids, it.OriginalID)
	}
	if got := strings.Join(ids, " "); got != "one-a one-b two-a two-b three-a three-b" {
		t.Errorf("captured %s; want each followed request once, none from before", got)
	}
}

// TestCaptureUntilOnAnIdleLog: a --follow --until capture stops once until
// passes even when nothing more is logged.
func TestCaptureUntilOnAnIdleLog(t *testing.T) {
	_, nc, js := requestLog(t)
	publishRequests(t, js, "r", 1)
	begin := time.Now()
	var out testenv.LogBuffer
	n, err := replay.Capture(t.Context(), replay.CaptureConfig{Conn: nc, Follow: true, FromSeq: 1, Until: begin.Add(time.Second)}, &out)
	if err != nil || n != 1 {
		t.Fatalf("captured %d, %v; want the 1 request", n, err)
	}
	if took := time.Since(begin); took > 5*time.Second {
		t.Errorf("an idle --follow --until 1s capture took %s", took)
	}
}

func TestCaptureConfigValidate(t *testing.T) {
	now := time.Now()
	for _, cfg := range []replay.CaptureConfig{
		{FromSeq: 3, Since: now},
		{Since: now, Until: now.Add(-time.Second)},
	} {
		if err := cfg.Validate(); !errors.Is(err, replay.ErrCaptureFlags) {
			t.Errorf("%+v: %v, want ErrCaptureFlags", cfg, err)
		}
	}
}

// TestReplayWarnsWithoutAScheduler: requests published onto a bus where no
// scheduler announces itself would wait out their timeout in silence; the
// replay says so within its grace.
func TestReplayWarnsWithoutAScheduler(t *testing.T) {
	srv, nc, _ := requestLog(t)
	logs := &testenv.LogBuffer{}
	r, err := replay.New(replay.Config{Target: srv.ClientURL(), Conn: nc, Timeout: 4 * time.Second, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	results, _, err := r.Run(t.Context(), []replay.Item{{Prompt: []uint32{1, 2, 3}, OutputTokens: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(results[0].Err, "timeout") {
		t.Errorf("result %+v, want a timeout", results[0])
	}
	if !strings.Contains(logs.String(), "no ready scheduler") {
		t.Errorf("no warning that no scheduler answers:\n%s", logs)
	}
}

// TestHTTPReplaySendsTheAPIKey: through a frontend with --api-key, the
// replay sends the key as a bearer token.
func TestHTTPReplaySendsTheAPIKey(t *testing.T) {
	var got []string
	var mu sync.Mutex
	url := testenv.ServeEngine(t, func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		got = append(got, req.Header.Get("Authorization"))
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n")
	})
	r, err := replay.New(replay.Config{Target: url, APIKey: "s3cret"})
	if err != nil {
		t.Fatal(err)
	}
	results, _, err := r.Run(t.Context(), []replay.Item{{Prompt: []uint32{1, 2, 3}, OutputTokens: 1}})
	if err != nil || results[0].Err != "" {
		t.Fatalf("%+v, %v", results, err)
	}
	if len(got) != 1 || got[0] != "Bearer s3cret" {
		t.Errorf("Authorization headers %q, want one Bearer s3cret", got)
	}
}

// TestStoppedReplayDoesNotSendQueuedRequests: requests waiting for a slot
// (--max-inflight) when the replay is stopped are not sent, and count as
// "not sent". Before, each was sent after the stop, onto the bus or to a
// frontend, as its slot came free, and counted as a request sent that
// failed: the report and the error said more requests were sent than were.
func TestStoppedReplayDoesNotSendQueuedRequests(t *testing.T) {
	var mu sync.Mutex
	got := 0
	arrived, release := make(chan struct{}, 8), make(chan struct{})
	url := testenv.ServeEngine(t, func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		got++
		mu.Unlock()
		arrived <- struct{}{}
		select { // no answer: the replay gives up on it
		case <-req.Context().Done():
		case <-release:
		}
	})
	t.Cleanup(func() { close(release) }) // before the engine stops
	r, err := replay.New(replay.Config{Target: url, MaxInflight: 1})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		<-arrived
		cancel()
	}()
	items := []replay.Item{{Prompt: []uint32{1}, OutputTokens: 1}, {Prompt: []uint32{2}, OutputTokens: 1}, {Prompt: []uint32{3}, OutputTokens: 1}}
	results, _, err := r.Run(ctx, items)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v, want context.Canceled", err)
	}
	sent := 0
	for i, res := range results {
		switch {
		case res.ReqID != "":
			sent++
		case !strings.Contains(res.Err, "not sent"):
			t.Errorf("result %d, never sent: err %q, want not sent", i, res.Err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if sent != 1 || got != 1 {
		t.Errorf("%d results with a request id, %d requests received, want 1 and 1: %+v", sent, got, results)
	}
}
