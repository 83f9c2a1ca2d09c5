package replay_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
)

// TestTraceSessionIDsAreChecked: a trace's session ids pass the frontend's
// rules, or the trace is refused naming the request: replayed onto the
// bus, a session id with escape sequences reached the operators'
// terminals through kvbus top, and one of 300 bytes the ranks' logs.
func TestTraceSessionIDsAreChecked(t *testing.T) {
	for name, id := range map[string]string{
		"escape":   `\u001b]0;PWNED\u0007`,
		"newline":  `\ng7 ready 4/4`,
		"too long": strings.Repeat("s", messages.MaxSessionIDBytes+1),
		"lone C1":  `\u009b2J`,
	} {
		line := `{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2], "session_id": "` + id + `"}` + "\n"
		_, err := replay.ReadTrace(strings.NewReader(`{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2], "session_id": "ok"}`+"\n"+line), replay.FormatMooncake)
		if !errors.Is(err, replay.ErrFormat) || !errors.Is(err, messages.ErrSessionID) || !strings.Contains(err.Error(), "request 2 of the trace") {
			t.Errorf("%s: %v; want a format error naming request 2 and its session id", name, err)
		}
	}
	if _, err := replay.ReadTrace(strings.NewReader(`{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2], "session_id": "日本語-🙂"}`+"\n"), replay.FormatMooncake); err != nil {
		t.Errorf("a Unicode session id: %v", err)
	}
}
