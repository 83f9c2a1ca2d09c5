package replay

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvbus/kvbus/internal/quantile"
	"github.com/kvbus/kvbus/scheduler"
)

// Result is what happened to one replayed request.
type Result struct {
	ReqID        string
	SessionID    string
	TurnDepth    int
	Group        string
	PromptTokens int
	CachedTokens int
	RemoteTokens int // of CachedTokens, read from another group (global pool)
	Sent         time.Time
	TTFT         time.Duration // to the first output chunk
	E2E          time.Duration // to the last
	Err          string
}

// Latency summarises durations in milliseconds.
type Latency struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P95  float64 `json:"p95"`
	P99  float64 `json:"p99"`
}

// Report is the summary of a replay. JSON keys are the contract of
// `kvbus replay --json` and `kvbus bench --json`.
type Report struct {
	Policy         string  `json:"policy"`
	Trace          string  `json:"trace,omitempty"`
	Requests       int     `json:"requests"`
	OK             int     `json:"ok"`
	Failed         int     `json:"failed"`
	DurationS      float64 `json:"duration_s"`
	ThroughputRPS  float64 `json:"throughput_rps"`
	PromptTokens   int64   `json:"prompt_tokens"`
	CachedTokens   int64   `json:"cached_tokens"`
	RemoteTokens   int64   `json:"remote_cached_tokens"`
	HitRatio       float64 `json:"hit_ratio"`
	LocalHitRatio  float64 `json:"local_hit_ratio"`
	RemoteHitRatio float64 `json:"remote_hit_ratio"`
	// RemoteBytes is what moved between groups, when the caller knows the
	// bytes per token of all ranks of a group (kvbus bench does).
	RemoteBytes    int64              `json:"remote_bytes,omitempty"`
	IdealHitRatio  float64            `json:"ideal_hit_ratio"`
	HitRatioByTurn map[string]float64 `json:"hit_ratio_by_turn"`
	TTFT           Latency            `json:"ttft_ms"`
	E2E            Latency            `json:"e2e_ms"`
	GroupRequests  map[string]int     `json:"group_requests,omitempty"`
	// GroupLoadMaxOverMean is the busiest group's requests over the mean
	// of the groups': those that served requests, and every group of the
	// cluster when it is known (CountGroups), idle ones at zero. Absent
	// when no request's group is known.
	GroupLoadMaxOverMean float64        `json:"group_load_max_over_mean,omitempty"`
	Errors               map[string]int `json:"errors,omitempty"`
	// TTFTCDF is the TTFT distribution, for plotting: its 0th, 1st, …,
	// 100th percentiles in milliseconds.
	TTFTCDF []float64 `json:"ttft_cdf_ms,omitempty"`
	// GroupTimeline counts requests sent to each group per BucketS seconds
	// from the first request.
	GroupTimeline *Timeline `json:"group_timeline,omitempty"`
}

// Timeline is a count per group per time bucket.
type Timeline struct {
	BucketS float64          `json:"bucket_s"`
	Groups  map[string][]int `json:"groups"`
}

// Summarize builds a report from per-request results (ok ones count toward
// latency and hit ratios) and the ideal hit ratio of the trace.
func Summarize(policy string, results []Result, ideal float64, elapsed time.Duration) *Report {
	r := &Report{Policy: policy, Requests: len(results), IdealHitRatio: ideal, HitRatioByTurn: map[string]float64{}, DurationS: elapsed.Seconds()}
	var ttft, e2e []time.Duration
	byTurn := map[string][2]int64{}
	groups := map[string]int{}
	for _, res := range results {
		if res.Err != "" {
			r.Failed++
			if r.Errors == nil {
				r.Errors = map[string]int{}
			}
			r.Errors[errorClass(res.Err)]++
			continue
		}
		r.OK++
		ttft, e2e = append(ttft, res.TTFT), append(e2e, res.E2E)
		r.PromptTokens += int64(res.PromptTokens)
		r.CachedTokens += int64(res.CachedTokens)
		r.RemoteTokens += int64(res.RemoteTokens)
		d := turnLabel(res.TurnDepth)
		t := byTurn[d]
		byTurn[d] = [2]int64{t[0] + int64(res.CachedTokens), t[1] + int64(res.PromptTokens)}
		if res.Group != "" {
			groups[res.Group]++
		}
	}
	if r.PromptTokens > 0 {
		r.HitRatio = float64(r.CachedTokens) / float64(r.PromptTokens)
		r.RemoteHitRatio = float64(r.RemoteTokens) / float64(r.PromptTokens)
		r.LocalHitRatio = r.HitRatio - r.RemoteHitRatio
	}
	for d, t := range byTurn {
		if t[1] > 0 {
			r.HitRatioByTurn[d] = float64(t[0]) / float64(t[1])
		}
	}
	if elapsed > 0 {
		r.ThroughputRPS = float64(r.OK) / elapsed.Seconds()
	}
	r.TTFT, r.E2E = summarize(ttft), summarize(e2e) // sorts them
	if len(ttft) > 0 {
		r.TTFTCDF = make([]float64, 101)
		for p := range r.TTFTCDF {
			r.TTFTCDF[p] = ms(quantile.NearestRank(ttft, float64(p)/100))
		}
	}
	r.GroupTimeline = timeline(results)
	if len(groups) > 0 {
		r.GroupRequests = groups
		r.spread()
	}
	return r
}

// CountGroups adds the cluster's groups that served no request to the
// load spread, at zero: a run that put every request on one of four groups
// is 4.00, not an even 1.00.
func (r *Report) CountGroups(names []string) {
	if r.GroupRequests == nil {
		r.GroupRequests = map[string]int{}
	}
	for _, g := range names {
		if _, ok := r.GroupRequests[g]; !ok {
			r.GroupRequests[g] = 0
		}
	}
	r.spread()
}

func (r *Report) spread() {
	maxN, sum := 0, 0
	for _, n := range r.GroupRequests {
		maxN, sum = max(maxN, n), sum+n
	}
	r.GroupLoadMaxOverMean = 0
	if sum > 0 {
		r.GroupLoadMaxOverMean = float64(maxN) / (float64(sum) / float64(len(r.GroupRequests)))
	}
}

// timeline buckets the successful requests by group and send time, in at
// most about 60 buckets of whole seconds.
func timeline(results []Result) *Timeline {
	var first, last time.Time
	for _, res := range results {
		if res.Err != "" || res.Group == "" || res.Sent.IsZero() {
			continue
		}
		if first.IsZero() || res.Sent.Before(first) {
			first = res.Sent
		}
		if res.Sent.After(last) {
			last = res.Sent
		}
	}
	if first.IsZero() {
		return nil
	}
	bucket := max(math.Ceil(last.Sub(first).Seconds()/60), 1)
	n := int(last.Sub(first).Seconds()/bucket) + 1
	tl := &Timeline{BucketS: bucket, Groups: map[string][]int{}}
	for _, res := range results {
		if res.Err != "" || res.Group == "" || res.Sent.IsZero() {
			continue
		}
		counts := tl.Groups[res.Group]
		if counts == nil {
			counts = make([]int, n)
			tl.Groups[res.Group] = counts
		}
		counts[min(int(res.Sent.Sub(first).Seconds()/bucket), n-1)]++
	}
	return tl
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > 240 {
		s = s[:240]
	}
	return s
}

// errorClass is an error's first line with every run of four or more
// digits (token counts, lengths, ids) as "N", so that one cause is one
// key of Report.Errors however many requests it failed; status codes stay.
func errorClass(s string) string {
	s = firstLine(s)
	var b strings.Builder
	for i := 0; i < len(s); {
		j := i
		for j < len(s) && s[j] >= '0' && s[j] <= '9' {
			j++
		}
		switch {
		case j-i >= 4:
			b.WriteByte('N')
		case j > i:
			b.WriteString(s[i:j])
		default:
			b.WriteByte(s[i])
			j++
		}
		i = j
	}
	return b.String()
}

func turnLabel(d int) string {
	if d >= 4 {
		return "4+"
	}
	return fmt.Sprint(max(d, 1))
}

func summarize(ds []time.Duration) Latency {
	if len(ds) == 0 {
		return Latency{}
	}
	slices.Sort(ds)
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	q := func(p float64) float64 { return ms(quantile.NearestRank(ds, p)) }
	return Latency{Mean: ms(sum / time.Duration(len(ds))), P50: q(0.50), P95: q(0.95), P99: q(0.99)}
}

func ms(d time.Duration) float64 { return math.Round(float64(d)/1e3) / 1e3 }

// IdealHitRatio is the hit ratio of an infinite cache shared by all groups:
// each prompt, in arrival order, finds the longest prefix of its full blocks
// seen in any earlier prompt (never the whole prompt: one token is always
// computed, as in the pipeline).
func IdealHitRatio(items []Item, model string, blockSize int) float64 {
	if blockSize < 1 {
		return 0
	}
	seen := map[uint64]struct{}{}
	seed := scheduler.HashSeed(model)
	var cached, total int64
	var hashes []uint64
	for _, it := range items {
		hashes = scheduler.HashBlocks(hashes[:0], seed, it.Prompt, blockSize)
		n := 0
		for n < len(hashes) {
			if _, ok := seen[hashes[n]]; !ok {
				break
			}
			n++
		}
		n = min(n, max(len(it.Prompt)-1, 0)/blockSize)
		cached += int64(n * blockSize)
		total += int64(len(it.Prompt))
		for _, h := range hashes {
			seen[h] = struct{}{}
		}
	}
	if total == 0 {
		return 0
	}
	return float64(cached) / float64(total)
}

// WriteTable prints reports side by side, one column per report.
func WriteTable(w io.Writer, reports []*Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name string, f func(r *Report) string) {
		fmt.Fprint(tw, name+"\t")
		for _, r := range reports {
			fmt.Fprint(tw, f(r)+"\t")
		}
		fmt.Fprintln(tw)
	}
	row("policy", func(r *Report) string { return r.Policy })
	row("requests", func(r *Report) string { return fmt.Sprint(r.Requests) })
	row("ok", func(r *Report) string { return fmt.Sprint(r.OK) })
	row("failed", func(r *Report) string { return fmt.Sprint(r.Failed) })
	row("throughput req/s", func(r *Report) string { return fmt.Sprintf("%.1f", r.ThroughputRPS) })
	row("hit_ratio", func(r *Report) string { return fmt.Sprintf("%.3f", r.HitRatio) })
	row("local_hit_ratio", func(r *Report) string { return fmt.Sprintf("%.3f", r.LocalHitRatio) })
	row("remote_hit_ratio", func(r *Report) string { return fmt.Sprintf("%.3f", r.RemoteHitRatio) })
	row("remote MiB moved", func(r *Report) string { return fmt.Sprintf("%.1f", float64(r.RemoteBytes)/(1<<20)) })
	row("ideal_hit_ratio", func(r *Report) string { return fmt.Sprintf("%.3f", r.IdealHitRatio) })
	turns := map[string]bool{}
	for _, r := range reports {
		for d := range r.HitRatioByTurn {
			turns[d] = true
		}
	}
	ds := make([]string, 0, len(turns))
	for d := range turns {
		ds = append(ds, d)
	}
	sort.Strings(ds)
	for _, d := range ds {
		row("hit_ratio turn "+d, func(r *Report) string { return fmt.Sprintf("%.3f", r.HitRatioByTurn[d]) })
	}
	for _, l := range []struct {
		name string
		f    func(r *Report) Latency
	}{{"ttft_ms", func(r *Report) Latency { return r.TTFT }}, {"e2e_ms", func(r *Report) Latency { return r.E2E }}} {
		row(l.name+" mean", func(r *Report) string { return fmt.Sprintf("%.1f", l.f(r).Mean) })
		row(l.name+" p50", func(r *Report) string { return fmt.Sprintf("%.1f", l.f(r).P50) })
		row(l.name+" p95", func(r *Report) string { return fmt.Sprintf("%.1f", l.f(r).P95) })
		row(l.name+" p99", func(r *Report) string { return fmt.Sprintf("%.1f", l.f(r).P99) })
	}
	row("group load max/mean", func(r *Report) string {
		if len(r.GroupRequests) == 0 {
			return "-" // groups unknown (a replay through HTTP without the bus)
		}
		return fmt.Sprintf("%.2f", r.GroupLoadMaxOverMean)
	})
	if err := tw.Flush(); err != nil {
		return err
	}
	// Why requests failed: the three commonest causes of each report.
	for _, r := range reports {
		classes := make([]string, 0, len(r.Errors))
		for c := range r.Errors {
			classes = append(classes, c)
		}
		sort.Slice(classes, func(i, j int) bool {
			if r.Errors[classes[i]] != r.Errors[classes[j]] {
				return r.Errors[classes[i]] > r.Errors[classes[j]]
			}
			return classes[i] < classes[j]
		})
		for _, c := range classes[:min(3, len(classes))] {
			if _, err := fmt.Fprintf(w, "failed (%s): %d × %s\n", r.Policy, r.Errors[c], c); err != nil {
				return err
			}
		}
	}
	return nil
}

// WriteJSON writes reports as a JSON list to path.
func WriteJSON(path string, reports []*Report) error {
	data, err := json.MarshalIndent(reports, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(data, '\n'), 0o644)
}
