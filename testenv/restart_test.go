package testenv_test

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestRestartedFrontendTakesRequestsAtOnce: a frontend started beside a
// running cluster (a rolling restart: the old process stopped, the new one
// listens on its port, and clients that met "connection refused" send
// again at once) answers the requests that reach it before it has heard
// a scheduler's announcement (one a second). They got 503
// no_ready_scheduler while every scheduler was ready: 11-13 requests at
// each restart of one of two frontends under 16 conversations.
func TestRestartedFrontendTakesRequestsAtOnce(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{TimeScale: 0})
	nc, err := nats.Connect(c.NATS.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fe, err := frontend.New(frontend.Config{
		Conn: nc, Subjects: messages.Subjects{Prefix: "kvbus"}, Listener: ln, Models: []string{c.Model},
		RequestTimeout: 10 * time.Second, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fe.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("frontend Run: %v", err)
		}
	})
	select {
	case <-fe.Ready():
	case err := <-done:
		t.Fatalf("frontend Run: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("frontend not ready after 10 s")
	}

	// The clients that found the port closed send the moment it opens.
	url := "http://" + fe.Addr().String() + "/v1/chat/completions"
	const clients = 8
	var wg sync.WaitGroup
	statuses := make([]int, clients)
	bodies := make([]string, clients)
	start := time.Now()
	for i := range clients {
		wg.Go(func() {
			status, _, body := testenv.Send(t, http.MethodPost, url,
				`{"model":"kvbus-sim","max_tokens":4,"messages":[{"role":"user","content":"hello after a restart"}]}`, nil)
			statuses[i], bodies[i] = status, string(body)
		})
	}
	wg.Wait()
	took := time.Since(start)
	for i, s := range statuses {
		if s != http.StatusOK {
			t.Errorf("request %d to the restarted frontend: %d %s, want 200", i, s, bodies[i])
		}
	}
	if took > 3*time.Second {
		t.Errorf("the requests took %s; want them answered within about a second (the schedulers' announcement)", took)
	}
	t.Logf("%d requests sent the moment the frontend listened: answered in %s", clients, took.Round(time.Millisecond))
}
