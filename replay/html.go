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
	"strings"
)

// palette colours the reports in order (colour-blind safe, Okabe–Ito).
func palette(i int) string {
	p := [...]string{"#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"}
	return p[i%len(p)]
}

// WriteHTML writes one self-contained page (inline SVG, no script, nothing
// fetched at view time) drawn from reports: the TTFT CDF per report, the
// hit ratio by turn depth per report against the ideal, local and remote
// cached tokens, requests per group over time, and the reports' figures.
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
		return list, nil
	}
	var one Report
	if err := json.Unmarshal(data, &one); err != nil {
		return nil, fmt.Errorf("replay: not a kvbus report (a JSON list of reports, or one): %w", err)
	}
	return []*Report{&one}, nil
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

func label(r *Report) string {
	if r.Trace != "" {
		return r.Policy + " (" + r.Trace + ")"
	}
	return r.Policy
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

// axes draws the frame with y ticks from 0 to yMax and x ticks to xMax.
func axes(b *strings.Builder, xMax, yMax float64, xLabel, yLabel string, yFmt string) {
	fmt.Fprintf(b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" role="img">`, chartW, chartH, chartW, chartH)
	fmt.Fprintf(b, `<rect x="%d" y="%d" width="%.0f" height="%.0f" fill="none" stroke="#999"/>`, marginL, marginT, plotW(), plotH())
	for i := 0; i <= 4; i++ {
		y := marginT + plotH()*(1-float64(i)/4)
		fmt.Fprintf(b, `<line x1="%d" x2="%.0f" y1="%.1f" y2="%.1f" stroke="#eee"/>`, marginL, marginL+plotW(), y, y)
		fmt.Fprintf(b, `<text x="%d" y="%.1f" text-anchor="end">`+yFmt+`</text>`, marginL-6, y+4, yMax*float64(i)/4)
		if xMax > 0 {
			x := marginL + plotW()*float64(i)/4
			fmt.Fprintf(b, `<text x="%.1f" y="%.0f" text-anchor="middle">%s</text>`, x, marginT+plotH()+16, trim(xMax*float64(i)/4))
		}
	}
	fmt.Fprintf(b, `<text x="%.0f" y="%d" text-anchor="middle">%s</text>`, marginL+plotW()/2, chartH-4, html.EscapeString(xLabel))
	fmt.Fprintf(b, `<text x="12" y="%.0f" transform="rotate(-90 12 %.0f)" text-anchor="middle">%s</text>`, marginT+plotH()/2, marginT+plotH()/2, html.EscapeString(yLabel))
}

func trim(v float64) string {
	if v >= 100 {
		return fmt.Sprintf("%.0f", v)
	}
	return strings.TrimRight(strings.TrimRight(fmt.Sprintf("%.2f", v), "0"), ".")
}

func ttftCDF(reports []*Report) string {
	xMax := 0.0
	for _, r := range reports {
		if n := len(r.TTFTCDF); n > 0 {
			xMax = max(xMax, r.TTFTCDF[min(99, n-1)]) // up to the p99: the tail beyond it would flatten the rest
		}
	}
	if xMax == 0 {
		return "<p>No TTFT distribution in these reports.</p>\n"
	}
	xMax = niceCeil(xMax)
	var b strings.Builder
	axes(&b, xMax, 1, "TTFT (ms)", "share of requests", "%.2f")
	for i, r := range reports {
		var pts []string
		for p, v := range r.TTFTCDF {
			x := marginL + plotW()*math.Min(v/xMax, 1)
			y := marginT + plotH()*(1-float64(p)/100)
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x, y))
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"><title>%s</title></polyline>`,
			palette(i), strings.Join(pts, " "), html.EscapeString(label(r)))
	}
	b.WriteString("</svg>\n")
	return b.String()
}

func hitByTurn(reports []*Report) string {
	depths := []string{"1", "2", "3", "4+"}
	var b strings.Builder
	axes(&b, 0, 1, "turn depth of the session", "hit ratio", "%.2f")
	slot := plotW() / float64(len(depths))
	bar := slot * 0.8 / float64(len(reports))
	for d, depth := range depths {
		x0 := marginL + slot*float64(d) + slot*0.1
		fmt.Fprintf(&b, `<text x="%.1f" y="%.0f" text-anchor="middle">%s</text>`, marginL+slot*(float64(d)+0.5), marginT+plotH()+16, depth)
		for i, r := range reports {
			v := r.HitRatioByTurn[depth]
			h := plotH() * math.Min(v, 1)
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s turn %s: %.3f</title></rect>`,
				x0+bar*float64(i), marginT+plotH()-h, bar*0.9, h, palette(i), html.EscapeString(label(r)), depth, v)
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

func localRemote(reports []*Report) string {
	var b strings.Builder
	yMax := 0.0
	for _, r := range reports {
		yMax = max(yMax, r.HitRatio, r.IdealHitRatio)
	}
	yMax = math.Min(niceCeil(math.Max(yMax, 0.05)), 1)
	axes(&b, 0, yMax, "report (darker: local, lighter: remote)", "share of prompt tokens", "%.2f")
	slot := plotW() / float64(len(reports))
	for i, r := range reports {
		x := marginL + slot*float64(i) + slot*0.2
		hl := plotH() * r.LocalHitRatio / yMax
		hr := plotH() * r.RemoteHitRatio / yMax
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s local %.3f</title></rect>`,
			x, marginT+plotH()-hl, slot*0.6, hl, palette(i), html.EscapeString(label(r)), r.LocalHitRatio)
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s" fill-opacity="0.4"><title>%s remote %.3f</title></rect>`,
			x, marginT+plotH()-hl-hr, slot*0.6, hr, palette(i), html.EscapeString(label(r)), r.RemoteHitRatio)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.0f" text-anchor="middle">%s</text>`, x+slot*0.3, marginT+plotH()+16, html.EscapeString(truncateLabel(r.Policy, 16)))
	}
	b.WriteString("</svg>\n")
	return b.String()
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
	var b strings.Builder
	fmt.Fprintf(&b, "<p>%s</p>\n", html.EscapeString(label(r)))
	axes(&b, float64(n)*tl.BucketS, float64(yMax), "seconds from the first request", fmt.Sprintf("requests per %gs", tl.BucketS), "%.0f")
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

func figures(reports []*Report) string {
	var b strings.Builder
	b.WriteString("<table><tr><th>report</th><th>requests</th><th>failed</th><th>hit ratio</th><th>ideal</th><th>local</th><th>remote</th>" +
		"<th>TTFT mean</th><th>p50</th><th>p95</th><th>p99 (ms)</th><th>e2e p95 (ms)</th><th>req/s</th></tr>\n")
	for _, r := range reports {
		fmt.Fprintf(&b, "<tr><td>%s</td><td>%d</td><td>%d</td><td>%.3f</td><td>%.3f</td><td>%.3f</td><td>%.3f</td><td>%.1f</td><td>%.1f</td><td>%.1f</td><td>%.1f</td><td>%.1f</td><td>%.1f</td></tr>\n",
			html.EscapeString(label(r)), r.Requests, r.Failed, r.HitRatio, r.IdealHitRatio, r.LocalHitRatio, r.RemoteHitRatio,
			r.TTFT.Mean, r.TTFT.P50, r.TTFT.P95, r.TTFT.P99, r.E2E.P95, r.ThroughputRPS)
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
