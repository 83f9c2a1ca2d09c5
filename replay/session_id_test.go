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
		"newline":  `ok\ng7 ready 4/4`, // inside: one at either end is trimmed, as the frontend does
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

// TestTraceSessionIDsAreTrimmed: a trace's session id is trimmed, and a
// blank one is no session, as the frontend reads vllm_xargs.session_id. A
// trace replayed onto the bus kept "  s1 " apart from "s1" and made "   " a
// session of its own, where the same trace replayed onto a frontend had
// one session and none.
func TestTraceSessionIDsAreTrimmed(t *testing.T) {
	var trace strings.Builder
	for _, id := range []string{"s1", "  s1 ", "\ts1", "   ", ""} {
		trace.WriteString(`{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1], "session_id": "` + strings.ReplaceAll(id, "\t", `\t`) + `"}` + "\n")
	}
	tr, err := replay.ReadTrace(strings.NewReader(trace.String()), replay.FormatMooncake)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, it := range tr.Items {
		got = append(got, it.SessionID)
	}
	if want := []string{"s1", "s1", "s1", "", ""}; strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("session ids %q, want %q", got, want)
	}
}
