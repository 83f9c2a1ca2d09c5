package testenv_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kvbus/kvbus/testenv"
)

// TestGrafanaDashboardNamesExist: every kvbus metric the Grafana dashboard
// (deploy/grafana/kvbus.json) queries is one kvbus registers, so no panel
// stays empty because of a renamed metric. (The compose smoke test runs
// every query against a real Prometheus scraping the cluster.)
func TestGrafanaDashboardNamesExist(t *testing.T) {
	queries := testenv.DashboardQueries(t, "../deploy/grafana/kvbus.json")
	registered := map[string]bool{}
	name := regexp.MustCompile(`Name:\s+"(kvbus_[a-z_]+)"`)
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		src, err := os.ReadFile(path)
		for _, m := range name.FindAllSubmatch(src, -1) {
			registered[string(m[1])] = true
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	used := regexp.MustCompile(`kvbus_[a-z_]+`)
	for _, q := range queries {
		for _, m := range used.FindAllString(q.Expr, -1) {
			base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(m, "_bucket"), "_sum"), "_count")
			if !registered[base] {
				t.Errorf("panel %q queries %s, which kvbus does not register", q.Panel, m)
			}
		}
	}
	if len(queries) < 10 {
		t.Errorf("%d queries in the dashboard", len(queries))
	}
}
