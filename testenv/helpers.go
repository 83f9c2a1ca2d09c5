package testenv

import (
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvbus/kvbus/messages"
)

// CounterSum sums the series of the counter name in g whose labels include
// every pair of want.
func CounterSum(t testing.TB, g prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	return metricSum(t, g, name, want, func(m *dto.Metric) float64 { return m.GetCounter().GetValue() })
}

// GaugeSum sums the series of the gauge name in g whose labels include
// every pair of want (the one series they name, with every label).
func GaugeSum(t testing.TB, g prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	return metricSum(t, g, name, want, func(m *dto.Metric) float64 { return m.GetGauge().GetValue() })
}

// HistogramCount sums the sample counts of the histogram name's series in
// g whose labels include every pair of want.
func HistogramCount(t testing.TB, g prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	return metricSum(t, g, name, want, func(m *dto.Metric) float64 { return float64(m.GetHistogram().GetSampleCount()) })
}

// SeriesCount counts the series of the metric name in g whose labels
// include every pair of want.
func SeriesCount(t testing.TB, g prometheus.Gatherer, name string, want map[string]string) int {
	t.Helper()
	return int(metricSum(t, g, name, want, func(*dto.Metric) float64 { return 1 }))
}

func metricSum(t testing.TB, g prometheus.Gatherer, name string, want map[string]string, value func(*dto.Metric) float64) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if labels[k] != v {
					continue series
				}
			}
			sum += value(m)
		}
	}
	return sum
}

// PromptTokens returns n deterministic token ids that differ by seed.
func PromptTokens(seed, n int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32(1 + (seed*1_000_003+i*7919)%128000)
	}
	return p
}

// Send makes one HTTP request with a JSON content type and headers, on a
// client of its own, and returns the status, headers and body. Transport
// errors fail the test.
func Send(t testing.TB, method, url, body string, headers map[string]string) (int, http.Header, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, b
}

// ServeEngine serves a stand-in model server on loopback for the test:
// GET /health answers 200, everything else goes to h. It returns the
// server's base URL.
func ServeEngine(t testing.TB, h http.HandlerFunc) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.Handle("/", h)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}

// EphemeralPortLow is the lowest port of the kernel's ephemeral range
// (Linux's default, 32768, where it cannot be read); at least 21000. A
// port a test picks below it for a process to bind later is one the kernel
// never hands to another process's bind(:0) or connect() meanwhile.
func EphemeralPortLow() int {
	lo := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 0 {
			if n, err := strconv.Atoi(f[0]); err == nil {
				lo = n
			}
		}
	}
	return max(lo, 21000)
}

// FreeAddrs returns n distinct loopback addresses free a moment ago, for a
// process or server that takes no open listener to bind later. Their
// ports are drawn at random between 20000 and EphemeralPortLow, where the
// kernel never picks one for another process's bind(:0) or connect(): only
// a process binding that very number can take one before the caller does
// (the kernel's own pick, 127.0.0.1:0, was free for any process to be
// given again). Where the range leaves no room below it, the kernel picks.
func FreeAddrs(t testing.TB, n int) []string {
	t.Helper()
	var out []string
	var held []net.Listener
	defer func() {
		for _, l := range held {
			_ = l.Close()
		}
	}()
	lo := EphemeralPortLow()
	for tries := 0; len(out) < n; tries++ {
		addr := "127.0.0.1:0"
		if lo > 21000 && tries < 1000*n {
			addr = "127.0.0.1:" + strconv.Itoa(20000+rand.IntN(lo-20000))
		}
		l, err := net.Listen("tcp", addr)
		if err != nil {
			if addr == "127.0.0.1:0" {
				t.Fatal(err)
			}
			continue // in use
		}
		held = append(held, l) // until all are drawn: n distinct
		out = append(out, l.Addr().String())
	}
	return out
}

// RequestOutputs returns the messages of msgs that are outputs of a
// request: the schedulers' probes of a frontend (messages.FrontendProbeReqID)
// on the same subjects are not.
func RequestOutputs(msgs []*nats.Msg) []*nats.Msg {
	var out []*nats.Msg
	for _, m := range msgs {
		if o, err := messages.DecodeOutput(m.Data); err == nil && o.ReqID == messages.FrontendProbeReqID {
			continue
		}
		out = append(out, m)
	}
	return out
}
