package testenv

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// CounterSum sums the series of the counter name in g whose labels include
// every pair of want.
func CounterSum(t testing.TB, g prometheus.Gatherer, name string, want map[string]string) float64 {
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
			sum += m.GetCounter().GetValue()
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
