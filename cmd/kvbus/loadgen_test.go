package main

import (
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestLoadgenCountsWhatTheServerServed: every request loadgen counts was
// answered 200 by the frontend, and the frontend answered at most one more
// per client (those cut by the end of the run), streaming or not.
func TestLoadgenCountsWhatTheServerServed(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	served := 0.0
	for _, stream := range []bool{false, true} {
		lg := &loadgenCmd{URLs: []string{c.URL}, Concurrency: 4, Duration: time.Second, Stream: stream, Model: c.Model, MaxTokens: 4, Prompt: "hello"}
		r, err := lg.measure(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Millisecond) // the cut requests end at the server
		now := testenv.CounterSum(t, c.Registry, "kvbus_frontend_requests_total", map[string]string{"status": "200"})
		got := now - served
		served = now
		if r.Errors != 0 || float64(r.Requests) > got || got > float64(r.Requests+4) || r.P50Ms <= 0 || r.P50Ms > r.P99Ms {
			t.Errorf("stream=%v: loadgen %+v, the frontend served %v", stream, r, got)
		}
	}
}

// TestLoadgenFailsWhenNothingSucceeds: a run where every request failed (a
// server that is down, a model it does not serve) exits non-zero and says
// why, where it printed "0 requests" and exited 0.
func TestLoadgenFailsWhenNothingSucceeds(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	lg := &loadgenCmd{URLs: []string{c.URL}, Concurrency: 2, Duration: 300 * time.Millisecond, Model: "no-such-model", MaxTokens: 4, Prompt: "hello"}
	err := lg.Run(t.Context())
	if err == nil || !strings.Contains(err.Error(), "status 404") || !strings.Contains(err.Error(), "no-such-model") {
		t.Errorf("Run = %v; want an error with the first failure (a 404 naming the model)", err)
	}
}
