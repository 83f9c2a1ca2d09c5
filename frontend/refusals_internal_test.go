package frontend

import (
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

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
