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
	// check, if set, runs after the load: it asserts that the fault took
	// effect and that the property it threatens held.
	check func(t *testing.T, c *testenv.Cluster)
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
	if load.check != nil {
		load.check(t, c)
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
	if load.abortRate > 0 && tally.aborted.Load() == 0 {
		t.Errorf("no client aborted: the fault did not take effect")
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

// killRank kills a rank and asserts that the kill took effect: its NATS
// connection is gone and every scheduler took its group out of placement.
func killRank(t *testing.T, c *testenv.Cluster, group string, rank int) {
	c.KillRank(t, group, rank)
	name := fmt.Sprintf("kvbus-worker-%s-%d", group, rank)
	testenv.Eventually(t, 5*time.Second, "the killed rank's connection gone", func() bool { return !c.Connected(t, name) })
	testenv.Eventually(t, 5*time.Second, "its group out of placement", func() bool {
		for _, s := range c.Schedulers {
			for _, g := range s.Groups() {
				if g.Name == group {
					return false
				}
			}
		}
		return true
	})
}

func TestFaultKillNonDriverRank(t *testing.T) {
	runFault(t, testenv.ClusterConfig{Groups: 2, TimeScale: 0.2}, faultLoad{requests: 300, concurrency: 16, faultAt: 100,
		fault: func(c *testenv.Cluster) { killRank(t, c, "g0", 2) }})
}

func TestFaultKillDriver(t *testing.T) {
	runFault(t, testenv.ClusterConfig{Groups: 2, TimeScale: 0.2}, faultLoad{requests: 300, concurrency: 16, faultAt: 100,
		fault: func(c *testenv.Cluster) { killRank(t, c, "g1", 0) }})
}

func TestFaultKillOneOfTwoSchedulers(t *testing.T) {
	runFault(t, testenv.ClusterConfig{Groups: 2, Schedulers: 2, TimeScale: 0.2}, faultLoad{requests: 300, concurrency: 16, faultAt: 100,
		alive: []int{0},
		fault: func(c *testenv.Cluster) {
			if err := c.Cluster.KillScheduler(1); err != nil {
				t.Fatal(err)
			}
			testenv.Eventually(t, 5*time.Second, "the killed scheduler's connection gone", func() bool {
				return !c.Connected(t, "kvbus-scheduler-1")
			})
		}})
}

func TestFaultRestartNATS(t *testing.T) {
	runFault(t, testenv.ClusterConfig{Groups: 2, TimeScale: 0.2, RequestTimeout: 8 * time.Second}, faultLoad{requests: 300, concurrency: 16, faultAt: 100,
		fault: func(c *testenv.Cluster) {
			before := time.Now()
			if err := c.Cluster.RestartNATS(); err != nil {
				t.Fatal(err)
			}
			// The fault took effect: the server now running started after it.
			if vz, err := c.Cluster.NATS.Varz(nil); err != nil || vz.Start.Before(before) {
				t.Fatalf("NATS not restarted: varz %v, %v", vz, err)
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

// TestFaultForgedKVSeq publishes, under load, one KVEventBatch for g0/1
// with seq 2^40 (what a corrupted, replayed or forged batch looks like). It
// must be dropped and counted as malformed, cause next to no resync (no
// storm of dumps), and leave caching on g0 intact: conversations placed on
// g0 afterwards find >= 95% of each previous prompt cached.
func TestFaultForgedKVSeq(t *testing.T) {
	var resyncsBefore float64
	runFault(t, testenv.ClusterConfig{Groups: 2, TimeScale: 0.2}, faultLoad{requests: 300, concurrency: 16, faultAt: 100,
		headers: func(i int) map[string]string { return map[string]string{"X-Session-ID": fmt.Sprint("s", i%10)} },
		fault: func(c *testenv.Cluster) {
			resyncsBefore = testenv.CounterSum(t, c.Registry, "kvbus_scheduler_kv_resyncs_total", nil)
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
		},
		check: func(t *testing.T, c *testenv.Cluster) {
			rejected := testenv.CounterSum(t, c.Registry, "kvbus_scheduler_kv_batches_rejected_total", nil)
			resyncs := testenv.CounterSum(t, c.Registry, "kvbus_scheduler_kv_resyncs_total", nil) - resyncsBefore
			t.Logf("forged batch: rejected %v, resyncs since %v", rejected, resyncs)
			if rejected != 1 {
				t.Errorf("kv_batches_rejected_total = %v, want 1: the forged batch was not recognised", rejected)
			}
			if resyncs > 2 {
				t.Errorf("%v resyncs after one forged batch, want at most 2", resyncs)
			}
			// Caching on g0 still works: conversations until two ran on g0.
			client := &http.Client{Timeout: 30 * time.Second}
			defer client.CloseIdleConnections()
			nc, err := nats.Connect(c.NATS.ClientURL())
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			var metas atomic.Int64
			if _, err := nc.Subscribe("kvbus.meta.g0.>", func(*nats.Msg) { metas.Add(1) }); err != nil {
				t.Fatal(err)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			onG0 := 0
			for conv := 0; conv < 12 && onG0 < 2; conv++ {
				seen := metas.Load()
				turns, err := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 100 + conv,
					Headers: map[string]string{"X-Session-ID": fmt.Sprint("after-forgery-", conv)}}.Run(t.Context(), 3)
				if err != nil {
					t.Fatal(err)
				}
				if metas.Load() == seen {
					continue // placed on g1
				}
				onG0++
				for i, share := range testenv.PreviousShares(turns, 16) {
					if share < 0.95 {
						t.Errorf("conversation %d on g0, turn %d: %.0f%% of the previous prompt cached, want >= 95%%", conv, i+2, 100*share)
					}
				}
			}
			if onG0 == 0 {
				t.Error("no conversation was placed on g0: the check shows nothing")
			}
		}})
}

func TestFaultClientAborts(t *testing.T) {
	runFault(t, testenv.ClusterConfig{Groups: 2, TimeScale: 0.2}, faultLoad{requests: 1000, concurrency: 32, abortRate: 0.1})
}
