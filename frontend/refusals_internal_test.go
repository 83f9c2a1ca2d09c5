package frontend

import (
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/kvbus/kvbus/internal/logbuf"
)

// TestRefusalLog: a refused request is logged at once; more within
// refusalLogEvery are counted into the next line, by status and code. A
// restart of the schedulers refused 107 requests over 12 s and the frontend
// logged nothing.
func TestRefusalLog(t *testing.T) {
	buf := &logbuf.Buffer{}
	r := &refusalLog{log: slog.New(slog.NewJSONHandler(buf, nil))}
	noSched := &APIError{Status: http.StatusServiceUnavailable, Code: "no_ready_scheduler", Message: "no scheduler is ready; retry shortly"}
	bad := &APIError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Message: "temperature must be a number"}
	t0 := time.Now()
	r.note(t0, noSched)
	if got := buf.Lines("requests refused before reaching the bus"); len(got) != 1 || !strings.Contains(got[0], `"level":"WARN"`) ||
		!strings.Contains(got[0], `"refused":1`) || !strings.Contains(got[0], "no scheduler is ready") {
		t.Fatalf("after the first refusal: %q; want one WARN line with its message", got)
	}
	r.note(t0.Add(time.Second), noSched)
	r.note(t0.Add(2*time.Second), bad)
	if got := buf.Lines("requests refused"); len(got) != 1 {
		t.Fatalf("within %v of the first line: %d lines; want no new one", refusalLogEvery, len(got))
	}
	r.note(t0.Add(refusalLogEvery+time.Second), noSched)
	got := buf.Lines("requests refused")
	if len(got) != 2 || !strings.Contains(got[1], `"refused":3`) ||
		!strings.Contains(got[1], `400 invalid_request_error: 1, 503 no_ready_scheduler: 2`) {
		t.Errorf("after %v: %q; want a second line counting 3 refusals by status", refusalLogEvery, got)
	}
}

// TestRefusalsAfterTheFirstAreLoggedWithoutAnother: refusals counted within
// the interval of the last line are logged once it has passed, though no
// refusal comes after them, and at the frontend's stop. Before, they were
// logged only by a later refusal: a burst of 429s that then stopped left
// one line, for its first request.
func TestRefusalsAfterTheFirstAreLoggedWithoutAnother(t *testing.T) {
	buf := &logbuf.Buffer{}
	r := &refusalLog{log: slog.New(slog.NewJSONHandler(buf, nil)), every: 200 * time.Millisecond}
	over := &APIError{Status: http.StatusTooManyRequests, Code: "overloaded", Message: "over --max-inflight"}
	r.note(time.Now(), over)
	r.note(time.Now(), over)
	r.note(time.Now(), over)
	if got := buf.Lines("requests refused"); len(got) != 1 {
		t.Fatalf("at once: %q; want the first refusal's line alone", got)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(buf.Lines("requests refused")) < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	got := buf.Lines("requests refused")
	if len(got) != 2 || !strings.Contains(got[1], `"refused":2`) || !strings.Contains(got[1], `429 overloaded: 2`) || !strings.Contains(got[1], `"level":"WARN"`) {
		t.Fatalf("after the interval, with no refusal since: %q; want a second WARN line counting the 2 refusals after the first", got)
	}
	time.Sleep(3 * r.every)
	if got := buf.Lines("requests refused"); len(got) != 2 {
		t.Errorf("nothing refused since: %d lines; want no new one", len(got))
	}

	// At the stop, whatever was counted since the last line is logged at
	// once.
	r.note(time.Now(), over) // logged: the interval has passed
	r.note(time.Now(), over) // counted
	if got := buf.Lines("requests refused"); len(got) != 3 {
		t.Fatalf("a refusal after the interval: %d lines; want it logged at once, the next counted", len(got))
	}
	r.flush(true)
	if got := buf.Lines("requests refused"); len(got) != 4 || !strings.Contains(got[3], `"refused":1`) {
		t.Errorf("after a stop's flush: %q; want a fourth line counting 1", got)
	}
}

// TestRefusalLogClipsALongMessage: a refusal's message quotes what the
// client sent (an unknown model's name); a 1 MB name made a 1 MB log line.
func TestRefusalLogClipsALongMessage(t *testing.T) {
	buf := &logbuf.Buffer{}
	r := &refusalLog{log: slog.New(slog.NewJSONHandler(buf, nil))}
	name := strings.Repeat("é", 1<<19) // 1 MiB of two-byte runes
	r.note(time.Now(), &APIError{Status: http.StatusNotFound, Code: "model_not_found", Message: "The model `" + name + "` does not exist."})
	got := buf.Lines("requests refused before reaching the bus")
	if len(got) != 1 || len(got[0]) > 2048 || !strings.Contains(got[0], "bytes in all") || !utf8.ValidString(got[0]) {
		t.Fatalf("%d lines, the first %d bytes (%.200s…); want one line under 2 KiB, valid UTF-8, saying how long the message was", len(got), len(got[0]), got[0])
	}
}
