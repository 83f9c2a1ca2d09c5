package frontend_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestNoReadySchedulerIsAFast503: while no scheduler announced itself
// ready, /healthz and vLLM's /health are 503 and a request gets 503 no_ready_scheduler with
// Retry-After at once (not a 504 after --request-timeout), and nothing is
// published; a scheduler announcing "not ready" does not count; once one
// announces ready, both are 200; vLLM's /ping answers as /health.
func TestNoReadySchedulerIsAFast503(t *testing.T) {
	s := startStandalone(t, false, func(c *frontend.Config) { c.RequestTimeout = 30 * time.Second })
	probe := func(step, path string, want int) {
		t.Helper()
		resp, err := http.Get(s.url + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("%s: %s %d, want %d", step, path, resp.StatusCode, want)
		}
		if (path == "/health" || path == "/ping") && len(body) != 0 {
			t.Errorf("%s: /health body %q, want it empty as vLLM's", step, body)
		}
	}
	// A frontend's first requests wait up to 1.5 s for the schedulers'
	// first announcements (TestRestartedFrontendTakesRequestsAtOnce): the
	// first step's 503 may take that, the later ones none of it.
	limit := 1500*time.Millisecond + 2*time.Second
	check := func(step string) {
		t.Helper()
		probe(step, "/healthz", http.StatusServiceUnavailable)
		probe(step, "/health", http.StatusServiceUnavailable)
		probe(step, "/ping", http.StatusServiceUnavailable)
		start := time.Now()
		r := s.post(t, "/v1/chat/completions", `{"model":"kvbus-sim","messages":[{"role":"user","content":"hi"}]}`)
		took := time.Since(start)
		var body struct {
			Error struct{ Code, Message string }
		}
		_ = json.Unmarshal(r.body, &body)
		if r.status != http.StatusServiceUnavailable || body.Error.Code != "no_ready_scheduler" || r.header.Get("Retry-After") == "" {
			t.Errorf("%s: status %d, Retry-After %q, body %s; want 503 no_ready_scheduler with Retry-After", step, r.status, r.header.Get("Retry-After"), r.body)
		}
		if took > limit {
			t.Errorf("%s: the 503 took %s; want it within %s", step, took, limit)
		}
		limit = 2 * time.Second
		if !strings.Contains(body.Error.Message, "scheduler") {
			t.Errorf("%s: message %q does not say what is missing", step, body.Error.Message)
		}
		if st := s.logState(t); st.Msgs != 0 {
			t.Errorf("%s: %d requests published with no scheduler", step, st.Msgs)
		}
	}
	check("no scheduler at all")

	nc, err := nats.Connect(s.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	announce := func(ready bool) {
		data, _ := messages.Marshal(&messages.Announcement{Role: messages.RoleScheduler, ID: "s1", Ready: ready,
			Reason: "no ready worker group", UnixMs: time.Now().UnixMilli()})
		if err := nc.Publish(messages.Subjects{}.Announce(messages.RoleScheduler, "s1"), data); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	announce(false)
	time.Sleep(100 * time.Millisecond)
	check("a scheduler that is not ready")

	announce(true)
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := http.Get(s.url + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/healthz %d after a ready announcement, want 200", resp.StatusCode)
		}
		time.Sleep(20 * time.Millisecond)
	}
	probe("a ready scheduler", "/health", http.StatusOK)
	probe("a ready scheduler", "/ping", http.StatusOK)
	// vLLM's SageMaker probe is also a POST.
	resp, err := http.Post(s.url+"/ping", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("POST /ping %d, want 200", resp.StatusCode)
	}
}

// TestNotReadyWhileNoGroupOfItsModels: a frontend is ready while a ready
// scheduler can place one of its models (ready_models in the
// announcements): one serving only a model whose workers are not up is not
// (/healthz 503 naming the model), as vLLM is not without its engine; it
// answered 200 and every request waited 2 s for a 503. A scheduler that
// does not list its models (an older kvbus) counts for every model.
func TestNotReadyWhileNoGroupOfItsModels(t *testing.T) {
	s := startStandalone(t, false, func(c *frontend.Config) { c.Models = []string{"c", "d"} })
	nc, err := nats.Connect(s.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	healthz := func(models []string, settled func(int, string) bool) (int, string) {
		t.Helper()
		data, _ := messages.Marshal(&messages.Announcement{Role: messages.RoleScheduler, ID: "s1", Ready: true,
			ReadyGroups: 1, UnixMs: time.Now().UnixMilli(), ReadyModels: models})
		if err := nc.Publish(messages.Subjects{}.Announce(messages.RoleScheduler, "s1"), data); err != nil {
			t.Fatal(err)
		}
		var status int
		var body []byte
		deadline := time.Now().Add(2 * time.Second)
		for time.Now().Before(deadline) { // the announcement reaches the frontend
			resp, err := http.Get(s.url + "/healthz")
			if err != nil {
				t.Fatal(err)
			}
			body, _ = io.ReadAll(resp.Body)
			resp.Body.Close()
			status = resp.StatusCode
			if settled(status, string(body)) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		return status, string(body)
	}
	saysModels := func(_ int, body string) bool { return strings.Contains(body, "model") }
	ok := func(status int, _ string) bool { return status == http.StatusOK }
	if status, body := healthz([]string{"a", "b"}, saysModels); status != http.StatusServiceUnavailable || !strings.Contains(body, "c, d") ||
		!strings.Contains(body, "--model c or d") {
		t.Errorf("groups of a and b only: /healthz %d %s, want 503 naming c and d", status, body)
	}
	if status, body := healthz([]string{"a", "d"}, ok); status != http.StatusOK {
		t.Errorf("a group of d ready: /healthz %d %s, want 200", status, body)
	}
	if status, body := healthz([]string{"a"}, saysModels); status != http.StatusServiceUnavailable {
		t.Errorf("again only a: /healthz %d %s, want 503", status, body)
	}
	if status, body := healthz(nil, ok); status != http.StatusOK {
		t.Errorf("a scheduler that lists no models: /healthz %d %s, want 200", status, body)
	}
}

// TestRequestsWaitForASchedulerReadyAgain: once a scheduler was ready, a
// request that finds none ready (its lone group briefly away: a rank
// replaced, its index resyncing) is held while a live scheduler would hold
// it for a group (the no_group_wait_ms of its announcement, its
// --no-group-wait), and published as soon as one is ready again. Before, it
// was a 503 no_ready_scheduler at once, whatever --no-group-wait said. A
// scheduler that holds nothing (its consumer not running) still gets the
// fast 503, and so does a hold that runs out.
func TestRequestsWaitForASchedulerReadyAgain(t *testing.T) {
	s := startStandalone(t, false, func(c *frontend.Config) { c.RequestTimeout = 8 * time.Second })
	announceS1 := schedulerAnnouncer(t, s)
	announce := func(ready bool, holds time.Duration) { t.Helper(); announceS1(ready, holds, false) }
	healthz := func() int { return s.healthz(t) }
	const chat = `{"model":"kvbus-sim","messages":[{"role":"user","content":"hi"}]}`
	// Before any scheduler was ready: at once, whatever it holds.
	announce(false, 10*time.Second)
	time.Sleep(1600 * time.Millisecond) // past the first announcements' wait
	start := time.Now()
	if r := s.post(t, "/v1/chat/completions", chat); r.status != http.StatusServiceUnavailable || time.Since(start) > time.Second {
		t.Fatalf("never ready: %d after %s, want a 503 at once", r.status, time.Since(start))
	}

	heldRequest(t, s) // held: not answered at once
	if st := s.logState(t); st.Msgs != 0 {
		t.Fatalf("%d requests published while no scheduler was ready", st.Msgs)
	}
	announce(true, 10*time.Second)
	testenv.Eventually(t, 5*time.Second, "the held request published once a scheduler is ready", func() bool { return s.logState(t).Msgs == 1 })

	// A scheduler that holds nothing: at once.
	announce(false, 0)
	testenv.Eventually(t, 5*time.Second, "/healthz 503", func() bool { return healthz() == http.StatusServiceUnavailable })
	start = time.Now()
	if r := s.post(t, "/v1/chat/completions", chat); r.status != http.StatusServiceUnavailable || time.Since(start) > time.Second {
		t.Fatalf("a scheduler that holds nothing: %d after %s, want a 503 at once", r.status, time.Since(start))
	}
	// A hold that runs out: the 503 after it, once /healthz says requests
	// wait (the frontend applied the announcement).
	announce(false, time.Second)
	testenv.Eventually(t, 5*time.Second, "/healthz saying requests wait up to 1s", func() bool {
		_, _, body := testenv.Send(t, http.MethodGet, s.url+"/healthz", "", nil)
		return strings.Contains(string(body), "requests wait up to 1s for it")
	})
	start = time.Now()
	r := s.post(t, "/v1/chat/completions", chat)
	if took := time.Since(start); r.status != http.StatusServiceUnavailable || took < 900*time.Millisecond || took > 3*time.Second {
		t.Fatalf("a hold of 1 s that ran out: %d after %s, want a 503 after ~1 s", r.status, took)
	}
	if !strings.Contains(string(r.body), "held 1") {
		t.Errorf("the 503 after a hold does not say the request was held: %s", r.body)
	}
	if st := s.logState(t); st.Msgs != 1 {
		t.Fatalf("%d requests published, want only the one held until a scheduler was ready", st.Msgs)
	}
}

// heldRequest sets up a frontend that saw scheduler s1 ready and then
// heard it say it is not ready while it holds requests 10 s for a group,
// and sends a chat request in the background, which the frontend holds.
// It returns the announcer (ready, hold, stopped) and where the answer
// ("<status> <body>") and its time arrive.
func heldRequest(t *testing.T, s *standalone) (announce func(ready bool, holds time.Duration, stopped bool), answered <-chan string, sent time.Time) {
	t.Helper()
	announce = schedulerAnnouncer(t, s)
	healthz := func() int { return s.healthz(t) }
	announce(true, 10*time.Second, false)
	testenv.Eventually(t, 5*time.Second, "/healthz 200", func() bool { return healthz() == http.StatusOK })
	announce(false, 10*time.Second, false)
	testenv.Eventually(t, 5*time.Second, "/healthz 503", func() bool { return healthz() == http.StatusServiceUnavailable })
	ch := make(chan string, 1)
	sent = time.Now()
	go func() {
		resp, err := http.Post(s.url+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"kvbus-sim","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			ch <- err.Error()
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		ch <- fmt.Sprintf("%d %s", resp.StatusCode, body)
	}()
	time.Sleep(300 * time.Millisecond)
	select {
	case r := <-ch:
		t.Fatalf("the request was not held: answered %s at once", r)
	default:
	}
	return announce, ch, sent
}

// TestHeldRequestEndsWhenNoSchedulerHoldsAnyMore: a request held while no
// scheduler is ready is answered its 503 no_ready_scheduler as soon as no
// live scheduler would hold it any more: the one that held it announced
// its clean stop, or fell silent past --scheduler-timeout. Before, it
// stayed held for the whole no_group_wait_ms first heard (here 10 s, cut
// to the 8 s request timeout), as no announcement but a ready one woke it.
func TestHeldRequestEndsWhenNoSchedulerHoldsAnyMore(t *testing.T) {
	t.Run("stopped", func(t *testing.T) {
		s := startStandalone(t, false, func(c *frontend.Config) { c.RequestTimeout = 8 * time.Second })
		announce, answered, _ := heldRequest(t, s)
		stopped := time.Now()
		announce(false, 0, true)
		select {
		case r := <-answered:
			if took := time.Since(stopped); !strings.HasPrefix(r, "503 ") || !strings.Contains(r, "no_ready_scheduler") || took > time.Second {
				t.Fatalf("after the scheduler's stop: %s after %s, want a 503 no_ready_scheduler at once", r, took)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no answer")
		}
	})
	t.Run("silent", func(t *testing.T) {
		s := startStandalone(t, false, func(c *frontend.Config) {
			c.RequestTimeout = 8 * time.Second
			c.SchedulerTimeout = time.Second
		})
		_, answered, sent := heldRequest(t, s) // its last announcement: ~300 ms before sent
		select {
		case r := <-answered:
			if took := time.Since(sent); !strings.HasPrefix(r, "503 ") || !strings.Contains(r, "no_ready_scheduler") || took > 2*time.Second {
				t.Fatalf("with the scheduler silent: %s after %s, want a 503 no_ready_scheduler within the 1 s scheduler timeout", r, took)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no answer")
		}
	})
}

// TestStopTimeoutEndsAHeldRequest: a request held while no scheduler is
// ready gets the 503 shutting_down of --stop-timeout when it passes, as a
// request waiting for its answer does. Before, the hold went on (here for
// the 8 s request timeout) and the listener closed under it: the client's
// connection was cut with no answer.
func TestStopTimeoutEndsAHeldRequest(t *testing.T) {
	s := startStandalone(t, false, func(c *frontend.Config) {
		c.RequestTimeout = 8 * time.Second
		c.StopTimeout = 500 * time.Millisecond
	})
	_, answered, _ := heldRequest(t, s)
	stop := time.Now()
	s.stop()
	select {
	case r := <-answered:
		if took := time.Since(stop); !strings.HasPrefix(r, "503 ") || !strings.Contains(r, "shutting_down") || took > 1500*time.Millisecond {
			t.Fatalf("after --stop-timeout 500ms: %s after %s, want a 503 shutting_down", r, took)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no answer")
	}
}

// schedulerAnnouncer returns what publishes scheduler s1's announcements
// to s's bus: ready or not, holding requests for holds, stopped.
func schedulerAnnouncer(t *testing.T, s *standalone) func(ready bool, holds time.Duration, stopped bool) {
	t.Helper()
	nc, err := nats.Connect(s.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return func(ready bool, holds time.Duration, stopped bool) {
		t.Helper()
		data, _ := messages.Marshal(&messages.Announcement{Role: messages.RoleScheduler, ID: "s1", Ready: ready, Stopped: stopped,
			Reason: "no ready worker group", UnixMs: time.Now().UnixMilli(), NoGroupWaitMs: holds.Milliseconds()})
		if err := nc.Publish(messages.Subjects{}.Announce(messages.RoleScheduler, "s1"), data); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
}

// healthz is the status of s's /healthz.
func (s *standalone) healthz(t *testing.T) int {
	t.Helper()
	resp, err := http.Get(s.url + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestRequestsAfterAReconnectWaitForTheAnnouncements: a frontend cut off
// from NATS for longer than --scheduler-timeout hears no announcement
// meanwhile; once it is back, a request waits for the schedulers' next
// announcements (each every second) as at the frontend's start, and is
// published. Before, the request of the moment after the reconnect got a
// 503 no_ready_scheduler at once ("start one"), with the scheduler ready
// all along: 33 requests in a review's compose cluster, its frontend's
// network cut for 20 s.
func TestRequestsAfterAReconnectWaitForTheAnnouncements(t *testing.T) {
	var proxy *testenv.FaultProxy
	var conn *nats.Conn
	s := startStandalone(t, false, func(c *frontend.Config) {
		c.RequestTimeout = 5 * time.Second
		c.SchedulerTimeout = time.Second
		proxy = testenv.StartFaultProxy(t, strings.TrimPrefix(c.Conn.ConnectedUrl(), "nats://"))
		nc, err := nats.Connect(proxy.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		c.Conn, conn = nc, nc
	})
	// A ready scheduler announcing itself every second, on the server.
	announce := schedulerAnnouncer(t, s)
	stop := make(chan struct{})
	loop := make(chan struct{})
	go func() {
		defer close(loop)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			announce(true, 2*time.Second, false)
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-loop })
	testenv.Eventually(t, 5*time.Second, "/healthz 200", func() bool { return s.healthz(t) == http.StatusOK })

	// Cut off: nothing reaches the frontend until its announcements are stale.
	proxy.Silence()
	testenv.Eventually(t, 5*time.Second, "/healthz 503 while cut off", func() bool { return s.healthz(t) == http.StatusServiceUnavailable })
	// The link is back: the connection reconnects through the proxy.
	before := time.Now()
	proxy.Cut()
	testenv.Eventually(t, 5*time.Second, "the reconnect", func() bool { return conn.Stats().Reconnects == 1 && conn.IsConnected() })
	r := s.post(t, "/v1/chat/completions", `{"model":"kvbus-sim","messages":[{"role":"user","content":"hi"}]}`)
	if strings.Contains(string(r.body), "no_ready_scheduler") {
		t.Fatalf("after the reconnect (%s after the link came back): %d %s; want the request to wait for the scheduler's next announcement",
			time.Since(before).Round(time.Millisecond), r.status, r.body)
	}
	if st := s.logState(t); st.Msgs != 1 {
		t.Fatalf("%d requests published after the reconnect, want 1 (answered %d %s)", st.Msgs, r.status, r.body)
	}
}
