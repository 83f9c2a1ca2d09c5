package main

import (
	"strings"
	"testing"

	"github.com/alecthomas/kong"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/internal/logsink"
)

// TestAuthInitHelpNamesEveryRole: `kvbus auth init --help` lists the keys
// it writes, one per role of auth.Roles(); it named four, leaving out the
// observer key that top and tap use.
func TestAuthInitHelpNamesEveryRole(t *testing.T) {
	var c cli
	p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"), kong.Exit(func(int) {}))
	if err != nil {
		t.Fatal(err)
	}
	var help string
	for _, n := range p.Model.Node.Children {
		if n.Name != "auth" {
			continue
		}
		for _, ch := range n.Children {
			if ch.Name == "init" {
				help = ch.Help
			}
		}
	}
	if help == "" {
		t.Fatal("kvbus auth init has no help")
	}
	for _, role := range auth.Roles() {
		if !strings.Contains(help, role) {
			t.Errorf("kvbus auth init --help does not name the %s key it writes: %q", role, help)
		}
	}
}
