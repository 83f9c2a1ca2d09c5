package scheduler_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
)

const (
	testModel    = "meta-llama/Llama-3.1-8B" // not a subject token as is
	testSchedID  = "sched-test"
	testFrontend = "fe-test"
	worldSize    = 2
	waitFor      = 15 * time.Second
)

// schedEnv is a scheduler on an embedded NATS server with fake worker
// groups: the test publishes their heartbeats and answers ReqMetas with a
// RankResult per rank.
type schedEnv struct {
	t    *testing.T
	nc   *nats.Conn
	js   jetstream.JetStream
	subj messages.Subjects
	s    *scheduler.Scheduler
	reg  *prometheus.Registry
	logs *testenv.LogBuffer
	srv  *bus.Server
	// proxy carries the scheduler's connection (viaProxy), to pause it.
	proxy *testenv.FaultProxy

	mu   sync.Mutex
	msgs []*nats.Msg // everything under the prefix, in arrival order

	// answer makes the fake ranks report on every ReqMeta.
	answer atomic.Bool
	hbOn   atomic.Bool
	groups []string

	stop func() error

	hbStarted int64
}

type schedEnvConfig struct {
	groups         []string // default g0
	policy         scheduler.Policy
	requestTimeout time.Duration
	noHeartbeats   bool
	noAnswers      bool
	dumpTimeout    time.Duration
	forgetAfter    time.Duration
	noGroupWait    time.Duration
	// unsyncedWait: the fake ranks answer no dump, so no group is ever
	// synced; 0 here means no wait.
	unsyncedWait time.Duration
	// backlog is put in the request log backlogAge before the scheduler
	// starts.
	backlog    []*messages.Request
	backlogAge time.Duration
	// before runs once the server and the fake ranks are up, before the
	// scheduler starts.
	before func(e *schedEnv)
	// viaProxy connects the scheduler through a testenv.FaultProxy.
	viaProxy bool
	// hbStarted is the fake ranks' started_unix_ms (0: 1).
	hbStarted int64
}

func startScheduler(t *testing.T, cfg schedEnvConfig) *schedEnv {
	t.Helper()
	if cfg.groups == nil {
		cfg.groups = []string{"g0"}
	}
	if cfg.policy == nil {
		cfg.policy = &scheduler.SessionPolicy{Epsilon: 0.25}
	}
	srv := testenv.StartNATS(t)
	e := &schedEnv{t: t, nc: testenv.Connect(t, srv), reg: prometheus.NewRegistry(), groups: cfg.groups, srv: srv,
		hbStarted: cmp.Or(cfg.hbStarted, 1)}
	e.answer.Store(!cfg.noAnswers)
	e.hbOn.Store(!cfg.noHeartbeats)
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	e.js = js
	if _, err := bus.EnsureRequestStream(t.Context(), js, bus.StreamConfig{Subjects: e.subj}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.nc.Subscribe(e.subj.All(), func(m *nats.Msg) {
		e.mu.Lock()
		e.msgs = append(e.msgs, m)
		e.mu.Unlock()
	}); err != nil {
		t.Fatal(err)
	}
	// The fake ranks of every group.
	for _, g := range cfg.groups {
		if _, err := e.nc.Subscribe(e.subj.MetaGroup(g), e.onMeta); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, req := range cfg.backlog {
		e.publishRequest(req)
	}
	time.Sleep(cfg.backlogAge)
	if cfg.before != nil {
		cfg.before(e)
	}
	logs := &testenv.LogBuffer{}
	e.logs = logs
	var conn *nats.Conn
	if cfg.viaProxy {
		e.proxy = testenv.StartFaultProxy(t, strings.TrimPrefix(srv.ClientURL(), "nats://"))
		if conn, err = nats.Connect(e.proxy.URL(), nats.MaxReconnects(-1)); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(conn.Close)
	} else {
		conn = testenv.Connect(t, srv)
	}
	e.s, err = scheduler.New(scheduler.Config{
		Conn: conn, Subjects: e.subj, ID: testSchedID, Policy: cfg.policy,
		HeartbeatTimeout: time.Second, RequestTimeout: cfg.requestTimeout, DumpTimeout: cfg.dumpTimeout, ForgetGroupAfter: cfg.forgetAfter,
		NoGroupWait: cfg.noGroupWait, UnsyncedWait: cmp.Or(cfg.unsyncedWait, -1),
		Logger: slog.New(slog.NewTextHandler(logs, nil)), Registerer: e.reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	if e.s.ID() != testSchedID {
		t.Fatalf("ID() = %q", e.s.ID())
	}
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- e.s.Run(ctx) }()
	hbDone := make(chan struct{})
	go func() { // the fake ranks' heartbeats, every 50 ms
		defer close(hbDone)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			if e.hbOn.Load() {
				e.heartbeat()
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	var once sync.Once
	var stopErr error
	e.stop = func() error {
		once.Do(func() {
			cancel()
			<-hbDone
			select {
			case stopErr = <-runErr:
			case <-time.After(waitFor):
				stopErr = errors.New("Scheduler.Run did not return after its context ended")
			}
		})
		return stopErr
	}
	// Registered after the connections, so it runs before they close.
	t.Cleanup(func() {
		if err := e.stop(); err != nil {
			t.Errorf("Scheduler.Run: %v", err)
		}
	})
	if !cfg.noHeartbeats {
		e.waitReady(len(cfg.groups))
	}
	return e
}

func (e *schedEnv) heartbeat() {
	for _, g := range e.groups {
		for r := range worldSize {
			data, err := messages.Marshal(&messages.Heartbeat{Group: g, TPRank: r, EPRank: r, WorldSize: worldSize,
				Model: testModel, StartedUnixMs: e.hbStarted})
			if err == nil {
				err = e.nc.Publish(e.subj.Heartbeat(g, r), data)
			}
			if err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
				e.t.Errorf("heartbeat: %v", err)
			}
		}
	}
}

func (e *schedEnv) waitReady(n int) {
	e.t.Helper()
	testenv.Eventually(e.t, waitFor, fmt.Sprintf("%d ready groups", n), func() bool { return e.s.ReadyGroups() == n })
}

// onMeta is the fake ranks: every rank of the group reports.
func (e *schedEnv) onMeta(m *nats.Msg) {
	if !e.answer.Load() {
		return
	}
	meta, err := messages.DecodeReqMeta(m.Data)
	if err != nil {
		e.t.Errorf("scheduler published a bad ReqMeta: %v", err)
		return
	}
	e.report(meta)
}

func (e *schedEnv) report(meta *messages.ReqMeta) {
	for r := range worldSize {
		data, err := messages.Marshal(&messages.RankResult{ReqID: meta.ReqID, Group: meta.Group, TPRank: r, EPRank: r,
			Attempt: meta.Attempt, StoredBlocks: len(meta.BlockHashes)})
		if err == nil {
			err = e.nc.Publish(meta.ResultSubject, data)
		}
		if err != nil && !errors.Is(err, nats.ErrConnectionClosed) { // closed: the test is ending
			e.t.Errorf("report: %v", err)
		}
	}
}

type metaMsg struct {
	subject string
	meta    *messages.ReqMeta
}

// metas returns the ReqMetas published for reqID, in order.
func (e *schedEnv) metas(reqID string) []metaMsg {
	e.mu.Lock()
	msgs := slices.Clone(e.msgs)
	e.mu.Unlock()
	var out []metaMsg
	for _, m := range msgs {
		if !strings.HasPrefix(m.Subject, messages.DefaultPrefix+".meta.") {
			continue
		}
		meta, err := messages.DecodeReqMeta(m.Data)
		if err != nil {
			e.t.Fatalf("bad ReqMeta on %s: %v", m.Subject, err)
		}
		if meta.ReqID == reqID {
			out = append(out, metaMsg{m.Subject, meta})
		}
	}
	return out
}

func (e *schedEnv) outputs(reqID string) []*messages.Output {
	return e.frontendOutputs(testFrontend, reqID)
}

// waitMeta waits for the one ReqMeta of reqID.
func (e *schedEnv) waitMeta(reqID string) metaMsg {
	e.t.Helper()
	testenv.Eventually(e.t, waitFor, "the ReqMeta of "+reqID, func() bool { return len(e.metas(reqID)) > 0 })
	return e.metas(reqID)[0]
}

func (e *schedEnv) waitNoTrackers() {
	e.t.Helper()
	testenv.Eventually(e.t, waitFor, "no live trackers", func() bool { return e.s.Trackers() == 0 })
}

func (e *schedEnv) counter(name string, want map[string]string) float64 {
	e.t.Helper()
	return testenv.CounterSum(e.t, e.reg, name, want)
}

func newRequest(id, session string, tokens []uint32) *messages.Request {
	req := &messages.Request{
		RequestID: id, SessionID: session, Model: testModel, FrontendID: testFrontend,
		ArrivalUnixMs: time.Now().UnixMilli(), PromptTokenIDs: tokens,
		SamplingParams: messages.SamplingParams{MaxTokens: 8, Temperature: 0.7, TopP: 0.9, Stop: []string{"\n\n"}},
		Endpoint:       messages.EndpointChat,
	}
	if session != "" {
		req.SamplingParams.ExtraArgs = messages.Args{messages.ExtraArgSessionID: session, "other": "kept"}
	}
	return req
}

// publishRequest puts req into the request log with its id as Nats-Msg-Id.
func (e *schedEnv) publishRequest(req *messages.Request) *jetstream.PubAck {
	e.t.Helper()
	data, err := messages.Marshal(req)
	if err != nil {
		e.t.Fatal(err)
	}
	return e.publishRaw(req.RequestID, data)
}

func (e *schedEnv) publishRaw(msgID string, data []byte) *jetstream.PubAck {
	e.t.Helper()
	ack, err := e.js.Publish(e.t.Context(), e.subj.Request(testModel), data, jetstream.WithMsgID(msgID))
	if err != nil {
		e.t.Fatal(err)
	}
	return ack
}

func TestNewValidates(t *testing.T) {
	policy := &scheduler.RoundRobinPolicy{}
	conn := &nats.Conn{}
	tests := []struct {
		name string
		cfg  scheduler.Config
	}{
		{"no connection", scheduler.Config{Policy: policy}},
		{"no policy", scheduler.Config{Conn: conn}},
		{"negative block size", scheduler.Config{Conn: conn, Policy: policy, BlockSize: -1}},
		{"id not a subject token", scheduler.Config{Conn: conn, Policy: policy, ID: "sched.1"}},
		{"bad prefix", scheduler.Config{Conn: conn, Policy: policy, Subjects: messages.Subjects{Prefix: "a b"}}},
	}
	for _, tt := range tests {
		if _, err := scheduler.New(tt.cfg); err == nil {
			t.Errorf("%s: New succeeded", tt.name)
		}
	}
	s, err := scheduler.New(scheduler.Config{Conn: conn, Policy: policy})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(s.ID(), "sched-") || messages.ValidateToken("id", s.ID()) != nil {
		t.Errorf("default ID %q", s.ID())
	}
	if s.Trackers() != 0 || s.ReadyGroups() != 0 {
		t.Errorf("a new scheduler has %d trackers, %d ready groups", s.Trackers(), s.ReadyGroups())
	}
}

func TestSchedulerDispatch(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0", "g1", "g2"}})
	tests := []struct {
		name        string
		req         *messages.Request
		wantSession string
	}{
		{"session", newRequest("r-sess", "conv-1", testenv.PromptTokens(1, 100)), "conv-1"},
		{"same session, next turn", newRequest("r-sess-2", "conv-1", testenv.PromptTokens(1, 140)), "conv-1"},
		{"no session", newRequest("r-none", "", testenv.PromptTokens(2, 64)), ""},
		{"session only in extra_args", func() *messages.Request {
			r := newRequest("r-xargs", "conv-2", testenv.PromptTokens(3, 33))
			r.SessionID = ""
			return r
		}(), "conv-2"},
		{"extra_args wins over the request field", func() *messages.Request {
			r := newRequest("r-both", "from-xargs", testenv.PromptTokens(4, 20))
			r.SessionID = "from-field"
			return r
		}(), "from-xargs"},
		{"session only in the request field", func() *messages.Request {
			r := newRequest("r-field", "conv-3", testenv.PromptTokens(5, 16))
			r.SamplingParams.ExtraArgs = nil
			return r
		}(), "conv-3"},
		{"a non-string extra_args session counts as absent", func() *messages.Request {
			r := newRequest("r-num", "", testenv.PromptTokens(6, 15))
			r.SamplingParams.ExtraArgs = messages.Args{messages.ExtraArgSessionID: int64(42)}
			return r
		}(), ""},
		{"empty prompt", newRequest("r-empty", "conv-4", nil), "conv-4"},
		{"explicit deadline", func() *messages.Request {
			r := newRequest("r-deadline", "conv-5", testenv.PromptTokens(7, 50))
			r.DeadlineUnixMs = time.Now().Add(time.Hour).UnixMilli()
			return r
		}(), "conv-5"},
	}
	// One at a time, like the turns of a conversation: each request is
	// placed with no load on any group, so a session keeps its group.
	for _, tt := range tests {
		if ack := e.publishRequest(tt.req); ack.Duplicate {
			t.Fatalf("%s: first publish is a duplicate", tt.name)
		}
		e.waitMeta(tt.req.RequestID)
		e.waitNoTrackers()
	}
	groupOf := map[string]string{} // session -> group
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := tt.req
			mm := e.waitMeta(req.RequestID)
			meta := mm.meta
			tokens := strings.Split(mm.subject, ".")
			if len(tokens) != 4 || tokens[0] != "kvbus" || tokens[1] != "meta" || tokens[2] != meta.Group {
				t.Errorf("ReqMeta on %q for group %q", mm.subject, meta.Group)
			}
			wantKey := messages.SessionKey(tt.wantSession)
			if tt.wantSession == "" {
				wantKey = "none"
			}
			if last := tokens[len(tokens)-1]; last != wantKey {
				t.Errorf("subject %q ends in %q, want %q", mm.subject, last, wantKey)
			}
			if mm.subject != e.subj.Meta(meta.Group, tt.wantSession) {
				t.Errorf("subject %q, want %q", mm.subject, e.subj.Meta(meta.Group, tt.wantSession))
			}
			if meta.SessionID != tt.wantSession {
				t.Errorf("ReqMeta.SessionID = %q, want %q", meta.SessionID, tt.wantSession)
			}
			if !slices.Contains([]string{"g0", "g1", "g2"}, meta.Group) {
				t.Errorf("placed on unknown group %q", meta.Group)
			}
			if tt.wantSession != "" {
				if g, ok := groupOf[tt.wantSession]; ok && g != meta.Group {
					t.Errorf("session %q went to %s, earlier to %s", tt.wantSession, meta.Group, g)
				}
				groupOf[tt.wantSession] = meta.Group
			}
			wantHashes := scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), req.PromptTokenIDs, 16)
			if !slices.Equal(meta.BlockHashes, wantHashes) || len(meta.BlockHashes) != len(req.PromptTokenIDs)/16 {
				t.Errorf("BlockHashes = %x, want %x", meta.BlockHashes, wantHashes)
			}
			if !slices.Equal(meta.TokenIDs, req.PromptTokenIDs) || meta.TokenLen != len(req.PromptTokenIDs) ||
				meta.NumPromptTokens != meta.TokenLen || meta.BlockSize != 16 {
				t.Errorf("tokens: len %d, token_len %d, num_prompt_tokens %d, block_size %d",
					len(meta.TokenIDs), meta.TokenLen, meta.NumPromptTokens, meta.BlockSize)
			}
			if meta.Model != testModel || meta.FrontendID != testFrontend || meta.ResultSubject != e.subj.Done(testSchedID) ||
				meta.Attempt != 0 || !meta.CanSave || !meta.IsLastChunk || meta.LoadSpec == nil {
				t.Errorf("ReqMeta %+v", meta)
			}
			// The fake ranks never store, but the next turn of conv-1 is placed
			// on the group that is saving the first turn's 6 blocks (its save
			// plan): it loads them (read-your-writes).
			wantLoad := 0
			if req.RequestID == "r-sess-2" {
				wantLoad = 100 / 16
			}
			if meta.SaveFromBlock != wantLoad || meta.LoadSpec.KVPoolCachedTokens != wantLoad*16 || meta.LoadSpec.CanLoad != (wantLoad > 0) {
				t.Errorf("save_from_block %d, load spec %+v; want %d blocks loaded", meta.SaveFromBlock, *meta.LoadSpec, wantLoad)
			}
			if got, want := fmt.Sprintf("%+v", meta.SamplingParams), fmt.Sprintf("%+v", req.SamplingParams); got != want {
				t.Errorf("sampling params %s, want %s", got, want)
			}
			wantDeadline := req.DeadlineUnixMs
			if wantDeadline == 0 {
				wantDeadline = req.ArrivalUnixMs + (60 * time.Second).Milliseconds()
			}
			if meta.DeadlineUnixMs != wantDeadline {
				t.Errorf("deadline %d, want %d", meta.DeadlineUnixMs, wantDeadline)
			}
			// The time left when it was sent: less than at its arrival,
			// more than now.
			if left := meta.TimeoutMs; left > wantDeadline-req.ArrivalUnixMs || left < wantDeadline-time.Now().UnixMilli() {
				t.Errorf("timeout_ms %d, want between %d and %d", left, wantDeadline-time.Now().UnixMilli(), wantDeadline-req.ArrivalUnixMs)
			}
		})
	}
	// Every rank answered: no tracker is left, and nothing was sent twice.
	e.waitNoTrackers()
	for _, tt := range tests {
		if n := len(e.metas(tt.req.RequestID)); n != 1 {
			t.Errorf("%s: %d ReqMetas", tt.req.RequestID, n)
		}
	}
	if got := e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "dispatched"}); got != float64(len(tests)) {
		t.Errorf("dispatched = %v, want %d", got, len(tests))
	}
	testenv.Eventually(t, waitFor, "every request counted completed", func() bool {
		return e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "completed"}) == float64(len(tests))
	})
}

func TestSchedulerRoundRobinUsesEveryGroup(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0", "g1"}, policy: &scheduler.RoundRobinPolicy{}})
	for i := range 4 {
		e.publishRequest(newRequest(fmt.Sprint("rr-", i), "one-session", testenv.PromptTokens(i, 32)))
	}
	var got []string
	for i := range 4 {
		got = append(got, e.waitMeta(fmt.Sprint("rr-", i)).meta.Group)
	}
	if want := []string{"g0", "g1", "g0", "g1"}; !slices.Equal(got, want) {
		t.Errorf("round robin placed on %v, want %v", got, want)
	}
	e.waitNoTrackers()
}

// TestRequestOutcomeOfRankErrors: a request every rank answered is counted
// by the gravest of its ranks' results: an error whose code is the
// request's deadline is a timeout, its client's abort aborted, a skipped
// save no error (the answer was produced), anything else failed (an older
// rank's error without a code too). Before, any rank's error counted
// failed: an overloaded cluster's requests running out of time looked like
// failed groups.
func TestRequestOutcomeOfRankErrors(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{noAnswers: true})
	type res struct{ err, code string }
	ok := res{}
	timeout := res{"context deadline exceeded", messages.RankErrTimeout}
	aborted := res{"request aborted", messages.RankErrAborted}
	skipped := res{"store queue full", messages.RankErrStoreSkipped}
	engine := res{"engine said no", "engine_error"}
	old := res{"something broke", ""}
	tests := []struct {
		results [worldSize]res
		want    string
	}{
		{[worldSize]res{ok, ok}, "completed"},
		{[worldSize]res{ok, timeout}, "timeout"},
		{[worldSize]res{aborted, aborted}, "aborted"},
		{[worldSize]res{skipped, ok}, "completed"},
		{[worldSize]res{timeout, aborted}, "timeout"},
		{[worldSize]res{timeout, engine}, "failed"},
		{[worldSize]res{old, skipped}, "failed"},
	}
	want := map[string]float64{}
	for i, tt := range tests {
		id := fmt.Sprint("outcome-", i)
		e.publishRequest(newRequest(id, "", testenv.PromptTokens(i, 32)))
		meta := e.waitMeta(id).meta
		for r, rr := range tt.results {
			data, err := messages.Marshal(&messages.RankResult{ReqID: meta.ReqID, Group: meta.Group, TPRank: r, Attempt: meta.Attempt,
				Error: rr.err, ErrorCode: rr.code})
			if err != nil {
				t.Fatal(err)
			}
			if err := e.nc.Publish(meta.ResultSubject, data); err != nil {
				t.Fatal(err)
			}
		}
		want[tt.want]++
		testenv.Eventually(t, waitFor, "request "+id+" counted "+tt.want, func() bool {
			return e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": tt.want}) == want[tt.want]
		})
	}
	for _, o := range []string{"completed", "timeout", "aborted", "failed"} {
		if got := e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": o}); got != want[o] {
			t.Errorf("outcome %s: %v, want %v", o, got, want[o])
		}
	}
}

func TestSchedulerDedupe(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{noAnswers: true})
	req := newRequest("dup", "s", testenv.PromptTokens(1, 64))
	if ack := e.publishRequest(req); ack.Duplicate {
		t.Fatal("first publish is a duplicate")
	}
	// Within JetStream's duplicate window the log does not even take it.
	if ack := e.publishRequest(req); !ack.Duplicate {
		t.Error("re-publish with the same Nats-Msg-Id was not a duplicate")
	}
	e.waitMeta("dup")
	// The same request id under another Nats-Msg-Id (a frontend retry after
	// the window, say) while the request is live: the tracker dedupes it.
	data, err := messages.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	e.publishRaw("dup-retry", data)
	testenv.Eventually(t, waitFor, "the retry counted as a duplicate", func() bool {
		return e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "duplicate"}) == 1
	})
	// Requests are dispatched in log order: once a later one is out, no
	// second ReqMeta for "dup" is coming.
	e.publishRequest(newRequest("later", "s", testenv.PromptTokens(2, 64)))
	e.waitMeta("later")
	if n := len(e.metas("dup")); n != 1 {
		t.Errorf("%d ReqMetas for a request published three times", n)
	}
	if n := e.s.Trackers(); n != 2 {
		t.Errorf("%d trackers, want 2", n)
	}
	// A result from the wrong attempt or group does not complete it; the
	// right ones do.
	meta := e.metas("dup")[0].meta
	stale := *meta
	stale.Attempt = 7
	e.report(&stale)
	wrongGroup := *meta
	wrongGroup.Group = "g9"
	e.report(&wrongGroup)
	e.report(meta)
	e.report(e.metas("later")[0].meta)
	e.waitNoTrackers()
}

func TestSchedulerWaitsForReadyGroup(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{noHeartbeats: true})
	e.publishRequest(newRequest("early", "s", testenv.PromptTokens(1, 48)))
	// The request is retried (nak with delay) while no group is ready.
	testenv.Eventually(t, waitFor, "the request handled twice without a group", func() bool {
		return e.counter("kvbus_bus_messages_total", map[string]string{"handler": "scheduler_request", "outcome": "ok"}) >= 2
	})
	if n := len(e.metas("early")); n != 0 || e.s.ReadyGroups() != 0 || e.s.Trackers() != 0 {
		t.Fatalf("without a ready group: %d ReqMetas, %d ready groups, %d trackers", n, e.s.ReadyGroups(), e.s.Trackers())
	}
	e.hbOn.Store(true)
	e.waitReady(1)
	mm := e.waitMeta("early")
	if mm.meta.Group != "g0" {
		t.Errorf("dispatched to %q", mm.meta.Group)
	}
	e.waitNoTrackers()
	e.publishRequest(newRequest("after", "s", testenv.PromptTokens(2, 48)))
	e.waitMeta("after")
	if n := len(e.metas("early")); n != 1 {
		t.Errorf("%d ReqMetas for one request", n)
	}
	if out := e.outputs("early"); len(out) != 0 {
		t.Errorf("a request that waited for a group got outputs from the scheduler: %+v", out[0])
	}
}

// TestSchedulerWaitsForTheIndexToSync: a group is ready, but its ranks
// have not answered the scheduler's dump requests (a scheduler that just
// started): a request waits up to UnsyncedWait for the index to sync, then
// is placed anyway. It was placed at once, and after a scheduler restart 9
// of 24 waiting second turns found none of their cached blocks.
func TestSchedulerWaitsForTheIndexToSync(t *testing.T) {
	const wait = 600 * time.Millisecond
	e := startScheduler(t, schedEnvConfig{unsyncedWait: wait})
	// startScheduler waits for the groups, not for the request consumer,
	// which may start a moment later on a loaded host.
	testenv.Eventually(t, waitFor, "the request consumer running", func() bool {
		_, why := e.s.Ready()
		return why != "request consumer not running"
	})
	if ok, why := e.s.Ready(); ok || !strings.Contains(why, "not synced") {
		t.Fatalf("Ready() = %v, %q; want not ready, index not synced", ok, why)
	}
	sent := time.Now()
	e.publishRequest(newRequest("unsynced", "s", testenv.PromptTokens(1, 48)))
	mm := e.waitMeta("unsynced")
	if waited := time.Since(sent); waited < wait {
		t.Errorf("placed %s after it arrived, before the index synced; want a wait of %s", waited.Round(time.Millisecond), wait)
	}
	if mm.meta.Group != "g0" {
		t.Errorf("dispatched to %q", mm.meta.Group)
	}
}

// TestSchedulerBacklogWaitsForAGroup: requests that queued in the log
// longer than NoGroupWait (the scheduler was down) get the whole wait of
// their own when the restarted scheduler has not heard its groups yet; they
// were refused at once, all of them, with no_ready_group.
func TestSchedulerBacklogWaitsForAGroup(t *testing.T) {
	const wait = time.Second
	var backlog []*messages.Request
	for i := range 3 {
		backlog = append(backlog, newRequest(fmt.Sprintf("queued-%d", i), fmt.Sprintf("s%d", i), testenv.PromptTokens(i, 48)))
	}
	e := startScheduler(t, schedEnvConfig{noHeartbeats: true, noGroupWait: wait, requestTimeout: time.Minute,
		backlog: backlog, backlogAge: wait + 200*time.Millisecond})
	testenv.Eventually(t, waitFor, "the backlog tried without a group", func() bool {
		return e.counter("kvbus_bus_messages_total", map[string]string{"handler": "scheduler_request", "outcome": "ok"}) >= 3
	})
	e.hbOn.Store(true)
	for _, req := range backlog {
		testenv.Eventually(t, waitFor, req.RequestID+" dispatched or refused", func() bool {
			return len(e.metas(req.RequestID))+len(e.outputs(req.RequestID)) > 0
		})
		if out := e.outputs(req.RequestID); len(out) != 0 {
			t.Errorf("%s was refused: %+v", req.RequestID, *out[0].Error)
		} else if mm := e.metas(req.RequestID)[0]; mm.meta.Group != "g0" {
			t.Errorf("%s dispatched to %q", req.RequestID, mm.meta.Group)
		}
	}
	if n := e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "no_ready_group"}); n != 0 {
		t.Errorf("no_ready_group = %v, want 0", n)
	}
}

func TestSchedulerExpiredRequest(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{requestTimeout: 10 * time.Second})
	deadlinePassed := newRequest("expired-deadline", "s", testenv.PromptTokens(1, 32))
	deadlinePassed.DeadlineUnixMs = time.Now().Add(-time.Second).UnixMilli()
	oldArrival := newRequest("expired-arrival", "", testenv.PromptTokens(2, 32))
	oldArrival.ArrivalUnixMs = time.Now().Add(-11 * time.Second).UnixMilli() // past the 10 s request timeout
	for _, req := range []*messages.Request{deadlinePassed, oldArrival} {
		e.publishRequest(req)
	}
	e.publishRequest(newRequest("fresh", "s", testenv.PromptTokens(3, 32)))
	e.waitMeta("fresh")
	for _, id := range []string{"expired-deadline", "expired-arrival"} {
		testenv.Eventually(t, waitFor, "the error output of "+id, func() bool { return len(e.outputs(id)) > 0 })
		out := e.outputs(id)
		if len(out) != 1 || out[0].Error == nil || out[0].Error.Code != "timeout" || out[0].Index != 0 || !out[0].Final() {
			t.Errorf("%s: outputs %+v, want one timeout error", id, out)
		}
		if n := len(e.metas(id)); n != 0 {
			t.Errorf("%s: dispatched an expired request", id)
		}
	}
	if got := e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "expired"}); got != 2 {
		t.Errorf("expired = %v, want 2", got)
	}
	e.waitNoTrackers()
}

// TestExpiredRequestsAreLoggedOnceAnInterval: a backlog that outlived its
// deadlines (every scheduler down for longer than the request timeout)
// expires one request at a time; each got its own WARN line, a flood of
// them, where one line with the count held back says it.
func TestExpiredRequestsAreLoggedOnceAnInterval(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{requestTimeout: 10 * time.Second})
	const n = 40
	for i := range n {
		req := newRequest(fmt.Sprintf("expired-%d", i), "s", testenv.PromptTokens(i, 32))
		req.DeadlineUnixMs = time.Now().Add(-time.Second).UnixMilli()
		e.publishRequest(req)
	}
	testenv.Eventually(t, waitFor, "every expired request answered", func() bool {
		return e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "expired"}) == n
	})
	for i := range n {
		id := fmt.Sprintf("expired-%d", i)
		testenv.Eventually(t, waitFor, "the error output of "+id, func() bool { return len(e.outputs(id)) > 0 })
		if out := e.outputs(id); len(out) != 1 || out[0].Error == nil || out[0].Error.Code != "timeout" {
			t.Fatalf("%s: outputs %+v, want one timeout error", id, out)
		}
	}
	if lines := e.logs.Lines("request expired before dispatch"); len(lines) != 1 {
		t.Errorf("%d lines for %d expired requests within 10 s, want 1:\n%s", len(lines), n, strings.Join(lines, "\n"))
	}
}

func TestSchedulerDropsMalformedRequest(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{})
	noFrontend, err := messages.Marshal(&messages.Request{RequestID: "no-frontend", Model: testModel})
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range [][]byte{[]byte("garbage"), {0xc1}, noFrontend} {
		e.publishRaw(fmt.Sprint("bad-", i), p)
	}
	e.publishRequest(newRequest("valid", "s", testenv.PromptTokens(1, 32)))
	e.waitMeta("valid")
	if got := e.counter("kvbus_bus_messages_total", map[string]string{"handler": "scheduler_request", "outcome": "malformed"}); got != 3 {
		t.Errorf("malformed requests counted %v, want 3", got)
	}
	if n := len(e.metas("no-frontend")); n != 0 {
		t.Error("an invalid request was dispatched")
	}
	e.waitNoTrackers()
	// Malformed messages are terminated, not redelivered forever.
	cons, err := e.js.Consumer(t.Context(), messages.RequestStream, bus.SchedulerConsumer)
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitFor, "nothing pending on the request consumer", func() bool {
		info, err := cons.Info(t.Context())
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0 && info.NumRedelivered == 0
	})
}

func TestSchedulerAbort(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{noAnswers: true})
	e.publishRequest(newRequest("to-abort", "s", testenv.PromptTokens(1, 32)))
	e.waitMeta("to-abort")
	if e.s.Trackers() != 1 {
		t.Fatalf("%d trackers", e.s.Trackers())
	}
	data, err := messages.Marshal(&messages.Abort{ReqID: "to-abort", Reason: "client disconnected"})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Publish(e.subj.Abort(), data); err != nil {
		t.Fatal(err)
	}
	e.waitNoTrackers()
	// The abort is counted once its tracker has ended (onAbort): no
	// tracker left does not say it is counted yet.
	aborted := func() float64 {
		return e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "aborted"})
	}
	testenv.Eventually(t, waitFor, "the abort counted", func() bool { return aborted() > 0 })
	if got := aborted(); got != 1 {
		t.Errorf("aborted = %v", got)
	}
}

func TestSchedulerTimesOutUnansweredRequest(t *testing.T) {
	// Only the driver answers; the other rank is silent. The tracker must
	// not leak: after the deadline (and the sweep's 2 s grace) the request
	// ends with a timeout error.
	e := startScheduler(t, schedEnvConfig{noAnswers: true})
	req := newRequest("silent", "s", testenv.PromptTokens(1, 32))
	// Long enough to be dispatched on a loaded host (at 300 ms, a request
	// that reached the scheduler after its deadline was never placed).
	req.DeadlineUnixMs = time.Now().Add(1500 * time.Millisecond).UnixMilli()
	e.publishRequest(req)
	meta := e.waitMeta("silent").meta
	data, err := messages.Marshal(&messages.RankResult{ReqID: meta.ReqID, Group: meta.Group, TPRank: 0, Attempt: meta.Attempt})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Publish(meta.ResultSubject, data); err != nil {
		t.Fatal(err)
	}
	e.waitNoTrackers()
	testenv.Eventually(t, waitFor, "a timeout error output", func() bool { return len(e.outputs("silent")) > 0 })
	if out := e.outputs("silent"); out[0].Error == nil || out[0].Error.Code != "timeout" {
		t.Errorf("output %+v, want a timeout error", out[0])
	}
	if got := e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "timeout"}); got != 1 {
		t.Errorf("timeout = %v", got)
	}
}

func TestSchedulerRunStops(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{})
	e.publishRequest(newRequest("r", "s", testenv.PromptTokens(1, 32)))
	e.waitMeta("r")
	e.waitNoTrackers()
	done := make(chan error, 1)
	go func() { done <- e.stop() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run = %v after cancel, want nil", err)
		}
	case <-time.After(waitFor):
		t.Fatal("Run did not return after cancel")
	}
}

// TestSchedulerResyncBacksOff: ranks that never answer a dump (the fake
// ranks here do not) are asked again with backoff — 100 ms doubling to 5 s,
// one dump in flight per rank — not on every sweep: no resync storm.
func TestSchedulerResyncBacksOff(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{dumpTimeout: 20 * time.Millisecond})
	time.Sleep(3 * time.Second)
	resyncs := e.counter("kvbus_scheduler_kv_resyncs_total", nil)
	// Per rank: asked at about 0, 0.12, 0.34, 0.76, 1.58 s and 3.2 s; a
	// retry on every 250 ms sweep would be 12.
	t.Logf("%v dump requests to %d silent ranks in 3 s", resyncs, worldSize)
	if resyncs < 3*worldSize || resyncs > 6*worldSize {
		t.Errorf("%v dump requests in 3 s to %d ranks, want 3 to 6 per rank", resyncs, worldSize)
	}
	if ok, why := e.s.Ready(); ok {
		t.Errorf("ready with no synced group")
	} else {
		t.Logf("not ready: %s", why)
	}
}

// TestRankMessagesOnAnotherRanksSubject: a heartbeat or a KV event batch
// that names a group other than its subject's is dropped as invalid. A
// worker key is allowed only its own group's subjects; without the check a
// g0 worker could write g1's index or make up a group.
func TestRankMessagesOnAnotherRanksSubject(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0"}})
	publish := func(subject string, m messages.Message) {
		t.Helper()
		data, err := messages.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.nc.Publish(subject, data); err != nil {
			t.Fatal(err)
		}
	}
	hb := func(r int) *messages.Heartbeat {
		return &messages.Heartbeat{Group: "g9", TPRank: r, EPRank: r, WorldSize: worldSize, Model: testModel, StartedUnixMs: 1}
	}
	// g9's heartbeats, sent by g0's ranks: no group g9.
	for r := range worldSize {
		publish(e.subj.Heartbeat("g0", r), hb(r))
	}
	batch := &messages.KVEventBatch{Group: "g1", Rank: 0, Seq: 1, Events: []messages.KVEvent{{Type: messages.EventAllBlocksCleared}}}
	publish(e.subj.KV("g0", 0), batch)
	malformed := func(handler string) float64 {
		return e.counter("kvbus_bus_messages_total", map[string]string{"handler": handler, "outcome": "malformed"})
	}
	testenv.Eventually(t, waitFor, "the forged messages refused", func() bool {
		return malformed("scheduler_heartbeat") == worldSize && malformed("scheduler_kv_events") == 1
	})
	time.Sleep(200 * time.Millisecond) // a few of the env's heartbeat rounds
	if n := e.s.ReadyGroups(); n != 1 {
		t.Fatalf("%d ready groups after g9's heartbeats came on g0's subjects, want 1", n)
	}
	// The same messages on their own subjects are taken: g9 is a group.
	for r := range worldSize {
		publish(e.subj.Heartbeat("g9", r), hb(r))
	}
	publish(e.subj.KV("g1", 0), batch)
	testenv.Eventually(t, waitFor, "g9 ready", func() bool {
		return slices.ContainsFunc(e.s.Groups(), func(g scheduler.GroupState) bool { return g.Name == "g9" })
	})
	testenv.Eventually(t, waitFor, "g1's batch on its own subject taken", func() bool {
		return e.counter("kvbus_bus_messages_total", map[string]string{"handler": "scheduler_kv_events", "outcome": "ok"}) == 1
	})
	if got := malformed("scheduler_kv_events"); got != 1 {
		t.Errorf("a batch on its own subject counted malformed: %v", got)
	}
	if _, ok := e.s.Index().GroupID("g1"); !ok {
		t.Error("g1's batch on its own subject did not reach the index")
	}
}

// TestSchedulerForgetsAGroupGoneForGood: a group not heard of for
// ForgetGroupAfter leaves the index (its id is free for another group) and
// the per-group gauges; the group still heard of stays.
func TestSchedulerForgetsAGroupGoneForGood(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0", "g1"}, forgetAfter: 1500 * time.Millisecond})
	if _, ok := e.s.Index().GroupID("g1"); !ok {
		t.Fatal("g1 is not in the index to begin with")
	}
	e.hbOn.Store(false) // from now on only g0 is heard of
	stop := time.Now().Add(waitFor)
	for {
		for r := range worldSize {
			data, _ := messages.Marshal(&messages.Heartbeat{Group: "g0", TPRank: r, EPRank: r, WorldSize: worldSize, Model: testModel, StartedUnixMs: 1})
			if err := e.nc.Publish(e.subj.Heartbeat("g0", r), data); err != nil {
				t.Fatal(err)
			}
		}
		if _, ok := e.s.Index().GroupID("g1"); !ok {
			break
		}
		if time.Now().After(stop) {
			t.Fatal("g1 was never forgotten")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, ok := e.s.Index().GroupID("g0"); !ok {
		t.Error("g0, still heard of, was forgotten too")
	}
	if n := e.s.ReadyGroups(); n != 1 {
		t.Errorf("%d ready groups, want g0", n)
	}
	families, err := e.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "group" && l.GetValue() == "g1" && strings.HasPrefix(f.GetName(), "kvbus_scheduler_group") {
					t.Errorf("%s still has a series for the forgotten g1", f.GetName())
				}
			}
		}
	}
}

// TestSchedulerForgetsAnIndexOnlyGroup: a group the index learnt of only
// from KV events (it never sent a heartbeat: a rank that died right after
// its first batch) is forgotten too, and frees its slot.
func TestSchedulerForgetsAnIndexOnlyGroup(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0"}, forgetAfter: 500 * time.Millisecond})
	data, err := messages.Marshal(&messages.KVEventBatch{Group: "ghost", Rank: 0, Seq: 1,
		Events: []messages.KVEvent{{Type: messages.EventAllBlocksCleared}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Publish(e.subj.KV("ghost", 0), data); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitFor, "ghost indexed", func() bool { _, ok := e.s.Index().GroupID("ghost"); return ok })
	testenv.Eventually(t, waitFor, "ghost forgotten", func() bool { _, ok := e.s.Index().GroupID("ghost"); return !ok })
	if _, ok := e.s.Index().GroupID("g0"); !ok {
		t.Error("g0, still heard of, was forgotten")
	}
}

// TestReplacedRankIsNoDuplicate: a rank's new process that starts while
// its predecessor drains (a rolling replacement) is not "two worker
// processes claim the same rank": that ERROR came at every replacement.
// A second process that is not draining still gets it.
func TestReplacedRankIsNoDuplicate(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0"}})
	publish := func(r int, started int64, draining bool) {
		t.Helper()
		data, err := messages.Marshal(&messages.Heartbeat{Group: "g5", TPRank: r, EPRank: r, WorldSize: worldSize, Model: testModel,
			StartedUnixMs: started, Draining: draining})
		if err != nil {
			t.Fatal(err)
		}
		if err := e.nc.Publish(e.subj.Heartbeat("g5", r), data); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now().UnixMilli()
	publish(0, now, false)     // the new process of g5/0
	publish(0, now-1000, true) // its predecessor, draining
	publish(1, now, false)
	publish(1, now-1000, false) // a second process of g5/1: an operator's slip
	const dup = "two worker processes claim the same rank"
	testenv.Eventually(t, waitFor, "the duplicate of g5/1 reported", func() bool { return len(e.logs.Lines(dup, "tp_rank=1")) == 1 })
	if n := len(e.logs.Lines(dup, "tp_rank=0")); n != 0 {
		t.Errorf("a draining predecessor reported as a duplicate (%d lines)", n)
	}
}

// TestRequestHandedOverToAnAdopter: a replica that was paused or cut off
// for longer than the heartbeat timeout comes back to find another replica
// adopted its requests (the adopter's save plan names them): it drops
// their trackers. It kept them, and ended each as a timeout 30 s later,
// while the ranks answered the adopter.
func TestRequestHandedOverToAnAdopter(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0"}, noAnswers: true, requestTimeout: 3 * time.Second})
	e.waitReady(1)
	e.publishRequest(newRequest("r-adopted", "s", testenv.PromptTokens(1, 64)))
	e.waitMeta("r-adopted")
	if n := e.s.Trackers(); n != 1 {
		t.Fatalf("%d trackers, want 1", n)
	}
	data, err := messages.Marshal(&messages.SavePlan{SchedulerID: "sched-adopter", ReqID: "r-adopted", Group: "g0", LogSeq: 1,
		ExpiresUnixMs: time.Now().Add(time.Second).UnixMilli()})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Publish(e.subj.Plan("sched-adopter"), data); err != nil {
		t.Fatal(err)
	}
	e.waitNoTrackers()
	time.Sleep(3 * time.Second) // past the request's deadline
	if n := e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "timeout"}); n != 0 {
		t.Errorf("%v timeouts: the handed-over request was still watched", n)
	}
}

// TestAdoptedRequestCountedOnceAfterAPause: replica sched-test is paused
// (its connection held, as by SIGSTOP) longer than the heartbeat timeout
// while its requests generate; their ranks finish and answer it, and those
// results wait for it. Replica sched-peer adopts the requests, the ranks
// answer it again from memory, and it counts each completed. The paused
// replica woke, handled the results that waited for it before it heard of
// the adoption, and counted each completed too: 11 of 11 adopted requests
// twice in a review. The adopter, which holds a request when it ends,
// counts it; the woken replica counts its copy duplicate.
func TestAdoptedRequestCountedOnceAfterAPause(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0"}, noAnswers: true, requestTimeout: 30 * time.Second, viaProxy: true})
	// Answered before the pause: the paused replica's alone.
	e.answer.Store(true)
	e.publishRequest(newRequest("r-before", "", testenv.PromptTokens(1, 64)))
	e.waitNoTrackers()
	time.Sleep(500 * time.Millisecond) // a replica tells the others what ended every 250 ms
	e.answer.Store(false)
	const n = 4
	for i := range n {
		e.publishRequest(newRequest(fmt.Sprint("r-", i), "", testenv.PromptTokens(i+2, 64)))
	}
	metas := make([]*messages.ReqMeta, n)
	for i := range n {
		metas[i] = e.waitMeta(fmt.Sprint("r-", i)).meta
	}

	// The peer starts once sched-test dispatched them all (from the plan
	// stream it knows what sched-test dispatched and ended).
	peerReg, peerLogs := prometheus.NewRegistry(), &testenv.LogBuffer{}
	peer, err := scheduler.New(scheduler.Config{
		Conn: testenv.Connect(t, e.srv), Subjects: e.subj, ID: "sched-peer", Policy: &scheduler.SessionPolicy{Epsilon: 0.25},
		HeartbeatTimeout: time.Second, RequestTimeout: 30 * time.Second, UnsyncedWait: -1,
		Logger: slog.New(slog.NewTextHandler(peerLogs, nil)), Registerer: peerReg,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	peerErr := make(chan error, 1)
	go func() { peerErr <- peer.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-peerErr; err != nil {
			t.Errorf("the peer's Run: %v", err)
		}
	})
	testenv.Eventually(t, waitFor, "the peer ready", func() bool { return peer.ReadyGroups() == 1 })
	time.Sleep(1500 * time.Millisecond) // it hears sched-test announce itself

	e.proxy.Hold()
	t.Cleanup(e.proxy.Release) // should the test end early
	paused := time.Now()
	for _, m := range metas { // the ranks finish: their results wait for sched-test
		e.report(m)
	}
	e.answer.Store(true) // and answer the adopter's ReqMetas from memory
	peerCounter := func(outcome string) float64 {
		return testenv.CounterSum(t, peerReg, "kvbus_scheduler_requests_total", map[string]string{"outcome": outcome})
	}
	deadline := time.Now().Add(waitFor)
	for peerCounter("adopted") != n || peerCounter("completed") != n {
		if time.Now().After(deadline) {
			t.Fatalf("the peer adopted %v and completed %v of the paused replica's %d requests\n%s", peerCounter("adopted"), peerCounter("completed"), n, peerLogs)
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(3*time.Second - time.Since(paused)) // a pause of 3 s
	e.proxy.Release()
	e.waitNoTrackers()
	time.Sleep(3 * time.Second) // whatever the woken replica counts late

	mine := func(outcome string) float64 {
		return e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": outcome})
	}
	// The clients got n+1 answers.
	if got := mine("completed") + peerCounter("completed"); got != n+1 {
		t.Errorf("completed %v (sched-test %v, sched-peer %v), want %d: the requests the clients got answered",
			got, mine("completed"), peerCounter("completed"), n+1)
	}
	for i := range n {
		id := fmt.Sprint("r-", i)
		done := len(e.logs.Lines("request done", "req_id="+id+" ", "outcome=completed")) +
			len(peerLogs.Lines("request done", "req_id="+id+" ", "outcome=completed"))
		if done != 1 {
			t.Errorf("%s, adopted, counted completed %d times", id, done)
		}
		if out := e.outputs(id); len(out) != 0 {
			t.Errorf("%s: the scheduler sent its client %d outputs (an error): %+v", id, len(out), out[0].Error)
		}
	}
	// The woken replica gives each copy up once: counted duplicate when it
	// handled the results that waited for it first, or handed over,
	// uncounted, when the adopter's save plan came first (the server
	// delivers what waited on both subscriptions at once).
	handedOver := 0
	for i := range n {
		handedOver += len(e.logs.Lines("request handed over", "req_id="+fmt.Sprint("r-", i)+" "))
	}
	if got := mine("duplicate"); int(got)+handedOver != n {
		t.Errorf("sched-test counted %v duplicate and handed %d over, want its %d copies of the adopted requests given up once each", got, handedOver, n)
	}
}

// TestRequestEndedAfterAPauseIsCountedWithoutAnAdopter: a replica paused
// longer than half the heartbeat timeout holds back the count of the
// requests whose results waited for it, for an adopter's save plan; with no
// other replica to adopt them, each is still counted completed, once.
func TestRequestEndedAfterAPauseIsCountedWithoutAnAdopter(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0"}, noAnswers: true, requestTimeout: 30 * time.Second, viaProxy: true})
	const n = 3
	metas := make([]*messages.ReqMeta, n)
	for i := range n {
		e.publishRequest(newRequest(fmt.Sprint("r-", i), "", testenv.PromptTokens(i+2, 64)))
		metas[i] = e.waitMeta(fmt.Sprint("r-", i)).meta
	}
	time.Sleep(500 * time.Millisecond) // the server answered its pings before
	e.proxy.Hold()
	t.Cleanup(e.proxy.Release) // should the test end early
	for _, m := range metas {
		e.report(m)
	}
	time.Sleep(2 * time.Second)
	e.proxy.Release()
	e.waitNoTrackers()
	completed := func() float64 {
		return e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "completed"})
	}
	if got := completed(); got != 0 {
		t.Errorf("%v completed at once: the count did not wait for an adopter's save plan", got)
	}
	testenv.Eventually(t, waitFor, "the held requests counted", func() bool { return completed() == n })
	time.Sleep(time.Second)
	if got, dup := completed(), e.counter("kvbus_scheduler_requests_total", map[string]string{"outcome": "duplicate"}); got != n || dup != 0 {
		t.Errorf("completed %v, duplicate %v; want %d and 0", got, dup, n)
	}
	if got := len(e.logs.Lines("request done", "outcome=completed")); got != n {
		t.Errorf("%d lines say a request was done, want %d", got, n)
	}
}

// frontendOutputs are the outputs of reqID sent to frontend fe.
func (e *schedEnv) frontendOutputs(fe, reqID string) []*messages.Output {
	e.mu.Lock()
	msgs := slices.Clone(e.msgs)
	e.mu.Unlock()
	var out []*messages.Output
	for _, m := range msgs {
		if m.Subject != e.subj.Out(fe) {
			continue
		}
		o, err := messages.DecodeOutput(m.Data)
		if err != nil {
			e.t.Fatalf("bad Output: %v", err)
		}
		if o.ReqID == reqID {
			out = append(out, o)
		}
	}
	return out
}

// TestSchedulerReadsAFrontendsDeadlineWhateverItsClock: a frontend sends a
// request's deadline on its own clock, with the time the request had left
// when it was published. With the frontend's clock two minutes behind this
// host's, every request of a 60 s timeout was refused as "expired before
// dispatch"; two minutes ahead, a request with 1 s left was watched for two
// minutes. The scheduler learns each frontend's clock from its requests:
// what a request waited in the request log still counts against it.
func TestSchedulerReadsAFrontendsDeadlineWhateverItsClock(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{noAnswers: true})
	// skewed is a request of frontend fe, whose clock is skew ahead of this
	// host's, published waited ago with left to go.
	skewed := func(id, fe string, skew, waited, left time.Duration) *messages.Request {
		req := newRequest(id, "sess-"+id, testenv.PromptTokens(len(id), 32))
		published := time.Now().Add(skew - waited)
		req.FrontendID = fe
		req.ArrivalUnixMs, req.DeadlineUnixMs, req.TimeoutMs = published.UnixMilli(), published.Add(left).UnixMilli(), left.Milliseconds()
		return req
	}

	// Two minutes behind: dispatched, with its minute to go.
	behind := skewed("fe-behind-1", "fe-behind", -2*time.Minute, 0, time.Minute)
	e.publishRequest(behind)
	meta := e.waitMeta(behind.RequestID).meta
	if meta.TimeoutMs < (55*time.Second).Milliseconds() || meta.TimeoutMs > time.Minute.Milliseconds() {
		t.Errorf("a frontend two minutes behind: ReqMeta timeout_ms %d, want about a minute", meta.TimeoutMs)
	}
	if got := time.Until(time.UnixMilli(meta.DeadlineUnixMs)); got < 55*time.Second || got > time.Minute+time.Second {
		t.Errorf("a frontend two minutes behind: ReqMeta deadline %v from now on this clock, want about a minute", got)
	}
	if lines := e.logs.Lines("clock and this host's disagree", "req_id=fe-behind-1", "frontend_id=fe-behind", "frontend_ahead_by=-2m"); len(lines) != 1 {
		t.Errorf("want one clock warning naming the request and its frontend, got %d:\n%s", len(lines), e.logs.String())
	}
	// A request of that frontend that waited 61 s in the log for its 60 s:
	// expired, whatever the clocks.
	waitedOut := skewed("fe-behind-2", "fe-behind", -2*time.Minute, 61*time.Second, time.Minute)
	e.publishRequest(waitedOut)
	testenv.Eventually(t, waitFor, "the error output of fe-behind-2", func() bool { return len(e.frontendOutputs("fe-behind", "fe-behind-2")) > 0 })
	if out := e.frontendOutputs("fe-behind", "fe-behind-2"); out[0].Error == nil || out[0].Error.Code != "timeout" || len(e.metas("fe-behind-2")) != 0 {
		t.Errorf("a request that waited past its deadline in the log: outputs %+v (error %+v), %d ReqMetas; want a timeout, none dispatched",
			out, out[0].Error, len(e.metas("fe-behind-2")))
	}

	// Two minutes ahead, 1 s left: it ends as a timeout within the
	// tracker sweep's grace, not two minutes later.
	ahead := skewed("fe-ahead-1", "fe-ahead", 2*time.Minute, 0, time.Second)
	start := time.Now()
	e.publishRequest(ahead)
	e.waitMeta(ahead.RequestID)
	testenv.Eventually(t, 10*time.Second, "the timeout of fe-ahead-1", func() bool { return len(e.frontendOutputs("fe-ahead", "fe-ahead-1")) > 0 })
	if out := e.frontendOutputs("fe-ahead", "fe-ahead-1"); out[0].Error == nil || out[0].Error.Code != "timeout" {
		t.Errorf("a frontend two minutes ahead: output %+v, want a timeout", out[0])
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("a frontend two minutes ahead: a request with 1 s left ended after %v", took)
	}
	// The first one's client leaves: nothing is left to watch.
	data, err := messages.Marshal(&messages.Abort{ReqID: behind.RequestID, Reason: messages.AbortReasonClientGone})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Publish(e.subj.Abort(), data); err != nil {
		t.Fatal(err)
	}
	e.waitNoTrackers()
}

// TestWorkerOfAHostAheadIsHeardAtOnce: a worker on a host whose clock runs
// two minutes ahead of the scheduler's says its process started two
// minutes in the future. Its heartbeats were refused as "started in the
// future" until the scheduler's clock caught up with that start, less a
// minute: its group was not ready for the first minute. It is taken at
// once, and the skew said once, with the group and rank.
func TestWorkerOfAHostAheadIsHeardAtOnce(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0"}})
	e.waitReady(1)
	started := time.Now().Add(2 * time.Minute).UnixMilli() // on the worker's clock
	heartbeats := func() {
		for r := range worldSize {
			data, err := messages.Marshal(&messages.Heartbeat{Group: "g7", TPRank: r, EPRank: r, WorldSize: worldSize, Model: testModel,
				StartedUnixMs: started})
			if err != nil {
				t.Fatal(err)
			}
			if err := e.nc.Publish(e.subj.Heartbeat("g7", r), data); err != nil {
				t.Fatal(err)
			}
		}
	}
	begin := time.Now()
	testenv.Eventually(t, waitFor, "g7, its workers' clock 2 min ahead, ready", func() bool {
		heartbeats() // a worker's heartbeat every 100 ms or so
		return slices.ContainsFunc(e.s.Groups(), func(g scheduler.GroupState) bool { return g.Name == "g7" })
	})
	t.Logf("g7 ready %v after its first heartbeat", time.Since(begin).Round(time.Millisecond))
	if n := e.counter("kvbus_bus_messages_total", map[string]string{"handler": "scheduler_heartbeat", "outcome": "malformed"}); n != 0 {
		t.Errorf("%v heartbeats refused", n)
	}
	for range 5 {
		heartbeats()
	}
	const ahead = "a worker's clock is ahead of this scheduler's"
	testenv.Eventually(t, waitFor, "the skew said", func() bool {
		return len(e.logs.Lines(ahead, "group=g7", "tp_rank=0 ")) > 0
	})
	for r := range worldSize {
		lines := e.logs.Lines(ahead, "group=g7", fmt.Sprintf("tp_rank=%d ", r))
		if len(lines) != 1 {
			t.Errorf("the skew of g7/%d said %d times, want once: %q", r, len(lines), lines)
			continue
		}
		_, v, _ := strings.Cut(lines[0], "rank_ahead_by_at_least=")
		v, _, _ = strings.Cut(v, " ")
		if d, err := time.ParseDuration(v); err != nil || d < 110*time.Second || d > 2*time.Minute {
			t.Errorf("g7/%d said ahead by %q, want about 2m", r, v)
		}
	}
}

// TestRankReplacedOnAHostBehind: g7's rank 0 is replaced (a rolling
// replacement: the old process drains) by a process on a host whose clock
// runs two minutes behind, so its started_unix_ms is the earlier. Read
// from started_unix_ms alone it was the older of the two: its heartbeats
// were ignored and reported as a second process claiming the rank for as
// long as the old one drained, and the group, its rank 0 draining, took no
// request meanwhile. This replica had heard the old process for longer
// than the heartbeat timeout before the new one appeared: the new one is
// the later, and the group is ready on it while the old one drains.
func TestRankReplacedOnAHostBehind(t *testing.T) {
	e := startScheduler(t, schedEnvConfig{groups: []string{"g0"}})
	old := time.Now().UnixMilli()
	replacement := time.Now().Add(-2 * time.Minute).UnixMilli() // on its host's clock
	var replaced atomic.Bool
	heartbeats := func() {
		for r := range worldSize {
			hb := &messages.Heartbeat{Group: "g7", TPRank: r, EPRank: r, WorldSize: worldSize, Model: testModel, StartedUnixMs: old}
			if r == 0 && replaced.Load() {
				hb.Draining = true
				data, _ := messages.Marshal(&messages.Heartbeat{Group: "g7", TPRank: 0, WorldSize: worldSize, Model: testModel, StartedUnixMs: replacement})
				if err := e.nc.Publish(e.subj.Heartbeat("g7", 0), data); err != nil {
					t.Fatal(err)
				}
			}
			data, _ := messages.Marshal(hb)
			if err := e.nc.Publish(e.subj.Heartbeat("g7", r), data); err != nil {
				t.Fatal(err)
			}
		}
	}
	ready := func() bool {
		return slices.ContainsFunc(e.s.Groups(), func(g scheduler.GroupState) bool { return g.Name == "g7" })
	}
	testenv.Eventually(t, waitFor, "g7 ready", func() bool { heartbeats(); return ready() })
	for start := time.Now(); time.Since(start) < 1500*time.Millisecond; time.Sleep(100 * time.Millisecond) {
		heartbeats() // heard for longer than the heartbeat timeout (1 s)
	}
	replaced.Store(true)
	handled := func() float64 {
		return e.counter("kvbus_bus_messages_total", map[string]string{"handler": "scheduler_heartbeat", "outcome": "ok"})
	}
	// Its old process drains on: the group stays ready on the new one.
	base := handled()
	for start := time.Now(); time.Since(start) < 2*time.Second; time.Sleep(100 * time.Millisecond) {
		heartbeats()
		if !ready() {
			t.Fatalf("g7 not ready %v after its rank 0's replacement began, its old process draining beside it", time.Since(start).Round(time.Millisecond))
		}
	}
	// The replacement's and the draining process's heartbeats were heard.
	testenv.Eventually(t, waitFor, "the heartbeats handled", func() bool { return handled()-base >= 20*(worldSize+1) })
	if n := len(e.logs.Lines("two worker processes claim the same rank", "group=g7")); n != 0 {
		t.Errorf("the replacement reported as a second process of the rank (%d lines)", n)
	}
}
