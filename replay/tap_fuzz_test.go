package replay

import (
	"bytes"
	"encoding/json"
	"math"
	"testing"
	"unicode/utf8"

	"github.com/kvbus/kvbus/messages"
)

// FuzzTapLine: whatever a message on a kvbus subject holds, tap decodes it
// by its subject, filters it by session and prints it as exactly one JSON
// line with its subject and kind, without a panic or an error of its own
// (a value JSON cannot hold is an "unprintable" line, a payload that is no
// such message a "malformed" one).
func FuzzTapLine(f *testing.F) {
	s := messages.Subjects{}
	add := func(subject string, m messages.Message) {
		data, err := messages.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(subject, data)
	}
	add(s.Heartbeat("g0", 0), &messages.Heartbeat{Group: "g0", WorldSize: 1, Model: "m"})
	add(s.KV("g0", 0), &messages.KVEventBatch{TS: math.NaN(), Group: "g0", Events: []messages.KVEvent{{Type: messages.EventAllBlocksCleared}}})
	add(s.Request("m"), &messages.Request{RequestID: "r1", SessionID: "s", Model: "m", PromptTokenIDs: []uint32{1, 2, 3}})
	add(s.Abort(), &messages.Abort{ReqID: "r1"})
	add(s.Resend(), &messages.Resend{ReqID: "r1"})
	f.Add(s.Heartbeat("g0", 0), []byte("not msgpack"))
	f.Add("kvbus.what.ever", []byte("xyz"))
	f.Add(s.Handoff("g0", 0), []byte{0, 1, 2})
	f.Add("kvbus.ctl.dump.g0.0", []byte{})
	f.Add("\xff", []byte{0xc0})
	f.Fuzz(func(t *testing.T, subject string, data []byte) {
		kind, v := decodeAny(s, subject, data)
		_ = keepForSession(kind, subject, v, "s", messages.SessionKey("s"), map[string]bool{"r1": true})
		var buf bytes.Buffer
		if err := tapLine(json.NewEncoder(&buf), subject, kind, v); err != nil {
			t.Fatalf("tapLine(%q, %q): %v", subject, kind, err)
		}
		if n := bytes.Count(buf.Bytes(), []byte("\n")); n != 1 || !bytes.HasSuffix(buf.Bytes(), []byte("\n")) {
			t.Fatalf("%q on %q: %d lines: %q", data, subject, n, buf.Bytes())
		}
		var line struct {
			Subject string          `json:"subject"`
			Kind    string          `json:"kind"`
			Msg     json.RawMessage `json:"msg"`
		}
		if err := json.Unmarshal(buf.Bytes(), &line); err != nil {
			t.Fatalf("%q on %q: not JSON: %v: %q", data, subject, err, buf.Bytes())
		}
		if line.Kind != kind && line.Kind != "unprintable" || utf8.ValidString(subject) && line.Subject != subject || len(line.Msg) == 0 {
			t.Errorf("%q on %q (kind %q): line %+v", data, subject, kind, line)
		}
	})
}
