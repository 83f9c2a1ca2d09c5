package main

import (
	"strings"
	"testing"
)

// TestOutputToADirectoryIsRefusedFirst: an output path that is a
// directory (capture --out, replay and bench --json and --html) is refused
// before the run, saying to give a file in it. Capture found it only at its
// end, renaming "/.tmp.….partial" onto the directory; replay --json DIR
// said "open DIR: is a directory" after the whole replay.
func TestOutputToADirectoryIsRefusedFirst(t *testing.T) {
	dir := t.TempDir()
	if o, err := createOutput(dir); err == nil || !strings.Contains(err.Error(), "is a directory") {
		if err == nil {
			o.discard()
		}
		t.Errorf("createOutput(%s): %v; want it refused as a directory", dir, err)
	}
	if err := checkOutputs(map[string]string{"--json": dir}); err == nil || !strings.Contains(err.Error(), "--json") || !strings.Contains(err.Error(), "is a directory") {
		t.Errorf("checkOutputs --json %s: %v; want it refused naming --json", dir, err)
	}
	if err := checkOutputs(map[string]string{"--json": dir + "/report.json"}); err != nil {
		t.Errorf("a file in the directory: %v", err)
	}
}
