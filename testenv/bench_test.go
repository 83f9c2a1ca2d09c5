package testenv_test

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// BenchmarkEndToEndHTTP measures the whole pipeline in one process: real
// HTTP on loopback → frontend → JetStream → scheduler → 4 ranks → output,
// with the instant sim engine (--time-scale 0), short chat prompts,
// max_tokens 8, 64 concurrent clients over 64 sessions, info-level logs.
func BenchmarkEndToEndHTTP(b *testing.B) {
	c := testenv.StartCluster(b, testenv.ClusterConfig{Groups: 1, Ranks: 4})
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 128, MaxConnsPerHost: 128}}
	defer client.CloseIdleConnections()
	var (
		mu        sync.Mutex
		latencies []time.Duration
		failed    atomic.Int64
		seq       atomic.Int64
	)
	b.SetParallelism(32) // 32 × GOMAXPROCS(2) = 64 clients
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		var local []time.Duration
		for pb.Next() {
			i := seq.Add(1)
			body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hello %d"}],"max_tokens":8}`, c.Model, i)
			req, _ := http.NewRequest(http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("X-Session-ID", fmt.Sprintf("bench-%d", i%64))
			t0 := time.Now()
			resp, err := client.Do(req)
			if err != nil {
				failed.Add(1)
				continue
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				failed.Add(1)
				continue
			}
			local = append(local, time.Since(t0))
		}
		mu.Lock()
		latencies = append(latencies, local...)
		mu.Unlock()
	})
	elapsed := time.Since(start)
	b.StopTimer()
	if failed.Load() > 0 {
		b.Fatalf("%d requests failed", failed.Load())
	}
	slices.Sort(latencies)
	q := func(p float64) float64 {
		if len(latencies) == 0 {
			return 0
		}
		return float64(latencies[int(p*float64(len(latencies)-1))].Microseconds()) / 1000
	}
	b.ReportMetric(float64(len(latencies))/elapsed.Seconds(), "req/s")
	b.ReportMetric(q(0.50), "p50-ms")
	b.ReportMetric(q(0.99), "p99-ms")
}

// BenchmarkOverload10x drives the frontend at ten times what it admits:
// --max-inflight 32 and 320 concurrent clients sending short chat requests
// to a 1 group × 4 ranks cluster with the instant engine. It reports the
// share of 429s, the p99 latency of admitted requests and the process's
// peak resident memory (VmHWM: the whole cluster and the clients).
func BenchmarkOverload10x(b *testing.B) {
	const admitted, clients = 32, 320
	c := testenv.StartCluster(b, testenv.ClusterConfig{MaxInflight: admitted, LogLevel: slog.LevelWarn})
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: clients, MaxConnsPerHost: clients}}
	defer client.CloseIdleConnections()
	var (
		mu         sync.Mutex
		latencies  []time.Duration
		ok, reject atomic.Int64
		seq        atomic.Int64
	)
	b.SetParallelism(clients / 2) // × GOMAXPROCS 2
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		var local []time.Duration
		for pb.Next() {
			i := seq.Add(1)
			body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"overload %d"}],"max_tokens":4}`, c.Model, i)
			t0 := time.Now()
			resp, err := client.Post(c.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
			if err != nil {
				b.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			switch resp.StatusCode {
			case http.StatusOK:
				ok.Add(1)
				local = append(local, time.Since(t0))
			case http.StatusTooManyRequests:
				reject.Add(1)
			default:
				b.Errorf("status %d", resp.StatusCode)
			}
		}
		mu.Lock()
		latencies = append(latencies, local...)
		mu.Unlock()
	})
	b.StopTimer()
	slices.Sort(latencies)
	if n := len(latencies); n > 0 {
		b.ReportMetric(float64(latencies[(n-1)*99/100].Microseconds())/1000, "p99-admitted-ms")
	}
	b.ReportMetric(float64(reject.Load())/float64(ok.Load()+reject.Load()), "share-429")
	b.ReportMetric(peakRSSMiB(b), "peak-RSS-MiB")
}

// peakRSSMiB reads VmHWM from /proc/self/status (Linux).
func peakRSSMiB(b *testing.B) float64 {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		b.Skipf("no /proc/self/status: %v", err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			var kb float64
			fmt.Sscanf(strings.TrimSpace(rest), "%f", &kb)
			return kb / 1024
		}
	}
	return 0
}
