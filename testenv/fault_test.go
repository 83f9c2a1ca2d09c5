package testenv_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// The fault-injection suite: `go test -v -run Fault ./testenv`. Each test
// runs load through a cluster, injects one fault, and prints one line:
// sent, completed, explicit errors, client aborts, lost (no answer and no
// error: must be 0), leaked trackers and goroutines (must be 0).

type faultLoad struct {
	requests    int
	concurrency int
	abortRate   float64                  // share of requests the client gives up on
	faultAt     int                      // inject after this many requests were sent
	fault       func(c *testenv.Cluster) // the fault
	headers     func(int) map[string]string
	// alive lists the scheduler replicas whose trackers must drain (nil:
	// all); a killed replica's memory died with it.
	alive []int
}

type faultTally struct {
	sent, completed, errors, aborted, lost atomic.Int64
	lostWhy                                sync.Map
}

func runFault(t *testing.T, cfg testenv.ClusterConfig, load faultLoad) {
	ignore := goleak.IgnoreCurrent()
	if cfg.RequestTimeout == 0 {
		cfg.RequestTimeout = 10 * time.Second
	}
	c := testenv.StartCluster(t, cfg)
	client := &http.Client{Timeout: cfg.RequestTimeout + 10*time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: load.concurrency}}
	var tally faultTally
	var wg sync.WaitGroup
	sem := make(chan struct{}, load.concurrency)
	for i := range load.requests {
		if i == load.faultAt && load.fault != nil {
			load.fault(c)
		}
		sem <- struct{}{}
		tally.sent.Add(1)
		wg.Go(func() {
			defer func() { <-sem }()
			oneRequest(c, client, i, load, &tally)
		})
	}
	wg.Wait()
	client.CloseIdleConnections()
	// Every tracker ends: answered, failed, aborted or timed out.
	deadline := time.Now().Add(cfg.RequestTimeout + 5*time.Second)
	trackers := 0
	for {
		trackers = 0
		for i, s := range c.Schedulers {
			if load.alive == nil || slices.Contains(load.alive, i) {
				trackers += s.Trackers()
			}
		}
		if trackers == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.Cluster.Stop()
	if err := c.Cluster.Wait(); err != nil {
		t.Logf("cluster stopped with: %v", err)
	}
	goroutines := 0
	if err := goleak.Find(ignore, goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait")); err != nil {
		goroutines = strings.Count(err.Error(), "Goroutine ")
		t.Logf("leaked goroutines: %v", err)
	}
	t.Logf("%s: sent %d, completed %d, explicit errors %d, client aborts %d, lost %d, leaked trackers %d, leaked goroutines %d",
		t.Name(), tally.sent.Load(), tally.completed.Load(), tally.errors.Load(), tally.aborted.Load(), tally.lost.Load(), trackers, goroutines)
	tally.lostWhy.Range(func(k, v any) bool { t.Logf("lost: %v ×%v", k, v); return true })
	if tally.lost.Load() != 0 || trackers != 0 || goroutines != 0 {
		t.Errorf("lost %d, leaked trackers %d, leaked goroutines %d: all must be 0", tally.lost.Load(), trackers, goroutines)
	}
	if tally.completed.Load() == 0 {
		t.Errorf("nothing completed: the load did not run")
	}
}

func oneRequest(c *testenv.Cluster, client *http.Client, i int, load faultLoad, tally *faultTally) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	aborting := load.abortRate > 0 && rand.Float64() < load.abortRate
	if aborting {
		time.AfterFunc(time.Duration(rand.IntN(20))*time.Millisecond, cancel)
	}
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"fault load %d"}],"max_tokens":8,"ignore_eos":true}`, c.Model, i)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if load.headers != nil {
		for k, v := range load.headers(i) {
			req.Header.Set(k, v)
		}
	}
	resp, err := client.Do(req)
	if err != nil {
		if aborting && ctx.Err() != nil {
			tally.aborted.Add(1)
			return
		}
		tally.lost.Add(1)
		why, _ := tally.lostWhy.LoadOrStore(err.Error(), new(atomic.Int64))
		why.(*atomic.Int64).Add(1)
		return
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		if aborting && ctx.Err() != nil {
			tally.aborted.Add(1)
			return
		}
		tally.lost.Add(1)
		return
	}
	var out struct {
		Choices []json.RawMessage `json:"choices"`
		Error   *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	switch {
	case json.Unmarshal(raw, &out) != nil:
		tally.lost.Add(1) // an answer that is neither a completion nor an error
	case resp.StatusCode == http.StatusOK && len(out.Choices) == 1:
		tally.completed.Add(1)
	case resp.StatusCode != http.StatusOK && out.Error != nil && out.Error.Message != "":
		tally.errors.Add(1)
	default:
		tally.lost.Add(1)
	}
}

func TestFaultKillNonDriverRank(t *testing.T) {
	runFault(t, testenv.ClusterConfig{Groups: 2, TimeScale: 0.2}, faultLoad{requests: 300, concurrency: 16, faultAt: 100,
		fault: func(c *testenv.Cluster) { c.KillRank(t, "g0", 2) }})
}

func TestFaultKillDriver(t *testing.T) {
	runFault(t, testenv.ClusterConfig{Groups: 2, TimeScale: 0.2}, faultLoad{requests: 300, concurrency: 16, faultAt: 100,
		fault: func(c *testenv.Cluster) { c.KillRank(t, "g1", 0) }})
}

func TestFaultKillOneOfTwoSchedulers(t *testing.T) {
	runFault(t, testenv.ClusterConfig{Groups: 2, Schedulers: 2, TimeScale: 0.2}, faultLoad{requests: 300, concurrency: 16, faultAt: 100,
		alive: []int{0},
		fault: func(c *testenv.Cluster) {
			if err := c.Cluster.KillScheduler(1); err != nil {
				t.Fatal(err)
			}
		}})
}

func TestFaultRestartNATS(t *testing.T) {
	runFault(t, testenv.ClusterConfig{Groups: 2, TimeScale: 0.2, RequestTimeout: 8 * time.Second}, faultLoad{requests: 300, concurrency: 16, faultAt: 100,
		fault: func(c *testenv.Cluster) {
			if err := c.Cluster.RestartNATS(); err != nil {
				t.Fatal(err)
			}
			// The load goes on once the roles have reconnected by themselves.
			client := &http.Client{Timeout: 5 * time.Second}
			defer client.CloseIdleConnections()
			testenv.Eventually(t, 30*time.Second, "the cluster back", func() bool {
				resp, err := client.Get(c.URL + "/healthz")
				if err != nil {
					return false
				}
				resp.Body.Close()
				return resp.StatusCode == http.StatusOK && c.Scheduler.ReadyGroups() == 2
			})
		}})
}

func TestFaultDropKVEvents(t *testing.T) {
	// A batch of g0/1's events "lost": the next one the scheduler sees
	// skips a seq, so it must resync that rank from a dump, under load.
	runFault(t, testenv.ClusterConfig{Groups: 2, TimeScale: 0.2}, faultLoad{requests: 300, concurrency: 16, faultAt: 100,
		headers: func(i int) map[string]string { return map[string]string{"X-Session-ID": fmt.Sprint("s", i%10)} },
		fault: func(c *testenv.Cluster) {
			nc, err := nats.Connect(c.NATS.ClientURL())
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			data, _ := messages.Marshal(&messages.KVEventBatch{Seq: 1 << 40, Group: "g0", Rank: 1,
				Events: []messages.KVEvent{{Type: messages.EventBlockStored, BlockHashes: messages.BlockHashes{42}}}})
			if err := nc.Publish(messages.Subjects{}.KV("g0", 1), data); err != nil {
				t.Fatal(err)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
		}})
}

func TestFaultClientAborts(t *testing.T) {
	runFault(t, testenv.ClusterConfig{Groups: 2, TimeScale: 0.2}, faultLoad{requests: 1000, concurrency: 32, abortRate: 0.1})
}
