package workers_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/workers"
)

const (
	testModel    = "kvbus-sim"
	testGroup    = "g0"
	testSchedID  = "sched-test"
	testFrontend = "fe-test"
	blockSize    = 16
	worldSize    = 2
	// tiny at tp 2: 2 × 1 layer × 2 heads × 4 × 2 bytes = 32 bytes per
	// token, 512 bytes per 16-token block.
	testBlockBytes = 32 * blockSize
	testCapacity   = 1 << 20
	waitFor        = 15 * time.Second
)

// recorder keeps every message of one subscription in arrival order. NATS
// delivers one publisher's messages to one subscription in publish order,
// so "A before B" on the recorder means the rank published A before B.
type recorder struct {
	mu   sync.Mutex
	msgs []*nats.Msg
}

func (r *recorder) all() []*nats.Msg {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.msgs)
}

// event is one decoded message for a request: a RankResult or an Output.
type event struct {
	result *messages.RankResult
	output *messages.Output
}

// rankEnv is a worker group of ranks on an embedded NATS server, watched by
// a recorder of everything under the subject prefix.
type rankEnv struct {
	t       *testing.T
	srv     *bus.Server
	nc      *nats.Conn
	subj    messages.Subjects
	rec     *recorder
	reg     *prometheus.Registry
	logs    *testenv.LogBuffer
	stop    func() []error // cancels Run and waits for every rank
	stopped chan struct{}
	// rankStop and rankDone, by tp_rank: one rank's own stop (its
	// process's SIGTERM) and the end of its Run.
	rankStop []context.CancelFunc
	rankDone []chan struct{}
}

// stopRank stops one rank as SIGTERM stops a worker process, waits until
// its Run returned, and says how long that took.
func (e *rankEnv) stopRank(rank int) time.Duration {
	e.t.Helper()
	start := time.Now()
	e.rankStop[rank]()
	select {
	case <-e.rankDone[rank]:
	case <-time.After(waitFor):
		e.t.Fatalf("rank %d: Run did not return %s after its context ended", rank, waitFor)
	}
	return time.Since(start)
}

type rankEnvConfig struct {
	engine workers.SimConfig
	// storeDelay slows these ranks' store threads; saveWait is every
	// rank's SaveWait.
	storeDelay map[int]time.Duration
	saveWait   time.Duration
	// hbInterval is every rank's HeartbeatInterval (0: 20 ms).
	hbInterval time.Duration
	// drainHandoff is every rank's DrainHandoff (0: off).
	drainHandoff int64
	// delayFirstMeta delays these ranks' first ReqMeta.
	delayFirstMeta map[int]time.Duration
	// queueSize is every rank's QueueSize (0: default).
	queueSize int
	// customEngine, if set, is every rank's Engine instead of a sim of
	// engine.
	customEngine workers.Engine
	// maxPayload is the NATS server's max_payload (0: kvbus nats's 8 MiB).
	maxPayload int32
	// capacity is every rank's CapacityBytes (0: testCapacity).
	capacity int64
}

func startRanks(t *testing.T, cfg rankEnvConfig) *rankEnv {
	t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), MaxPayload: cfg.maxPayload})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	e := &rankEnv{
		t: t, srv: srv, nc: testenv.Connect(t, srv), rec: &recorder{}, reg: prometheus.NewRegistry(),
		logs: &testenv.LogBuffer{}, stopped: make(chan struct{}),
	}
	if _, err := e.nc.Subscribe(e.subj.All(), func(m *nats.Msg) {
		e.rec.mu.Lock()
		e.rec.msgs = append(e.rec.msgs, m)
		e.rec.mu.Unlock()
	}); err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	profile, err := workers.LookupModelProfile("tiny")
	if err != nil {
		t.Fatal(err)
	}
	var engine workers.Engine = cfg.customEngine
	if engine == nil {
		if engine, err = workers.NewSimEngine(cfg.engine); err != nil {
			t.Fatal(err)
		}
	}
	log := slog.New(slog.NewTextHandler(e.logs, nil))
	metrics, hm := workers.NewMetrics(e.reg), bus.NewHandlerMetrics(e.reg)
	hbInterval := cmp.Or(cfg.hbInterval, 20*time.Millisecond)
	var ranks []*workers.Rank
	for r := range worldSize {
		rank, err := workers.NewRank(workers.RankConfig{
			Conn: testenv.Connect(t, srv), Subjects: e.subj, Group: testGroup,
			TPRank: r, TPSize: worldSize, EPRank: r, EPSize: worldSize,
			Model: testModel, Profile: profile, CapacityBytes: cmp.Or(cfg.capacity, testCapacity), Engine: engine,
			BlockSize: blockSize, HeartbeatInterval: hbInterval, ShutdownTimeout: 5 * time.Second,
			IdentityWait: -1, // fresh identities (TestSecondProcessOfARankRefused checks the wait)
			Logger:       log, Metrics: metrics, HandlerMetrics: hm, StoreDelay: cfg.storeDelay[r], SaveWait: cfg.saveWait,
			DrainHandoff: cfg.drainHandoff, DelayFirstReqMeta: cfg.delayFirstMeta[r], QueueSize: cfg.queueSize,
		})
		if err != nil {
			t.Fatal(err)
		}
		if rank.IsDriver() != (r == 0) {
			t.Fatalf("rank %d: IsDriver() = %v", r, rank.IsDriver())
		}
		ranks = append(ranks, rank)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, worldSize)
	var wg sync.WaitGroup
	for _, rank := range ranks {
		rankCtx, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		e.rankStop, e.rankDone = append(e.rankStop, stop), append(e.rankDone, done)
		wg.Go(func() {
			defer close(done)
			defer stop()
			errs <- rank.Run(rankCtx)
		})
	}
	var once sync.Once
	var runErrs []error
	e.stop = func() []error {
		once.Do(func() {
			cancel()
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(waitFor):
				t.Error("Rank.Run did not return after its context ended")
				return
			}
			close(errs)
			for err := range errs {
				runErrs = append(runErrs, err)
			}
			close(e.stopped)
		})
		return runErrs
	}
	// Registered after the connections, so it runs before they close.
	t.Cleanup(func() {
		for _, err := range e.stop() {
			if err != nil {
				t.Errorf("Rank.Run: %v", err)
			}
		}
	})
	// A rank heartbeats only after it subscribed to its group's ReqMetas.
	testenv.Eventually(t, waitFor, "a heartbeat from every rank", func() bool {
		for r := range worldSize {
			if len(e.heartbeats(r)) == 0 {
				return false
			}
		}
		return true
	})
	return e
}

// readyGroups makes groups of two ranks, each with room for 1,000 blocks,
// send heartbeats every 10 ms (other groups ready to take a hand-off) until
// the returned func is called.
func (e *rankEnv) readyGroups(groups ...string) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			for _, g := range groups {
				for r := range 2 {
					data, _ := messages.Marshal(&messages.Heartbeat{Group: g, TPRank: r, WorldSize: 2, Model: testModel, CapacityBlocks: 1000})
					_ = e.nc.Publish(e.subj.Heartbeat(g, r), data)
				}
			}
			select {
			case <-done:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

func (e *rankEnv) heartbeats(rank int) []*messages.Heartbeat {
	var out []*messages.Heartbeat
	for _, m := range e.rec.all() {
		if m.Subject != e.subj.Heartbeat(testGroup, rank) {
			continue
		}
		hb, err := messages.DecodeHeartbeat(m.Data)
		if err != nil {
			e.t.Fatalf("bad heartbeat: %v", err)
		}
		out = append(out, hb)
	}
	return out
}

// events returns the RankResults and Outputs of a request in arrival order.
func (e *rankEnv) events(reqID string) []event {
	var out []event
	for _, m := range e.rec.all() {
		switch m.Subject {
		case e.subj.Done(testSchedID):
			r, err := messages.DecodeRankResult(m.Data)
			if err != nil {
				e.t.Fatalf("bad RankResult: %v", err)
			}
			// The driver's early "prefilled" report and receipts are not
			// rank results.
			if r.ReqID == reqID && !r.Prefilled && !r.Received {
				out = append(out, event{result: r})
			}
		case e.subj.Out(testFrontend):
			o, err := messages.DecodeOutput(m.Data)
			if err != nil {
				e.t.Fatalf("bad Output: %v", err)
			}
			if o.ReqID == reqID {
				out = append(out, event{output: o})
			}
		}
	}
	return out
}

func (e *rankEnv) results(reqID string) []*messages.RankResult {
	var out []*messages.RankResult
	for _, ev := range e.events(reqID) {
		if ev.result != nil {
			out = append(out, ev.result)
		}
	}
	return out
}

func (e *rankEnv) outputs(reqID string) []*messages.Output {
	var out []*messages.Output
	for _, ev := range e.events(reqID) {
		if ev.output != nil {
			out = append(out, ev.output)
		}
	}
	return out
}

// resultsByRank waits until every rank reported on reqID and returns the
// results by tp_rank; it fails if a rank reported twice.
func (e *rankEnv) resultsByRank(reqID string) map[int]*messages.RankResult {
	e.t.Helper()
	testenv.Eventually(e.t, waitFor, "a RankResult from every rank for "+reqID, func() bool {
		return len(e.results(reqID)) >= worldSize
	})
	out := map[int]*messages.RankResult{}
	for _, r := range e.results(reqID) {
		if out[r.TPRank] != nil {
			e.t.Fatalf("%s: rank %d reported twice: %+v and %+v", reqID, r.TPRank, out[r.TPRank], r)
		}
		out[r.TPRank] = r
	}
	if len(out) != worldSize {
		e.t.Fatalf("%s: results from ranks %v, want 0..%d", reqID, out, worldSize-1)
	}
	return out
}

// finalOutput checks the driver's stream of reqID and returns its last
// chunk: indexes 0, 1, 2, ... in order, exactly one final chunk, last.
func (e *rankEnv) finalOutput(reqID string) *messages.Output {
	e.t.Helper()
	testenv.Eventually(e.t, waitFor, "the final output of "+reqID, func() bool {
		for _, o := range e.outputs(reqID) {
			if o.Final() {
				return true
			}
		}
		return false
	})
	outs := e.outputs(reqID)
	for i, o := range outs {
		if o.Index != i {
			e.t.Fatalf("%s: output %d has index %d", reqID, i, o.Index)
		}
		if o.Final() != (i == len(outs)-1) {
			e.t.Fatalf("%s: output %d of %d final=%v", reqID, i, len(outs), o.Final())
		}
	}
	return outs[len(outs)-1]
}

func (e *rankEnv) publish(subject string, m messages.Message) {
	e.t.Helper()
	data, err := messages.Marshal(m)
	if err != nil {
		e.t.Fatal(err)
	}
	e.publishRaw(subject, data)
}

func (e *rankEnv) publishRaw(subject string, data []byte) {
	e.t.Helper()
	if err := e.nc.Publish(subject, data); err != nil {
		e.t.Fatal(err)
	}
	if err := e.nc.Flush(); err != nil {
		e.t.Fatal(err)
	}
}

func (e *rankEnv) sendMeta(m *messages.ReqMeta) {
	e.t.Helper()
	e.publish(e.subj.Meta(m.Group, m.SessionID), m)
}

// counter sums the series of a counter in the env's registry whose labels
// include want.
func (e *rankEnv) counter(name string, want map[string]string) float64 {
	e.t.Helper()
	return testenv.CounterSum(e.t, e.reg, name, want)
}

func newMeta(reqID, session string, tokens []uint32) *messages.ReqMeta {
	return &messages.ReqMeta{
		ReqID: reqID, SessionID: session, Model: testModel, Group: testGroup,
		TokenLen: len(tokens), TokenIDs: tokens, BlockSize: blockSize,
		BlockHashes: scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), tokens, blockSize),
		LoadSpec:    &messages.LoadSpec{CanLoad: true},
		CanSave:     true, IsLastChunk: true, NumPromptTokens: len(tokens),
		SamplingParams: messages.SamplingParams{MaxTokens: 8, IgnoreEOS: true},
		FrontendID:     testFrontend, ResultSubject: messages.Subjects{}.Done(testSchedID),
	}
}

func TestNewRankValidates(t *testing.T) {
	tiny, _ := workers.LookupModelProfile("tiny")
	engine, _ := workers.NewSimEngine(workers.SimConfig{})
	good := func() workers.RankConfig {
		return workers.RankConfig{Conn: &nats.Conn{}, Group: "g0", TPRank: 1, TPSize: 2, EPRank: 1, EPSize: 2,
			Model: "m", Profile: tiny, Engine: engine}
	}
	tests := []struct {
		name   string
		modify func(*workers.RankConfig)
	}{
		{"no connection", func(c *workers.RankConfig) { c.Conn = nil }},
		{"bad group", func(c *workers.RankConfig) { c.Group = "g.0" }},
		{"empty group", func(c *workers.RankConfig) { c.Group = "" }},
		{"tp rank >= tp size", func(c *workers.RankConfig) { c.TPRank = 2 }},
		{"negative tp rank", func(c *workers.RankConfig) { c.TPRank = -1 }},
		{"zero tp size", func(c *workers.RankConfig) { c.TPSize, c.TPRank = 0, 0 }},
		{"ep rank >= ep size", func(c *workers.RankConfig) { c.EPRank = 2 }},
		{"no model", func(c *workers.RankConfig) { c.Model = "" }},
		{"no profile", func(c *workers.RankConfig) { c.Profile = workers.ModelProfile{} }},
		{"driver without engine", func(c *workers.RankConfig) { c.TPRank, c.Engine = 0, nil }},
		{"negative capacity", func(c *workers.RankConfig) { c.CapacityBytes = -1 }},
		{"bad subject prefix", func(c *workers.RankConfig) { c.Subjects.Prefix = "a.b" }},
	}
	for _, tt := range tests {
		cfg := good()
		tt.modify(&cfg)
		if _, err := workers.NewRank(cfg); err == nil {
			t.Errorf("%s: NewRank succeeded", tt.name)
		} else if tt.name != "bad subject prefix" && !errors.Is(err, workers.ErrConfig) {
			t.Errorf("%s: error %v does not wrap ErrConfig", tt.name, err)
		}
	}
	cfg := good()
	cfg.Engine = nil // only the driver needs an engine
	if _, err := workers.NewRank(cfg); err != nil {
		t.Errorf("a non-driver rank without engine: %v", err)
	}
}

// TestRankLoadAndStore runs requests one after another on one group, so
// that each step sees the blocks the previous ones stored.
func TestRankLoadAndStore(t *testing.T) {
	env := startRanks(t, rankEnvConfig{})
	const promptLen = 70 // 4 full blocks of 16, and 6 tokens that are not saved
	const fullBlocks = promptLen / blockSize
	base := testenv.PromptTokens(1, promptLen)
	// Shares the first two blocks with base, then diverges.
	fork := append(slices.Clone(base[:2*blockSize]), testenv.PromptTokens(2, promptLen-2*blockSize)...)
	loading := func(m *messages.ReqMeta, tokens int) *messages.ReqMeta {
		m.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: tokens, CanLoad: true}
		return m
	}
	steps := []struct {
		name string
		meta *messages.ReqMeta
		// want, per rank (CompletionTokens only on the driver).
		want messages.RankResult
	}{
		{"first request stores every full block", newMeta("r1", "sess-A", base),
			messages.RankResult{StoredBlocks: fullBlocks}},
		{"repeated prompt skips stored blocks", newMeta("r2", "sess-A", base),
			messages.RankResult{SkippedBlocks: fullBlocks}},
		{"LoadSpec over stored blocks loads them", loading(newMeta("r3", "sess-A", base), fullBlocks*blockSize),
			messages.RankResult{LoadedTokens: fullBlocks * blockSize, SkippedBlocks: fullBlocks}},
		{"LoadSpec of half the stored blocks", loading(newMeta("r4", "sess-A", base), 2*blockSize),
			messages.RankResult{LoadedTokens: 2 * blockSize, SkippedBlocks: fullBlocks}},
		{"LoadSpec over blocks never stored: recompute", loading(newMeta("r5", "sess-B", testenv.PromptTokens(3, promptLen)), 3*blockSize),
			messages.RankResult{FailedBlocks: 3, StoredBlocks: fullBlocks}},
		{"LoadSpec past a shared prefix loads the prefix only", loading(newMeta("r6", "sess-C", fork), fullBlocks*blockSize),
			messages.RankResult{LoadedTokens: 2 * blockSize, FailedBlocks: 2, SkippedBlocks: 2, StoredBlocks: 2}},
		{"can_save false stores nothing", func() *messages.ReqMeta {
			m := newMeta("r7", "", testenv.PromptTokens(4, promptLen))
			m.CanSave = false
			return m
		}(), messages.RankResult{}},
		{"save_from_block skips the blocks before it", func() *messages.ReqMeta {
			m := newMeta("r8", "", testenv.PromptTokens(5, promptLen))
			m.SaveFromBlock = 3
			return m
		}(), messages.RankResult{StoredBlocks: fullBlocks - 3}},
		{"a prompt shorter than a block", newMeta("r9", "sess-A", testenv.PromptTokens(6, blockSize-1)), messages.RankResult{}},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			outer := env.t
			env.t = t
			defer func() { env.t = outer }()
			env.sendMeta(st.meta)
			final := env.finalOutput(st.meta.ReqID)
			results := env.resultsByRank(st.meta.ReqID)
			for rank, r := range results {
				want := st.want
				want.V, want.ReqID, want.Group, want.TPRank, want.EPRank = messages.Version, st.meta.ReqID, testGroup, rank, rank
				want.LoadUs, want.StoreUs = r.LoadUs, r.StoreUs
				if r.StartedUnixMs <= 0 || r.StartedUnixMs > time.Now().UnixMilli() {
					t.Errorf("rank %d: started_unix_ms %d is not its process's start", rank, r.StartedUnixMs)
				}
				want.StartedUnixMs = r.StartedUnixMs
				if rank == 0 {
					want.CompletionTokens = st.meta.SamplingParams.MaxTokens
				}
				if *r != want {
					t.Errorf("rank %d:\n got %+v\nwant %+v", rank, *r, want)
				}
			}
			wantUsage := messages.Usage{PromptTokens: st.meta.TokenLen, CompletionTokens: st.meta.SamplingParams.MaxTokens,
				CachedTokens: st.want.LoadedTokens}
			if final.FinishReason != workers.FinishLength || final.Error != nil || final.Usage == nil || *final.Usage != wantUsage {
				t.Errorf("final output %+v usage %+v, want finish %q and usage %+v", final, final.Usage, workers.FinishLength, wantUsage)
			}
			var ids []uint32
			for _, o := range env.outputs(st.meta.ReqID) {
				ids = append(ids, o.TokenIDs...)
			}
			if len(ids) != st.meta.SamplingParams.MaxTokens {
				t.Errorf("%d output token ids, want %d", len(ids), st.meta.SamplingParams.MaxTokens)
			}
			// Every rank logs the session id it was given in its store thread.
			for rank := range worldSize {
				want := []string{`msg="store thread"`, "req_id=" + st.meta.ReqID, fmt.Sprintf("tp_rank=%d ", rank), "group=" + testGroup}
				if st.meta.SessionID != "" {
					want = append(want, "session_id="+st.meta.SessionID)
				}
				if len(env.logs.Lines(want...)) == 0 {
					t.Errorf("rank %d logged no line with %q", rank, want)
				}
			}
		})
		if t.Failed() {
			return // later steps depend on this one
		}
	}
}

// TestBlocksAStoreSkipsAreUsedByItsRequest: a store thread that finds a
// prompt's blocks already held (the request did not load them: the
// scheduler had not heard they were saved, or, on a driver, whose store
// thread takes requests as their prefills end, a later request's save came
// first) skips them, and they are as recently used as the request that
// skipped them. Left at the recency of the request that saved them, the
// next save evicted them on one rank and, where the ranks' threads came in
// another order, kept them on the others: the ranks of a group no longer
// held the same blocks (TestTheRanksOfAGroupEvictAlike: 134 of 160).
func TestBlocksAStoreSkipsAreUsedByItsRequest(t *testing.T) {
	const prompt = 4 * blockSize
	env := startRanks(t, rankEnvConfig{capacity: 8 * testBlockBytes})
	send := func(id string, tokens []uint32) {
		t.Helper()
		env.sendMeta(newMeta(id, "", tokens))
		env.finalOutput(id)
		testenv.Eventually(t, waitFor, id+"'s result from every rank", func() bool { return len(env.resultsByRank(id)) == worldSize })
	}
	p, x, q := testenv.PromptTokens(1, prompt), testenv.PromptTokens(2, prompt), testenv.PromptTokens(3, prompt)
	send("r1", p)
	send("r2", x)
	send("r3", p) // p's blocks are held: skipped
	if r := env.resultsByRank("r3")[1]; r.SkippedBlocks != 4 || r.StoredBlocks != 0 {
		t.Fatalf("r3 on rank 1: %+v, want its 4 blocks skipped", r)
	}
	send("r4", q) // fills the store: 4 blocks go
	hashes := func(tokens []uint32) []uint64 {
		return scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), tokens, blockSize)
	}
	for rank := range worldSize {
		held := env.dump(rank)
		for _, h := range hashes(p) {
			if !held[h] {
				t.Errorf("rank %d evicted a block of p, used by r3 after r2 saved x", rank)
			}
		}
		for _, h := range hashes(x) {
			if held[h] {
				t.Errorf("rank %d kept a block of x, saved by r2, and evicted one of p, used by r3", rank)
			}
		}
	}
}

// dump is the set of blocks rank holds, from its dump.
func (e *rankEnv) dump(rank int) map[uint64]bool {
	e.t.Helper()
	msg, err := e.nc.Request(e.subj.Dump(testGroup, rank), nil, waitFor)
	if err != nil {
		e.t.Fatal(err)
	}
	b, err := messages.DecodeKVEventBatch(msg.Data)
	if err != nil {
		e.t.Fatal(err)
	}
	held := map[uint64]bool{}
	for _, ev := range b.Events {
		for _, h := range ev.BlockHashes {
			held[h] = true
		}
	}
	return held
}

func TestRankDuplicateReqMeta(t *testing.T) {
	env := startRanks(t, rankEnvConfig{})
	m := newMeta("dup", "sess", testenv.PromptTokens(1, 40))
	env.sendMeta(m)
	env.sendMeta(m) // a redelivery: same req_id, same attempt
	testenv.Eventually(t, waitFor, "both ranks to drop the duplicate", func() bool {
		return env.counter("kvbus_worker_dropped_total", map[string]string{"reason": "duplicate"}) == worldSize
	})
	testenv.Eventually(t, waitFor, "a result from every rank", func() bool { return len(env.results("dup")) >= worldSize })
	env.finalOutput("dup")
	// A later request on the same subject is handled after the duplicate
	// was (ranks take ReqMetas in order): once it is done, the duplicate had
	// every chance to produce output.
	env.sendMeta(newMeta("after", "sess", testenv.PromptTokens(2, 40)))
	env.resultsByRank("after")
	env.finalOutput("after")
	// A rank that gets a ReqMeta again after it reported answers with the
	// same result again (a scheduler that did not hear it, or another
	// replica that took the request over, needs it); it does not run the
	// request twice.
	byRank := map[int][]*messages.RankResult{}
	for _, r := range env.results("dup") {
		byRank[r.TPRank] = append(byRank[r.TPRank], r)
	}
	for rank := range worldSize {
		rs := byRank[rank]
		if len(rs) == 0 || len(rs) > 2 || (len(rs) == 2 && *rs[0] != *rs[1]) {
			t.Errorf("rank %d: results for a request sent twice: %+v; want one, or the same one twice", rank, rs)
		}
	}
	finals := 0
	for _, o := range env.outputs("dup") {
		if o.Final() {
			finals++
		}
	}
	if finals != 1 {
		t.Errorf("%d final outputs for a request sent twice, want 1", finals)
	}
	if got := env.counter("kvbus_worker_reqmeta_total", nil); got != 3*worldSize {
		t.Errorf("kvbus_worker_reqmeta_total = %v, want %d", got, 3*worldSize)
	}

	// A newer attempt of the same request is run again.
	m.Attempt = 1
	env.sendMeta(m)
	testenv.Eventually(t, waitFor, "results of attempt 1", func() bool {
		n := 0
		for _, r := range env.results("dup") {
			if r.Attempt == 1 {
				n++
			}
		}
		return n == worldSize
	})
	// An older attempt arriving late is a duplicate.
	m.Attempt = 0
	env.sendMeta(m)
	testenv.Eventually(t, waitFor, "both ranks to drop the stale attempt", func() bool {
		return env.counter("kvbus_worker_dropped_total", map[string]string{"reason": "duplicate"}) == 2*worldSize
	})
}

// streamingAnswer starts ranks that decode a token every 50 ms and sends
// them request id, of 100 tokens (5 s of decoding); it returns once the
// first chunk streamed, with the time the ReqMeta was sent.
func streamingAnswer(t *testing.T, id string) (*rankEnv, time.Time) {
	t.Helper()
	env := startRanks(t, rankEnvConfig{engine: workers.SimConfig{
		Profile: workers.SimProfile{DecodePerToken: 50 * time.Millisecond}, TimeScale: 1,
	}})
	m := newMeta(id, "sess", testenv.PromptTokens(1, 40))
	m.SamplingParams.MaxTokens = 100 // 5 s of decoding
	sent := time.Now()
	env.sendMeta(m)
	testenv.Eventually(t, waitFor, "the first streamed chunk", func() bool { return len(env.outputs(id)) > 0 })
	return env, sent
}

func TestRankAbort(t *testing.T) {
	env, start := streamingAnswer(t, "slow")
	env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: "slow", Reason: "client disconnected"})
	results := env.resultsByRank("slow")
	if d := time.Since(start); d > 4*time.Second {
		t.Errorf("the aborted request ran for %s", d)
	}
	driver := results[0]
	if driver.Error == "" {
		t.Errorf("driver RankResult of an aborted request has no error: %+v", driver)
	}
	if driver.ErrorCode != messages.RankErrAborted {
		t.Errorf("driver: error code %q (%q), want %q: the scheduler counts the request by it", driver.ErrorCode, driver.Error, messages.RankErrAborted)
	}
	if driver.CompletionTokens >= 100 {
		t.Errorf("aborted request generated all %d tokens", driver.CompletionTokens)
	}
	// The driver publishes its final output before its RankResult, so no
	// final chunk before the result means none ever.
	sawResult := false
	for _, ev := range env.events("slow") {
		switch {
		case ev.result != nil && ev.result.TPRank == 0:
			sawResult = true
		case ev.output != nil && ev.output.Final():
			t.Errorf("the driver sent a final output for an aborted request: %+v", ev.output)
		case ev.output != nil && sawResult:
			t.Errorf("output after the driver's RankResult: %+v", ev.output)
		}
	}
	// The group still serves requests.
	next := newMeta("next", "sess", testenv.PromptTokens(2, 40))
	next.SamplingParams.MaxTokens = 2
	env.sendMeta(next)
	env.resultsByRank("next")
	if f := env.finalOutput("next"); f.FinishReason != workers.FinishLength {
		t.Errorf("after an abort: final %+v", f)
	}
	// An abort for an unknown request is harmless.
	env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: "never-seen"})
}

// TestRankAbortOfATimeoutSaysTimeout: a frontend whose --request-timeout
// passed aborts the request with the reason "timeout"; a scheduler replica
// that does not track it passes that Abort on to the group. The ranks
// answered it as aborted by its client, and the replica that tracks it,
// hearing those results before the Abort, counted
// kvbus_scheduler_requests_total{outcome="aborted"}: a review's two 504s
// were one timeout and one aborted. The ranks say timeout, running or not
// yet run.
func TestRankAbortOfATimeoutSaysTimeout(t *testing.T) {
	env, _ := streamingAnswer(t, "late")
	env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: "late", Reason: messages.AbortReasonTimeout})
	// The driver was generating (the other rank had saved its shard and
	// answered already).
	if r := env.resultsByRank("late")[0]; r.ErrorCode != messages.RankErrTimeout {
		t.Errorf("driver: error code %q (%q), want %q: the scheduler counts the request by it", r.ErrorCode, r.Error, messages.RankErrTimeout)
	}
	// Its ReqMeta after the frontend's timeout (a resend).
	env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: "queued", Reason: messages.AbortReasonTimeout})
	testenv.Eventually(t, waitFor, "the abort handled", func() bool {
		return env.counter("kvbus_bus_messages_total", map[string]string{"handler": "worker_abort"}) >= 2*worldSize
	})
	env.sendMeta(newMeta("queued", "sess", testenv.PromptTokens(2, 40)))
	for rank, r := range env.resultsByRank("queued") {
		if r.ErrorCode != messages.RankErrTimeout {
			t.Errorf("rank %d answered the timed-out request with %q (%q), want %q", rank, r.ErrorCode, r.Error, messages.RankErrTimeout)
		}
	}
}

// TestRankAbortBeforeReqMeta: a client's Abort can reach the ranks before
// the request's ReqMeta (the frontend and the scheduler publish them); the
// ranks then drop the ReqMeta instead of running the request for nobody,
// and answer the scheduler that it was aborted: one that did not hear the
// Abort (lost across a NATS restart) held the request until its deadline.
// A group-scoped withdrawal of an unknown request is not remembered.
func TestRankAbortBeforeReqMeta(t *testing.T) {
	env := startRanks(t, rankEnvConfig{})
	env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: "gone", Reason: "client disconnected"})
	env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: "moved", Group: testGroup, BeforeAttempt: 1, Reason: "dispatched again"})
	testenv.Eventually(t, waitFor, "the aborts handled", func() bool {
		return env.counter("kvbus_bus_messages_total", map[string]string{"handler": "worker_abort"}) >= 2*worldSize
	})
	env.sendMeta(newMeta("gone", "sess", testenv.PromptTokens(1, 40)))
	moved := newMeta("moved", "sess", testenv.PromptTokens(2, 40))
	moved.Attempt = 1
	env.sendMeta(moved)
	env.resultsByRank("moved") // the withdrawn request's next attempt runs
	testenv.Eventually(t, waitFor, "every rank to drop the aborted request", func() bool {
		return env.counter("kvbus_worker_dropped_total", map[string]string{"reason": "aborted"}) == worldSize
	})
	got := env.resultsByRank("gone")
	for rank, r := range got {
		if r.ErrorCode != messages.RankErrAborted {
			t.Errorf("rank %d answered the aborted request with %+v, want error code %s", rank, r, messages.RankErrAborted)
		}
	}
	if out := env.outputs("gone"); len(out) != 0 {
		t.Errorf("the aborted request ran: %d outputs", len(out))
	}
}

// TestRankAbortStopsTheAttemptsToCome: a client's Abort that reaches the
// ranks while they run (or ran) one attempt of its request also stops the
// next attempt, dispatched again before the scheduler heard the Abort (a
// rank of the group restarted) and whose ReqMeta comes after it: the ranks
// drop it. Before, the ranks that had seen the first attempt let the next
// one run, and the driver generated the whole answer for nobody.
func TestRankAbortStopsTheAttemptsToCome(t *testing.T) {
	env, _ := streamingAnswer(t, "left")
	env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: "left", Reason: "client disconnected"})
	env.resultsByRank("left")
	next := newMeta("left", "sess", testenv.PromptTokens(1, 40))
	next.Attempt, next.SamplingParams.MaxTokens = 1, 100
	env.sendMeta(next)
	testenv.Eventually(t, waitFor, "every rank to drop the next attempt", func() bool {
		return env.counter("kvbus_worker_dropped_total", map[string]string{"reason": "aborted"}) == worldSize
	})
	for _, r := range env.results("left") {
		if r.Attempt == 1 && r.ErrorCode != messages.RankErrAborted {
			t.Errorf("rank %d ran the attempt after its client's abort: %+v", r.TPRank, r)
		}
	}
	for _, o := range env.outputs("left") {
		if o.Attempt == 1 {
			t.Errorf("the attempt after its client's abort sent an output: %+v", o)
		}
	}
}

// TestRankWithdrawSparesTheNewAttempt: a scheduler that dispatches a
// request again on the same group (a rank restarted) withdraws the attempts
// below the new one; ranks that got the new attempt's ReqMeta first (another
// subject) keep running it, and an abort below an attempt they do not run
// yet stops the one they run.
func TestRankWithdrawSparesTheNewAttempt(t *testing.T) {
	env := startRanks(t, rankEnvConfig{engine: workers.SimConfig{
		Profile: workers.SimProfile{DecodePerToken: 50 * time.Millisecond}, TimeScale: 1,
	}})
	for _, tc := range []struct {
		id      string
		before  int
		aborted bool
	}{{"spared", 1, false}, {"withdrawn", 2, true}} {
		m := newMeta(tc.id, "sess", testenv.PromptTokens(len(tc.id), 40))
		m.Attempt, m.SamplingParams.MaxTokens = 1, 20 // 1 s of decoding
		env.sendMeta(m)
		testenv.Eventually(t, waitFor, "the first streamed chunk of "+tc.id, func() bool { return len(env.outputs(tc.id)) > 0 })
		env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: tc.id, Group: testGroup, BeforeAttempt: tc.before, Reason: "dispatched again"})
		driver := env.resultsByRank(tc.id)[0]
		if got := driver.Error != ""; got != tc.aborted {
			t.Errorf("%s: attempt 1 after an abort of attempts below %d: error %q, want aborted %v", tc.id, tc.before, driver.Error, tc.aborted)
		}
		if !tc.aborted && driver.CompletionTokens != 20 {
			t.Errorf("%s: %d tokens, want all 20", tc.id, driver.CompletionTokens)
		}
	}
}

func TestRankDropsMalformedMeta(t *testing.T) {
	env := startRanks(t, rankEnvConfig{})
	invalid := newMeta("bad", "sess", testenv.PromptTokens(1, 40))
	invalid.BlockSize = 0
	invalidData, err := messages.Marshal(invalid)
	if err != nil {
		t.Fatal(err)
	}
	payloads := [][]byte{
		[]byte("not msgpack at all"),
		{},
		{0xc1},
		{0x81, 0xa1, 'v'}, // truncated map
		invalidData,       // decodes, breaks a rule
	}
	for _, p := range payloads {
		env.publishRaw(env.subj.Meta(testGroup, "sess"), p)
	}
	want := float64(len(payloads) * worldSize)
	testenv.Eventually(t, waitFor, "every malformed ReqMeta counted", func() bool {
		return env.counter("kvbus_bus_messages_total", map[string]string{"handler": "worker_reqmeta", "outcome": "malformed"}) == want
	})
	if n := env.counter("kvbus_worker_reqmeta_total", nil); n != 0 {
		t.Errorf("malformed payloads counted as ReqMetas: %v", n)
	}
	good := newMeta("good", "sess", testenv.PromptTokens(2, 40))
	env.sendMeta(good)
	env.resultsByRank("good")
	if f := env.finalOutput("good"); f.FinishReason == "" {
		t.Errorf("after malformed input: final %+v", f)
	}
	if n := len(env.results("bad")); n != 0 {
		t.Errorf("%d results for an invalid ReqMeta", n)
	}
}

func TestRankHeartbeats(t *testing.T) {
	env := startRanks(t, rankEnvConfig{})
	testenv.Eventually(t, waitFor, "repeated heartbeats", func() bool {
		return len(env.heartbeats(0)) >= 3 && len(env.heartbeats(1)) >= 3
	})
	for rank := range worldSize {
		for _, hb := range env.heartbeats(rank) {
			want := messages.Heartbeat{
				V: messages.Version, Group: testGroup, TPRank: rank, EPRank: rank, WorldSize: worldSize, Model: testModel,
				CapacityBlocks: testCapacity / testBlockBytes, StartedUnixMs: hb.StartedUnixMs,
				ResendByGroup: rank == 0, // the driver reads its group's Resends
			}
			if *hb != want {
				t.Fatalf("rank %d heartbeat:\n got %+v\nwant %+v", rank, *hb, want)
			}
			if time.Since(time.UnixMilli(hb.StartedUnixMs)) > time.Minute || hb.StartedUnixMs > time.Now().UnixMilli() {
				t.Errorf("rank %d: started_unix_ms %d is not about now", rank, hb.StartedUnixMs)
			}
		}
	}
	// After a request, heartbeats count the stored blocks.
	env.sendMeta(newMeta("r", "s", testenv.PromptTokens(1, 5*blockSize)))
	env.resultsByRank("r")
	testenv.Eventually(t, waitFor, "heartbeats with 5 used blocks", func() bool {
		for rank := range worldSize {
			hbs := env.heartbeats(rank)
			if last := hbs[len(hbs)-1]; last.UsedBlocks != 5 || last.QueueDepth != 0 {
				return false
			}
		}
		return true
	})
}

// TestDriverHeartbeatsFollowTheLoad checks the load heartbeats the driver
// sends besides the periodic ones (an hour apart here): one at every
// prefill, and after a request's end one within loadHeartbeatDelay (5 ms)
// unless another goes out first — so a burst of requests costs about one
// per request, and the last one always reports the group idle.
func TestDriverHeartbeatsFollowTheLoad(t *testing.T) {
	env := startRanks(t, rankEnvConfig{hbInterval: time.Hour})
	before := len(env.heartbeats(0))
	env.sendMeta(newMeta("one", "s", testenv.PromptTokens(1, 2*blockSize)))
	env.resultsByRank("one")
	testenv.Eventually(t, waitFor, "the prefill's and the end's heartbeats", func() bool { return len(env.heartbeats(0)) >= before+2 })
	time.Sleep(50 * time.Millisecond) // nothing more comes
	hbs := env.heartbeats(0)
	if got := len(hbs) - before; got != 2 {
		t.Fatalf("one request: %d driver heartbeats, want 2 (its prefill, its end)", got)
	}
	if last := hbs[len(hbs)-1]; last.InflightRequests != 0 || last.QueueDepth != 0 {
		t.Fatalf("the heartbeat after the end reports %d in flight, queue depth %d", last.InflightRequests, last.QueueDepth)
	}
	for r := 1; r < worldSize; r++ { // the other ranks beat only periodically
		if n := len(env.heartbeats(r)); n != 1 {
			t.Errorf("rank %d sent %d heartbeats, want only its first", r, n)
		}
	}

	before = len(hbs)
	const burst = 40
	for i := range burst {
		env.sendMeta(newMeta(fmt.Sprint("burst-", i), "", testenv.PromptTokens(10+i, 2*blockSize)))
	}
	for i := range burst {
		env.resultsByRank(fmt.Sprint("burst-", i))
	}
	testenv.Eventually(t, waitFor, "a heartbeat that reports the group idle", func() bool {
		hbs := env.heartbeats(0)
		last := hbs[len(hbs)-1]
		return len(hbs) >= before+burst && last.InflightRequests == 0 && last.QueueDepth == 0
	})
	time.Sleep(50 * time.Millisecond)
	if got := len(env.heartbeats(0)) - before; got > burst+burst/2 {
		t.Fatalf("%d requests: %d driver heartbeats, want about one per request (at most %d)", burst, got, burst+burst/2)
	}
}

// TestRanksFollowHeartbeatsOnlyWhenDraining: with the drain hand-off on, a
// rank reads other ranks' heartbeats (a driver sends one per request) only
// once it drains, and then it does.
func TestRanksFollowHeartbeatsOnlyWhenDraining(t *testing.T) {
	env := startRanks(t, rankEnvConfig{drainHandoff: 1 << 20})
	peerHeartbeats := func() float64 {
		return env.counter("kvbus_bus_messages_total", map[string]string{"handler": "worker_peer_heartbeat"})
	}
	for i := range 5 {
		env.sendMeta(newMeta(fmt.Sprint("r", i), "s", testenv.PromptTokens(i, 2*blockSize)))
		env.resultsByRank(fmt.Sprint("r", i))
	}
	if n := peerHeartbeats(); n != 0 {
		t.Fatalf("serving ranks handled %v peer heartbeats, want 0", n)
	}
	env.stop()
	if n := peerHeartbeats(); n == 0 {
		t.Fatal("draining ranks handled no peer heartbeat: the hand-off could not see the group")
	}
	if !strings.Contains(env.logs.String(), "drain hand-off: nothing to hand off") {
		t.Fatalf("the driver did not reach its hand-off plan:\n%s", env.logs.String())
	}
}

func TestRankGracefulStop(t *testing.T) {
	env := startRanks(t, rankEnvConfig{engine: workers.SimConfig{
		Profile: workers.SimProfile{DecodePerToken: 20 * time.Millisecond}, TimeScale: 1,
	}})
	m := newMeta("inflight", "sess", testenv.PromptTokens(1, 40))
	m.SamplingParams.MaxTokens = 10
	env.sendMeta(m)
	testenv.Eventually(t, waitFor, "the first streamed chunk", func() bool { return len(env.outputs("inflight")) > 0 })
	for _, err := range env.stop() {
		if err != nil {
			t.Errorf("Run returned %v after its context ended", err)
		}
	}
	// The in-flight request was finished, not cut off.
	results := env.resultsByRank("inflight")
	if f := env.finalOutput("inflight"); f.FinishReason != workers.FinishLength || f.Usage.CompletionTokens != 10 {
		t.Errorf("in-flight request at shutdown: final %+v", f)
	}
	for rank, r := range results {
		if r.Error != "" {
			t.Errorf("rank %d: %q", rank, r.Error)
		}
	}
	// A stopped rank sends no more heartbeats.
	n0, n1 := len(env.heartbeats(0)), len(env.heartbeats(1))
	env.sendMeta(newMeta("late", "sess", testenv.PromptTokens(2, 40)))
	// Round trip through the server: everything published before now has
	// been delivered to the recorder.
	if err := env.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if len(env.heartbeats(0)) > n0+1 || len(env.heartbeats(1)) > n1+1 {
		t.Errorf("heartbeats after Run returned")
	}
	if n := len(env.events("late")); n != 0 {
		t.Errorf("a stopped rank answered a ReqMeta: %d messages", n)
	}
}

func TestRankDeadlinePassed(t *testing.T) {
	env := startRanks(t, rankEnvConfig{})
	m := newMeta("late", "sess", testenv.PromptTokens(1, 40))
	m.DeadlineUnixMs = time.Now().Add(-time.Second).UnixMilli()
	env.sendMeta(m)
	results := env.resultsByRank("late")
	final := env.finalOutput("late")
	if final.Error == nil || final.Error.Code != "timeout" || final.FinishReason != "" {
		t.Errorf("final output %+v (error %+v), want a timeout error", final, final.Error)
	}
	for rank, r := range results {
		if r.Error == "" || r.ErrorCode != messages.RankErrTimeout || r.StoredBlocks != 0 {
			t.Errorf("rank %d: %+v, want a timeout error and nothing stored", rank, r)
		}
	}
}

// TestRankDeadlineIsTheTimeLeftNotTheSchedulersClock: a ReqMeta carries its
// deadline on the scheduler's clock and the time the request had left when
// it was sent. A rank whose clock runs two minutes ahead of the scheduler's
// read the deadline as passed and ended the request at once with a timeout
// (and every other request sent to it); one whose clock runs two minutes
// behind kept generating for minutes after the client's deadline. The rank
// counts the time left from receipt, and says once that the clocks differ.
func TestRankDeadlineIsTheTimeLeftNotTheSchedulersClock(t *testing.T) {
	env := startRanks(t, rankEnvConfig{engine: workers.SimConfig{
		Profile: workers.SimProfile{DecodePerToken: 20 * time.Millisecond}, TimeScale: 1,
	}})
	// The scheduler's clock two minutes behind this host's: its deadline,
	// a minute after it sent the request, is a minute ago here.
	ahead := newMeta("rank-clock-ahead", "sess-ahead", testenv.PromptTokens(1, 40))
	ahead.SamplingParams.MaxTokens = 10 // 0.2 s of decoding
	ahead.DeadlineUnixMs = time.Now().Add(-2*time.Minute + time.Minute).UnixMilli()
	ahead.TimeoutMs = time.Minute.Milliseconds()
	env.sendMeta(ahead)
	final := env.finalOutput("rank-clock-ahead")
	if final.Error != nil || final.FinishReason != workers.FinishLength || final.Usage.CompletionTokens != 10 {
		t.Errorf("rank two minutes ahead of the scheduler: final output %+v (error %+v), want the whole answer", final, final.Error)
	}
	for rank, r := range env.resultsByRank("rank-clock-ahead") {
		if r.Error != "" {
			t.Errorf("rank two minutes ahead of the scheduler: rank %d: %q", rank, r.Error)
		}
	}
	if lines := env.logs.Lines("clock and this host's disagree", "req_id=rank-clock-ahead", "session_id=sess-ahead"); len(lines) != worldSize {
		t.Errorf("want one clock warning per rank naming the request, got %d:\n%s", len(lines), env.logs.String())
	}

	// The scheduler's clock two minutes ahead: its deadline is three
	// minutes away here, but only 300 ms were left.
	behind := newMeta("rank-clock-behind", "sess-behind", testenv.PromptTokens(2, 40))
	behind.SamplingParams.MaxTokens = 250 // 5 s of decoding
	behind.DeadlineUnixMs = time.Now().Add(2*time.Minute + time.Minute).UnixMilli()
	behind.TimeoutMs = 300
	start := time.Now()
	env.sendMeta(behind)
	final = env.finalOutput("rank-clock-behind")
	took := time.Since(start)
	if final.Error == nil || final.Error.Code != "timeout" {
		t.Errorf("rank two minutes behind the scheduler: final output %+v (error %+v), want a timeout", final, final.Error)
	}
	if took < 300*time.Millisecond || took > 2*time.Second {
		t.Errorf("rank two minutes behind the scheduler: the request ended after %v, want about 300 ms", took)
	}
	// The other rank stored the prompt's blocks well within the 300 ms.
	if r := env.resultsByRank("rank-clock-behind")[0]; r.ErrorCode != messages.RankErrTimeout {
		t.Errorf("rank two minutes behind the scheduler: the driver's result %+v, want a timeout", r)
	}
	// Held back: one warning a minute per rank.
	if lines := env.logs.Lines("clock and this host's disagree", "req_id=rank-clock-behind"); len(lines) != 0 {
		t.Errorf("the second skewed request within a minute was warned about again:\n%s", strings.Join(lines, "\n"))
	}
}

// TestRankRefusesAnotherModelsReqMeta: a ReqMeta naming another model (a
// scheduler that did not tell models apart) is not run on these weights:
// every rank answers it with an error, nothing is stored, and the driver
// ends the answer with model_mismatch. It was run as if it were its model's.
func TestRankRefusesAnotherModelsReqMeta(t *testing.T) {
	env := startRanks(t, rankEnvConfig{})
	m := newMeta("other-model", "sess", testenv.PromptTokens(2, 40))
	m.Model = "another-model"
	env.sendMeta(m)
	results := env.resultsByRank("other-model")
	final := env.finalOutput("other-model")
	if final.Error == nil || final.Error.Code != "model_mismatch" || !strings.Contains(final.Error.Message, `"another-model"`) {
		t.Errorf("final output %+v (error %+v), want a model_mismatch error naming the model", final, final.Error)
	}
	for rank, r := range results {
		if r.Error == "" || r.ErrorCode != "model_mismatch" || r.StoredBlocks != 0 {
			t.Errorf("rank %d: %+v, want a model_mismatch error and nothing stored", rank, r)
		}
	}
}

// TestRankLoadWaitsForInflightSave: the next turn arrives while rank 1 is
// still saving the previous turn's blocks. Its load waits for that save
// (within SaveWait) and finds every block; past SaveWait the blocks count
// in failed_blocks and are recomputed.
func TestRankLoadWaitsForInflightSave(t *testing.T) {
	for _, tc := range []struct {
		name                       string
		delay, wait                time.Duration
		wantLoaded, failed, waited int
	}{
		{"the save ends within SaveWait", 200 * time.Millisecond, 2 * time.Second, 4 * blockSize, 0, 1},
		{"the save ends after SaveWait", 600 * time.Millisecond, 50 * time.Millisecond, 0, 4, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := startRanks(t, rankEnvConfig{storeDelay: map[int]time.Duration{1: tc.delay}, saveWait: tc.wait})
			prompt := testenv.PromptTokens(9, 4*blockSize+3)
			first := newMeta("turn-1", "sess-w", prompt)
			next := newMeta("turn-2", "sess-w", append(slices.Clone(prompt), testenv.PromptTokens(10, 2*blockSize)...))
			next.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 4 * blockSize, CanLoad: true}
			next.SaveFromBlock = 4
			env.sendMeta(first)
			env.finalOutput("turn-1")
			env.sendMeta(next) // the driver answered; rank 1 is still saving turn 1
			got := env.resultsByRank("turn-2")
			for rank, r := range got {
				wantLoaded, failed := 4*blockSize, 0
				if rank == 1 {
					wantLoaded, failed = tc.wantLoaded, tc.failed
				}
				if r.LoadedTokens != wantLoaded || r.FailedBlocks != failed {
					t.Errorf("rank %d: loaded %d tokens, failed_blocks %d; want %d, %d", rank, r.LoadedTokens, r.FailedBlocks, wantLoaded, failed)
				}
			}
			waited := env.counter("kvbus_worker_blocks_total", map[string]string{"op": "waited_for_save", "tp_rank": "1"})
			if waited != float64(tc.waited) {
				t.Errorf("rank 1 found %v blocks by waiting for a save in flight, want %d", waited, tc.waited)
			}
		})
	}
}

// TestRankReceiptsAndDriverLoad: a rank busy with a request for longer than
// ReceiptAfter (here the driver, generating) sends a receipt, so the
// scheduler can tell it from a rank that lost the ReqMeta; the others,
// done sooner, send their result instead. The driver's heartbeats carry its group's load
// (requests in flight, prompt tokens not yet prefilled, none once done) and
// how long its engine has been on the prefill at the head of its queue; its
// prefill report says how long the prefill took.
func TestRankReceiptsAndDriverLoad(t *testing.T) {
	env := startRanks(t, rankEnvConfig{engine: workers.SimConfig{
		Profile: workers.SimProfile{PrefillPerToken: time.Millisecond, DecodePerToken: 50 * time.Millisecond}, TimeScale: 1,
	}})
	m := newMeta("slow", "sess-r", testenv.PromptTokens(11, 200))
	m.SamplingParams.MaxTokens = 10
	env.sendMeta(m)
	receipts := func() map[int]bool {
		out := map[int]bool{}
		for _, msg := range env.rec.all() {
			if msg.Subject != env.subj.Done(testSchedID) {
				continue
			}
			if r, err := messages.DecodeRankResult(msg.Data); err == nil && r.ReqID == "slow" && r.Received {
				out[r.TPRank] = true
			}
		}
		return out
	}
	testenv.Eventually(t, waitFor, "the driver's receipt", func() bool { return receipts()[0] })
	// While it prefills (200 tokens at 1 ms), the driver reports it queued.
	sawQueued := false
	for _, hb := range env.heartbeats(0) {
		if hb.InflightRequests == 1 && hb.QueuedPrefillTokens == 200 {
			sawQueued = true
		}
	}
	if !sawQueued {
		t.Error("no driver heartbeat reported 1 request in flight with 200 tokens to prefill")
	}
	env.resultsByRank("slow")
	testenv.Eventually(t, waitFor, "the driver's load back to zero", func() bool {
		hbs := env.heartbeats(0)
		last := hbs[len(hbs)-1]
		return last.InflightRequests == 0 && last.QueuedPrefillTokens == 0 && last.PrefillingTokens == 0 && last.PrefillingUs == 0
	})
	// Heartbeats every 20 ms during the 200 ms prefill: the time the engine
	// has been on it grows from one to the next.
	var prefilling []int64
	for _, hb := range env.heartbeats(0) {
		if hb.PrefillingTokens == 200 {
			prefilling = append(prefilling, hb.PrefillingUs)
		}
	}
	if len(prefilling) < 2 || !slices.IsSorted(prefilling) || prefilling[len(prefilling)-1] <= prefilling[0] {
		t.Errorf("prefilling_us of the heartbeats during the prefill = %v, want a rising series", prefilling)
	}
	var prefillUs int64 = -1
	for _, msg := range env.rec.all() {
		if r, err := messages.DecodeRankResult(msg.Data); msg.Subject == env.subj.Done(testSchedID) && err == nil && r.Prefilled {
			prefillUs = r.PrefillUs
		}
	}
	// Timers never fire early: 200 tokens at 1 ms took at least 200 ms.
	if prefillUs < 200_000 {
		t.Errorf("the prefill report's prefill_us = %d, want >= 200000 (200 tokens at 1 ms)", prefillUs)
	}
}

// TestSlowRankHandsOffAfterItsDriverLeft: when the whole group drains and
// rank 1 finishes its saves after the driver handed off and exited, rank 1
// still hands off by the plan it received, so the target holds whole

// takeHandoffs answers the hand-offs sent on subject as a target that
// stores every block, after delay, and tells seen how many blocks each one
// carried.
func takeHandoffs(t *testing.T, nc *nats.Conn, subject string, delay time.Duration, seen func(blocks int)) {
	t.Helper()
	if _, err := nc.Subscribe(subject, func(m *nats.Msg) {
		h, err := messages.DecodeHandoff(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		n := 0
		for _, run := range h.Runs {
			n += len(run.BlockHashes)
		}
		seen(n)
		answer := func() {
			data, _ := messages.Marshal(&messages.HandoffResult{Stored: n})
			_ = m.Respond(data)
		}
		if delay == 0 {
			answer()
			return
		}
		go func() { time.Sleep(delay); answer() }()
	}); err != nil {
		t.Fatal(err)
	}
}

// prefixes on every rank.
func TestSlowRankHandsOffAfterItsDriverLeft(t *testing.T) {
	env := startRanks(t, rankEnvConfig{drainHandoff: 1 << 20, storeDelay: map[int]time.Duration{1: 500 * time.Millisecond}})
	// g1 (two ranks) is ready and takes whatever is handed to it.
	var got [2]atomic.Int64
	for r := range 2 {
		takeHandoffs(t, env.nc, env.subj.Handoff("g1", r), 0, func(n int) { got[r].Add(int64(n)) })
	}
	defer env.readyGroups("g1")()
	env.sendMeta(newMeta("a", "s", testenv.PromptTokens(1, 4*blockSize+1)))
	env.resultsByRank("a")
	// The driver answers b at once; rank 1 saves it 500 ms later, after
	// the driver has handed off and exited.
	env.sendMeta(newMeta("b", "s2", testenv.PromptTokens(2, 4*blockSize+1)))
	env.finalOutput("b")
	env.stop()
	if a, b := got[0].Load(), got[1].Load(); a != 8 || b != a {
		t.Errorf("blocks handed to g1: rank 0 %d, rank 1 %d; want 8 each (two sessions of 4 blocks)", a, b)
	}
}

// TestHandoffsFromTwoGroupsAtOnce: two groups drain at once and hand off to
// the same rank. Each source takes readDelay to answer its pool reads; the
// target takes both hand-offs at once, so each answer comes within about
// readDelay, inside its sender's wait, not one after the other.
func TestHandoffsFromTwoGroupsAtOnce(t *testing.T) {
	const readDelay = 400 * time.Millisecond
	env := startRanks(t, rankEnvConfig{})
	for _, src := range []string{"g8", "g9"} { // the draining groups' rank 0: slow, and it lost the blocks
		if _, err := env.nc.Subscribe(env.subj.Pool(src, 0), func(m *nats.Msg) {
			go func() {
				time.Sleep(readDelay)
				data, _ := messages.Marshal(&messages.PoolPart{Part: 0, Parts: 1})
				_ = m.Respond(data)
			}()
		}); err != nil {
			t.Fatal(err)
		}
	}
	type answer struct {
		res  *messages.HandoffResult
		err  error
		took time.Duration
	}
	answers := make(chan answer, 2)
	for _, src := range []string{"g8", "g9"} {
		go func() {
			data, _ := messages.Marshal(&messages.Handoff{Model: testModel, TPRank: 0, Source: src, BlockSize: blockSize,
				Runs: []messages.HandoffRun{{Session: "s-" + src, BlockHashes: messages.BlockHashes{1, 2, 3}}}})
			start := time.Now()
			reply, err := env.nc.Request(env.subj.Handoff(testGroup, 0), data, readDelay*7/4) // a sender's wait
			if err != nil {
				answers <- answer{err: err, took: time.Since(start)}
				return
			}
			res := &messages.HandoffResult{}
			err = messages.Unmarshal(reply.Data, res)
			answers <- answer{res: res, err: err, took: time.Since(start)}
		}()
	}
	for range 2 {
		a := <-answers
		switch {
		case a.err != nil:
			t.Errorf("a hand-off got no answer within its sender's wait: %v after %s", a.err, a.took)
		case a.res.Error != "" || a.res.Failed != 3 || a.res.Stored != 0:
			t.Errorf("hand-off result %+v, want 3 failed (the source had lost them)", a.res)
		case a.took < readDelay:
			t.Errorf("answered in %s, before the source's read (%s) could have: the slow source did not take effect", a.took, readDelay)
		}
	}
}

// TestHandoffWithAnImpossibleBlockSizeIsRefused: a hand-off whose
// block_size makes a block larger than the pool carries is refused, its
// blocks not read. block_size 2^62 made the block's byte size overflow to 0:
// the rank "copied" every block, even ones the source never held, as
// empty values under the real blocks' keys, and announced them stored; its
// own saves of those blocks then found the keys taken and skipped them.
func TestHandoffWithAnImpossibleBlockSizeIsRefused(t *testing.T) {
	env := startRanks(t, rankEnvConfig{})
	if _, err := env.nc.Subscribe(env.subj.Pool("g8", 0), func(m *nats.Msg) {
		data, _ := messages.Marshal(&messages.PoolPart{Part: 0, Parts: 1}) // it holds none of them
		_ = m.Respond(data)
	}); err != nil {
		t.Fatal(err)
	}
	for _, bs := range []int{1 << 62, 1 << 40, messages.MaxPoolBlockBytes} {
		data, _ := messages.Marshal(&messages.Handoff{Model: testModel, TPRank: 0, Source: "g8", BlockSize: bs,
			Runs: []messages.HandoffRun{{Session: "s", BlockHashes: messages.BlockHashes{1, 2, 3}}}})
		reply, err := env.nc.Request(env.subj.Handoff(testGroup, 0), data, 5*time.Second)
		if err != nil {
			t.Fatalf("block_size %d: no answer: %v", bs, err)
		}
		res := &messages.HandoffResult{}
		if err := messages.Unmarshal(reply.Data, res); err != nil {
			t.Fatal(err)
		}
		if res.Stored != 0 || !strings.Contains(res.Error, "block_size") {
			t.Errorf("block_size %d: %+v, want nothing stored and an error naming block_size", bs, res)
		}
	}
}

// TestDrainHandsOffToEveryTargetAtOnce: a draining group's rank asks all
// its targets at once, so the hand-off takes one target's time, not the sum
// (one --shutdown-timeout at most, as the README says, however many targets).
func TestDrainHandsOffToEveryTargetAtOnce(t *testing.T) {
	const answerDelay = time.Second
	env := startRanks(t, rankEnvConfig{drainHandoff: 1 << 20})
	var got sync.Map // target group -> blocks handed to its rank 0
	for _, g := range []string{"g1", "g2"} {
		for r := range 2 {
			// answerDelay: a target copying a large hand-off.
			takeHandoffs(t, env.nc, env.subj.Handoff(g, r), answerDelay, func(n int) {
				if r == 0 {
					got.Store(g, n)
				}
			})
		}
	}
	defer env.readyGroups("g1", "g2")()
	env.sendMeta(newMeta("a", "s", testenv.PromptTokens(1, 4*blockSize+1)))
	env.finalOutput("a")
	env.sendMeta(newMeta("b", "s2", testenv.PromptTokens(2, 4*blockSize+1)))
	env.finalOutput("b")
	env.resultsByRank("b")
	env.stop()
	for _, g := range []string{"g1", "g2"} {
		if n, _ := got.Load(g); n != 4 {
			t.Errorf("%s was handed %v blocks, want one session's 4 (the plan spreads two sessions over two targets)", g, n)
		}
	}
	done := env.logs.Lines(`msg="drain hand-off done"`)
	if len(done) != 2 {
		t.Fatalf("%d ranks logged their hand-off done, want 2: %v", len(done), done)
	}
	for _, l := range done {
		var ms int
		if i := strings.Index(l, "took_ms="); i >= 0 {
			fmt.Sscanf(l[i+len("took_ms="):], "%d", &ms)
		}
		if ms < int(answerDelay.Milliseconds()) || ms > int(answerDelay.Milliseconds())*3/2 {
			t.Errorf("hand-off took %d ms with two targets answering after %s each; want about one answer's time: %s", ms, answerDelay, l)
		}
	}
}

// TestDrainedRankWaitsForItsGroupsHandOffs: a draining group's ranks each
// hand off their shard of the same blocks to the same rank of the target;
// one rank whose target takes longer must not leave the others to exit
// meanwhile. A rank's exit clears its shard of every block from the index
// (AllBlocksCleared), and until the slow target rank holds its copies
// the draining group is the only one whose ranks all hold the prefix: a
// next turn placed in between recomputed it. Rank 0's target answers at
// once and rank 1's after a second: rank 0 clears its blocks only after
// rank 1's hand-off is answered. Before, rank 0 exited at once, a second
// before.
func TestDrainedRankWaitsForItsGroupsHandOffs(t *testing.T) {
	const slow = time.Second
	env := startRanks(t, rankEnvConfig{drainHandoff: 1 << 20})
	var slowAnswered atomic.Int64 // unix ns when rank 1's target answered
	takeHandoffs(t, env.nc, env.subj.Handoff("g1", 0), 0, func(int) {})
	if _, err := env.nc.Subscribe(env.subj.Handoff("g1", 1), func(m *nats.Msg) {
		go func() {
			time.Sleep(slow)
			data, _ := messages.Marshal(&messages.HandoffResult{Stored: 4})
			slowAnswered.Store(time.Now().UnixNano())
			_ = m.Respond(data)
		}()
	}); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var cleared []time.Time // rank 0's AllBlocksCleared, as received
	if _, err := env.nc.Subscribe(env.subj.KV(testGroup, 0), func(m *nats.Msg) {
		batch, err := messages.DecodeKVEventBatch(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		for _, ev := range batch.Events {
			if ev.Type == messages.EventAllBlocksCleared {
				mu.Lock()
				cleared = append(cleared, time.Now())
				mu.Unlock()
			}
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := env.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	defer env.readyGroups("g1")()
	env.sendMeta(newMeta("a", "s", testenv.PromptTokens(1, 4*blockSize+1)))
	env.finalOutput("a")
	env.resultsByRank("a")
	env.stop()
	if len(env.logs.Lines(`msg="drain hand-off: blocks handed to a group"`, "target_group=g1")) != 2 {
		t.Fatalf("not both ranks handed off to g1 (the fault did not take effect): %v", env.logs.Lines("drain hand-off"))
	}
	answered := slowAnswered.Load()
	if answered == 0 {
		t.Fatal("rank 1's target was never asked")
	}
	testenv.Eventually(t, waitFor, "rank 0's last AllBlocksCleared received", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(cleared) > 0 // the one it exits with (it started before this subscription)
	})
	mu.Lock()
	last := cleared[len(cleared)-1]
	mu.Unlock()
	if early := time.Unix(0, answered).Sub(last); early > 0 {
		t.Errorf("rank 0 cleared its blocks %s before rank 1's hand-off was answered: no group held the prefix whole meanwhile", early)
	}
}

// TestQueueDepthAfterModelMismatch: a ReqMeta of another model is refused;
// the rank's queue-depth gauge comes back to 0. Before, each such refusal
// took it one lower, for good (the worker's stop message then counted
// requests in flight wrong).
func TestQueueDepthAfterModelMismatch(t *testing.T) {
	env := startRanks(t, rankEnvConfig{})
	for i := range 3 {
		m := newMeta(fmt.Sprint("other-model-", i), "sess", testenv.PromptTokens(2, 40))
		m.Model = "another-model"
		env.sendMeta(m)
		for r, res := range env.resultsByRank(m.ReqID) {
			if res.ErrorCode != "model_mismatch" {
				t.Fatalf("rank %d: %+v; want model_mismatch (the fault did not take effect)", r, res)
			}
		}
	}
	for r := range worldSize {
		if depth := testenv.GaugeSum(t, env.reg, "kvbus_worker_queue_depth", map[string]string{"tp_rank": fmt.Sprint(r)}); depth != 0 {
			t.Errorf("rank %d: kvbus_worker_queue_depth = %v after 3 refused ReqMetas, want 0", r, depth)
		}
	}
}

// TestOverloadedResultAnsweredAgain: a rank refuses a ReqMeta with
// "overloaded" (its load queue is full). A scheduler replica that takes
// the request over (or sends it again because the result was lost) sends
// the same attempt again, to its own result subject: the ranks answer it
// again, as they do every other finished request. Before, they remembered
// no result for it and said nothing, and the replica waited for its
// deadline.
func TestOverloadedResultAnsweredAgain(t *testing.T) {
	env := startRanks(t, rankEnvConfig{saveWait: 500 * time.Millisecond, queueSize: 1})
	otherDone := env.subj.Done("sched-other")
	var mu sync.Mutex
	var again []*messages.RankResult
	if _, err := env.nc.Subscribe(otherDone, func(m *nats.Msg) {
		if r, err := messages.DecodeRankResult(m.Data); err == nil && r.ReqID == "over" && !r.Received && !r.Prefilled {
			mu.Lock()
			again = append(again, r)
			mu.Unlock()
		}
	}); err != nil {
		t.Fatal(err)
	}
	blockLoadThread(t, env)
	time.Sleep(50 * time.Millisecond) // the load thread holds the blocker
	env.sendMeta(newMeta("queued", "sq", testenv.PromptTokens(2, 2*blockSize)))
	over := newMeta("over", "so", testenv.PromptTokens(3, 2*blockSize))
	env.sendMeta(over)
	for r, res := range env.resultsByRank("over") {
		if res.ErrorCode != "overloaded" {
			t.Fatalf("rank %d: %+v; want overloaded (the queue was not full: the fault did not take effect)", r, res)
		}
	}
	// Another scheduler replica asks again, to its own subject.
	over.ResultSubject = otherDone
	env.sendMeta(over)
	testenv.Eventually(t, waitFor, "every rank's result sent again to the other replica", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(again) >= worldSize
	})
	mu.Lock()
	defer mu.Unlock()
	for _, r := range again {
		if r.ErrorCode != "overloaded" {
			t.Errorf("rank %d answered again %+v; want its overloaded result", r.TPRank, r)
		}
	}
}

// TestLoadWaitsForTheSaverAfterAnAbortedOne: two requests of one prompt
// (a regenerated turn) both save its blocks; the first is aborted and
// saves nothing. The next turn reaches rank 1 while its store thread is
// still saving the second: its load waits for that save and loads the
// whole prefix. Before, only the first saver was recorded per block, the
// second's save was waited for by nobody, and rank 1 recomputed all 4
// blocks of the previous turn.
func TestLoadWaitsForTheSaverAfterAnAbortedOne(t *testing.T) {
	env := startRanks(t, rankEnvConfig{storeDelay: map[int]time.Duration{1: 300 * time.Millisecond}, saveWait: 3 * time.Second})
	prompt := testenv.PromptTokens(9, 4*blockSize+3)
	env.sendMeta(newMeta("turn-1a", "sess-r", prompt))
	env.sendMeta(newMeta("turn-1b", "sess-r", prompt))
	env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: "turn-1a", Reason: "client disconnected"})
	env.finalOutput("turn-1b")
	next := newMeta("turn-2", "sess-r", append(slices.Clone(prompt), testenv.PromptTokens(10, 2*blockSize)...))
	next.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 4 * blockSize, CanLoad: true}
	next.SaveFromBlock = 4
	env.sendMeta(next) // the driver answered turn-1b; rank 1 is still saving it
	for rank, r := range env.resultsByRank("turn-2") {
		if r.LoadedTokens != 4*blockSize || r.FailedBlocks != 0 {
			t.Errorf("rank %d: loaded %d tokens, failed_blocks %d; want %d, 0", rank, r.LoadedTokens, r.FailedBlocks, 4*blockSize)
		}
	}
	// The fault took effect: rank 1 saved nothing of the first.
	for _, r := range env.results("turn-1a") {
		if r.TPRank == 1 && r.StoredBlocks != 0 {
			t.Errorf("rank 1 stored %d blocks of the aborted turn-1a; want 0 (the abort came too late to test anything)", r.StoredBlocks)
		}
	}
}

// TestAbortDropsSavesTheStoreThreadHasNotBegun: a request aborted while it
// waits for a busy store thread will save nothing, and a later load of its
// blocks (the client's retry of the prompt) does not wait for the store
// thread to reach it only to find them missing. Before, the aborted
// request's saves stayed registered until then, and rank 1's load of the
// retry waited behind two slow saves (~800 ms here; up to --save-wait),
// holding every request behind it in the load queue.
func TestAbortDropsSavesTheStoreThreadHasNotBegun(t *testing.T) {
	const delay = 400 * time.Millisecond
	env := startRanks(t, rankEnvConfig{storeDelay: map[int]time.Duration{1: delay}, saveWait: 3 * time.Second})
	env.sendMeta(newMeta("busy", "sess-b", testenv.PromptTokens(11, 4*blockSize+3))) // rank 1's store thread sleeps on it
	prompt := testenv.PromptTokens(12, 4*blockSize+3)
	env.sendMeta(newMeta("left", "sess-l", prompt))
	env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: "left", Reason: messages.AbortReasonClientGone})
	testenv.Eventually(t, waitFor, "the abort handled", func() bool {
		return env.counter("kvbus_bus_messages_total", map[string]string{"handler": "worker_abort"}) >= worldSize
	})
	retry := newMeta("retry", "sess-l", prompt)
	retry.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 4 * blockSize, CanLoad: true} // as the aborted request's save plan says
	retry.SaveFromBlock = 4
	env.sendMeta(retry)
	r := env.resultsByRank("retry")[1]
	if wait := time.Duration(r.LoadUs) * time.Microsecond; wait >= delay/2 {
		t.Errorf("rank 1's load of the retry took %s (loaded %d tokens, failed_blocks %d): it waited for the saves of the aborted request, want < %s",
			wait, r.LoadedTokens, r.FailedBlocks, delay/2)
	}
	if left := env.resultsByRank("left")[1]; left.StoredBlocks != 0 {
		t.Errorf("rank 1 stored %d blocks of the aborted request; want 0 (the abort came too late to test anything)", left.StoredBlocks)
	}
}

// bigAnswerEngine answers every request with one chunk whose raw JSON (a
// model server's answer) is size bytes of text.
type bigAnswerEngine struct {
	size int
	last bool // the chunk is marked the answer's last (sent with its finish reason)
	text bool // the chunk carries the answer's text too, as OpenAIEngine's does
}

func (e bigAnswerEngine) body() string {
	return `{"choices":[{"index":0,"text":"` + strings.Repeat("x", e.size) + `","finish_reason":"stop"}]}`
}

func (e bigAnswerEngine) Generate(ctx context.Context, req workers.EngineRequest, prefilled func(), emit func(workers.Chunk) error) (workers.EngineResult, error) {
	if prefilled != nil {
		prefilled()
	}
	text := "x"
	if e.text {
		text = strings.Repeat("x", e.size)
	}
	if err := emit(workers.Chunk{Text: text, Raw: []byte(e.body()), Last: e.last}); err != nil {
		return workers.EngineResult{}, err
	}
	return workers.EngineResult{FinishReason: workers.FinishStop, CompletionTokens: 1}, nil
}

// TestDriverEndsAnAnswerTooLargeForTheBus proves that a stream's chunk
// above the NATS server's max payload (one server-sent event, which cannot
// be split) ends the request with an error naming the limit, in order on
// the output stream. It failed before: its publish failed and was only
// logged, the output stream skipped an index, and the frontend, taking the
// answer for lost on the bus, had the engine run the whole request again,
// up to three times, before the client got output_lost.
func TestDriverEndsAnAnswerTooLargeForTheBus(t *testing.T) {
	srvLimit := int(testenv.Connect(t, testenv.StartNATS(t)).MaxPayload())
	for _, last := range []bool{false, true} {
		t.Run(fmt.Sprint("last=", last), func(t *testing.T) {
			env := startRanks(t, rankEnvConfig{customEngine: bigAnswerEngine{size: srvLimit, last: last}})
			meta := newMeta("big", "sess", testenv.PromptTokens(1, 40))
			meta.Stream = true
			env.sendMeta(meta)
			final := env.finalOutput("big")
			if final.Index != 0 || final.Error == nil || final.Error.Code != "engine_error" || !strings.Contains(final.Error.Message, "max payload") {
				t.Fatalf("final output %+v (error %+v), want output 0 ending with an engine_error naming the bus's max payload", final, final.Error)
			}
			if n := len(env.logs.Lines("publish failed")); n != 0 {
				t.Errorf("%d publishes failed", n)
			}
		})
	}
}

// TestDriverSplitsAWholeAnswerTooLargeForTheBus: an engine's whole (not
// streamed) answer of 2.5 times the NATS server's max payload (logprobs of
// a long answer, n > 1) goes out in three outputs, each within the limit,
// the last with the finish reason, and their bodies put together are the
// engine's answer, byte for byte. Before, it ended with an engine_error
// naming the max payload, where vLLM answers it directly: 1 MiB, a stock
// nats-server's limit, is a few thousand tokens with top logprobs.
func TestDriverSplitsAWholeAnswerTooLargeForTheBus(t *testing.T) {
	srvLimit := int(testenv.Connect(t, testenv.StartNATS(t)).MaxPayload())
	// last: the engine marks its answer's last chunk (sent with the
	// finish reason), or does not (the OpenAI engine's whole answer).
	for _, last := range []bool{false, true} {
		t.Run(fmt.Sprint("last=", last), func(t *testing.T) {
			engine := bigAnswerEngine{size: srvLimit * 5 / 2, last: last}
			env := startRanks(t, rankEnvConfig{customEngine: engine})
			env.sendMeta(newMeta("big", "sess", testenv.PromptTokens(1, 40)))
			outs := env.wholeAnswer("big", engine)
			for _, o := range outs {
				if data, err := messages.Marshal(o); err != nil || len(data) > srvLimit {
					t.Fatalf("output %d: %d bytes on the bus (%v); the max payload is %d", o.Index, len(data), err, srvLimit)
				}
			}
			if len(outs) < 3 {
				t.Fatalf("%d outputs carried the answer; want 3 or more", len(outs))
			}
		})
	}
}

// TestDriverSendsAWholeAnswerWhoseBodyAloneFits: an engine's whole answer
// whose body fits in one message, but not with its text beside it (as
// OpenAIEngine reads it: 5 MiB of text on kvbus nats's 8 MiB), goes as one
// output carrying the body alone. splitAnswer made no part of it and
// returned nil, which its caller took for "cannot be split": the client
// got a 500 engine_error naming the max payload.
func TestDriverSendsAWholeAnswerWhoseBodyAloneFits(t *testing.T) {
	for _, last := range []bool{false, true} {
		t.Run(fmt.Sprint("last=", last), func(t *testing.T) {
			engine := bigAnswerEngine{size: 5 << 20, text: true, last: last}
			env := startRanks(t, rankEnvConfig{customEngine: engine})
			env.sendMeta(newMeta("big", "sess", testenv.PromptTokens(1, 40)))
			env.wholeAnswer("big", engine)
		})
	}
}

// TestDriverSplitsAtTheDecodersLimit: on a NATS server whose max_payload
// is above messages.MaxMessageBytes (an external server's may be 64 MiB),
// an engine's whole answer (5 MiB, with its text beside it as
// OpenAIEngine reads it) goes in outputs every decoder takes. It went as
// one output of 10 MiB, which the server passed and the frontend's
// decoder refused: the answer was lost on the bus.
func TestDriverSplitsAtTheDecodersLimit(t *testing.T) {
	engine := bigAnswerEngine{size: 5 << 20, text: true}
	env := startRanks(t, rankEnvConfig{customEngine: engine, maxPayload: 16 << 20})
	env.sendMeta(newMeta("big", "sess", testenv.PromptTokens(1, 40)))
	env.wholeAnswer("big", engine) // every output decoded
}

// wholeAnswer waits for reqID's outputs, in order, the last ending the
// answer, checks that the bodies they carry put together are engine's
// answer, and returns them.
func (e *rankEnv) wholeAnswer(reqID string, engine bigAnswerEngine) []*messages.Output {
	e.t.Helper()
	if final := e.finalOutput(reqID); final.Error != nil || final.FinishReason != workers.FinishStop {
		e.t.Fatalf("final output (error %+v), want the answer's end", final.Error)
	}
	outs := e.outputs(reqID)
	var body []byte
	for _, o := range outs {
		body = append(body, o.Raw...)
	}
	if string(body) != engine.body() {
		e.t.Fatalf("the outputs carried %d bytes; want the engine's %d-byte answer", len(body), len(engine.body()))
	}
	return outs
}

// bigErrorEngine refuses every request with an *EngineError whose body is
// size bytes.
type bigErrorEngine struct{ size int }

func (e bigErrorEngine) Generate(context.Context, workers.EngineRequest, func(), func(workers.Chunk) error) (workers.EngineResult, error) {
	body := `{"error":{"message":"Input should be a valid string","type":"BadRequestError","code":400,"input":"` + strings.Repeat("x", e.size) + `"}}`
	return workers.EngineResult{}, &workers.EngineError{Status: 400, Body: []byte(body)}
}

// TestDriverRelaysAnEngineErrorTooLargeForTheBus proves that an engine's
// error whose body is above the NATS server's max payload (a validation
// error echoing a huge input) still ends the request, with the engine's
// status and message. It failed before: its publish failed and was only
// logged, and the client waited for --request-timeout.
func TestDriverRelaysAnEngineErrorTooLargeForTheBus(t *testing.T) {
	srvLimit := int(testenv.Connect(t, testenv.StartNATS(t)).MaxPayload())
	env := startRanks(t, rankEnvConfig{customEngine: bigErrorEngine{size: srvLimit}})
	env.sendMeta(newMeta("bigerr", "sess", testenv.PromptTokens(1, 40)))
	final := env.finalOutput("bigerr")
	if final.Index != 0 || final.Error == nil || final.Error.Code != "engine_error" || final.Error.Status != 400 ||
		!strings.Contains(final.Error.Message, "Input should be a valid string") || len(final.Error.Raw) != 0 {
		t.Fatalf("final output %+v (error %+v), want output 0 ending with the engine's 400 and message, without its body", final, final.Error)
	}
}

// timeoutEngine fails every request as the engine's --engine-timeout does.
type timeoutEngine struct{}

func (timeoutEngine) Generate(context.Context, workers.EngineRequest, func(), func(workers.Chunk) error) (workers.EngineResult, error) {
	return workers.EngineResult{}, fmt.Errorf("%w (1s): %w", workers.ErrEngineTimeout, context.DeadlineExceeded)
}

// TestDriverNamesTheEngineTimeout: the client of a request that outlived
// --engine-timeout is told so (a timeout, 504), not that its own deadline
// passed during generation, which its deadline had not.
func TestDriverNamesTheEngineTimeout(t *testing.T) {
	env := startRanks(t, rankEnvConfig{customEngine: timeoutEngine{}})
	env.sendMeta(newMeta("slow", "sess", testenv.PromptTokens(1, 40)))
	final := env.finalOutput("slow")
	if final.Error == nil || final.Error.Code != "timeout" || !strings.Contains(final.Error.Message, "--engine-timeout") {
		t.Fatalf("final output %+v (error %+v), want a timeout naming --engine-timeout", final, final.Error)
	}
}

// TestDriverSendsAnAnswerThatDoesNotStreamWhole: the answer of a request
// that does not stream, from an engine that paces its tokens (the sim at
// --time-scale > 0), goes out in two outputs — the first token at once,
// its time to first token, and the rest with the finish reason — whose
// text and token ids are those of the same request streamed, byte for
// byte; on a bus whose messages hold only part of it, in as many outputs
// as it takes, each within the limit. It went out one output per token
// (40 here, 1,000 below), a message on the bus and in the frontend each.
func TestDriverSendsAnAnswerThatDoesNotStreamWhole(t *testing.T) {
	for _, tt := range []struct {
		name       string
		maxPayload int32
		tokens     int
		outputs    func(n int) bool
	}{
		{"whole", 0, 40, func(n int) bool { return n == 2 }},
		{"in parts", 4 << 10, 1000, func(n int) bool { return n >= 3 && n <= 6 }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			env := startRanks(t, rankEnvConfig{maxPayload: tt.maxPayload, engine: workers.SimConfig{
				Profile: workers.SimProfile{DecodePerToken: 100 * time.Microsecond}, TimeScale: 1,
			}})
			answer := func(id string, stream bool) (string, messages.TokenIDs, []*messages.Output) {
				m := newMeta(id, "sess", testenv.PromptTokens(1, 40))
				m.Stream = stream
				m.SamplingParams.MaxTokens = tt.tokens
				env.sendMeta(m)
				if f := env.finalOutput(id); f.FinishReason != workers.FinishLength || f.Usage == nil || f.Usage.CompletionTokens != tt.tokens {
					t.Fatalf("%s: final output %+v, want the answer's end after %d tokens", id, f, tt.tokens)
				}
				var text strings.Builder
				var ids messages.TokenIDs
				outs := env.outputs(id)
				for _, o := range outs {
					text.WriteString(o.Text)
					ids = append(ids, o.TokenIDs...)
					if data, err := messages.Marshal(o); err != nil || tt.maxPayload > 0 && len(data) > int(tt.maxPayload) {
						t.Fatalf("%s: output %d takes %d bytes on the bus (%v); the max payload is %d", id, o.Index, len(data), err, tt.maxPayload)
					}
				}
				return text.String(), ids, outs
			}
			streamedText, streamedIDs, streamed := answer("streamed", true)
			text, ids, outs := answer("whole", false)
			if len(streamed) != tt.tokens+1 {
				t.Fatalf("the streamed answer came in %d outputs; want one per token and the finish, %d: the engine does not pace its tokens", len(streamed), tt.tokens+1)
			}
			if !tt.outputs(len(outs)) {
				t.Errorf("the answer that does not stream came in %d outputs", len(outs))
			}
			if len(outs[0].TokenIDs) != 1 {
				t.Errorf("its first output carries %d token ids; want the first token alone, sent at once", len(outs[0].TokenIDs))
			}
			if text != streamedText || !slices.Equal(ids, streamedIDs) {
				t.Errorf("the answer that does not stream: %d bytes of text and %d token ids; want the streamed answer's %d and %d, the same", len(text), len(ids), len(streamedText), len(streamedIDs))
			}
		})
	}
}

// TestDriverSendsAHeldAnswerEverySecond: the answer of a request that does
// not stream, held by its driver for its last output, goes out at least
// once a second while the engine gives tokens (3.5 s of them here): in a
// few outputs, none after a silence near the 3 s after a NATS reconnect in
// which a frontend that hears nothing takes an answer for lost. Held whole,
// it was silent from its first token to its last, and across a NATS
// restart the frontend asked its driver about it; with --stream-replay 0,
// which no driver answers, it published the request again and the answer
// was computed twice.
func TestDriverSendsAHeldAnswerEverySecond(t *testing.T) {
	env := startRanks(t, rankEnvConfig{engine: workers.SimConfig{
		Profile: workers.SimProfile{DecodePerToken: 10 * time.Millisecond}, TimeScale: 1,
	}})
	var mu sync.Mutex
	var at []time.Time
	sub, err := env.nc.Subscribe(env.subj.Out(testFrontend), func(*nats.Msg) {
		mu.Lock()
		at = append(at, time.Now())
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := env.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	m := newMeta("long", "sess", testenv.PromptTokens(1, 40))
	m.SamplingParams.MaxTokens = 350
	env.sendMeta(m)
	if f := env.finalOutput("long"); f.FinishReason != workers.FinishLength || f.Usage.CompletionTokens != 350 {
		t.Fatalf("final output %+v, want the answer's end after 350 tokens", f)
	}
	mu.Lock()
	defer mu.Unlock()
	var longest time.Duration
	for i := 1; i < len(at); i++ {
		longest = max(longest, at[i].Sub(at[i-1]))
	}
	if took := at[len(at)-1].Sub(at[0]); longest > 2*time.Second || len(at) < 3 || len(at) > 8 {
		t.Errorf("the answer (%v from its first output to its last) came in %d outputs, %v apart at most; want a few, at most ~1 s apart",
			took.Round(time.Millisecond), len(at), longest.Round(time.Millisecond))
	}
}

// TestDrainHandsOffBesideItsReplacements: an upgrade stops a group's ranks
// and starts their new processes at once, which send heartbeats on the
// same subjects as the draining ones, not draining and holding nothing.
// The draining group still hands its blocks off, every rank of it: the
// hand-off follows its group's heartbeats by process. Before, a
// replacement's heartbeat took the place of its predecessor's, and the
// driver found "only part of the group is stopping" (in a test that
// replaced a group in place, 1 run of 4 handed nothing off).
func TestDrainHandsOffBesideItsReplacements(t *testing.T) {
	env := startRanks(t, rankEnvConfig{drainHandoff: 1 << 20})
	var handed sync.Map // rank -> blocks handed to g1's rank
	for r := range 2 {
		takeHandoffs(t, env.nc, env.subj.Handoff("g1", r), 0, func(n int) { handed.Store(r, n) })
	}
	defer env.readyGroups("g1")()
	replacements := make(chan struct{})
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(replacements)
	started := time.Now().Add(time.Hour).UnixMilli() // not a draining process's
	wg.Go(func() {
		for {
			for r := range 2 {
				data, _ := messages.Marshal(&messages.Heartbeat{Group: testGroup, TPRank: r, WorldSize: 2, Model: testModel,
					CapacityBlocks: 1000, StartedUnixMs: started})
				_ = env.nc.Publish(env.subj.Heartbeat(testGroup, r), data)
			}
			select {
			case <-replacements:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	})
	env.sendMeta(newMeta("a", "s", testenv.PromptTokens(1, 4*blockSize+1)))
	env.finalOutput("a")
	env.resultsByRank("a")
	env.stop()
	for r := range 2 {
		if n, _ := handed.Load(r); n != 4 {
			t.Errorf("rank %d handed %v blocks to g1 beside its replacement, want its 4: %v", r, n, env.logs.Lines("drain hand-off"))
		}
	}
}

// TestDriverReportsAWholeAnswersPrefillAsSent: behind a model server, a
// request that does not stream leaves the driver's prefill queue as it is
// sent: while the engine takes its time over the whole answer, the driver's
// heartbeats report nothing queued, and its prefill report says no prefill
// time (the engine tells none), so that no scheduler learns a pace from it.
// Before, the prompt's tokens stayed queued until the answer came, and the
// report's prefill_us was the whole generation.
func TestDriverReportsAWholeAnswersPrefillAsSent(t *testing.T) {
	const generation = 800 * time.Millisecond
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			return
		}
		time.Sleep(generation)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":200,"completion_tokens":1}}`)
	}))
	t.Cleanup(srv.Close)
	engine, err := workers.NewOpenAIEngine(workers.OpenAIConfig{URL: srv.URL, HealthInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	env := startRanks(t, rankEnvConfig{customEngine: engine}) // the driver watches its health
	testenv.Eventually(t, waitFor, "the engine healthy", func() bool { ok, _ := engine.Healthy(); return ok })
	m := newMeta("whole", "sess-w", testenv.PromptTokens(12, 200))
	m.Endpoint, m.Body = messages.EndpointCompletions, []byte(`{"model":"m","prompt":"hi"}`)
	start := time.Now()
	env.sendMeta(m)
	testenv.Eventually(t, waitFor, "the prefill report", func() bool {
		for _, msg := range env.rec.all() {
			if r, err := messages.DecodeRankResult(msg.Data); err == nil && r.ReqID == "whole" && r.Prefilled {
				if r.PrefillUs != 0 {
					t.Errorf("the prefill report's prefill_us = %d, want 0 (the engine tells no prefill time)", r.PrefillUs)
				}
				return true
			}
		}
		return false
	})
	if took := time.Since(start); took >= generation/2 {
		t.Errorf("the prefill was reported %v after the request, want it as the request reached the engine (the answer takes %v)", took, generation)
	}
	testenv.Eventually(t, waitFor, "a heartbeat with nothing queued while the answer is generated", func() bool {
		hbs := env.heartbeats(0)
		last := hbs[len(hbs)-1]
		return last.InflightRequests == 1 && last.QueuedPrefillTokens == 0
	})
	env.resultsByRank("whole")
}

// TestStoreCapacityIsExported: how full a rank's store is takes its
// capacity beside its used bytes. Only kvbus_worker_store_used_bytes was
// exported, so the alert's "stores full" (used bytes at --kv-capacity) could
// not be written in PromQL (a review, every role its own process).
func TestStoreCapacityIsExported(t *testing.T) {
	const capacity = 3 << 20
	env := startRanks(t, rankEnvConfig{capacity: capacity})
	env.sendMeta(newMeta("a", "s", testenv.PromptTokens(1, 4*blockSize+1)))
	env.finalOutput("a")
	env.resultsByRank("a")
	for r := range worldSize {
		rank := map[string]string{"group": testGroup, "tp_rank": fmt.Sprint(r)}
		if got := testenv.GaugeSum(t, env.reg, "kvbus_worker_store_capacity_bytes", rank); got != capacity {
			t.Errorf("rank %d: kvbus_worker_store_capacity_bytes = %v, want %d (--kv-capacity)", r, got, capacity)
		}
		if used := testenv.GaugeSum(t, env.reg, "kvbus_worker_store_used_bytes", rank); used <= 0 || used > capacity {
			t.Errorf("rank %d: kvbus_worker_store_used_bytes = %v after storing 4 blocks, want within (0, %d]", r, used, capacity)
		}
	}
}
