package messages

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestSubjectsSpelledOnlyHere: DESIGN.md §2 makes this package the only
// place subjects are spelled. No string literal of another package's code
// (tests aside) may hold a subject's kind token in a subject: auth spelled
// its permission patterns ("req.>", "pool.*.*.handoff") and tap its
// "ctl.abort" itself, so a subject renamed here would have left them
// behind.
func TestSubjectsSpelledOnlyHere(t *testing.T) {
	kinds := []string{KindRequest, KindMeta, KindDone, KindOut, KindKV, KindHeartbeat, KindControl,
		KindAnnounce, KindScheduler, KindPool, KindDrain}
	spells := func(s string) bool {
		for _, k := range kinds {
			if strings.HasPrefix(s, k+".") || strings.Contains(s, "."+k+".") || strings.HasPrefix(s, DefaultPrefix+".") {
				return true
			}
		}
		return false
	}
	fset := token.NewFileSet()
	checked := 0
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != ".." && (strings.HasPrefix(name, ".") || name == "messages" || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		checked++
		ast.Inspect(f, func(n ast.Node) bool {
			lit, ok := n.(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true
			}
			if s, err := strconv.Unquote(lit.Value); err == nil && spells(s) && !strings.Contains(s, " ") {
				t.Errorf("%s: %q spells a subject outside package messages", fset.Position(lit.Pos()), s)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 50 {
		t.Fatalf("checked %d files: not the repository", checked)
	}
}
