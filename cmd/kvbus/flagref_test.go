package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestFlagReferenceListsEveryFlag: the README's "Flag reference" names
// every flag a command's --help prints, and no flag that no command has. A
// review found some 50 flags missing from it (capture's --since, every
// loadgen flag, ...): the table had drifted from the commands.
func TestFlagReferenceListsEveryFlag(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(readme)
	start := strings.Index(text, "\n## Flag reference\n")
	if start < 0 {
		t.Fatal(`README.md has no "## Flag reference" section`)
	}
	section := text[start+1:]
	if end := strings.Index(section, "\n## "); end >= 0 {
		section = section[:end]
	}
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile("`(?:-[a-z]/)?--([a-z][a-z0-9-]*)").FindAllStringSubmatch(section, -1) {
		listed[m[1]] = true
	}
	flags := commandFlags(t)
	for name, cmds := range flags {
		if !listed[name] {
			t.Errorf("--%s (%s) is not in the README's flag reference: add a row for it", name, strings.Join(cmds, ", "))
		}
	}
	for name := range listed {
		if flags[name] == nil {
			t.Errorf("the README's flag reference lists --%s, which no kvbus command has", name)
		}
	}
	if len(flags) < 100 {
		t.Errorf("only %d flags found on the commands: is the walk still right?", len(flags))
	}
}
