//go:build smoke

package smoke

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvbus/kvbus/testenv"
)

// promtool is Debian's, unpacked by make smoke (see the Makefile's PROMTOOL).
const promtool = "../build/prometheus-deb/x/usr/bin/promtool"

// TestDashboardCountsAGroupOnce: a worker counter that every rank of a
// group counts for the same thing (each holds its shard of a block; each
// drops the same ReqMeta) is shown on the dashboard once per group, not
// once per rank. Promtool's PromQL engine runs the panels' queries over
// series of two groups of four ranks (each its own scrape target, as in
// compose): every rank stores 60 blocks a minute and drops 6 duplicate
// ReqMetas; g1 also 3 overloaded ones. Before, the panels summed the
// ranks: 8 blocks/s where the groups stored 2.
func TestDashboardCountsAGroupOnce(t *testing.T) {
	if _, err := os.Stat(promtool); err != nil {
		t.Skipf("no promtool (%v): make smoke fetches Debian's prometheus package", err)
	}
	want := map[string]string{ // panel: its samples at 5m, promtool's exp_samples
		"Worker KV blocks by op": `
          - labels: '{op="stored"}'
            value: 2`,
		"Worker dropped ReqMetas by reason": `
          - labels: '{reason="duplicate"}'
            value: 0.2
          - labels: '{reason="overloaded"}'
            value: 0.05`,
	}
	var series, tests strings.Builder
	for g := range 2 {
		for r := range 4 {
			target := fmt.Sprintf(`job="kvbus",role="worker",instance="10.0.%d.%d:9091",group="g%d",tp_rank="%d"`, g, r, g, r)
			fmt.Fprintf(&series, "      - series: 'kvbus_worker_blocks_total{%s,op=\"stored\"}'\n        values: '0+60x10'\n", target)
			fmt.Fprintf(&series, "      - series: 'kvbus_worker_dropped_total{%s,reason=\"duplicate\"}'\n        values: '0+6x10'\n", target)
			if g == 1 {
				fmt.Fprintf(&series, "      - series: 'kvbus_worker_dropped_total{%s,reason=\"overloaded\"}'\n        values: '0+3x10'\n", target)
			}
		}
	}
	for _, q := range testenv.DashboardQueries(t, "../deploy/grafana/kvbus.json") {
		samples, ok := want[q.Panel]
		if !ok {
			continue
		}
		delete(want, q.Panel)
		fmt.Fprintf(&tests, "      - expr: '%s'\n        eval_time: 5m\n        exp_samples:%s\n",
			strings.ReplaceAll(expandGrafanaVars(q.Expr), "'", "''"), samples)
	}
	for panel := range want {
		t.Errorf("the dashboard has no panel %q", panel)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "none.yml"), []byte("groups: []\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "dashboard_test.yml")
	spec := "rule_files:\n  - none.yml\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n" +
		series.String() + "    promql_expr_test:\n" + tests.String()
	if err := os.WriteFile(file, []byte(spec), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(promtool, "test", "rules", file).CombinedOutput()
	if err != nil {
		t.Errorf("promtool test rules: %v\n%s\n(the test file:)\n%s", err, out, spec)
	}
}
