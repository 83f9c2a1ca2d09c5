package testenv_test

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestStopFinishesAcceptedRequests: `kvbus serve` on SIGTERM (the
// cluster's Stop) stops intake and lets the requests it accepted finish.
// Sixteen clients keep sending while the cluster stops: each request gets
// its answer or a quick refusal, never a wait until its deadline. Stopping
// every role at once left requests accepted in the last moments in the
// request log with no scheduler to dispatch them (a 504 after the request
// timeout, in the first or second round of every run); the roles now stop
// frontend first, then schedulers, then ranks; and the frontend answers
// new requests with a 503 for its stop grace before it closes its listener.
func TestStopFinishesAcceptedRequests(t *testing.T) {
	for round := range 8 { // the window is a race: a few rounds
		if !t.Run(fmt.Sprint("round", round), stopRound) {
			return
		}
	}
}

func stopRound(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 2, TimeScale: 1, RequestTimeout: 6 * time.Second})
	type result struct {
		status int
		took   time.Duration
		err    error
	}
	var (
		mu      sync.Mutex
		results []result
		wg      sync.WaitGroup
	)
	for w := range 16 {
		wg.Go(func() {
			client := &http.Client{Timeout: 30 * time.Second}
			defer client.CloseIdleConnections()
			for i := 0; ; i++ {
				body := fmt.Sprintf(`{"model":%q,"prompt":"client %d request %d","max_tokens":8}`, c.Model, w, i)
				start := time.Now()
				resp, err := client.Post(c.URL+"/v1/completions", "application/json", strings.NewReader(body))
				r := result{err: err, took: time.Since(start)}
				if err == nil {
					resp.Body.Close()
					r.status = resp.StatusCode
				}
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
				if r.status != http.StatusOK {
					return
				}
			}
		})
	}
	time.Sleep(500 * time.Millisecond)
	stopAt := time.Now()
	c.Cluster.Stop()
	wg.Wait()
	_ = c.Cluster.Wait()
	t.Logf("stop took %s", time.Since(stopAt).Round(time.Millisecond))
	counts := map[int]int{}
	for _, r := range results {
		counts[r.status]++
		if r.status == http.StatusGatewayTimeout || r.took > 4*time.Second {
			t.Errorf("an accepted request hung through the stop: status %d after %s (%v)", r.status, r.took.Round(time.Millisecond), r.err)
		}
	}
	if counts[http.StatusOK] < 16 {
		t.Errorf("only %d requests answered before the stop: the load did not run", counts[http.StatusOK])
	}
	// Each client's last request came after the stop began: a 503
	// shutting_down on its kept-alive connection (the frontend's stop
	// grace), not a connection closed under it.
	if counts[http.StatusServiceUnavailable] < 15 {
		t.Errorf("%d of 16 clients got the 503 shutting_down; the others' connections closed without an answer", counts[http.StatusServiceUnavailable])
	}
	t.Logf("statuses %v (0: transport error)", counts)
}
