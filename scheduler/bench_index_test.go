package scheduler

// Benchmarks of the KV index and of the scheduler's routing decision.
//
//	go test -run='^$' -bench='Index|Routing' -benchmem ./scheduler
//
// Targets: PrefixMatch ≥ 20,000 lookups/s for an 8,192-token prompt over 8
// groups; ingest ≥ 2,000,000 blocks/s; a routing decision p50 ≤ 100 µs and
// p99 ≤ 1 ms. BenchmarkIndexMemoryPerBlock measures once per run (each
// iteration inserts 1,000,000 blocks × 4 ranks; the default -benchtime runs it
// once, -benchtime=1x makes sure).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

const benchModel = "meta-llama/Llama-3.1-8B"

// benchTokens returns n deterministic token ids that differ by seed (the
// formula of testenv.PromptTokens, which an internal test cannot import).
func benchTokens(seed, n int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32(1 + (seed*1_000_003+i*7919)%128000)
	}
	return p
}

// randomHashes returns n random block hashes.
func randomHashes(rng *rand.Rand, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = rng.Uint64()
	}
	return out
}

func BenchmarkIndexPrefixMatch8kTokens8Groups(b *testing.B) {
	const (
		groups = 8
		ranks  = 4
		others = 100_000 // other blocks every rank of a group holds
	)
	prompt := HashBlocks(nil, HashSeed(benchModel), benchTokens(1, 8192), 16)
	if len(prompt) != 512 {
		b.Fatalf("%d blocks", len(prompt))
	}
	names := make([]string, groups)
	for i := range names {
		names[i] = fmt.Sprint("g", i)
	}
	x := readyIndex(b, ranks, names...)
	rng := rand.New(rand.NewPCG(1, 1))
	for _, g := range names {
		held := append(slices.Clone(prompt), randomHashes(rng, others)...)
		for r := range ranks {
			if x.Apply(kvBatch(g, r, 1, stored(held...))) {
				b.Fatal("dump asked")
			}
		}
	}
	states := make([]GroupState, groups)
	for i, g := range names {
		states[i] = GroupState{Name: g, WorldSize: ranks}
	}
	x.Match(prompt, states)
	for _, s := range states {
		if s.IndexBlocks != 512 {
			b.Fatalf("%s: prefix %d, want 512", s.Name, s.IndexBlocks)
		}
	}
	for b.Loop() {
		x.Match(prompt, states)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "lookups/s")
}

// BenchmarkIndexRemoteRuns8kTokens: the LoadSpec's runs of an 8k-token
// prefix that 3 of 8 groups hold and the chosen one does not: one run of
// 512 blocks, whose two alternates are found by a second walk over it.
func BenchmarkIndexRemoteRuns8kTokens(b *testing.B) {
	const ranks = 4
	prompt := HashBlocks(nil, HashSeed(benchModel), benchTokens(1, 8192), 16)
	names := make([]string, 8)
	for i := range names {
		names[i] = fmt.Sprint("g", i)
	}
	x := readyIndex(b, ranks, names...)
	rng := rand.New(rand.NewPCG(1, 1))
	for i, g := range names {
		held := randomHashes(rng, 100_000)
		if i >= 5 {
			held = append(held, prompt...)
		}
		for r := range ranks {
			if x.Apply(kvBatch(g, r, 1, stored(held...))) {
				b.Fatal("dump asked")
			}
		}
	}
	runs, end := x.RemoteRuns(prompt, "g0", 0, len(prompt), names, nil)
	if end != 512 || len(runs) != 1 || len(runs[0].Alternates) != 2 {
		b.Fatalf("runs %+v, end %d; want one run of 512 blocks with 2 alternates", runs, end)
	}
	for b.Loop() {
		x.RemoteRuns(prompt, "g0", 0, len(prompt), names, nil)
	}
}

func BenchmarkIndexIngest(b *testing.B) {
	const (
		ranks     = 4
		blockSize = 16
		perBatch  = 16   // blocks per BlockStored
		chunk     = 8192 // payloads encoded at a time, with the timer stopped
	)
	x := readyIndex(b, ranks, "g0")
	tokens := benchTokens(2, perBatch*blockSize)
	// Payload i is rank i%4's batch number i/4+1: its seq. The four ranks
	// store the same blocks, as the TP ranks of a group do.
	next := 0
	encode := func() [][]byte {
		out := make([][]byte, chunk)
		for j := range out {
			i := next + j
			k := uint64(i / ranks)
			hashes := make(messages.BlockHashes, perBatch)
			for h := range hashes {
				hashes[h] = k*perBatch + uint64(h) + 1
			}
			parent := k*perBatch - 1
			data, err := messages.Marshal(&messages.KVEventBatch{
				TS: 1, Seq: k + 1, Group: "g0", Rank: i % ranks,
				Events: []messages.KVEvent{{Type: messages.EventBlockStored, BlockHashes: hashes, ParentBlockHash: &parent,
					TokenIDs: tokens, BlockSize: blockSize, Medium: "kvpool"}},
			})
			if err != nil {
				b.Fatal(err)
			}
			out[j] = data
		}
		next += chunk
		return out
	}
	payloads := encode()
	pos, bad := 0, 0
	for b.Loop() {
		if pos == len(payloads) {
			b.StopTimer()
			payloads, pos = encode(), 0
			b.StartTimer()
		}
		batch, err := messages.DecodeKVEventBatch(payloads[pos])
		if err != nil {
			b.Fatal(err)
		}
		if x.Apply(batch) {
			bad++
		}
		pos++
	}
	if bad > 0 {
		b.Fatalf("%d batches found a gap in seq", bad)
	}
	if want := b.N / ranks; x.GroupBlocks("g0") < (want-1)*perBatch {
		b.Fatalf("GroupBlocks = %d after %d batches", x.GroupBlocks("g0"), b.N)
	}
	b.ReportMetric(float64(b.N*perBatch)/b.Elapsed().Seconds(), "blocks/s")
}

func BenchmarkIndexMemoryPerBlock(b *testing.B) {
	const (
		ranks    = 4
		blocks   = 1_000_000
		perBatch = 10_000
	)
	var perBlock float64
	runs := 0
	for b.Loop() {
		b.StopTimer()
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		b.StartTimer()
		x := readyIndex(b, ranks, "g0")
		hashes := make([]uint64, perBatch)
		for r := range ranks {
			for k := range blocks / perBatch {
				for i := range hashes {
					hashes[i] = uint64(k*perBatch+i)*0x9e3779b97f4a7c15 + 1
				}
				x.Apply(kvBatch("g0", r, uint64(k+1), stored(hashes...)))
			}
		}
		b.StopTimer()
		if n := x.GroupBlocks("g0"); n != blocks {
			b.Fatalf("GroupBlocks = %d, want %d", n, blocks)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		runtime.KeepAlive(x)
		perBlock += float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)) / blocks
		runs++
		b.StartTimer()
	}
	b.ReportMetric(perBlock/float64(runs), "bytes/block")
}

// benchMsg is a jetstream.Msg carrying a request, as the consumer would
// deliver it for the first time. Methods onRequest does not use are the
// embedded nil interface's.
type benchMsg struct {
	jetstream.Msg
	data    []byte
	subject string
	acks    int
	naks    int
}

func (m *benchMsg) Data() []byte                     { return m.data }
func (m *benchMsg) Subject() string                  { return m.subject }
func (m *benchMsg) Ack() error                       { m.acks++; return nil }
func (m *benchMsg) Nak() error                       { m.naks++; return nil }
func (m *benchMsg) NakWithDelay(time.Duration) error { m.naks++; return nil }
func (m *benchMsg) Term() error                      { m.naks++; return nil }
func (m *benchMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{NumDelivered: 1}, nil
}

// fakeRank is a worker rank as the scheduler sees it: its KV events and
// its answers to dump requests.
type fakeRank struct {
	mu   sync.Mutex
	seq  uint64
	held []uint64
}

// BenchmarkRoutingDecision times the scheduler's request path from a
// received Request (already tokenised) to its ReqMeta published: decode,
// block hashing, index match over 8 groups, session binding, placement,
// tracker, ReqMeta encode and publish, ack. The index is fed through the
// scheduler's own subscriptions (dumps and KV events from fake ranks).
func BenchmarkRoutingDecision(b *testing.B) { benchRouting(b, 8, 20_000, 100*time.Millisecond) }

// BenchmarkRoutingDecision256Groups is BenchmarkRoutingDecision over 256
// groups of 4 ranks (1,024 GPUs), each holding 2,000 other blocks, each
// rank sending a heartbeat a second (the workers' default).
func BenchmarkRoutingDecision256Groups(b *testing.B) { benchRouting(b, 256, 2_000, time.Second) }

// benchRouting runs the routing benchmark over groups groups of 4 ranks,
// each rank holding others blocks besides a share of the prompt and
// sending a heartbeat every hbEvery.
func benchRouting(b *testing.B, groups, others int, hbEvery time.Duration) {
	const (
		worldSize  = 4
		promptLen  = 8192
		blockSize  = 16
		sessions   = 1024
		drainEvery = 256 // trackers answered (timer stopped) every so many decisions
	)
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(srv.Shutdown)
	connect := func(opts ...nats.Option) *nats.Conn {
		nc, err := nats.Connect(srv.ClientURL(), opts...)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(nc.Close)
		return nc
	}
	schedConn, rankConn := connect(nats.NoEcho()), connect() // a scheduler's connection is NoEcho
	var subj messages.Subjects
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	s, err := New(Config{Conn: schedConn, ID: "sched-bench", Policy: KVPolicy{}, BlockSize: blockSize, Logger: log})
	if err != nil {
		b.Fatal(err)
	}

	names := make([]string, groups)
	ranks := map[rankID]*fakeRank{}
	for i := range names {
		names[i] = fmt.Sprint("g", i)
		for r := range worldSize {
			fr := &fakeRank{}
			ranks[rankID{names[i], r}] = fr
			g, r := names[i], r
			if _, err := rankConn.Subscribe(subj.Dump(g, r), func(m *nats.Msg) {
				fr.mu.Lock()
				data, err := messages.Marshal(kvDump(g, r, fr.seq, fr.held...))
				fr.mu.Unlock()
				if err == nil {
					err = m.Respond(data)
				}
				if err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
					b.Error(err)
				}
			}); err != nil {
				b.Fatal(err)
			}
		}
	}
	if err := rankConn.Flush(); err != nil {
		b.Fatal(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- s.Run(ctx) }()
	hbDone := make(chan struct{})
	go func() {
		defer close(hbDone)
		tick := time.NewTicker(hbEvery)
		defer tick.Stop()
		for {
			for _, g := range names {
				for r := range worldSize {
					data, _ := messages.Marshal(&messages.Heartbeat{Group: g, TPRank: r, EPRank: r, WorldSize: worldSize,
						Model: benchModel, StartedUnixMs: 1})
					_ = rankConn.Publish(subj.Heartbeat(g, r), data)
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	var stopOnce sync.Once
	stop := func() {
		stopOnce.Do(func() {
			cancel()
			<-hbDone
			select {
			case err := <-runDone:
				if err != nil {
					b.Errorf("Run: %v", err)
				}
			case <-time.After(30 * time.Second):
				b.Error("Run did not return")
			}
		})
	}
	b.Cleanup(stop) // before the connections close and the server stops

	waitUntil := func(what string, cond func() bool) {
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				b.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitUntil("every group ready", func() bool { return s.ReadyGroups() == groups })
	waitUntil("every rank synced from its dump", func() bool {
		s.index.mu.RLock()
		n := 0
		for _, g := range s.index.groups {
			for _, rs := range g.ranks {
				if !rs.resyncing {
					n++
				}
			}
		}
		s.index.mu.RUnlock()
		return n == groups*worldSize
	})

	// Group gi holds the first (gi+1)/groups of the prompt's 512 blocks,
	// plus others.
	tokens := benchTokens(3, promptLen)
	prompt := HashBlocks(nil, HashSeed(benchModel), tokens, blockSize)
	share := func(i int) int { return (i + 1) * len(prompt) / groups }
	rng := rand.New(rand.NewPCG(3, 3))
	for i, g := range names {
		held := append(slices.Clone(prompt[:share(i)]), randomHashes(rng, others)...)
		for r := range worldSize {
			fr := ranks[rankID{g, r}]
			fr.mu.Lock()
			fr.seq++
			fr.held = held
			data, err := messages.Marshal(kvBatch(g, r, fr.seq, stored(held...)))
			fr.mu.Unlock()
			if err != nil {
				b.Fatal(err)
			}
			if err := rankConn.Publish(subj.KV(g, r), data); err != nil {
				b.Fatal(err)
			}
		}
	}
	for i, g := range names {
		waitUntil(g+" indexed", func() bool { return s.index.GroupBlocks(g) == share(i)+others })
	}

	// One request, its id and session patched in place per decision (the
	// decoder copies strings, so trackers keep their own ids).
	const idPrefix, sessPrefix = "bench-req-", "bench-session-"
	req := &messages.Request{
		RequestID: idPrefix + "000000000", SessionID: sessPrefix + "0000", Model: benchModel, FrontendID: "fe-bench",
		ArrivalUnixMs: time.Now().UnixMilli(), DeadlineUnixMs: time.Now().Add(time.Hour).UnixMilli(),
		PromptTokenIDs: tokens, SamplingParams: messages.SamplingParams{MaxTokens: 64, Temperature: 0.7, TopP: 1},
		Stream: true, Endpoint: messages.EndpointChat,
	}
	payload, err := messages.Marshal(req)
	if err != nil {
		b.Fatal(err)
	}
	idAt := bytes.Index(payload, []byte(req.RequestID)) + len(idPrefix)
	sessAt := bytes.Index(payload, []byte(req.SessionID)) + len(sessPrefix)
	if idAt < len(idPrefix) || sessAt < len(sessPrefix) {
		b.Fatal("request id or session not found in the payload")
	}
	msg := &benchMsg{data: payload, subject: subj.Request(benchModel)}
	var seq int
	setIDs := func() {
		var buf [9]byte
		n := strconv.AppendInt(buf[:0], int64(seq), 10)
		copy(payload[idAt:idAt+9], "000000000")
		copy(payload[idAt+9-len(n):idAt+9], n)
		n = strconv.AppendInt(buf[:0], int64(seq%sessions), 10)
		copy(payload[sessAt:sessAt+4], "0000")
		copy(payload[sessAt+4-len(n):sessAt+4], n)
		seq++
	}

	handler := bus.Wrap(s.onRequest, s.log, s.hm, "scheduler_request")
	// drain answers every live request as its ranks would, through the
	// scheduler's own result handler.
	placed := map[string]int{}
	drain := func(want int) {
		s.trackers.mu.Lock()
		live := make([]*RequestTracker, 0, len(s.trackers.m))
		for _, t := range s.trackers.m {
			live = append(live, t)
		}
		s.trackers.mu.Unlock()
		if len(live) != want {
			b.Fatalf("%d live trackers, want %d (acks %d, naks %d)", len(live), want, msg.acks, msg.naks)
		}
		for _, t := range live {
			placed[t.Group]++
			for r := range t.WorldSize {
				data, err := messages.Marshal(&messages.RankResult{ReqID: t.ReqID, Group: t.Group, TPRank: r, EPRank: r,
					Attempt: t.Attempt, LoadedTokens: t.LoadBlocks * blockSize})
				if err != nil {
					b.Fatal(err)
				}
				if err := s.onDone(ctx, &nats.Msg{Data: data}); err != nil {
					b.Fatal(err)
				}
			}
		}
		if n := s.trackers.Len(); n != 0 {
			b.Fatalf("%d trackers left after answering", n)
		}
	}

	// A first decision, untimed: with empty queues the group holding the
	// whole prompt wins and loads all but the last block.
	setIDs()
	if err := handler(ctx, msg); err != nil {
		b.Fatal(err)
	}
	s.trackers.mu.Lock()
	first := s.trackers.m[idPrefix+"000000000"]
	s.trackers.mu.Unlock()
	if last := names[groups-1]; first == nil || first.Group != last || first.LoadBlocks != 511 {
		b.Fatalf("first decision %+v, want %s loading 511 blocks", first, last)
	}
	drain(1)
	clear(placed)

	lat := make([]time.Duration, 0, 1<<16)
	pending := 0
	for b.Loop() {
		setIDs()
		t0 := time.Now()
		err := handler(ctx, msg)
		lat = append(lat, time.Since(t0))
		if err != nil {
			b.Fatal(err)
		}
		if pending++; pending == drainEvery {
			b.StopTimer()
			drain(pending)
			pending = 0
			b.StartTimer()
		}
	}
	drain(pending)
	if msg.naks != 0 {
		b.Fatalf("%d requests not dispatched", msg.naks)
	}
	stop()

	slices.Sort(lat)
	q := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))]) / float64(time.Microsecond) }
	b.ReportMetric(q(0.50), "p50-µs")
	b.ReportMetric(q(0.99), "p99-µs")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
	b.Logf("%d decisions; placed %v", len(lat), placed)
}
