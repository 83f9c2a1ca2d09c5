// Package quantile computes percentiles the one way kvbus reports them,
// by nearest rank: bench and replay reports, kvbus top and kvbus loadgen
// agree on the same samples.
package quantile

import "math"

// NearestRank returns the q-quantile (0 ≤ q ≤ 1) of sorted, ascending
// values by the nearest-rank method: the smallest value with at least a
// share q of the values at or below it, sorted[⌈q·n⌉−1] (the smallest for
// q = 0); the zero value when there are none. A q·n within 1e-9 of an
// integer counts as that integer, so that 0.07 × 100 is rank 7, not 8.
func NearestRank[T any](sorted []T, q float64) T {
	var zero T
	if len(sorted) == 0 {
		return zero
	}
	i := int(math.Ceil(q*float64(len(sorted))-1e-9)) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}
