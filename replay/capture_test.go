package replay

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

func TestCaptureRoundTrip(t *testing.T) {
	big := bytes.Repeat([]byte{0, 1, 2, 0xff}, 1<<18) // 1 MiB
	frames := []Frame{
		{Time: time.Unix(1700000000, 123456789), Subject: "kvbus.req.m", Payload: []byte{0x81, 0xa1, 'v', 0x01}},
		{Time: time.Unix(1700000000, 123456790), Subject: "kvbus.req.other_model", Payload: []byte("\x00\x00not msgpack\xc1\x00")},
		{Time: time.Unix(0, 1), Subject: "", Payload: []byte{}},
		{Time: time.Unix(-5, 999999999), Subject: "x", Payload: nil},
		{Time: time.Date(2262, 4, 11, 23, 47, 16, 0, time.UTC), Subject: "s.é.ü", Payload: big},
	}
	var buf bytes.Buffer
	cw, err := NewCaptureWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range frames {
		if err := cw.Write(f); err != nil {
			t.Fatal(err)
		}
	}
	if cw.Frames() != len(frames) {
		t.Errorf("Frames() = %d, want %d", cw.Frames(), len(frames))
	}
	if err := cw.Flush(); err != nil {
		t.Fatal(err)
	}
	if got := buf.Bytes()[:12]; string(got) != "KVBUSCAP\x01\x00\x00\x00" {
		t.Errorf("header % x", got)
	}
	cr, err := NewCaptureReader(bytes.NewReader(buf.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range frames {
		got, err := cr.Next()
		if err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
		if got.Time.UnixNano() != want.Time.UnixNano() || !got.Time.Equal(want.Time) {
			t.Errorf("frame %d: time %v (%d ns), want %v (%d ns)", i, got.Time, got.Time.UnixNano(), want.Time, want.Time.UnixNano())
		}
		if got.Subject != want.Subject || !bytes.Equal(got.Payload, want.Payload) {
			t.Errorf("frame %d: subject %q payload %d bytes, want %q and %d bytes", i, got.Subject, len(got.Payload), want.Subject, len(want.Payload))
		}
	}
	for range 2 {
		if _, err := cr.Next(); err != io.EOF {
			t.Errorf("after the last frame: %v, want io.EOF", err)
		}
	}

	t.Run("empty capture", func(t *testing.T) {
		cr, err := NewCaptureReader(bytes.NewReader(captureBytes(t)))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cr.Next(); err != io.EOF {
			t.Errorf("%v, want io.EOF", err)
		}
	})
	t.Run("write error", func(t *testing.T) {
		cw, err := NewCaptureWriter(failWriter{})
		if err != nil {
			t.Fatal(err) // buffered: the header is not written yet
		}
		if err := cw.Write(frames[0]); err != nil {
			t.Fatal(err)
		}
		if err := cw.Flush(); err == nil {
			t.Error("Flush to a failing writer succeeded")
		}
	})
}

type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func TestNewCaptureReaderRejects(t *testing.T) {
	cases := []struct {
		name   string
		data   string
		inText string
	}{
		{"empty", "", ""},
		{"short header", "KVBUSCAP\x01", ""},
		{"magic only", "KVBUSCAP", ""},
		{"wrong magic", "KVBUSCAX\x01\x00\x00\x00", ""},
		{"lower case magic", "kvbuscap\x01\x00\x00\x00", ""},
		{"garbage", "\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d", ""},
		{"a mooncake trace", mooncakeFixture, ""},
		{"an azure trace", azureFixture, ""},
		{"version 0", "KVBUSCAP\x00\x00\x00\x00", "version 0"},
		{"version 2", "KVBUSCAP\x02\x00\x00\x00" + "\x00\x00\x00\x00", "version 2"},
		{"version 256", "KVBUSCAP\x00\x01\x00\x00", "version 256"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewCaptureReader(strings.NewReader(tc.data))
			if !errors.Is(err, ErrNotCapture) {
				t.Fatalf("error %v, want ErrNotCapture", err)
			}
			if !strings.Contains(err.Error(), tc.inText) {
				t.Errorf("error %q does not say %q", err, tc.inText)
			}
		})
	}
}

func frameLen(n uint32) string {
	return string(binary.LittleEndian.AppendUint32(nil, n))
}

func TestCaptureReaderCorrupt(t *testing.T) {
	good := captureBytes(t, Frame{Time: t0, Subject: "kvbus.req.m", Payload: []byte("payload")})
	hdr := string(good[:12])
	frame := string(good[12:])
	cases := []struct {
		name string
		data string
		ok   int // good frames before the error
	}{
		{"one byte of length", hdr + "\x05", 0},
		{"three bytes of length", hdr + "\x05\x00\x00", 0},
		{"truncated frame", string(good[:len(good)-1]), 0},
		{"length only", hdr + frame[:4], 0},
		{"truncated second frame", hdr + frame + frame[:len(frame)-3], 1},
		{"oversized length", hdr + frameLen(MaxFrameBytes+1), 0},
		{"huge length", hdr + frameLen(0xffffffff) + "abc", 0},
		{"zero length", hdr + frameLen(0), 0},
		{"not msgpack", hdr + frameLen(3) + "\xc1\xc1\xc1", 0},
		{"msgpack of another shape", hdr + frameLen(2) + "\x92\x01", 0},
		{"wrong field types", hdr + frameLen(7) + "\x81\xa1t\xa3abc", 0},
		{"after a good frame", hdr + frame + frameLen(3) + "\xc1\xc1\xc1", 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cr, err := NewCaptureReader(strings.NewReader(tc.data))
			if err != nil {
				t.Fatal(err)
			}
			for i := range tc.ok {
				if _, err := cr.Next(); err != nil {
					t.Fatalf("frame %d: %v", i, err)
				}
			}
			f, err := cr.Next()
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("frame %d: %+v, %v; want ErrCorrupt", tc.ok, f, err)
			}
		})
	}
	// A corrupt length must not make the reader allocate it.
	t.Run("oversized length allocates nothing", func(t *testing.T) {
		data := []byte(hdr + frameLen(0xfffffff0))
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		cr, err := NewCaptureReader(bytes.NewReader(data))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cr.Next(); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("%v, want ErrCorrupt", err)
		}
		runtime.ReadMemStats(&after)
		if d := after.TotalAlloc - before.TotalAlloc; d > 1<<20 {
			t.Errorf("reading a 4 GiB length allocated %d bytes", d)
		}
	})
}

func TestStats(t *testing.T) {
	withXargs := testRequest("r3", "", 30)
	withXargs.SamplingParams.MaxTokens = 12
	withXargs.SamplingParams.ExtraArgs = messages.Args{messages.ExtraArgSessionID: "xargs-only"}
	r1 := testRequest("r1", "s1", 10)
	r2 := testRequest("r2", "s1", 20)
	r2.SamplingParams.MaxTokens = 8
	r4 := testRequest("r4", "s2", 20)
	r4.SamplingParams.MaxTokens = 0
	data := captureBytes(t,
		Frame{Time: t0, Subject: "kvbus.req.bad", Payload: []byte("not a request")}, // malformed first
		Frame{Time: t0.Add(time.Second), Subject: "kvbus.req.m", Payload: marshal(t, r1)},
		Frame{Time: t0.Add(1500 * time.Millisecond), Subject: "kvbus.req.m", Payload: marshal(t, r2)},
		Frame{Time: t0.Add(2 * time.Second), Subject: "kvbus.req.other", Payload: marshal(t, withXargs)},
		Frame{Time: t0.Add(3 * time.Second), Subject: "kvbus.req.m", Payload: marshal(t, r4)},
	)
	s, err := Stats(bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	if s.Requests != 5 || s.Malformed != 1 {
		t.Errorf("requests %d malformed %d, want 5 and 1", s.Requests, s.Malformed)
	}
	if !s.First.Equal(t0) || !s.Last.Equal(t0.Add(3*time.Second)) || s.Span != 3*time.Second {
		t.Errorf("first %v last %v span %v", s.First, s.Last, s.Span)
	}
	if want := map[string]int{"kvbus.req.bad": 1, "kvbus.req.m": 3, "kvbus.req.other": 1}; !equalMaps(s.Subjects, want) {
		t.Errorf("subjects %v, want %v", s.Subjects, want)
	}
	if s.Sessions != 3 { // s1, s2 and xargs-only: the sessions a replay of the file has (TestStatsAgreesWithReplay)
		t.Errorf("sessions %d, want 3", s.Sessions)
	}
	if s.PromptTokens.Min != 10 || s.PromptTokens.Max != 30 || s.PromptTokens.Mean != 20 {
		t.Errorf("prompt tokens %+v, want min 10 max 30 mean 20", s.PromptTokens)
	}
	if s.MaxTokensMean != 6 { // (4 + 8 + 12 + 0) / 4
		t.Errorf("max_tokens mean %v, want 6", s.MaxTokensMean)
	}
	var out bytes.Buffer
	s.Write(&out)
	for _, want := range []string{"requests      5 (1 malformed)", "sessions      3", "min 10, mean 20.0, max 30",
		"subject       kvbus.req.m: 3", `model         "m": 4`, "(3s)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("Write output lacks %q:\n%s", want, out.String())
		}
	}

	// A cut tail: the stats of the frames before it, with the error.
	t.Run("truncated", func(t *testing.T) {
		s, err := Stats(bytes.NewReader(data[:len(data)-3]))
		if !errors.Is(err, ErrCorrupt) || s == nil {
			t.Fatalf("%+v, %v; want the stats and ErrCorrupt", s, err)
		}
		if s.Requests != 4 || s.Sessions != 2 || s.Span != 2*time.Second || s.PromptTokens.Mean != 20 || s.MaxTokensMean != 8 {
			t.Errorf("requests %d sessions %d span %s prompt mean %.1f max_tokens mean %.1f; want 4, 2, 2s, 20, 8",
				s.Requests, s.Sessions, s.Span, s.PromptTokens.Mean, s.MaxTokensMean)
		}
	})
	t.Run("empty", func(t *testing.T) {
		s, err := Stats(bytes.NewReader(captureBytes(t)))
		if err != nil || s.Requests != 0 || s.Span != 0 || s.PromptTokens.Mean != 0 {
			t.Errorf("%+v, %v", s, err)
		}
		var out bytes.Buffer
		s.Write(&out)
		if !strings.Contains(out.String(), "requests      0 (0 malformed)") {
			t.Errorf("output:\n%s", out.String())
		}
	})
	t.Run("all malformed", func(t *testing.T) {
		s, err := Stats(bytes.NewReader(captureBytes(t, Frame{Time: t0, Subject: "a", Payload: []byte{0xc1}})))
		if err != nil || s.Requests != 1 || s.Malformed != 1 || s.PromptTokens.Min != 0 || s.PromptTokens.Mean != 0 {
			t.Errorf("%+v, %v", s, err)
		}
	})
	t.Run("not a capture", func(t *testing.T) {
		if _, err := Stats(strings.NewReader(mooncakeFixture)); !errors.Is(err, ErrNotCapture) {
			t.Errorf("error %v, want ErrNotCapture", err)
		}
	})
	t.Run("truncated", func(t *testing.T) {
		s, err := Stats(bytes.NewReader(data[:len(data)-2]))
		if !errors.Is(err, ErrCorrupt) || s == nil || s.Requests != 4 {
			t.Errorf("%+v, %v; want the 4 frames before the corrupt one and ErrCorrupt", s, err)
		}
	})
}

// TestReadCaptureTraceItems checks that a capture gives items like every
// other trace format does: a prompt to send and a time from the start of
// the trace that is not negative.
func TestReadCaptureTraceItems(t *testing.T) {
	noPrompt := testRequest("r2", "", 0)
	noPrompt.PromptTokenIDs = nil
	cases := []struct {
		name   string
		frames []Frame
	}{
		// The frontend never publishes an empty prompt (it answers 400
		// "prompt is empty"), so replaying one cannot reproduce anything.
		{"request without prompt tokens", []Frame{
			{Time: t0, Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r1", "", 5))},
			{Time: t0.Add(time.Second), Subject: "kvbus.req.m", Payload: marshal(t, noPrompt)},
		}},
		// Frames out of time order (a merged or hand-made capture): the
		// first frame is not the earliest.
		{"first frame not the earliest", []Frame{
			{Time: t0, Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r1", "", 5))},
			{Time: t0.Add(-2 * time.Second), Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r2", "", 5))},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := ReadTrace(bytes.NewReader(captureBytes(t, tc.frames...)), FormatAuto)
			if err != nil {
				return // refusing the file is fine too
			}
			for i, it := range tr.Items {
				if len(it.Prompt) == 0 || it.At < 0 {
					t.Errorf("item %d (%s): %d prompt tokens at %v; want a prompt and a time ≥ 0 (or an ErrFormat)", i, it.OriginalID, len(it.Prompt), it.At)
				}
			}
		})
	}
}

// TestCaptureWriterFrameLimit checks that the writer never produces a
// frame its reader refuses: a capture is byte-exact or it fails when
// written, not when replayed.
func TestCaptureWriterFrameLimit(t *testing.T) {
	payload := make([]byte, MaxFrameBytes) // with t, s and p the frame is over the limit
	var buf bytes.Buffer
	cw, err := NewCaptureWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if err := cw.Write(Frame{Time: t0, Subject: "kvbus.req.m", Payload: payload}); err != nil {
		return // refused when written: fine
	}
	if err := cw.Flush(); err != nil {
		t.Fatal(err)
	}
	cr, err := NewCaptureReader(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if f, err := cr.Next(); err != nil || len(f.Payload) != len(payload) {
		t.Errorf("CaptureWriter wrote a %d-byte payload that CaptureReader refuses: %v", len(payload), err)
	}
}

// TestCaptureFrameOfAStrayTimeIsLeftOut: a frame whose timestamp is
// damaged (one flipped byte put a request in 1828) is left out, and the
// trace says so, instead of holding the replay for centuries: its time is
// more than a year from the capture's others. Before, it was kept, and a
// replay at --speed 1000 still waited for it.
func TestCaptureFrameOfAStrayTimeIsLeftOut(t *testing.T) {
	tr, err := ReadTrace(bytes.NewReader(captureBytes(t,
		Frame{Time: t0, Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r1", "s", 5))},
		Frame{Time: time.Date(1828, 3, 1, 0, 0, 0, 0, time.UTC), Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r2", "s", 5))},
		Frame{Time: t0.Add(time.Second), Subject: "kvbus.req.m", Payload: marshal(t, testRequest("r3", "s", 5))},
	)), FormatAuto)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, it := range tr.Items {
		ids = append(ids, it.OriginalID)
	}
	if !slices.Equal(ids, []string{"r1", "r3"}) || tr.Items[1].At != time.Second {
		t.Errorf("items %v (last at %v), want r1 and r3 a second apart: the 1828 frame left out", ids, tr.Items[len(tr.Items)-1].At)
	}
	if len(tr.Damage) != 1 || !strings.Contains(tr.Damage[0], "frame 1 at 1828-03-01") {
		t.Errorf("damage %q, want one note naming frame 1 and its time", tr.Damage)
	}
}
