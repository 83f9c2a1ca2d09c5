package replay

import (
	"cmp"
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
	"unicode"
	"unicode/utf8"

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
	// RemoteUnknown: how much of CachedTokens was read from another group
	// is not known (through HTTP, where the bus did not tell it).
	RemoteUnknown bool
	Sent          time.Time
	TTFT          time.Duration // to the first output chunk
	E2E           time.Duration // to the last
	Err           string
}

// DefaultPolicyLabel labels a report given no policy (a replay without
// --policy-label).
const DefaultPolicyLabel = "replay"

// Latency summarises durations in milliseconds.
type Latency struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P95  float64 `json:"p95"`
	P99  float64 `json:"p99"`
}

// Report is the summary of a replay. JSON keys are the contract of
// `kvbus replay --json` and `kvbus bench --json`.
//
// What only succeeded requests measure (the hit ratios, TTFT, e2e) is nil,
// null in the JSON, when none succeeded: no data, not a zero. So are the
// local and remote hit ratios when the split of a succeeded request's
// cached tokens is not known (RemoteCachedTokens is then 0).
type Report struct {
	Policy         string   `json:"policy"`
	Trace          string   `json:"trace,omitempty"`
	Requests       int      `json:"requests"`
	OK             int      `json:"ok"`
	Failed         int      `json:"failed"`
	DurationS      float64  `json:"duration_s"`
	ThroughputRPS  float64  `json:"throughput_rps"`
	PromptTokens   int64    `json:"prompt_tokens"`
	CachedTokens   int64    `json:"cached_tokens"`
	RemoteTokens   int64    `json:"remote_cached_tokens"`
	HitRatio       *float64 `json:"hit_ratio"`
	LocalHitRatio  *float64 `json:"local_hit_ratio"`
	RemoteHitRatio *float64 `json:"remote_hit_ratio"`
	// RemoteBytes is what moved between groups, when the caller knows the
	// bytes per token of all ranks of a group (kvbus bench does); nil,
	// left out of the JSON, when it does not (a replay).
	RemoteBytes   *int64  `json:"remote_bytes,omitempty"`
	IdealHitRatio float64 `json:"ideal_hit_ratio"`
	// HitRatioByTurn has a key only for the turn depths (1, 2, 3, 4+) at
	// which requests succeeded.
	HitRatioByTurn map[string]float64 `json:"hit_ratio_by_turn"`
	TTFT           *Latency           `json:"ttft_ms"`
	E2E            *Latency           `json:"e2e_ms"`
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
// latency and hit ratios) and the ideal hit ratio of the trace. An empty
// policy is DefaultPolicyLabel.
func Summarize(policy string, results []Result, ideal float64, elapsed time.Duration) *Report {
	if policy == "" {
		policy = DefaultPolicyLabel
	}
	r := &Report{Policy: policy, Requests: len(results), IdealHitRatio: ideal, HitRatioByTurn: map[string]float64{}, DurationS: elapsed.Seconds()}
	var ttft, e2e []time.Duration
	remoteUnknown := false
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
		remoteUnknown = remoteUnknown || res.RemoteUnknown
		d := turnLabel(res.TurnDepth)
		t := byTurn[d]
		byTurn[d] = [2]int64{t[0] + int64(res.CachedTokens), t[1] + int64(res.PromptTokens)}
		if res.Group != "" {
			groups[res.Group]++
		}
	}
	r.HitRatio = ratio(r.CachedTokens, r.PromptTokens)
	if remoteUnknown {
		r.RemoteTokens = 0 // a part would read as the whole
	} else {
		r.LocalHitRatio = ratio(r.CachedTokens-r.RemoteTokens, r.PromptTokens)
		r.RemoteHitRatio = ratio(r.RemoteTokens, r.PromptTokens)
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

// ratio is n/d, or nil when there is nothing to divide (d = 0).
func ratio(n, d int64) *float64 {
	if d <= 0 {
		return nil
	}
	v := float64(n) / float64(d)
	return &v
}

// name is the report's policy, DefaultPolicyLabel for a report without
// one (a JSON file of an older replay).
func (r *Report) name() string {
	if r.Policy == "" {
		return DefaultPolicyLabel
	}
	return r.Policy
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

// maxErrorLine bounds an error's first line as a key of Report.Errors, and
// maxErrorKey any key (an OpenAI error's whole message), in bytes.
const (
	maxErrorLine = 240
	maxErrorKey  = 1024
)

// errorClass is the cause of a failure as a key of Report.Errors: an HTTP
// OpenAI error body as its status, code (or type) and whole message, any
// other error as its first line; every run of four or more digits (token
// counts, lengths, ids) reads "N", so that one cause is one key however
// many requests it failed. Status codes stay. A key is one printable line
// of valid UTF-8: the table prints it on a terminal.
func errorClass(s string) string {
	if k, ok := openAIError(s); ok {
		return clip(digitsAsN(printable(k)), maxErrorKey)
	}
	return clip(digitsAsN(printable(firstLine(s))), maxErrorLine)
}

// openAIError reads "http STATUS: BODY" (a failed replayed request) where
// BODY is an OpenAI error, {"error":{"message","type","code"}} (or vLLM's
// older {"object":"error","message","type","code"}), as "http STATUS CODE:
// MESSAGE", CODE being the error's code when it is a word, else its type.
func openAIError(s string) (string, bool) {
	rest, ok := strings.CutPrefix(s, "http ")
	if !ok {
		return "", false
	}
	status, body, ok := strings.Cut(rest, ": ")
	if !ok || len(status) != 3 || strings.Trim(status, "0123456789") != "" {
		return "", false
	}
	type object struct {
		Message string          `json:"message"`
		Type    string          `json:"type"`
		Code    json.RawMessage `json:"code"`
	}
	var e struct {
		object
		Object string  `json:"object"`
		Error  *object `json:"error"`
	}
	if json.Unmarshal([]byte(body), &e) != nil {
		return "", false
	}
	o := e.Error
	if o == nil && e.Object == "error" {
		o = &e.object
	}
	if o == nil || strings.TrimSpace(o.Message) == "" {
		return "", false
	}
	kind := o.Type
	var code string
	if json.Unmarshal(o.Code, &code) == nil && strings.TrimSpace(code) != "" {
		kind = code
	}
	key := "http " + status
	if kind = strings.Join(strings.Fields(kind), " "); kind != "" {
		key += " " + kind
	}
	return key + ": " + strings.Join(strings.Fields(o.Message), " "), true
}

// firstLine is s up to its first line break (\n or \r), trimmed.
func firstLine(s string) string {
	if i := strings.IndexAny(s, "\r\n"); i >= 0 {
		s = s[:i]
	}
	return strings.TrimSpace(s)
}

// printable is s with each control character (an escape sequence's ESC, a
// tab) a space, and each byte that is not UTF-8 U+FFFD.
func printable(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
}

// clip cuts s to at most n bytes at a character boundary, and says so
// with "…".
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}

// digitsAsN writes every run of four or more digits of s as "N".
func digitsAsN(s string) string {
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

// summarize sorts ds and summarises them; nil when there are none.
func summarize(ds []time.Duration) *Latency {
	if len(ds) == 0 {
		return nil
	}
	slices.Sort(ds)
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	q := func(p float64) float64 { return ms(quantile.NearestRank(ds, p)) }
	return &Latency{Mean: ms(sum / time.Duration(len(ds))), P50: q(0.50), P95: q(0.95), P99: q(0.99)}
}

func ms(d time.Duration) float64 { return math.Round(float64(d)/1e3) / 1e3 }

// IdealHitRatio is the hit ratio of an infinite cache shared by all groups:
// each prompt, in arrival order, finds the longest prefix of its full blocks
// seen in any earlier prompt (never the whole prompt: one token is always
// computed, as in the pipeline). model is the model every request asks
// for (Config.Model); empty, each request asks for the model a replay gives
// it (a captured request its own, a trace's DefaultModel). The model seeds
// the block hashes with a captured request's LoRA adapter and cache_salt,
// as the scheduler's: prompts of two models, adapters or salts share
// nothing (a request replayed as another model's goes without its
// adapter).
func IdealHitRatio(items []Item, model string, blockSize int) float64 {
	if blockSize < 1 {
		return 0
	}
	seen := map[uint64]struct{}{}
	var cached, total int64
	var hashes []uint64
	for _, it := range items {
		asked, lora, salt := "", "", ""
		if it.Request != nil {
			asked, lora, salt = it.Request.Model, it.Request.LoRAName, it.Request.CacheSalt
		}
		m := cmp.Or(model, asked, DefaultModel)
		if m != asked {
			lora = "" // sent without it (Replayer.request)
		}
		seed := scheduler.PromptSeed(m, lora, salt)
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

// field is one figure of the reports: key names it in the table, title on
// the page, with its unit. cell is false when a report has no data for it
// (nothing succeeded, no request at that depth, groups unknown).
type field struct {
	key, title string
	cell       func(r *Report) (string, bool)
}

// fields are the figures the table and the page show, in order: those of
// the JSON report (DESIGN §8), and the hit ratio at each turn depth at
// which a report had requests.
func fields(reports []*Report) []field {
	count := func(n func(r *Report) int) func(r *Report) (string, bool) {
		return func(r *Report) (string, bool) { return fmt.Sprint(n(r)), true }
	}
	share := func(v func(r *Report) *float64) func(r *Report) (string, bool) {
		return func(r *Report) (string, bool) {
			if p := v(r); p != nil {
				return fmt.Sprintf("%.3f", *p), true
			}
			return "", false
		}
	}
	fs := []field{
		{"requests", "requests", count(func(r *Report) int { return r.Requests })},
		{"ok", "ok (requests)", count(func(r *Report) int { return r.OK })},
		{"failed", "failed (requests)", count(func(r *Report) int { return r.Failed })},
		{"throughput req/s", "throughput (ok req/s)", func(r *Report) (string, bool) { return fmt.Sprintf("%.1f", r.ThroughputRPS), true }},
		{"hit_ratio", "hit ratio (cached / prompt tokens)", share(func(r *Report) *float64 { return r.HitRatio })},
		{"local_hit_ratio", "local hit ratio (cached in the group / prompt tokens)", share(func(r *Report) *float64 { return r.LocalHitRatio })},
		{"remote_hit_ratio", "remote hit ratio (from other groups / prompt tokens)", share(func(r *Report) *float64 { return r.RemoteHitRatio })},
		{"remote MiB moved", "moved between groups (MiB)", remoteMiB},
		{"ideal_hit_ratio", "ideal hit ratio (infinite shared cache / prompt tokens)", func(r *Report) (string, bool) { return fmt.Sprintf("%.3f", r.IdealHitRatio), true }},
	}
	for _, d := range turnDepths(reports) {
		fs = append(fs, field{"hit_ratio turn " + d, "hit ratio at turn " + d + " (cached / prompt tokens)", func(r *Report) (string, bool) {
			v, ok := r.HitRatioByTurn[d]
			return fmt.Sprintf("%.3f", v), ok
		}})
	}
	for _, l := range []struct {
		key, title string
		of         func(r *Report) *Latency
	}{{"ttft_ms", "TTFT", func(r *Report) *Latency { return r.TTFT }}, {"e2e_ms", "e2e latency", func(r *Report) *Latency { return r.E2E }}} {
		for _, q := range []struct {
			name string
			of   func(l *Latency) float64
		}{{"mean", func(l *Latency) float64 { return l.Mean }}, {"p50", func(l *Latency) float64 { return l.P50 }},
			{"p95", func(l *Latency) float64 { return l.P95 }}, {"p99", func(l *Latency) float64 { return l.P99 }}} {
			fs = append(fs, field{l.key + " " + q.name, l.title + " " + q.name + " (ms)", func(r *Report) (string, bool) {
				if lat := l.of(r); lat != nil {
					return fmt.Sprintf("%.1f", q.of(lat)), true
				}
				return "", false
			}})
		}
	}
	return append(fs, field{"group load max/mean", "group load (busiest / mean requests per group)", func(r *Report) (string, bool) {
		if len(r.GroupRequests) == 0 || r.GroupLoadMaxOverMean == 0 {
			// Groups unknown (a replay through HTTP without the bus), or
			// none served a request (the JSON leaves the figure out).
			return "", false
		}
		return fmt.Sprintf("%.2f", r.GroupLoadMaxOverMean), true
	}})
}

// remoteMiB is what moved between groups, known when the caller gave the
// bytes (kvbus bench) or nothing was read from another group.
func remoteMiB(r *Report) (string, bool) {
	if r.OK == 0 || r.RemoteHitRatio == nil || (r.RemoteTokens > 0 && r.RemoteBytes == nil) {
		return "", false
	}
	var n int64
	if r.RemoteBytes != nil {
		n = *r.RemoteBytes
	}
	return fmt.Sprintf("%.1f", float64(n)/(1<<20)), true
}

// turnDepths are the turn depths at which any of reports had requests,
// sorted.
func turnDepths(reports []*Report) []string {
	var ds []string
	for _, r := range reports {
		for d := range r.HitRatioByTurn {
			if !slices.Contains(ds, d) {
				ds = append(ds, d)
			}
		}
	}
	slices.Sort(ds)
	return ds
}

// causes are the keys of r.Errors, the commonest first.
func causes(r *Report) []string {
	cs := make([]string, 0, len(r.Errors))
	for c := range r.Errors {
		cs = append(cs, c)
	}
	sort.Slice(cs, func(i, j int) bool {
		if r.Errors[cs[i]] != r.Errors[cs[j]] {
			return r.Errors[cs[i]] > r.Errors[cs[j]]
		}
		return cs[i] < cs[j]
	})
	return cs
}

// WriteTable prints reports side by side, one column per report, "-" where
// a report has no data (see Report), and under them the three commonest
// causes of each report's failures.
func WriteTable(w io.Writer, reports []*Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name string, cell func(r *Report) (string, bool)) {
		fmt.Fprint(tw, name+"\t")
		for _, r := range reports {
			v, ok := cell(r)
			if !ok {
				v = "-"
			}
			fmt.Fprint(tw, v+"\t")
		}
		fmt.Fprintln(tw)
	}
	row("policy", func(r *Report) (string, bool) { return r.name(), true })
	for _, f := range fields(reports) {
		row(f.key, f.cell)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range reports {
		cs := causes(r)
		for _, c := range cs[:min(3, len(cs))] {
			if _, err := fmt.Fprintf(w, "failed (%s): %d × %s\n", r.name(), r.Errors[c], c); err != nil {
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
