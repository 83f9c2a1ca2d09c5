package testenv_test

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/kvbus/kvbus/testenv"
)

// TestGroupsBeyondTheIndexServe: a cluster with more groups than its
// schedulers' KV index tracks becomes ready (it waited for every group's
// index to sync, which an untracked group never does), and the group
// beyond the index takes its share of requests.
func TestGroupsBeyondTheIndexServe(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 3, Ranks: 2, IndexGroups: 2, Policy: "round-robin"})
	var untracked []string
	for g := range 3 {
		name := fmt.Sprint("g", g)
		if _, ok := c.Scheduler.Index().GroupID(name); !ok {
			untracked = append(untracked, name)
		}
	}
	if len(untracked) != 1 {
		t.Fatalf("groups beyond the index: %v, want one (the index tracks 2 of 3)", untracked)
	}
	const requests = 9
	for i := range requests {
		body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"question %d"}],"max_tokens":2}`, c.Model, i)
		if code, _, resp := testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions", body,
			map[string]string{"X-Session-ID": fmt.Sprint("beyond-", i)}); code != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, code, resp)
		}
	}
	got := testenv.CounterSum(t, c.Registry, "kvbus_worker_reqmeta_total", map[string]string{"group": untracked[0], "tp_rank": "0"})
	if got != requests/3 {
		t.Errorf("%s (beyond the index) took %v of %d round-robin requests, want %d", untracked[0], got, requests, requests/3)
	}
}
