package quantile

import "testing"

func TestNearestRank(t *testing.T) {
	one20 := make([]int, 20) // 1..20
	for i := range one20 {
		one20[i] = i + 1
	}
	one100 := make([]int, 100)
	for i := range one100 {
		one100[i] = i + 1
	}
	for _, tc := range []struct {
		vals []int
		q    float64
		want int
	}{
		{one20, 0.5, 10}, {one20, 0.95, 19}, {one20, 0.99, 20}, {one20, 1, 20}, {one20, 0, 1},
		{[]int{10, 20}, 0.5, 10}, {[]int{10, 20}, 0.51, 20},
		{one100, 0.07, 7}, {one100, 0.5, 50}, {one100, 0.95, 95},
		{nil, 0.5, 0}, {[]int{3}, 0.5, 3},
	} {
		if got := NearestRank(tc.vals, tc.q); got != tc.want {
			t.Errorf("NearestRank(%d values, %g) = %d, want %d", len(tc.vals), tc.q, got, tc.want)
		}
	}
}
