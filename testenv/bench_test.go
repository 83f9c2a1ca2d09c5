package testenv_test

import (
	"fmt"
	"io"
	"net/http"
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
