package workers

import (
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// sent collects what an outputReplay publishes.
type sent struct{ data []string }

func (s *sent) send(data []byte)                   { s.data = append(s.data, string(data)) }
func (s *sent) resend(subject string, data []byte) { s.data = append(s.data, subject+":"+string(data)) }
func out(i int) []byte                             { return []byte(fmt.Sprintf("o%d", i)) }
func meta(id string, attempt int) *messages.ReqMeta {
	return &messages.ReqMeta{ReqID: id, SessionID: "s", Attempt: attempt, Stream: true}
}

func TestStreamReplayResendsFromAnIndex(t *testing.T) {
	m := newOutputReplay(1<<20, time.Minute)
	e := m.begin(meta("r1", 0), "kvbus.out.fe")
	var live sent
	for i := range 4 {
		m.publish(e, out(i), live.send)
	}
	if len(live.data) != 4 {
		t.Fatalf("published %q; want every output at once", live.data)
	}
	var again sent
	res, known, err := m.resend("r1", 0, 2, again.resend)
	if !known || err != nil || res.n != 2 || res.done || res.session != "s" {
		t.Fatalf("resend from 2: %+v known %v err %v; want 2 outputs of a running request", res, known, err)
	}
	if want := []string{"kvbus.out.fe:o2", "kvbus.out.fe:o3"}; fmt.Sprint(again.data) != fmt.Sprint(want) {
		t.Errorf("sent again %q; want %q", again.data, want)
	}
	// Nothing past the last: none, still known (the request runs on).
	if res, known, err = m.resend("r1", 0, 4, again.resend); !known || err != nil || res.n != 0 {
		t.Errorf("resend past the end: %+v %v %v; want none, known", res, known, err)
	}
	// Another attempt, or another request, is not this driver's to answer.
	if _, known, _ = m.resend("r1", 1, 0, again.resend); known {
		t.Error("another attempt is known")
	}
	if _, known, _ = m.resend("r2", 0, 0, again.resend); known {
		t.Error("an unknown request is known")
	}
	m.end(e, time.Now())
	if res, known, _ = m.resend("r1", 0, 3, again.resend); !known || !res.done || res.n != 1 {
		t.Errorf("after its end: %+v known %v; want the last output, done", res, known)
	}
}

func TestStreamReplayForgetsAfterItsAge(t *testing.T) {
	m := newOutputReplay(1<<20, time.Minute)
	now := time.Now()
	e := m.begin(meta("r1", 0), "s")
	m.publish(e, out(0), func([]byte) {})
	m.end(e, now)
	m.expire(now.Add(61 * time.Second))
	if _, known, _ := m.resend("r1", 0, 0, func(string, []byte) {}); !known {
		t.Fatal("forgotten past its age before its server confirmed it")
	}
	m.confirm(now.Add(deliveryMargin + time.Millisecond))
	m.expire(now.Add(59 * time.Second))
	if _, known, _ := m.resend("r1", 0, 0, func(string, []byte) {}); !known {
		t.Fatal("forgotten before its age")
	}
	m.expire(now.Add(61 * time.Second))
	if _, known, _ := m.resend("r1", 0, 0, func(string, []byte) {}); known {
		t.Error("kept past its age")
	}
	if m.bytes != 0 || len(m.byID) != 0 || len(m.ended) != 0 {
		t.Errorf("memory after expiry: %d bytes, %d ids, %d ended; want empty", m.bytes, len(m.byID), len(m.ended))
	}
}

func TestStreamReplayWithinItsBudget(t *testing.T) {
	// Outputs of 100 bytes: two (202 bytes with their lengths) fit, three
	// (303) do not, whatever room append leaves.
	big := func(i int) []byte { return []byte(fmt.Sprintf("%-100d", i)) }
	m := newOutputReplay(replayEntryBytes+250, time.Minute)
	old := m.begin(meta("old", 0), "s")
	m.publish(old, big(0), func([]byte) {})
	m.publish(old, big(1), func([]byte) {})
	m.end(old, time.Now())
	// A running request's outputs push out the ended one's.
	e := m.begin(meta("new", 0), "s")
	m.publish(e, big(0), func([]byte) {})
	m.publish(e, big(1), func([]byte) {})
	if _, known, _ := m.resend("old", 0, 0, func(string, []byte) {}); known {
		t.Error("an ended request kept over the budget")
	}
	if res, known, err := m.resend("new", 0, 0, func(string, []byte) {}); !known || err != nil || res.n != 2 {
		t.Fatalf("running request: %+v %v %v; want both outputs", res, known, err)
	}
	// Running requests alone over the budget: the newest outputs' request
	// is cut, still published, and says so when asked.
	var live sent
	m.publish(e, big(2), live.send)
	m.publish(e, big(3), live.send)
	if len(live.data) != 2 {
		t.Errorf("published %q over the budget; want both", live.data)
	}
	if _, known, err := m.resend("new", 0, 0, func(string, []byte) {}); !known || err == nil {
		t.Errorf("cut request: known %v err %v; want known with an error", known, err)
	}
	if m.bytes != 0 {
		t.Errorf("%d bytes counted after the cut; want 0", m.bytes)
	}
	// A new attempt of the same request starts afresh.
	e2 := m.begin(meta("new", 1), "s")
	m.publish(e2, big(0), func([]byte) {})
	if res, known, err := m.resend("new", 1, 0, func(string, []byte) {}); !known || err != nil || res.n != 1 {
		t.Errorf("new attempt: %+v %v %v; want its one output", res, known, err)
	}
}

// TestOutputReplayKeepsAnAnswerUntilItsServerConfirmedIt: an answer not
// streamed is kept after its end until the driver's server confirmed what
// was published deliveryMargin after it, and for the memory's age, as a
// stream is: a frontend whose subscription came back after the driver's
// connection asks for it 3 s after its reconnect.
func TestOutputReplayKeepsAnAnswerUntilItsServerConfirmedIt(t *testing.T) {
	m := newOutputReplay(1<<20, time.Minute)
	now := time.Now()
	e := m.begin(&messages.ReqMeta{ReqID: "a1"}, "s")
	m.publish(e, out(0), func([]byte) {})
	m.end(e, now)
	m.expire(now.Add(time.Hour))
	if len(m.byID) != 1 {
		t.Fatal("an unconfirmed answer forgotten")
	}
	m.confirm(now.Add(deliveryMargin - time.Millisecond))
	if len(m.byID) != 1 {
		t.Fatal("an answer forgotten within deliveryMargin of its confirmation")
	}
	m.confirm(now.Add(deliveryMargin + time.Millisecond))
	if _, known, _ := m.resend("a1", 0, 0, func(string, []byte) {}); !known {
		t.Fatal("an answer forgotten at its confirmation, within the memory's age")
	}
	m.expire(now.Add(61 * time.Second))
	if m.bytes != 0 || len(m.byID) != 0 || len(m.answered) != 0 {
		t.Errorf("after its confirmation and age: %d bytes, %d ids, %d answered; want empty", m.bytes, len(m.byID), len(m.answered))
	}
}

// TestOutputReplaySendsAgainWhatItsServerDidNotConfirm: after a reconnect
// the outputs published since the last confirmation less deliveryMargin
// go out again, those before it do not; of streams and answers alike.
func TestOutputReplaySendsAgainWhatItsServerDidNotConfirm(t *testing.T) {
	m := newOutputReplay(1<<20, time.Minute)
	at := m.base
	m.clock = func() time.Time { return at }
	stream := m.begin(meta("s1", 0), "kvbus.out.fe")
	answer := m.begin(&messages.ReqMeta{ReqID: "a1"}, "kvbus.out.fe")
	old := m.begin(&messages.ReqMeta{ReqID: "a0"}, "kvbus.out.fe")
	m.publish(old, []byte("a0"), func([]byte) {})
	m.end(old, at)
	m.publish(stream, out(0), func([]byte) {})
	at = at.Add(5 * time.Second)
	m.confirm(at) // everything above reached the server
	at = at.Add(deliveryMargin / 2)
	m.publish(stream, out(1), func([]byte) {}) // within the margin: sent again
	at = at.Add(time.Second)
	m.publish(stream, out(2), func([]byte) {})
	m.publish(answer, []byte("a1"), func([]byte) {})
	m.end(answer, at)
	var again sent
	outputs, requests := m.unconfirmed(again.resend)
	sort.Strings(again.data)
	want := []string{"kvbus.out.fe:a1", "kvbus.out.fe:o1", "kvbus.out.fe:o2"}
	if fmt.Sprint(again.data) != fmt.Sprint(want) || outputs != 3 || requests != 2 {
		t.Errorf("sent again %q (%d outputs of %d requests); want %q of 2", again.data, outputs, requests, want)
	}
}

// TestResendSendsEachOutputOnceAWindow: asks repeated within resendWindow
// (a forged or broken frontend's: the frontend waits 2 s before it asks
// again) have each kept output sent again once, however they are made;
// every reply counts what the ask covers. Before, each ask for a stream of
// 100 outputs published all 100 again: ten asks, 1,000 messages. Outputs
// published after a resend, or asked after the window, are sent again.
func TestResendSendsEachOutputOnceAWindow(t *testing.T) {
	now := time.Now()
	m := newOutputReplay(1<<20, time.Minute)
	m.clock = func() time.Time { return now }
	e := m.begin(meta("r1", 0), "kvbus.out.fe")
	for i := range 100 {
		m.publish(e, out(i), func([]byte) {})
	}
	var again sent
	ask := func(from, wantN int) {
		t.Helper()
		res, known, err := m.resend("r1", 0, from, again.resend)
		if !known || err != nil || res.n != wantN {
			t.Fatalf("resend from %d: %+v known %v err %v; want %d outputs counted", from, res, known, err, wantN)
		}
	}
	for range 10 {
		ask(0, 100)
	}
	if len(again.data) != 100 {
		t.Errorf("ten asks from 0 in a window sent %d outputs again, want the 100 once", len(again.data))
	}
	again.data = nil
	now = now.Add(resendWindow)
	for from := 90; from >= 0; from -= 10 { // each ask from further back
		ask(from, 100-from)
	}
	if len(again.data) != 100 {
		t.Errorf("asks from 90 down to 0 in a window sent %d outputs again, want the 100 once", len(again.data))
	}

	// A frontend's own asks: from the first output it lacks, then, after
	// more came and one more was lost, from that one.
	again.data = nil
	now = now.Add(resendWindow)
	ask(95, 5)
	for i := 100; i < 110; i++ {
		m.publish(e, out(i), func([]byte) {})
	}
	ask(105, 5)
	want := []string{"o95", "o96", "o97", "o98", "o99", "o105", "o106", "o107", "o108", "o109"}
	for i := range want {
		want[i] = "kvbus.out.fe:" + want[i]
	}
	if fmt.Sprint(again.data) != fmt.Sprint(want) {
		t.Errorf("a frontend's two asks sent %q, want %q", again.data, want)
	}
}
