package main

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/alecthomas/kong"

	"github.com/kvbus/kvbus/internal/logsink"
)

// TestMetricHelpNamesRealFlags: a flag a metric's HELP names (what an
// operator reads on /metrics and in Prometheus) is a flag of some kvbus
// command: kvbus_scheduler_heartbeat_gap_seconds named --heartbeat-every,
// which no command has (the workers' flag is --heartbeat-interval).
func TestMetricHelpNamesRealFlags(t *testing.T) {
	flags := commandFlags(t)
	help := regexp.MustCompile(`Help:\s+("(?:[^"\\]|\\.)*")`)
	flag := regexp.MustCompile(`--([a-z][a-z0-9-]*)`)
	checked := 0
	err := filepath.WalkDir("../..", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range help.FindAllSubmatch(src, -1) {
			text, err := strconv.Unquote(string(m[1]))
			if err != nil {
				t.Errorf("%s: %v", path, err)
				continue
			}
			for _, f := range flag.FindAllStringSubmatch(text, -1) {
				checked++
				if flags[f[1]] == nil {
					t.Errorf("%s: a metric's HELP names --%s, which no kvbus command has: %q", path, f[1], text)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 5 {
		t.Errorf("only %d flags named in metrics' HELP: is the pattern still right?", checked)
	}
}

// commandFlags maps every flag of every kvbus command (--help and --version
// aside) to the commands that have it ("auth init", "serve", ...).
func commandFlags(t *testing.T) map[string][]string {
	t.Helper()
	var c cli
	p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"), kong.Exit(func(int) {}))
	if err != nil {
		t.Fatal(err)
	}
	flags := map[string][]string{}
	var walk func(n *kong.Node)
	walk = func(n *kong.Node) {
		for _, fl := range n.Flags {
			if fl.Name != "help" && fl.Name != "version" && !fl.Hidden {
				flags[fl.Name] = append(flags[fl.Name], n.Path())
			}
		}
		for _, ch := range n.Children {
			walk(ch)
		}
	}
	walk(p.Model.Node)
	return flags
}
