package replay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

type tapLine struct {
	Subject string         `json:"subject"`
	Kind    string         `json:"kind"`
	Msg     map[string]any `json:"msg"`
}

// lines parses every complete line; each must be a JSON object with exactly
// the keys subject, kind and msg.
func tapLines(t *testing.T, b *testenv.LogBuffer) []tapLine {
	t.Helper()
	data := b.String()
	data = data[:strings.LastIndexByte(data, '\n')+1]
	var out []tapLine
	for _, l := range strings.Split(strings.TrimSuffix(data, "\n"), "\n") {
		if l == "" {
			continue
		}
		var keys map[string]json.RawMessage
		if err := json.Unmarshal([]byte(l), &keys); err != nil {
			t.Fatalf("tap line is not JSON: %v: %s", err, l)
		}
		if len(keys) != 3 || keys["subject"] == nil || keys["kind"] == nil || keys["msg"] == nil {
			t.Fatalf("tap line without exactly subject, kind and msg: %s", l)
		}
		var tl tapLine
		if err := json.Unmarshal([]byte(l), &tl); err != nil {
			t.Fatalf("tap line: %v: %s", err, l)
		}
		out = append(out, tl)
	}
	return out
}

// tapRun is a running Tap.
type tapRun struct {
	out      *testenv.LogBuffer
	finished chan struct{}
	err      error // set before finished is closed
}

// stopped reports whether Tap returned, and what.
func (r *tapRun) stopped() (bool, error) {
	select {
	case <-r.finished:
		return true, r.err
	default:
		return false, nil
	}
}

// startTap runs replay.Tap until the test ends. It returns once the tap's
// subscription is on the server.
func startTap(t *testing.T, nc *nats.Conn, cfg replay.TapConfig) *tapRun {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	cfg.Conn = nc
	r := &tapRun{out: &testenv.LogBuffer{}, finished: make(chan struct{})}
	before := nc.NumSubscriptions()
	go func() {
		r.err = replay.Tap(ctx, cfg, r.out)
		close(r.finished)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.finished:
			if r.err != nil {
				t.Errorf("Tap: %v", r.err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Tap did not return after its context ended")
		}
	})
	testenv.Eventually(t, 5*time.Second, "the tap's subscription", func() bool { return nc.NumSubscriptions() > before })
	// The SUB went out on nc before this PING: after the PONG the server
	// has it.
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return r
}

func chat(t *testing.T, c *testenv.Cluster, session, content string) {
	t.Helper()
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":8}`, c.Model, content)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("chat for %s: status %d: %s", session, resp.StatusCode, b)
	}
}

func TestTap(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	observed := c.Observe(t, "kvbus.>")
	// Given with the spaces the frontend trims off a session id.
	tap := startTap(t, testenv.Connect(t, c.NATS), replay.TapConfig{SessionID: " tap-me "})
	out := tap.out

	chat(t, c, "tap-me", "hello tap")
	chat(t, c, "other", "hello other")

	// Wait until the bus carried everything of both requests: one Request,
	// one ReqMeta and 4 RankResults (one per rank) each. The driver also
	// reports once when the prompt is prefilled.
	done4 := func(o *testenv.Observer) bool {
		n := 0
		for _, m := range o.Messages() {
			if strings.HasPrefix(m.Subject, "kvbus.done.") {
				if r, err := messages.DecodeRankResult(m.Data); err == nil && !r.Prefilled {
					n++
				}
			}
		}
		return n == 8
	}
	testenv.Eventually(t, 10*time.Second, "8 rank results on the bus", func() bool { return done4(observed) })

	// count counts lines by kind; "done" are the ranks' results, without
	// the driver's prefilled report.
	count := func(lines []tapLine) map[string]int {
		n := map[string]int{}
		for _, l := range lines {
			if l.Kind == "done" && l.Msg["prefilled"] == true {
				n["prefilled"]++
				continue
			}
			n[l.Kind]++
		}
		return n
	}
	testenv.Eventually(t, 10*time.Second, "tap-me's req, meta, 4 done and out lines", func() bool {
		n := count(tapLines(t, out))
		return n["req"] == 1 && n["meta"] == 1 && n["done"] == 4 && n["out"] >= 1
	})
	if stopped, err := tap.stopped(); stopped {
		t.Fatalf("Tap returned early: %v", err)
	}
	// The tap reads its own connection: make sure it has handled every
	// message the observer saw by sending a marker after them and waiting
	// for it (a result of tap-me's request on a subject nothing else reads).
	var tapID string
	for _, l := range tapLines(t, out) {
		if l.Kind == "req" {
			tapID, _ = l.Msg["request_id"].(string)
		}
	}
	const marker = "kvbus.done.tap-test-marker"
	pub := testenv.Connect(t, c.NATS)
	data, err := messages.Marshal(&messages.RankResult{ReqID: tapID, Group: "marker"})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(marker, data); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "the marker", func() bool {
		return slices.ContainsFunc(tapLines(t, out), func(l tapLine) bool { return l.Subject == marker })
	})

	lines := slices.DeleteFunc(tapLines(t, out), func(l tapLine) bool { return l.Subject == marker })
	if n := count(lines); n["req"] != 1 || n["meta"] != 1 || n["done"] != 4 || n["prefilled"] > 1 || len(n) != 4+min(n["prefilled"], 1) {
		t.Errorf("kinds %v, want req 1, meta 1, done 4 (and at most one prefilled report) and out", n)
	}
	var reqID string
	for _, l := range lines {
		if l.Kind != "req" {
			continue
		}
		reqID, _ = l.Msg["request_id"].(string)
		if reqID == "" || l.Msg["session_id"] != "tap-me" || !strings.HasPrefix(l.Subject, "kvbus.req.") {
			t.Errorf("request line %+v", l)
		}
		ids, ok := l.Msg["prompt_token_ids"].([]any)
		if !ok || len(ids) == 0 {
			t.Fatalf("prompt_token_ids is %T %v, want a non-empty JSON array", l.Msg["prompt_token_ids"], l.Msg["prompt_token_ids"])
		}
		for _, id := range ids {
			if f, ok := id.(float64); !ok || f != math.Trunc(f) || f < 0 {
				t.Fatalf("prompt token %v (%T) is not a token id", id, id)
			}
		}
		if _, ok := l.Msg["sampling_params"].(map[string]any); !ok {
			t.Errorf("request without sampling_params: %v", l.Msg)
		}
	}
	for _, l := range lines {
		switch l.Kind {
		case "meta":
			if l.Msg["req_id"] != reqID || l.Msg["session_id"] != "tap-me" || !strings.HasSuffix(l.Subject, "."+messages.SessionKey("tap-me")) {
				t.Errorf("meta line of another request: %s %v %v", l.Subject, l.Msg["req_id"], l.Msg["session_id"])
			}
		case "done", "out":
			if l.Msg["req_id"] != reqID {
				t.Errorf("%s line of request %v, want only %s", l.Kind, l.Msg["req_id"], reqID)
			}
		}
	}
	ranks := map[float64]bool{}
	for _, l := range lines {
		if l.Kind == "done" && l.Msg["prefilled"] != true {
			r, _ := l.Msg["tp_rank"].(float64)
			ranks[r] = true
		}
	}
	if len(ranks) != 4 {
		t.Errorf("done lines from ranks %v, want 4 different ranks", ranks)
	}
}

func TestTapHeartbeats(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	out := startTap(t, testenv.Connect(t, c.NATS), replay.TapConfig{Subject: "kvbus.hb.>"}).out
	testenv.Eventually(t, 10*time.Second, "a heartbeat of every rank", func() bool {
		ranks := map[float64]bool{}
		for _, l := range tapLines(t, out) {
			r, _ := l.Msg["tp_rank"].(float64)
			ranks[r] = true
		}
		return len(ranks) == 4
	})
	chat(t, c, "s", "not a heartbeat") // must not show up
	for _, l := range tapLines(t, out) {
		if l.Kind != "hb" || !strings.HasPrefix(l.Subject, "kvbus.hb.") || l.Msg["group"] == nil || l.Msg["world_size"] != 4.0 {
			t.Errorf("line %+v, want only heartbeats", l)
		}
	}
}

// TestTapAbortsAndResends: a client's Abort (kvbus.ctl.abort) and the one
// a scheduler passes on to a group (kvbus.ctl.abort.<g>) are both shown as
// aborts, decoded; the second was shown as a dump request's size. So are a
// frontend's Resends to the schedulers (kvbus.ctl.resend) and to a group's
// driver (kvbus.ctl.resend.<g>).
func TestTapAbortsAndResends(t *testing.T) {
	srv := testenv.StartNATS(t)
	pub := testenv.Connect(t, srv)
	subj := messages.Subjects{Prefix: "taptest"} // no kvbus component listens
	out := startTap(t, testenv.Connect(t, srv), replay.TapConfig{Subjects: subj}).out
	abort, err := messages.Marshal(&messages.Abort{ReqID: "r1", Reason: messages.AbortReasonClientGone})
	if err != nil {
		t.Fatal(err)
	}
	resend, err := messages.Marshal(&messages.Resend{ReqID: "r2", FromIndex: 3})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []struct {
		subject string
		data    []byte
	}{{subj.Abort(), abort}, {subj.AbortGroup("g0"), abort}, {subj.Resend(), resend}, {subj.ResendGroup("g0"), resend}} {
		if err := pub.Publish(m.subject, m.data); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, 5*time.Second, "four lines", func() bool { return len(tapLines(t, out)) == 4 })
	for i, l := range tapLines(t, out) {
		switch {
		case i < 2 && (l.Kind != "abort" || l.Msg["req_id"] != "r1" || l.Msg["reason"] != messages.AbortReasonClientGone):
			t.Errorf("line %+v, want the abort of r1", l)
		case i >= 2 && (l.Kind != "resend" || l.Msg["req_id"] != "r2" || l.Msg["from_index"] != float64(3)):
			t.Errorf("line %+v, want the resend of r2 from index 3", l)
		}
	}
}

// TestTapOddMessages checks that Tap reports what it cannot decode or
// encode and keeps going: a tap is how one debugs a bus with odd traffic.
func TestTapOddMessages(t *testing.T) {
	srv := testenv.StartNATS(t)
	pub := testenv.Connect(t, srv)
	subj := messages.Subjects{Prefix: "taptest"} // no kvbus component listens
	tap := startTap(t, testenv.Connect(t, srv), replay.TapConfig{Subjects: subj})
	out := tap.out

	hb, err := messages.Marshal(&messages.Heartbeat{Group: "g0", WorldSize: 1, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	// A KV event batch whose ts is NaN decodes (msgpack carries NaN) but
	// has no JSON form.
	nan, err := messages.Marshal(&messages.KVEventBatch{TS: math.NaN(), Group: "g0", Events: []messages.KVEvent{{Type: messages.EventAllBlocksCleared}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []struct {
		subject string
		data    []byte
	}{
		{subj.Heartbeat("g0", 0), []byte("not msgpack")},
		{"taptest.what.ever", []byte("xyz")},
		{subj.KV("g0", 0), nan},
		{subj.Heartbeat("g0", 0), hb},
	} {
		if err := pub.Publish(m.subject, m.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := pub.Flush(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "the heartbeat after the odd messages", func() bool {
		if stopped, err := tap.stopped(); stopped {
			t.Fatalf("Tap stopped on an odd message: %v", err)
		}
		for _, l := range tapLines(t, out) {
			if l.Kind == "hb" && l.Msg["group"] == "g0" {
				return true
			}
		}
		return false
	})
	// One line per message, in order.
	lines := tapLines(t, out)
	var subjects []string
	kinds := map[string]bool{}
	for _, l := range lines {
		subjects = append(subjects, l.Subject)
		kinds[l.Kind] = true
	}
	want := []string{"taptest.hb.g0.0", "taptest.what.ever", "taptest.kv.g0.0", "taptest.hb.g0.0"}
	if strings.Join(subjects, " ") != strings.Join(want, " ") {
		t.Errorf("lines on %v, want one per message on %v", subjects, want)
	}
	if !kinds["malformed"] || !kinds["unknown"] {
		t.Errorf("kinds %v, want malformed and unknown lines too", kinds)
	}
}

// TestTapDecodesControlMessages: announcements, save plans, pool reads and
// drain plans, all in the wire contract, are printed decoded, not as
// "unknown" byte counts; a hand-off (block bytes) by its size.
func TestTapDecodesControlMessages(t *testing.T) {
	srv := testenv.StartNATS(t)
	pub := testenv.Connect(t, srv)
	subj := messages.Subjects{Prefix: "taptest"}
	tap := startTap(t, testenv.Connect(t, srv), replay.TapConfig{Subjects: subj})
	marshal := func(m messages.Message) []byte {
		data, err := messages.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	sent := []struct {
		subject string
		data    []byte
		kind    string
	}{
		{subj.Announce(messages.RoleScheduler, "s1"), marshal(&messages.Announcement{Role: messages.RoleScheduler, ID: "s1"}), "announcement"},
		{subj.Plan("s1"), marshal(&messages.SavePlan{SchedulerID: "s1", ReqID: "r1", Group: "g0", BlockHashes: messages.BlockHashes{7}}), "save_plan"},
		{subj.Pool("g0", 1), marshal(&messages.PoolRead{ReqID: "r1", Model: "m", TPRank: 1, BlockHashes: messages.BlockHashes{7}}), "pool_read"},
		{subj.Drain("g0"), marshal(&messages.DrainPlan{Group: "g0", Model: "m"}), "drain_plan"},
		{subj.Handoff("g1", 1), []byte("block bytes"), "handoff"},
		// Printed as "out" before, once a second per frontend with
		// requests in flight, among the answers' outputs.
		{subj.Out("fe1"), marshal(&messages.Output{ReqID: messages.FrontendProbeReqID}), "frontend_probe"},
		{subj.Out("fe1"), marshal(&messages.Output{ReqID: "r1", Text: "hi"}), messages.KindOut},
	}
	for _, m := range sent {
		if err := pub.Publish(m.subject, m.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := pub.Flush(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "a line per message", func() bool { return len(tapLines(t, tap.out)) >= len(sent) })
	for i, l := range tapLines(t, tap.out) {
		if l.Kind != sent[i].kind {
			t.Errorf("%s printed as %q (%v), want %q", l.Subject, l.Kind, l.Msg, sent[i].kind)
		}
	}
}

// TestTapNeedsTheAdminKey: with keys on the bus, a role's key may not read
// every subject; tap says which key it needs instead of waiting for ever.
func TestTapNeedsTheAdminKey(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t)
	nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), NKeySeedFile: filepath.Join(dir, "worker.nk")})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	err = replay.Tap(ctx, replay.TapConfig{Conn: nc}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "admin key") || ctx.Err() != nil {
		t.Errorf("Tap with a worker key: %v (context %v); want an error naming the admin key, at once", err, ctx.Err())
	}
}

// slowWriter is a terminal: each write takes 200 µs to show.
type slowWriter struct{ testenv.LogBuffer }

func (w *slowWriter) Write(p []byte) (int, error) {
	time.Sleep(200 * time.Microsecond)
	return w.LogBuffer.Write(p)
}

// TestTapKeepsUpWithABurst: a burst on the bus faster than tap's output
// is printed whole, late. Before, tap's channel held 4,096 messages and
// the client dropped the rest of the burst (as a slow consumer), saying
// nothing on stdout.
func TestTapKeepsUpWithABurst(t *testing.T) {
	srv := testenv.StartNATS(t)
	pub := testenv.Connect(t, srv)
	subj := messages.Subjects{Prefix: "taptest"}
	w := &slowWriter{}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- replay.Tap(ctx, replay.TapConfig{Conn: testenv.Connect(t, srv), Subjects: subj}, w) }()
	hb, err := messages.Marshal(&messages.Heartbeat{Group: "g0", WorldSize: 1, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "tap subscribed", func() bool {
		_ = pub.Publish(subj.Heartbeat("g0", 1), hb) // rank 1: not counted below
		return w.String() != ""
	})
	const n = 6000
	for range n {
		if err := pub.Publish(subj.Heartbeat("g0", 0), hb); err != nil {
			t.Fatal(err)
		}
	}
	if err := pub.Flush(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "every message of the burst printed", func() bool {
		return len(w.Lines(`"subject":"taptest.hb.g0.0"`)) == n
	})
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Tap: %v", err)
	}
}
