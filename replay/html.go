package replay

import (
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
)

// palette colours the reports in order (colour-blind safe, Okabe–Ito).
func palette(i int) string {
	p := [...]string{"#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"}
	return p[i%len(p)]
}

// WriteHTML writes one self-contained page (inline SVG, no script, nothing
// fetched at view time) drawn from reports: why requests failed, if any
// did; the TTFT CDF per report, the hit ratio by turn depth per report
// against the ideal, local and remote cached tokens, requests per group
// over time, and the reports' figures. What a report has no data for is
// "–", never drawn as a zero.
func WriteHTML(w io.Writer, title string, reports []*Report) error {
	var b strings.Builder
	fmt.Fprintf(&b, `<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>%s</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;font-variant-numeric:tabular-nums}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}.legend span{display:inline-block;margin-right:16px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:5px;vertical-align:-1px}
svg text{font:11px system-ui,sans-serif;fill:#333}
td.cause,th.cause{text-align:left;max-width:760px;overflow-wrap:anywhere}
</style></head><body>
<h1>%s</h1>
`, html.EscapeString(title), html.EscapeString(title))
	if len(reports) == 0 {
		b.WriteString("<p>No reports.</p>")
	} else {
		b.WriteString(`<p class="legend">`)
		for i, r := range reports {
			fmt.Fprintf(&b, `<span><i style="background:%s"></i>%s</span>`, palette(i), html.EscapeString(label(r)))
		}
		b.WriteString("</p>\n")
		if slices.ContainsFunc(reports, func(r *Report) bool { return r.Failed > 0 }) {
			b.WriteString("<h2>Failed requests, by cause</h2>\n")
			b.WriteString(failures(reports))
		}
		b.WriteString("<h2>TTFT, cumulative distribution</h2>\n")
		b.WriteString(ttftCDF(reports))
		b.WriteString("<h2>Hit ratio by turn depth (dashed: ideal hit ratio of the trace)</h2>\n")
		b.WriteString(hitByTurn(reports))
		b.WriteString("<h2>Cached tokens: local and from other groups (remote), share of prompt tokens</h2>\n")
		b.WriteString(localRemote(reports))
		b.WriteString("<h2>Requests per group over time</h2>\n")
		for _, r := range reports {
			b.WriteString(groupTimeline(r))
		}
		b.WriteString("<h2>Figures</h2>\n")
		b.WriteString(figures(reports))
	}
	b.WriteString("\n</body></html>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteHTMLFile writes WriteHTML's page to path.
func WriteHTMLFile(path, title string, reports []*Report) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := WriteHTML(f, title, reports); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// ReadJSON reads reports written by WriteJSON (a list, or one report).
func ReadJSON(r io.Reader) ([]*Report, error) {
	data, err := io.ReadAll(io.LimitReader(r, 256<<20))
	if err != nil {
		return nil, err
	}
	var list []*Report
	if err := json.Unmarshal(data, &list); err == nil {
		if slices.Contains(list, nil) {
			return nil, errors.New("replay: not a kvbus report: a null in the list of reports")
		}
		if err := checkDepths(list); err != nil {
			return nil, err
		}
		var keys []map[string]json.RawMessage
		if err := json.Unmarshal(data, &keys); err != nil {
			return nil, fmt.Errorf("replay: not a kvbus report: %w", err)
		}
		for i, k := range keys {
			if err := checkPolicyKey(k); err != nil {
				return nil, fmt.Errorf("%w (report %d)", err, i+1)
			}
		}
		return list, nil
	}
	var one Report
	if err := json.Unmarshal(data, &one); err != nil {
		return nil, fmt.Errorf("replay: not a kvbus report (a JSON list of reports, or one): %w", err)
	}
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(data, &keys); err != nil {
		return nil, fmt.Errorf("replay: not a kvbus report: %w", err)
	}
	if err := checkPolicyKey(keys); err != nil {
		return nil, err
	}
	if err := checkDepths([]*Report{&one}); err != nil {
		return nil, err
	}
	return []*Report{&one}, nil
}

// checkPolicyKey refuses a JSON object that is no report: WriteJSON writes
// every report's "policy". Any other object (another tool's JSON, a
// trace's line) was read as a report of nothing, and kvbus report drew an
// empty page and exited 0.
func checkPolicyKey(keys map[string]json.RawMessage) error {
	if _, ok := keys["policy"]; !ok {
		return errors.New(`replay: not a kvbus report: no "policy" in it; give a file written by kvbus bench or kvbus replay with --json`)
	}
	return nil
}

// checkDepths refuses turn depths that a report does not have (1, 2, 3,
// 4+): each is a row of the table and a group of bars of the page for
// every report, so a file of thousands would draw millions of cells.
func checkDepths(reports []*Report) error {
	for i, r := range reports {
		for d := range r.HitRatioByTurn {
			switch d {
			case "1", "2", "3", "4+":
			default:
				return fmt.Errorf("replay: not a kvbus report: report %d has a hit_ratio_by_turn of depth %q (want 1, 2, 3 or 4+)", i+1, clip(printable(d), 40))
			}
		}
	}
	return nil
}

// ReadJSONFile reads reports from a file written by WriteJSON.
func ReadJSONFile(path string) ([]*Report, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ReadJSON(f)
}

// label names a report: its policy, and its trace when known.
func label(r *Report) string {
	if r.Trace != "" {
		return r.name() + " (" + r.Trace + ")"
	}
	return r.name()
}

// chart geometry: a plot area inside margins.
const (
	chartW, chartH = 720, 300
	marginL        = 56
	marginB        = 36
	marginT        = 12
	marginR        = 16
)

func plotW() float64 { return chartW - marginL - marginR }
func plotH() float64 { return chartH - marginT - marginB }

// axes draws the frame with y ticks from 0 to yMax and x ticks to xMax,
// in quarters.
func axes(b *strings.Builder, xMax, yMax float64, xLabel, yLabel string) {
	fmt.Fprintf(b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" role="img">`, chartW, chartH, chartW, chartH)
	fmt.Fprintf(b, `<rect x="%d" y="%d" width="%.0f" height="%.0f" fill="none" stroke="#999"/>`, marginL, marginT, plotW(), plotH())
	for i := 0; i <= 4; i++ {
		y := marginT + plotH()*(1-float64(i)/4)
		fmt.Fprintf(b, `<line x1="%d" x2="%.0f" y1="%.1f" y2="%.1f" stroke="#eee"/>`, marginL, marginL+plotW(), y, y)
		fmt.Fprintf(b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`, marginL-6, y+4, tick(yMax*float64(i)/4))
		if xMax > 0 {
			x := marginL + plotW()*float64(i)/4
			fmt.Fprintf(b, `<text x="%.1f" y="%.0f" text-anchor="middle">%s</text>`, x, marginT+plotH()+16, tick(xMax*float64(i)/4))
		}
	}
	fmt.Fprintf(b, `<text x="%.0f" y="%d" text-anchor="middle">%s</text>`, marginL+plotW()/2, chartH-4, html.EscapeString(xLabel))
	fmt.Fprintf(b, `<text x="12" y="%.0f" transform="rotate(-90 12 %.0f)" text-anchor="middle">%s</text>`, marginT+plotH()/2, marginT+plotH()/2, html.EscapeString(yLabel))
}

// tick writes an axis value exactly, in as few digits as it takes: 0.025,
// not 0.03; 137.25, not 137.
func tick(v float64) string {
	v, _ = strconv.ParseFloat(strconv.FormatFloat(v, 'g', 12, 64), 64) // 0.1*3/4 is 0.075, not 0.07500000000000001
	return strconv.FormatFloat(v, 'f', -1, 64)
}

// mark writes a vertical note up from the bottom of the plot, centred on
// x where a bar would be, with what it stands for as its title.
func mark(b *strings.Builder, x float64, text, title string) {
	x, y := x+4, marginT+plotH()-4 // the baseline, half a line right of x
	fmt.Fprintf(b, `<text x="%.1f" y="%.1f" transform="rotate(-90 %.1f %.1f)" fill="#777" style="fill:#777"><title>%s</title>%s</text>`,
		x, y, x, y, html.EscapeString(title), html.EscapeString(text))
}

// ttftCDF draws the TTFT distribution of each report up to the largest
// p99 (the tail beyond it would flatten the rest), and says what it left
// out.
func ttftCDF(reports []*Report) string {
	xMax := 0.0
	for _, r := range reports {
		if n := len(r.TTFTCDF); n > 0 {
			xMax = max(xMax, r.TTFTCDF[min(99, n-1)])
		}
	}
	if xMax == 0 {
		return "<p>No TTFT distribution in these reports.</p>\n"
	}
	xMax = niceCeil(xMax)
	var b strings.Builder
	axes(&b, xMax, 1, "TTFT (ms)", "share of requests")
	var cut []string
	for i, r := range reports {
		pts, beyond := cdfPoints(r.TTFTCDF, xMax)
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"><title>%s</title></polyline>`,
			palette(i), strings.Join(pts, " "), html.EscapeString(label(r)))
		if beyond > 0 {
			cut = append(cut, fmt.Sprintf("%s: up to %d%% of requests (slowest %s ms)", label(r), beyond, tick(r.TTFTCDF[len(r.TTFTCDF)-1])))
		}
	}
	b.WriteString("</svg>\n")
	if len(cut) > 0 {
		fmt.Fprintf(&b, "<p>The x axis cut at %s ms, past the largest p99; not drawn beyond it: %s.</p>\n",
			tick(xMax), html.EscapeString(strings.Join(cut, "; ")))
	}
	return b.String()
}

// cdfPoints are the points of a CDF given as percentiles (0th to 100th)
// within xMax, then flat to the axis' edge at the share known to be within
// it; beyond is how many percentiles are past xMax, each 1% of requests at
// most.
func cdfPoints(cdf []float64, xMax float64) (pts []string, beyond int) {
	at := func(v float64, p int) string {
		return fmt.Sprintf("%.1f,%.1f", marginL+plotW()*v/xMax, marginT+plotH()*(1-float64(p)/100))
	}
	last := -1
	for p, v := range cdf {
		if v > xMax {
			break
		}
		pts, last = append(pts, at(v, p)), p
	}
	beyond = len(cdf) - 1 - last
	if beyond > 0 && last >= 0 && cdf[last] < xMax {
		pts = append(pts, at(xMax, last))
	}
	return pts, beyond
}

// hitByTurn draws each report's hit ratio at each turn depth at which any
// report had requests; a report without requests at a depth is marked so,
// not drawn as 0.
func hitByTurn(reports []*Report) string {
	depths := turnDepths(reports)
	if len(depths) == 0 {
		return "<p>No hit ratio by turn: no request succeeded.</p>\n"
	}
	var b strings.Builder
	axes(&b, 0, 1, "turn depth of the session", "hit ratio")
	slot := plotW() / float64(len(depths))
	bar := slot * 0.8 / float64(len(reports))
	for d, depth := range depths {
		x0 := marginL + slot*float64(d) + slot*0.1
		fmt.Fprintf(&b, `<text x="%.1f" y="%.0f" text-anchor="middle">%s</text>`, marginL+slot*(float64(d)+0.5), marginT+plotH()+16, html.EscapeString(depth))
		for i, r := range reports {
			x := x0 + bar*float64(i)
			v, ok := r.HitRatioByTurn[depth]
			if !ok {
				mark(&b, x+bar*0.45, "no requests", fmt.Sprintf("%s turn %s: no requests", label(r), depth))
				continue
			}
			h := plotH() * math.Min(v, 1)
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s turn %s: %.3f</title></rect>`,
				x, marginT+plotH()-h, bar*0.9, h, palette(i), html.EscapeString(label(r)), html.EscapeString(depth), v)
		}
	}
	for i, r := range reports {
		if r.IdealHitRatio > 0 {
			y := marginT + plotH()*(1-math.Min(r.IdealHitRatio, 1))
			fmt.Fprintf(&b, `<line x1="%d" x2="%.0f" y1="%.1f" y2="%.1f" stroke="%s" stroke-dasharray="6 4"><title>ideal %.3f</title></line>`,
				marginL, marginL+plotW(), y, y, palette(i), r.IdealHitRatio)
		}
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// localRemote draws each report's cached tokens, local and remote, as a
// share of its prompt tokens; a report in which nothing succeeded is
// marked so.
func localRemote(reports []*Report) string {
	if !slices.ContainsFunc(reports, func(r *Report) bool { return r.HitRatio != nil }) {
		return "<p>No cached tokens: no request succeeded.</p>\n"
	}
	var b strings.Builder
	yMax := 0.0
	for _, r := range reports {
		yMax = max(yMax, deref(r.HitRatio), r.IdealHitRatio)
	}
	yMax = math.Min(niceCeil(math.Max(yMax, 0.05)), 1)
	axes(&b, 0, yMax, "report (darker: local, lighter: remote)", "share of prompt tokens")
	slot := plotW() / float64(len(reports))
	for i, r := range reports {
		x := marginL + slot*float64(i) + slot*0.2
		fmt.Fprintf(&b, `<text x="%.1f" y="%.0f" text-anchor="middle">%s</text>`, x+slot*0.3, marginT+plotH()+16, html.EscapeString(truncateLabel(r.name(), 16)))
		if r.HitRatio == nil {
			mark(&b, x+slot*0.3, "no request succeeded", label(r)+": no request succeeded")
			continue
		}
		if r.LocalHitRatio == nil || r.RemoteHitRatio == nil {
			mark(&b, x+slot*0.3, "local/remote not known", label(r)+": how much was read from other groups is not known (replayed through HTTP without the bus)")
			continue
		}
		local, remote := *r.LocalHitRatio, *r.RemoteHitRatio
		hl, hr := plotH()*local/yMax, plotH()*remote/yMax
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s local %.3f</title></rect>`,
			x, marginT+plotH()-hl, slot*0.6, hl, palette(i), html.EscapeString(label(r)), local)
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s" fill-opacity="0.4"><title>%s remote %.3f</title></rect>`,
			x, marginT+plotH()-hl-hr, slot*0.6, hr, palette(i), html.EscapeString(label(r)), remote)
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// deref is *p, or 0 for nil.
func deref(p *float64) float64 {
	if p == nil {
		return 0
	}
	return *p
}

func groupTimeline(r *Report) string {
	tl := r.GroupTimeline
	if tl == nil || len(tl.Groups) == 0 {
		return fmt.Sprintf("<p>%s: no group timeline in this report.</p>\n", html.EscapeString(label(r)))
	}
	names := make([]string, 0, len(tl.Groups))
	n, yMax := 0, 1
	for g, counts := range tl.Groups {
		names = append(names, g)
		n = max(n, len(counts))
		for _, c := range counts {
			yMax = max(yMax, c)
		}
	}
	slices.Sort(names)
	yMax = (yMax + 3) / 4 * 4 // whole requests at every tick
	var b strings.Builder
	fmt.Fprintf(&b, "<p>%s</p>\n", html.EscapeString(label(r)))
	axes(&b, float64(n)*tl.BucketS, float64(yMax), "seconds from the first request", fmt.Sprintf("requests per %gs", tl.BucketS))
	for g, name := range names {
		var pts []string
		for k, c := range tl.Groups[name] {
			x := marginL + plotW()*(float64(k)+0.5)/float64(n)
			y := marginT + plotH()*(1-float64(c)/float64(yMax))
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x, y))
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"><title>%s</title></polyline>`,
			palette(g), strings.Join(pts, " "), html.EscapeString(name))
		fmt.Fprintf(&b, `<text x="%.0f" y="%d" fill="%s" style="fill:%s">%s</text>`, marginL+plotW()-40, marginT+14+14*g, palette(g), palette(g), html.EscapeString(name))
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// figures is the table of the reports' figures: one row per field, each
// titled with its unit, one column per report.
func figures(reports []*Report) string {
	var b strings.Builder
	b.WriteString("<table><tr><th></th>")
	for _, r := range reports {
		fmt.Fprintf(&b, "<th>%s</th>", html.EscapeString(label(r)))
	}
	b.WriteString("</tr>\n")
	for _, f := range fields(reports) {
		fmt.Fprintf(&b, "<tr><th>%s</th>", html.EscapeString(f.title))
		for _, r := range reports {
			if v, ok := f.cell(r); ok {
				fmt.Fprintf(&b, "<td>%s</td>", html.EscapeString(v))
			} else {
				b.WriteString(`<td title="no data">–</td>`)
			}
		}
		b.WriteString("</tr>\n")
	}
	b.WriteString("</table>\n")
	return b.String()
}

// failures lists, per report that had failures, how many requests each
// cause failed, the commonest first.
func failures(reports []*Report) string {
	var b strings.Builder
	b.WriteString("<p>Latencies and hit ratios count only the requests that succeeded; the ideal hit ratio, every request of the trace.</p>\n")
	b.WriteString(`<table><tr><th>report</th><th>failed (requests)</th><th class="cause">cause</th></tr>` + "\n")
	for _, r := range reports {
		if r.Failed == 0 {
			continue
		}
		cs := causes(r)
		if len(cs) == 0 {
			fmt.Fprintf(&b, `<tr><td>%s</td><td>%d</td><td class="cause">– (not in this report)</td></tr>`+"\n", html.EscapeString(label(r)), r.Failed)
		}
		for _, c := range cs {
			fmt.Fprintf(&b, `<tr><td>%s</td><td>%d</td><td class="cause">%s</td></tr>`+"\n", html.EscapeString(label(r)), r.Errors[c], html.EscapeString(c))
		}
	}
	b.WriteString("</table>\n")
	return b.String()
}

func truncateLabel(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-1] + "…"
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}
