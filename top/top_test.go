package top_test

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/top"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestWatcherSeesWhatClientsSee: top, reading only the bus with the admin
// key, reports the groups as the heartbeats describe them, every finished
// request, and for each turn depth exactly the hit ratio the clients got
// in their usage; each session is listed on the group that served it.
func TestWatcherSeesWhatClientsSee(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Ranks: 2, AuthDir: dir})
	w := c.StartTop(t) // the admin key: "top" is not a role's name

	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	prompt, cached := map[int]int{}, map[int]int{}
	var slowest time.Duration
	for conv := range 2 {
		d := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 300 + conv,
			Headers: map[string]string{"X-Session-ID": fmt.Sprint("top-", conv)}}.Start()
		for turn := range 4 {
			start := time.Now()
			got, err := d.Next(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			slowest = max(slowest, time.Since(start))
			depth := min(turn+1, 4)
			prompt[depth] += got.PromptTokens
			cached[depth] += got.CachedTokens
		}
	}
	var s top.Snapshot
	testenv.Eventually(t, 5*time.Second, "8 finished requests and both groups' ranks heard", func() bool {
		s = w.Snapshot(time.Now())
		return s.Finished == 8 && len(s.Groups) == 2 && s.Groups[0].Ranks == 2 && s.Groups[1].Ranks == 2
	})
	for _, g := range s.Groups {
		if g.State != "ready" || g.Ranks != 2 || g.WorldSize != 2 {
			t.Errorf("group %+v, want ready with 2 of 2 ranks", g)
		}
	}
	for depth, label := range map[int]string{1: "1", 2: "2", 3: "3", 4: "4+"} {
		want := float64(cached[depth]) / float64(prompt[depth])
		if got := s.HitRatio[label]; got != want {
			t.Errorf("turn %s: top says hit ratio %.4f, the clients got %.4f", label, got, want)
		}
	}
	if s.HitRatio["2"] < 0.8 {
		t.Errorf("turn 2 hit ratio %.2f: the conversations should hit", s.HitRatio["2"])
	}
	if s.TTFTP50Ms <= 0 || s.TTFTP50Ms > s.TTFTP95Ms || time.Duration(s.TTFTP95Ms*float64(time.Millisecond)) > slowest {
		t.Errorf("TTFT p50 %.2f ms p95 %.2f ms, the slowest turn took %s", s.TTFTP50Ms, s.TTFTP95Ms, slowest)
	}
	if len(s.Sessions) != 2 {
		t.Fatalf("sessions %+v", s.Sessions)
	}
	for _, ss := range s.Sessions {
		if ss.Turns != 4 || (ss.Group != "g0" && ss.Group != "g1") {
			t.Errorf("session %+v, want 4 turns on g0 or g1", ss)
		}
		if !strings.Contains(c.Logs.String(), fmt.Sprintf("session_id=%s group=%s outcome=completed", ss.ID, ss.Group)) {
			t.Errorf("session %s is listed on %s, the scheduler placed it elsewhere", ss.ID, ss.Group)
		}
	}
	screen := top.NewModel(w, time.Second, 10).Render()
	for _, want := range []string{"g0", "g1", "ready", "top-0", "top-1", "hit ratio by turn"} {
		if !strings.Contains(screen, want) {
			t.Errorf("the screen lacks %q:\n%s", want, screen)
		}
	}
}

// TestWatcherNeedsTheAdminKey: with keys on the bus, a role's key cannot
// watch everything, and top says which key it needs.
func TestWatcherNeedsTheAdminKey(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t)
	nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), NKeySeedFile: filepath.Join(dir, "worker.nk")})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	w, err := top.New(top.Config{Conn: nc})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Run(t.Context()); err == nil || !strings.Contains(err.Error(), "admin key") {
		t.Errorf("Run with a worker key: %v, want an error naming the admin key", err)
	}
}

// TestWatcherEndsAbortedRequests: a request whose client went away (an
// Abort on the bus; the driver publishes no final output for it) leaves
// in_flight at once and counts as aborted, not finished; a scheduler's
// withdrawal from one group (a group-scoped Abort) does not end it.
func TestWatcherEndsAbortedRequests(t *testing.T) {
	srv := testenv.StartNATS(t)
	nc := testenv.Connect(t, srv)
	w, err := top.New(top.Config{Conn: nc})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	<-w.Subscribed()
	s := messages.Subjects{}
	publish := func(subject string, m messages.Message) {
		data, err := messages.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := nc.Publish(subject, data); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"r1", "r2"} {
		publish(s.Request("kvbus-sim"), &messages.Request{RequestID: id, FrontendID: "fe-1", SessionID: "s", Model: "kvbus-sim", PromptTokenIDs: []uint32{1, 2, 3}})
	}
	publish(s.Abort(), &messages.Abort{ReqID: "r1", Group: "g0", BeforeAttempt: 1, Reason: "dispatched again"})
	publish(s.Abort(), &messages.Abort{ReqID: "r2", Reason: "client disconnected"})
	testenv.Eventually(t, 5*time.Second, "the client's abort seen", func() bool { return w.Snapshot(time.Now()).Aborted == 1 })
	snap := w.Snapshot(time.Now())
	if snap.InFlight != 1 || snap.Finished != 0 {
		t.Errorf("in_flight %d, finished %d; want 1 (the withdrawn request goes on) and 0", snap.InFlight, snap.Finished)
	}
}

// TestConfigRefusesNegatives: a negative window, heartbeat timeout or
// session count is refused (a negative window silently became 1 min).
func TestConfigRefusesNegatives(t *testing.T) {
	nc := testenv.Connect(t, testenv.StartNATS(t))
	for _, cfg := range []top.Config{
		{Conn: nc, Window: -time.Second},
		{Conn: nc, HeartbeatTimeout: -time.Second},
		{Conn: nc, Sessions: -1},
	} {
		if _, err := top.New(cfg); err == nil {
			t.Errorf("top.New(%+v) accepted it", cfg)
		}
	}
	if _, err := top.New(top.Config{Conn: nc}); err != nil {
		t.Errorf("the defaults: %v", err)
	}
}
