//go:build browser

// The browser tests render kvbus's HTML in headless Chromium, as a person
// would look at it: `go test -tags browser ./cmd/kvbus` (.ci/run runs them
// when a chromium binary is installed; `apt-get install chromium`).
package main

import (
	"fmt"
	"html"
	"image"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/top"
)

// chromium returns the headless browser, or skips.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Skip("no chromium installed (apt-get install chromium)")
	return ""
}

// shoot renders url to a PNG and returns it with the browser's log.
func shoot(t *testing.T, browser, url, png string, w, h int) string {
	t.Helper()
	cmd := exec.Command(browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
		"--enable-logging=stderr", "--v=0", fmt.Sprintf("--window-size=%d,%d", w, h), "--screenshot="+png, url)
	cmd.Env = append(os.Environ(), "HOME="+t.TempDir())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("chromium: %v\n%s", err, out)
	}
	return string(out)
}

// inked returns the share of pixels that are not background white, and how
// many distinct colours the image has.
func inked(t *testing.T, path string) (float64, int) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	b := img.Bounds()
	colours := map[[3]uint32]bool{}
	ink := 0
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			r, g, bl, _ := img.At(x, y).RGBA()
			colours[[3]uint32{r >> 8, g >> 8, bl >> 8}] = true
			if r < 0xf000 || g < 0xf000 || bl < 0xf000 {
				ink++
			}
		}
	}
	return float64(ink) / float64(b.Dx()*b.Dy()), len(colours)
}

var _ image.Image // image/png registers the decoder

// TestBenchHTMLInChromium: `kvbus bench --html` on a small Mooncake-format
// trace writes a page that Chromium renders with its plots drawn (ink in
// several colours, not a blank page) and without a script or console error.
// KVBUS_SCREENSHOT_DIR keeps the screenshot (the README's).
func TestBenchHTMLInChromium(t *testing.T) {
	browser := chromium(t)
	dir := t.TempDir()
	bin := buildBinary(t, dir)
	trace := filepath.Join(dir, "trace.jsonl")
	var lines []string
	for i := range 40 {
		conv := i % 8
		ids := []string{}
		for b := range 4 + i/8 {
			ids = append(ids, fmt.Sprint(conv*100+b))
		}
		lines = append(lines, fmt.Sprintf(`{"timestamp": %d, "input_length": %d, "output_length": 4, "hash_ids": [%s]}`,
			i*200, len(ids)*512, strings.Join(ids, ", ")))
	}
	if err := os.WriteFile(trace, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	page := filepath.Join(dir, "bench.html")
	out, err := exec.Command(bin, "bench", "--trace", trace, "--policies", "kv,round-robin", "--groups", "2", "--ranks", "2",
		"--speed", "10", "--infer-sessions", "--html", page, "--log-level", "warn").CombinedOutput()
	if err != nil {
		t.Fatalf("bench: %v\n%s", err, out)
	}
	shot := filepath.Join(dir, "bench.png")
	if keep := os.Getenv("KVBUS_SCREENSHOT_DIR"); keep != "" {
		shot = filepath.Join(keep, "bench-html.png")
	}
	log := shoot(t, browser, "file://"+page, shot, 1100, 1500)
	for _, bad := range []string{"Uncaught", "CONSOLE(", "SyntaxError"} {
		if strings.Contains(log, bad) {
			t.Errorf("chromium logged %q:\n%s", bad, log)
		}
	}
	share, colours := inked(t, shot)
	t.Logf("screenshot %s: %.1f%% inked, %d colours", shot, 100*share, colours)
	if share < 0.02 || colours < 8 {
		t.Errorf("the page looks blank: %.2f%% of pixels inked, %d colours", 100*share, colours)
	}
}

// TestTopScreenshot renders what `kvbus top` shows of a running cluster
// (two groups, three conversations) as terminal text in Chromium: the
// README's picture of it, checked not blank. TestTopInATerminal checks the
// same screen in a real pseudo-terminal.
func TestTopScreenshot(t *testing.T) {
	browser := chromium(t)
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Ranks: 4})
	w := c.StartTop(t)
	converse(t, c.URL, "support-chat-17", "code-review-4", "travel-plans-2")
	time.Sleep(1200 * time.Millisecond) // a heartbeat after the last answer
	screen := top.NewModel(w, time.Second, 10).Render()
	plain := regexp.MustCompile("\x1b\\[[0-9;:]*m").ReplaceAllString(screen, "")
	if !strings.Contains(plain, "g1") || !strings.Contains(plain, "support-chat-17") {
		t.Fatalf("screen:\n%s", plain)
	}
	dir := t.TempDir()
	page := filepath.Join(dir, "top.html")
	doc := `<!DOCTYPE html><html><body style="margin:0;background:#111"><pre style="margin:0;padding:12px;color:#ddd;font:13px/1.35 monospace">` +
		html.EscapeString(plain) + `</pre></body></html>`
	if err := os.WriteFile(page, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	shot := filepath.Join(dir, "top.png")
	if keep := os.Getenv("KVBUS_SCREENSHOT_DIR"); keep != "" {
		shot = filepath.Join(keep, "top.png")
	}
	shoot(t, browser, "file://"+page, shot, 1000, 360)
	share, colours := inked(t, shot)
	if share < 0.5 || colours < 4 { // a dark terminal with light text
		t.Errorf("the screenshot looks blank: %.2f%% inked, %d colours", 100*share, colours)
	}
}
