package testenv

import (
	"encoding/json"
	"os"
	"testing"
)

// DashboardQuery is one PromQL query of a Grafana dashboard panel.
type DashboardQuery struct {
	Panel string
	Expr  string
}

// DashboardQueries reads the Grafana dashboard at path (deploy/grafana's
// kvbus.json) and returns every panel's queries, in order; it fails the
// test if the file is not a dashboard.
func DashboardQueries(t testing.TB, path string) []DashboardQuery {
	t.Helper()
	raw, err := os.ReadFile(path)
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
		t.Fatalf("%s is not a dashboard: %v", path, err)
	}
	var out []DashboardQuery
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			out = append(out, DashboardQuery{Panel: p.Title, Expr: tg.Expr})
		}
	}
	return out
}
