package testenv_test

import (
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestGrafanaDashboardNamesExist: every kvbus metric the Grafana dashboard
// (deploy/grafana/kvbus.json) queries is one kvbus registers, so no panel
// stays empty because of a renamed metric. (The compose smoke test runs
// every query against a real Prometheus scraping the cluster.)
func TestGrafanaDashboardNamesExist(t *testing.T) {
	raw, err := os.ReadFile("../deploy/grafana/kvbus.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	registered := map[string]bool{}
	name := regexp.MustCompile(`Name:\s+"(kvbus_[a-z_]+)"`)
	err = filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
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
	panels := 0
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			panels++
			for _, m := range used.FindAllString(tg.Expr, -1) {
				base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(m, "_bucket"), "_sum"), "_count")
				if !registered[base] {
					t.Errorf("panel %q queries %s, which kvbus does not register", p.Title, m)
				}
			}
		}
	}
	if panels < 10 {
		t.Errorf("%d queries in the dashboard", panels)
	}
}
