package workers_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/workers"
)

// poolRanks runs rank 1 of each group (Llama-3.1-8B at TP 4: 512 KiB
// blocks) on a server with the given max payload.
type poolRanks struct {
	nc   *nats.Conn
	done *nats.Subscription
}

func startPoolRanks(t testing.TB, maxPayload int32, groups ...string) *poolRanks {
	t.Helper()
	return startPoolRanksWithCapacity(t, maxPayload, 1<<30, groups...)
}

func startPoolRanksWithCapacity(t testing.TB, maxPayload int32, capacity int64, groups ...string) *poolRanks {
	t.Helper()
	return startPoolRanksWith(t, maxPayload, capacity, 0, groups...)
}

// startPoolRanksWith starts the ranks with a --save-wait (0: the default).
func startPoolRanksWith(t testing.TB, maxPayload int32, capacity int64, saveWait time.Duration, groups ...string) *poolRanks {
	t.Helper()
	return startPoolRanksDelayed(t, maxPayload, capacity, saveWait, nil, groups...)
}

// startPoolRanksDelayed starts the ranks with a store thread that sleeps
// storeDelay[group] before each request's save.
func startPoolRanksDelayed(t testing.TB, maxPayload int32, capacity int64, saveWait time.Duration, storeDelay map[string]time.Duration, groups ...string) *poolRanks {
	t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", MaxPayload: maxPayload})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	profile, err := workers.LookupModelProfile("llama-3.1-8b")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, g := range groups {
		rank, err := workers.NewRank(workers.RankConfig{
			Conn: testenv.Connect(t, srv), Group: g, TPRank: 1, TPSize: 4, EPRank: 1, EPSize: 4,
			Model: testModel, Profile: profile, CapacityBytes: capacity, SaveWait: saveWait, StoreDelay: storeDelay[g], Logger: slog.New(slog.DiscardHandler),
		})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			if err := rank.Run(ctx); err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	p := &poolRanks{nc: testenv.Connect(t, srv)}
	if p.done, err = p.nc.SubscribeSync(messages.Subjects{}.Done(testSchedID)); err != nil {
		t.Fatal(err)
	}
	return p
}

// run sends meta until its rank reports (the rank may not have subscribed
// yet; a duplicate is answered from memory) and returns the result.
func (p *poolRanks) run(t testing.TB, meta *messages.ReqMeta) *messages.RankResult {
	t.Helper()
	data, err := messages.Marshal(meta)
	if err != nil {
		t.Fatal(err)
	}
	var res *messages.RankResult
	testenv.Eventually(t, waitFor, "the rank's result for "+meta.ReqID, func() bool {
		if err := p.nc.Publish(messages.Subjects{}.Meta(meta.Group, meta.SessionID), data); err != nil {
			t.Fatal(err)
		}
		for {
			m, err := p.done.NextMsg(200 * time.Millisecond)
			if err != nil {
				return false
			}
			r, err := messages.DecodeRankResult(m.Data)
			if err == nil && r.ReqID == meta.ReqID && !r.Received && !r.Prefilled {
				res = r
				return true
			}
		}
	})
	return res
}

// poolSource stores blocks blocks in g1's rank 1 and returns a pool client
// and the stored hashes.
func poolSource(t testing.TB, maxPayload int32, blocks int) (workers.PoolClient, []uint64) {
	t.Helper()
	p := startPoolRanks(t, maxPayload, "g1")
	tokens := testenv.PromptTokens(42, blocks*blockSize+3)
	meta := newMeta("fill", "", tokens)
	meta.Group = "g1"
	if r := p.run(t, meta); r.StoredBlocks != blocks {
		t.Fatalf("stored %d blocks, want %d", r.StoredBlocks, blocks)
	}
	return workers.PoolClient{Conn: p.nc}, scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), tokens, blockSize)
}

// TestRankLoadsRemoteRuns: a LoadSpec run held by another group is copied
// from that group's rank (the same tp_rank) into the local segment, counted
// as loaded and remote, announced in KV events, and found locally next
// time; a run the source does not hold is recomputed.
func TestRankLoadsRemoteRuns(t *testing.T) {
	p := startPoolRanks(t, 64<<10, "g0", "g1")
	events, err := p.nc.SubscribeSync(messages.Subjects{}.KV("g0", 1))
	if err != nil {
		t.Fatal(err)
	}
	tokens := testenv.PromptTokens(7, 8*blockSize+5)
	fill := newMeta("fill", "s", tokens)
	fill.Group = "g1"
	p.run(t, fill)

	next := newMeta("next", "s", append(slices.Clone(tokens), testenv.PromptTokens(8, 2*blockSize)...))
	next.Group = "g0"
	next.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 8 * blockSize, CanLoad: true,
		Remote: []messages.RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 8}}}
	next.SaveFromBlock = 8
	r := p.run(t, next)
	if r.LoadedTokens != 8*blockSize || r.RemoteTokens != 8*blockSize || r.FailedBlocks != 0 || r.StoredBlocks != 2 {
		t.Errorf("remote load: %+v; want 8 blocks loaded, all remote, 2 new stored", r)
	}
	copied := 0
	for m, err := events.NextMsg(time.Second); err == nil; m, err = events.NextMsg(100 * time.Millisecond) {
		if b, err := messages.DecodeKVEventBatch(m.Data); err == nil {
			for _, ev := range b.Events {
				if ev.Type == messages.EventBlockStored {
					copied += len(ev.BlockHashes)
				}
			}
		}
	}
	if copied != 10 {
		t.Errorf("g0/1 announced %d stored blocks, want 10 (8 copies, 2 new)", copied)
	}
	// The copies are local now.
	again := newMeta("again", "s", next.TokenIDs)
	again.Group = "g0"
	again.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 10 * blockSize, CanLoad: true}
	again.SaveFromBlock = 10
	if r := p.run(t, again); r.LoadedTokens != 10*blockSize || r.RemoteTokens != 0 {
		t.Errorf("local reload: %+v; want 10 blocks, none remote", r)
	}
	// A run the source never held: recomputed.
	other := newMeta("other", "s", testenv.PromptTokens(9, 4*blockSize+1))
	other.Group = "g0"
	other.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 4 * blockSize, CanLoad: true,
		Remote: []messages.RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 4}}}
	other.SaveFromBlock = 4
	if r := p.run(t, other); r.LoadedTokens != 0 || r.FailedBlocks != 4 || r.StoredBlocks != 4 {
		t.Errorf("missing run: %+v; want 0 loaded, 4 failed, 4 stored", r)
	}

	// A run planned from a save in flight at g1 (Saving) whose ReqMeta
	// reaches g1 300 ms after g0's read, as it can in a NATS cluster: the
	// read waits for it, and the run is loaded whole.
	late := testenv.PromptTokens(10, 4*blockSize+1)
	lateFill := newMeta("late-fill", "s2", late)
	lateFill.Group = "g1"
	lateNext := newMeta("late-next", "s2", late)
	lateNext.Group = "g0"
	lateNext.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 4 * blockSize, CanLoad: true,
		Remote: []messages.RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 4, Saving: true}}}
	lateNext.SaveFromBlock = 4
	publish := func(m *messages.ReqMeta) {
		data, err := messages.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.nc.Publish(messages.Subjects{}.Meta(m.Group, m.SessionID), data); err != nil {
			t.Fatal(err)
		}
	}
	publish(lateNext)
	time.Sleep(300 * time.Millisecond)
	publish(lateFill)
	var res *messages.RankResult
	for deadline := time.Now().Add(waitFor); res == nil && time.Now().Before(deadline); {
		m, err := p.done.NextMsg(time.Until(deadline))
		if err != nil {
			break
		}
		if r, err := messages.DecodeRankResult(m.Data); err == nil && r.ReqID == lateNext.ReqID && !r.Received && !r.Prefilled {
			res = r
		}
	}
	if res == nil || res.LoadedTokens != 4*blockSize || res.RemoteTokens != 4*blockSize || res.FailedBlocks != 0 {
		t.Errorf("a Saving run read before its source's ReqMeta: %+v; want 4 blocks loaded, all remote", res)
	}
}

// TestRemoteTokensAreWithinTheLoadedPrefix: copies past the first block
// the load could not find are not part of the prefix loaded, so they are
// not counted (or charged by the engine) as remote tokens.
func TestRemoteTokensAreWithinTheLoadedPrefix(t *testing.T) {
	p := startPoolRanks(t, 0, "g0", "g1")
	tokens := testenv.PromptTokens(7, 10*blockSize+5)
	fill := newMeta("fill", "s", tokens)
	fill.Group = "g1"
	p.run(t, fill)
	local := newMeta("local", "s", tokens[:3*blockSize+1])
	local.Group = "g0"
	p.run(t, local) // g0 holds blocks 0-2
	// Blocks 3-5 are nowhere; 6-9 are copied from g1 but come after the gap.
	next := newMeta("next", "s", tokens)
	next.Group = "g0"
	next.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 10 * blockSize, CanLoad: true,
		Remote: []messages.RemoteRun{{Group: "g1", FromBlock: 6, Blocks: 4}}}
	next.SaveFromBlock = 10
	if r := p.run(t, next); r.LoadedTokens != 3*blockSize || r.RemoteTokens != 0 || r.FailedBlocks != 7 {
		t.Errorf("loaded %d tokens (%d remote), %d failed blocks; want %d, 0 remote, 7 failed", r.LoadedTokens, r.RemoteTokens, r.FailedBlocks, 3*blockSize)
	}
}

// TestPoolReadNotQueuedBehindASave: a read of blocks a rank is still
// saving waits for the save, but a read of blocks it holds is answered
// meanwhile, not queued behind it.
func TestPoolReadNotQueuedBehindASave(t *testing.T) {
	env := startRanks(t, rankEnvConfig{storeDelay: map[int]time.Duration{1: 1500 * time.Millisecond}, saveWait: 3 * time.Second})
	hashes := func(tok []uint32) messages.BlockHashes {
		return scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), tok, blockSize)
	}
	held := testenv.PromptTokens(1, 4*blockSize+1)
	env.sendMeta(newMeta("held", "s", held))
	env.resultsByRank("held")
	saving := testenv.PromptTokens(2, 4*blockSize+1)
	env.sendMeta(newMeta("saving", "s2", saving))
	client := workers.PoolClient{Conn: env.nc, Subjects: env.subj}
	size := env.blockBytes(t)
	// The driver answers once it stored; rank 1, which got the ReqMeta at
	// the same time, registered its saves on arrival and stores 1.5 s late.
	env.finalOutput("saving")
	var wg sync.WaitGroup
	var waited [][]byte
	wg.Go(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		waited, _ = client.Read(ctx, testGroup, 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: hashes(saving)[:4]}, size)
	})
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond) // well before the save ends
	defer cancel()
	got, err := client.Read(ctx, testGroup, 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: hashes(held)[:4]}, size)
	isNil := func(v []byte) bool { return v == nil }
	if err != nil || slices.ContainsFunc(got, isNil) {
		t.Errorf("a read of 4 blocks rank 1 holds, while another waits for a save: %d values, err %v", len(got), err)
	}
	wg.Wait()
	if len(waited) != 4 || slices.ContainsFunc(waited, isNil) {
		t.Errorf("the read that waited for the save got %d values (some nil: %v), want 4 blocks", len(waited), slices.ContainsFunc(waited, isNil))
	}
	env.resultsByRank("saving")
}

// TestPoolReadWaitsForTheIntake: rank 1 has received a ReqMeta but not yet
// handled it (its intake is behind) when pool reads arrive. A read of the
// blocks that ReqMeta saves waits for the intake, then for the save, and
// gets them all; a read of blocks nobody saves is answered (missing) as
// soon as the intake has caught up, not after SaveWait. A read the
// scheduler planned from that save (Saving) is answered as soon as the
// save is done too: before, it then waited out a quarter of SaveWait for
// a ReqMeta to come, the one it had just waited for.
func TestPoolReadWaitsForTheIntake(t *testing.T) {
	for _, saving := range []bool{false, true} {
		t.Run(fmt.Sprintf("saving=%v", saving), func(t *testing.T) { testPoolReadWaitsForTheIntake(t, saving) })
	}
}

func testPoolReadWaitsForTheIntake(t *testing.T, saving bool) {
	const delay, saveWait = 500 * time.Millisecond, 12 * time.Second
	env := startRanks(t, rankEnvConfig{delayFirstMeta: map[int]time.Duration{1: delay}, saveWait: saveWait})
	tokens := testenv.PromptTokens(3, 4*blockSize+1)
	hashes := scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), tokens, blockSize)[:4]
	size := env.blockBytes(t)
	client := workers.PoolClient{Conn: env.nc, Subjects: env.subj}
	env.sendMeta(newMeta("delayed", "s", tokens))
	// The driver answers while rank 1 still sleeps on the ReqMeta.
	env.finalOutput("delayed")
	testenv.Eventually(t, delay/2, "rank 1's ReqMeta delayed (the fault took effect)", func() bool {
		return len(env.logs.Lines("fault injection: ReqMeta delayed")) == 1
	})
	var wg sync.WaitGroup
	var absent [][]byte
	var absentErr error
	wg.Go(func() {
		// Well under SaveWait: a read that waited for saves nobody makes
		// would time out.
		ctx, cancel := context.WithTimeout(context.Background(), saveWait/2)
		defer cancel()
		absent, absentErr = client.Read(ctx, testGroup, 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: []uint64{0xdead, 0xbeef}}, size)
	})
	ctx, cancel := context.WithTimeout(t.Context(), saveWait)
	defer cancel()
	start := time.Now()
	got, err := client.Read(ctx, testGroup, 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: hashes, Saving: saving}, size)
	if err != nil {
		t.Fatal(err)
	}
	// The ReqMeta is handled delay after it came (the read came after
	// it); a read that then waited for another would take saveWait/4.
	if took := time.Since(start); took >= delay+saveWait/8 {
		t.Errorf("the read took %v; want it answered once the delayed ReqMeta's save is done (%v after it came), well before %v", took, delay, saveWait/4)
	}
	for i, h := range hashes {
		if !workers.VerifyPayload(got[i], h, 1, size) {
			t.Errorf("block %d of the delayed ReqMeta's save: %d bytes, want the block", i, len(got[i]))
		}
	}
	wg.Wait()
	if absentErr != nil || len(absent) != 2 || absent[0] != nil || absent[1] != nil {
		t.Errorf("a read of blocks nobody saves: %d values, err %v; want 2 nil values, answered once the intake caught up", len(absent), absentErr)
	}
	if got := testenv.CounterSum(t, env.reg, "kvbus_worker_blocks_total", map[string]string{"op": "pool_awaited_intake"}); got != 4 {
		t.Errorf("%v blocks found after waiting for the intake, want 4", got)
	}
	env.resultsByRank("delayed")
}

// TestPoolReadOfASaveNotYetReceived: in a NATS cluster a read can reach a
// rank before the ReqMeta that saves its blocks has reached it at all (the
// two took different routes), so the rank's intake is caught up and knows
// of no such save. A read the scheduler planned from that save (Saving)
// waits for the ReqMeta and gets every block; the same read without Saving
// is answered at once with none (what every such read got before), and a
// Saving read of blocks nobody saves is answered, missing, within the
// reader's SaveWait.
func TestPoolReadOfASaveNotYetReceived(t *testing.T) {
	const saveWait = 4 * time.Second
	env := startRanks(t, rankEnvConfig{saveWait: saveWait})
	tokens := testenv.PromptTokens(5, 4*blockSize+1)
	hashes := scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), tokens, blockSize)[:4]
	size := env.blockBytes(t)
	client := workers.PoolClient{Conn: env.nc, Subjects: env.subj}
	read := func(saving bool, hs []uint64) ([][]byte, error) {
		ctx, cancel := context.WithTimeout(context.Background(), saveWait) // as a reader's load gives it
		defer cancel()
		return client.Read(ctx, testGroup, 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: hs, Saving: saving}, size)
	}
	isSet := func(v []byte) bool { return v != nil }
	if got, err := read(false, hashes); err != nil || len(got) != 4 || slices.ContainsFunc(got, isSet) {
		t.Fatalf("a read before the ReqMeta, not Saving: %d values (some set: %v), err %v; want 4 missing", len(got), slices.ContainsFunc(got, isSet), err)
	}

	var wg sync.WaitGroup
	var got [][]byte
	var gotErr error
	wg.Go(func() { got, gotErr = read(true, hashes) })
	time.Sleep(300 * time.Millisecond) // the ReqMeta comes 300 ms after the read
	env.sendMeta(newMeta("late", "s", tokens))
	wg.Wait()
	if gotErr != nil || len(got) != 4 {
		t.Fatalf("a Saving read before the ReqMeta: %d values, err %v; want 4", len(got), gotErr)
	}
	for i, h := range hashes {
		if !workers.VerifyPayload(got[i], h, 1, size) {
			t.Errorf("block %d of the late ReqMeta's save: %d bytes, want the block", i, len(got[i]))
		}
	}
	// The read came before the ReqMeta (the fault took effect): its blocks
	// were unknown to the rank, and found after the wait.
	if n := testenv.CounterSum(t, env.reg, "kvbus_worker_blocks_total", map[string]string{"op": "pool_awaited_intake"}); n != 4 {
		t.Errorf("%v blocks found after waiting for their ReqMeta, want 4", n)
	}
	if absent, err := read(true, []uint64{0xdead}); err != nil || len(absent) != 1 || absent[0] != nil {
		t.Errorf("a Saving read of a block nobody saves: %d values, err %v; want one missing, within the reader's SaveWait", len(absent), err)
	}
	env.resultsByRank("late")
}

// TestSavingReadOfADrainingRank: once a rank has stopped its intake (it
// drains, finishing what it holds), no ReqMeta can come that saves the
// blocks a Saving read names; the read is answered with what the rank has
// at once, not after a quarter of SaveWait spent waiting for one.
func TestSavingReadOfADrainingRank(t *testing.T) {
	const saveWait, storeDelay = 12 * time.Second, 2 * time.Second
	env := startRanks(t, rankEnvConfig{saveWait: saveWait, storeDelay: map[int]time.Duration{1: storeDelay}})
	env.sendMeta(newMeta("storing", "s", testenv.PromptTokens(6, 2*blockSize+1)))
	env.finalOutput("storing") // rank 1 got it too, and stores it storeDelay late
	env.rankStop[1]()          // as SIGTERM stops its process
	testenv.Eventually(t, waitFor, "rank 1 stopped its intake (the fault took effect)", func() bool {
		for _, l := range env.logs.Lines("rank stopping: finishing in-flight requests") {
			if strings.Contains(l, "tp_rank=1") {
				return true
			}
		}
		return false
	})
	client := workers.PoolClient{Conn: env.nc, Subjects: env.subj}
	ctx, cancel := context.WithTimeout(t.Context(), saveWait)
	defer cancel()
	start := time.Now()
	got, err := client.Read(ctx, testGroup, 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: []uint64{0xdead}, Saving: true}, env.blockBytes(t))
	took := time.Since(start)
	if err != nil || len(got) != 1 || got[0] != nil {
		t.Fatalf("a Saving read of a draining rank: %d values, err %v; want one missing", len(got), err)
	}
	if took >= saveWait/8 {
		t.Errorf("a Saving read of a draining rank took %v; want it answered at once, not after a wait for a ReqMeta (%v)", took, saveWait/4)
	}
	select {
	case <-env.rankDone[1]:
		t.Error("rank 1 had stopped before the read: the read did not reach a draining rank")
	default:
	}
	select {
	case <-env.rankDone[1]:
	case <-time.After(waitFor):
		t.Fatalf("rank 1: Run did not return %s after its context ended", waitFor)
	}
}

// TestPoolReadIntakeWaitIsBounded: a rank whose intake is stuck longer
// than SaveWait answers a read within the reader's own SaveWait, with what
// it has, instead of waiting until the reader has given up.
func TestPoolReadIntakeWaitIsBounded(t *testing.T) {
	const delay, saveWait = 1500 * time.Millisecond, time.Second
	env := startRanks(t, rankEnvConfig{delayFirstMeta: map[int]time.Duration{1: delay}, saveWait: saveWait})
	env.sendMeta(newMeta("stuck", "s", testenv.PromptTokens(4, 2*blockSize+1)))
	testenv.Eventually(t, time.Second, "rank 1's ReqMeta delayed (the fault took effect)", func() bool {
		return len(env.logs.Lines("fault injection: ReqMeta delayed")) == 1
	})
	client := workers.PoolClient{Conn: env.nc, Subjects: env.subj}
	ctx, cancel := context.WithTimeout(t.Context(), saveWait) // as a reader's load gives it
	defer cancel()
	got, err := client.Read(ctx, testGroup, 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: []uint64{0xdead}}, 64)
	if err != nil || len(got) != 1 || got[0] != nil {
		t.Errorf("a read while the intake is stuck: %d values, err %v; want one nil value within the reader's SaveWait", len(got), err)
	}
	env.resultsByRank("stuck")
}

// TestPoolRead: rank 1 of another group reads blocks from g1's rank 1:
// every block it holds arrives whole and verified, through a server whose
// max payload (64 KiB) is smaller than one block (512 KiB), and a block it
// does not hold comes back nil.
func TestPoolRead(t *testing.T) {
	const blocks, size = 8, 512 << 10
	// The server's default payload (8 MiB) sends each block in one piece;
	// a 64 KiB one in eight.
	for _, payload := range []int32{0, 64 << 10} {
		t.Run(fmt.Sprint("max_payload=", payload), func(t *testing.T) { testPoolRead(t, payload, blocks, size) })
	}
}

func testPoolRead(t *testing.T, payload int32, blocks, size int) {
	client, hashes := poolSource(t, payload, blocks)
	want := append(hashes[:blocks:blocks], 0xdead) // the last one is held by nobody
	got, err := client.Read(t.Context(), "g1", 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: want}, size)
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range want[:blocks] {
		if !workers.VerifyPayload(got[i], h, 1, size) {
			t.Errorf("block %d: %d bytes, not the block's payload", i, len(got[i]))
		}
	}
	if got[blocks] != nil {
		t.Errorf("a block nobody holds came back with %d bytes", len(got[blocks]))
	}
	// Another rank's key space: rank 2's keys are not rank 1's.
	got, err = client.Read(t.Context(), "g1", 1, &messages.PoolRead{Model: testModel, TPRank: 2, BlockHashes: want[:2]}, size)
	if err != nil || got[0] != nil || got[1] != nil {
		t.Errorf("tp_rank 2's blocks from rank 1: %v, %v", got, err)
	}
	// Nobody serves g9: the server says so at once (its "no responders"),
	// and the read ends with that error, not at its deadline.
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if _, err := client.Read(ctx, "g9", 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: want}, size); !errors.Is(err, workers.ErrPoolRead) ||
		!strings.Contains(err.Error(), "no rank serves pool reads") {
		t.Errorf("a read from a group nobody serves: %v; want ErrPoolRead saying no rank serves it", err)
	}
}

// TestRemoteRunReadFromAnAlternate: a run whose source no rank serves any
// more (it stopped since the LoadSpec was made), or that no longer holds
// all of the run, is read, the rest of it, from the run's alternates in
// turn; with none left the rest is recomputed, as before.
func TestRemoteRunReadFromAnAlternate(t *testing.T) {
	p := startPoolRanks(t, 64<<10, "g1", "g2", "t1", "t2", "t3", "t4", "t5")
	tokens := testenv.PromptTokens(11, 8*blockSize+5)
	fill := newMeta("fill", "s", tokens)
	fill.Group = "g1" // g1 holds blocks 0-7
	p.run(t, fill)
	half := newMeta("half", "s", tokens[:4*blockSize+1])
	half.Group = "g2" // g2 holds blocks 0-3
	p.run(t, half)
	tests := []struct {
		target string
		run    messages.RemoteRun
		loaded int // blocks
	}{
		{"t1", messages.RemoteRun{Group: "gone", Blocks: 8, Alternates: []string{"g1"}}, 8},
		{"t2", messages.RemoteRun{Group: "g2", Blocks: 8, Alternates: []string{"g1"}}, 8},
		{"t3", messages.RemoteRun{Group: "gone", Blocks: 8, Alternates: []string{"g2", "g1"}}, 8},
		{"t4", messages.RemoteRun{Group: "gone", Blocks: 8}, 0},
		// An alternate holding the run's start gives that much.
		{"t5", messages.RemoteRun{Group: "gone", Blocks: 8, Alternates: []string{"g2"}}, 4},
	}
	for _, tt := range tests {
		next := newMeta("next-"+tt.target, "s", append(slices.Clone(tokens), testenv.PromptTokens(12, blockSize)...))
		next.Group = tt.target
		next.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 8 * blockSize, CanLoad: true, Remote: []messages.RemoteRun{tt.run}}
		next.SaveFromBlock = 8
		r := p.run(t, next)
		if r.LoadedTokens != tt.loaded*blockSize || r.RemoteTokens != tt.loaded*blockSize || r.FailedBlocks != 8-tt.loaded {
			t.Errorf("%s reading %+v: loaded %d tokens (%d remote), %d failed blocks; want %d blocks loaded, all remote, %d failed",
				tt.target, tt.run, r.LoadedTokens, r.RemoteTokens, r.FailedBlocks, tt.loaded, 8-tt.loaded)
		}
	}
}

// replying answers every PoolRead on g1/1 with the given parts, encoded
// without the decoder's checks, as a faulty or hostile rank would.
func replying(t *testing.T, parts ...messages.PoolPart) workers.PoolClient {
	t.Helper()
	srv := testenv.StartNATS(t)
	src := testenv.Connect(t, srv)
	if _, err := src.Subscribe(messages.Subjects{}.Pool("g1", 1), func(m *nats.Msg) {
		for i := range parts {
			data, err := parts[i].MarshalMsg(nil)
			if err != nil {
				t.Error(err)
				return
			}
			_ = src.Publish(m.Reply, data)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := src.Flush(); err != nil {
		t.Fatal(err)
	}
	return workers.PoolClient{Conn: testenv.Connect(t, srv)}
}

// TestPoolReadMalformedReplies: what a reply claims never crashes the
// reader, never makes it allocate beyond the blocks it asked for, and never
// passes off a block whose bytes did not all arrive, in order.
func TestPoolReadMalformedReplies(t *testing.T) {
	const size = 512
	h := uint64(0xabc)
	full := workers.BlockPayload(h, 1, size)
	read := func(t *testing.T, client workers.PoolClient, hashes messages.BlockHashes, wait time.Duration) ([][]byte, error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), wait)
		defer cancel()
		return client.Read(ctx, "g1", 1, &messages.PoolRead{Model: "m", TPRank: 1, BlockHashes: hashes}, size)
	}
	t.Run("part count far beyond any reply", func(t *testing.T) {
		// 1<<62 sized an allocation and panicked the load thread.
		client := replying(t, messages.PoolPart{Part: 0, Parts: 1 << 62})
		if _, err := read(t, client, messages.BlockHashes{h}, 300*time.Millisecond); !errors.Is(err, workers.ErrPoolRead) {
			t.Errorf("err = %v, want ErrPoolRead once the context ends", err)
		}
	})
	t.Run("pieces announcing 64 MiB blocks", func(t *testing.T) {
		pieces := make([]messages.PoolPiece, 32)
		hashes := make(messages.BlockHashes, 32)
		for i := range pieces {
			pieces[i] = messages.PoolPiece{Index: i, Size: messages.MaxPoolBlockBytes, Data: []byte{1}}
			hashes[i] = uint64(i + 1)
		}
		client := replying(t, messages.PoolPart{Part: 0, Parts: 1, Pieces: pieces})
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		got, err := read(t, client, hashes, 5*time.Second)
		runtime.ReadMemStats(&after)
		if err != nil || slices.ContainsFunc(got, func(v []byte) bool { return v != nil }) {
			t.Errorf("blocks of the wrong size: %d values, err %v; want all nil", len(got), err)
		}
		if n := after.TotalAlloc - before.TotalAlloc; n > 64<<20 {
			t.Errorf("a reply of 32 one-byte pieces made the reader allocate %d MiB", n>>20)
		}
	})
	t.Run("the same half twice", func(t *testing.T) {
		half := messages.PoolPiece{Index: 0, Size: size, Data: full[:size/2]}
		client := replying(t,
			messages.PoolPart{Part: 0, Parts: 2, Pieces: []messages.PoolPiece{half}},
			messages.PoolPart{Part: 1, Parts: 2, Pieces: []messages.PoolPiece{half}})
		got, err := read(t, client, messages.BlockHashes{h}, 5*time.Second)
		if err != nil || got[0] != nil {
			t.Errorf("a block of which half arrived twice: %d bytes, err %v; want nil", len(got[0]), err)
		}
	})
	t.Run("in order across parts", func(t *testing.T) {
		client := replying(t,
			messages.PoolPart{Part: 0, Parts: 2, Pieces: []messages.PoolPiece{{Index: 0, Size: size, Data: full[:100]}}},
			messages.PoolPart{Part: 1, Parts: 2, Pieces: []messages.PoolPiece{{Index: 0, Offset: 100, Size: size, Data: full[100:]}}})
		got, err := read(t, client, messages.BlockHashes{h}, 5*time.Second)
		if err != nil || !workers.VerifyPayload(got[0], h, 1, size) {
			t.Errorf("a block sent in two pieces: %d bytes, err %v; want it whole", len(got[0]), err)
		}
	})
}

// BenchmarkPoolRead32Blocks512KiB: one pool read of 32 blocks of 512 KiB
// (a 512-token prefix of Llama-3.1-8B at TP 4) from another rank, over
// loopback through the embedded server (8 MiB max payload).
func BenchmarkPoolRead32Blocks512KiB(b *testing.B) {
	const blocks = 32
	client, hashes := poolSource(b, 0, blocks)
	req := &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: hashes[:blocks]}
	b.SetBytes(blocks * 512 << 10)
	b.ResetTimer()
	for b.Loop() {
		got, err := client.Read(context.Background(), "g1", 1, req, 512<<10)
		if err != nil || got[blocks-1] == nil {
			b.Fatal(fmt.Sprint("read: ", err))
		}
	}
}

// TestLongRemoteRunKeepsWhatArrivedInTime: a remote run far larger than
// one read should carry is read in pieces of at most 16 MiB, so that a
// source that cannot send the whole run within SaveWait still hands over
// the blocks it sent by then. Read in one PoolRead (128 blocks of 512 KiB,
// 64 MiB: past the server's pending limit for the reader when the reader
// is slow, as a GOMAXPROCS=1 worker is) a run that missed its deadline
// lost every block, those received included, and the reader could be cut
// off as a slow consumer.
func TestLongRemoteRunKeepsWhatArrivedInTime(t *testing.T) {
	// Under the race detector, 16 MiB take the server and the reader over
	// a second: the wait and the source's pace are scaled alike.
	p := startPoolRanksWith(t, 0, 1<<30, 2*time.Second*raceSlowdown, "g0")
	const blocks = 128
	perBlock := 25 * time.Millisecond * raceSlowdown // the source sends 40 blocks a second
	size := 16 * blockSize * 1024 * 2                // llama-3.1-8b at TP 4: 512 KiB a block
	var mu sync.Mutex
	var asked []int
	stop := make(chan struct{})
	stopped := false
	var busy sync.WaitGroup
	t.Cleanup(func() {
		mu.Lock()
		stopped = true
		mu.Unlock()
		close(stop)
		busy.Wait()
	})
	if _, err := p.nc.Subscribe(messages.Subjects{}.Pool("g1", 1), func(m *nats.Msg) {
		mu.Lock()
		if stopped {
			mu.Unlock()
			return
		}
		busy.Add(1)
		mu.Unlock()
		defer busy.Done()
		req, err := messages.DecodePoolRead(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		mu.Lock()
		asked = append(asked, len(req.BlockHashes))
		mu.Unlock()
		select {
		case <-time.After(time.Duration(len(req.BlockHashes)) * perBlock):
		case <-stop:
			return
		}
		answerPoolRead(t, p.nc, m.Reply, req, size)
	}); err != nil {
		t.Fatal(err)
	}
	if err := p.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	next := newMeta("long", "s", testenv.PromptTokens(11, blocks*blockSize+5))
	next.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: blocks * blockSize, CanLoad: true,
		Remote: []messages.RemoteRun{{Group: "g1", FromBlock: 0, Blocks: blocks}}}
	next.SaveFromBlock = blocks
	r := p.run(t, next)
	// Within SaveWait (2 s, scaled) pieces of 32 blocks (0.8 s each, scaled)
	// bring 64 blocks; the third piece is late.
	if r.LoadedTokens < 32*blockSize || r.RemoteTokens != r.LoadedTokens || r.FailedBlocks != blocks-r.LoadedTokens/blockSize {
		t.Errorf("long remote run: loaded %d tokens (%d remote), %d failed blocks; want at least 32 blocks loaded, all remote, the rest failed",
			r.LoadedTokens, r.RemoteTokens, r.FailedBlocks)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, n := range asked {
		if n*size > 16<<20 {
			t.Errorf("a PoolRead asked for %d blocks (%d MiB); want at most 16 MiB a read (reads: %v)", n, n*size>>20, asked)
			break
		}
	}
}

// TestRemoteCopiesDoNotEvictThePrefixTheyExtend: a rank whose store is
// nearly full copies a remote run that extends a prefix it holds. The
// copies evicted the least recently used blocks — the local head of that
// very prefix — and the load then found nothing (0 of 8 blocks). A
// prefix longer than the store, all of it remote, evicted its own first
// copies and loaded nothing either; what was read is loaded, whether or
// not the store keeps it.
func TestRemoteCopiesDoNotEvictThePrefixTheyExtend(t *testing.T) {
	const size = 512 << 10 // llama-3.1-8b at TP 4
	p := startPoolRanksWithCapacity(t, 0, 8*size, "g0")
	// g1's rank 1 holds every block asked for.
	sub, err := p.nc.Subscribe(messages.Subjects{}.Pool("g1", 1), func(m *nats.Msg) {
		req, err := messages.DecodePoolRead(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		answerPoolRead(t, p.nc, m.Reply, req, size)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Drain() })
	tokens := testenv.PromptTokens(21, 8*blockSize+3)
	head := newMeta("head", "s", tokens[:3*blockSize+1])
	p.run(t, head) // g0 holds blocks 0-2 of s
	other := newMeta("other", "o", testenv.PromptTokens(22, 5*blockSize+1))
	p.run(t, other) // and 5 of another session: the store is full, s's oldest
	next := newMeta("next", "s", tokens)
	next.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 8 * blockSize, CanLoad: true,
		Remote: []messages.RemoteRun{{Group: "g1", FromBlock: 3, Blocks: 5}}}
	next.SaveFromBlock = 8
	if r := p.run(t, next); r.LoadedTokens != 8*blockSize || r.RemoteTokens != 5*blockSize || r.FailedBlocks != 0 {
		t.Errorf("prefix of 3 local and 5 remote blocks in a full store of 8: loaded %d tokens (%d remote), %d failed blocks; want 8 blocks, 5 remote, none failed",
			r.LoadedTokens, r.RemoteTokens, r.FailedBlocks)
	}
	long := testenv.PromptTokens(23, 12*blockSize+3)
	all := newMeta("long", "l", long)
	all.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 12 * blockSize, CanLoad: true,
		Remote: []messages.RemoteRun{{Group: "g1", FromBlock: 0, Blocks: 12}}}
	all.SaveFromBlock = 12
	if r := p.run(t, all); r.LoadedTokens != 12*blockSize || r.RemoteTokens != 12*blockSize || r.FailedBlocks != 0 {
		t.Errorf("remote prefix of 12 blocks into a store of 8: loaded %d tokens (%d remote), %d failed blocks; want 12 blocks, all remote, none failed",
			r.LoadedTokens, r.RemoteTokens, r.FailedBlocks)
	}
}

// answerPoolRead answers a PoolRead as rank 1 holding every block asked
// for would: one part a block of size bytes.
func answerPoolRead(t *testing.T, nc *nats.Conn, reply string, req *messages.PoolRead, size int) {
	for i, h := range req.BlockHashes {
		part := messages.PoolPart{Part: i, Parts: len(req.BlockHashes), Pieces: []messages.PoolPiece{
			{Index: i, Size: size, Data: workers.BlockPayload(h, 1, size)}}}
		data, err := messages.Marshal(&part)
		if err != nil {
			t.Error(err)
			return
		}
		_ = nc.Publish(reply, data)
	}
}

// TestAPromptLongerThanTheStoreKeepsItsStart: a rank whose store holds 8
// blocks saves a 12-block prompt. Saved in order, the last blocks pushed
// out the first and the next turn loaded nothing (a prefix is usable only
// from block 0); now the store keeps the first 8, and later pressure
// evicts a prefix from its end (0 of 8 loaded before; then 0 of 6).
func TestAPromptLongerThanTheStoreKeepsItsStart(t *testing.T) {
	const size = 512 << 10 // llama-3.1-8b at TP 4
	p := startPoolRanksWithCapacity(t, 0, 8*size, "g0")
	tokens := testenv.PromptTokens(31, 12*blockSize+3)
	p.run(t, newMeta("first", "s", tokens))
	turn := func(id string, cached int) *messages.RankResult {
		m := newMeta(id, "s", tokens)
		m.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: cached * blockSize, CanLoad: true}
		m.SaveFromBlock = cached
		return p.run(t, m)
	}
	if r := turn("second", 8); r.LoadedTokens != 8*blockSize || r.FailedBlocks != 0 {
		t.Errorf("after a 12-block prompt in a store of 8: loaded %d tokens, %d failed blocks; want the first 8 blocks", r.LoadedTokens, r.FailedBlocks)
	}
	p.run(t, newMeta("other", "o", testenv.PromptTokens(32, 2*blockSize+1))) // 2 blocks of another session
	if r := turn("third", 6); r.LoadedTokens != 6*blockSize || r.FailedBlocks != 0 {
		t.Errorf("after another session's 2 blocks: loaded %d tokens, %d failed blocks; want the first 6 blocks (the prefix's end evicted)", r.LoadedTokens, r.FailedBlocks)
	}
}

// blockBytes is the size of one block at one rank of startRanks' model.
func (e *rankEnv) blockBytes(t *testing.T) int {
	t.Helper()
	profile, err := workers.LookupModelProfile("tiny") // startRanks'
	if err != nil {
		t.Fatal(err)
	}
	return blockSize * profile.BytesPerTokenPerRank(worldSize)
}

// TestTwoGroupsReadingFromEachOtherDoNotWaitOnEachOther: g0's load thread
// reads a run from g1 that a request queued behind g1's load thread saves,
// while g1's load thread reads a run from g0 that a request queued behind
// g0's saves: each source's read waits for a save behind its own load
// thread, which waits for the other. Before, both reads waited out the
// whole SaveWait and both runs were recomputed; now the rank of the group
// first by name does not wait for a save queued behind its own read from
// the reader's group once that read has gone unanswered for half of
// SaveWait, so one run is recomputed then and the other is read whole.
func TestTwoGroupsReadingFromEachOtherDoNotWaitOnEachOther(t *testing.T) {
	const saveWait = 4 * time.Second
	p := startPoolRanksWith(t, 0, 1<<30, saveWait, "g0", "g1")
	x, y, took := crossedReads(t, p, false)
	// g0 (first by name) answered y's read without waiting for w, which
	// was queued behind x's read from g1: y recomputes its run.
	if y.LoadedTokens != 0 || y.FailedBlocks != 4 {
		t.Errorf("y (g1 reading from g0): %+v; want its run recomputed (0 loaded, 4 failed)", y)
	}
	// g1 waited for z, which followed y once y's read was answered.
	if x.LoadedTokens != 4*blockSize || x.RemoteTokens != 4*blockSize || x.FailedBlocks != 0 {
		t.Errorf("x (g0 reading from g1): %+v; want its run read whole from g1 (4 blocks)", x)
	}
	// y's read was answered after half of SaveWait, not at its end (x,
	// read whole, came within its own SaveWait).
	if took["y"] >= saveWait*7/8 {
		t.Errorf("y took %v; want it well within SaveWait (%v): the two groups waited on each other", took["y"], saveWait)
	}
}

// TestCrossedReadsThatDoNotWaitOnEachOtherBothLoad: as above, but the save
// g0's read waits for at g1 is not queued behind g1's load thread (z came
// before y, and only g1's store thread is slow, 100 ms): no cycle. g0 keeps
// waiting for w while its own read from g1 is answered late, and both runs
// are read whole; taking every read from the reader's group that is slow
// to answer for a cycle recomputed y's run.
func TestCrossedReadsThatDoNotWaitOnEachOtherBothLoad(t *testing.T) {
	const saveWait = 4 * time.Second
	p := startPoolRanksDelayed(t, 0, 1<<30, saveWait, map[string]time.Duration{"g1": 100 * time.Millisecond}, "g0", "g1")
	x, y, _ := crossedReads(t, p, true)
	for _, r := range []*messages.RankResult{x, y} {
		if r.LoadedTokens != 4*blockSize || r.RemoteTokens != 4*blockSize || r.FailedBlocks != 0 {
			t.Errorf("%s: %+v; want its run read whole from the other group (4 blocks)", r.ReqID, r)
		}
	}
}

// crossedReads sends x to g0, reading from g1 the 4 blocks z saves on g1,
// and y to g1, reading from g0 the 4 blocks w saves on g0; w is sent after
// x, and z after y (zFirst: before y). It returns x's and y's results and
// how long after sending each came.
func crossedReads(t *testing.T, p *poolRanks, zFirst bool) (x, y *messages.RankResult, took map[string]time.Duration) {
	t.Helper()
	forG0 := testenv.PromptTokens(21, 4*blockSize+1) // saved by w on g0, read by y on g1
	forG1 := testenv.PromptTokens(22, 4*blockSize+1) // saved by z on g1, read by x on g0
	reader := func(id, group, source string, tokens []uint32) *messages.ReqMeta {
		m := newMeta(id, "s-"+id, append(slices.Clone(tokens[:4*blockSize]), testenv.PromptTokens(23, blockSize+1)...))
		m.Group = group
		m.LoadSpec = &messages.LoadSpec{KVPoolCachedTokens: 4 * blockSize, CanLoad: true,
			Remote: []messages.RemoteRun{{Group: source, FromBlock: 0, Blocks: 4, Saving: true}}}
		m.SaveFromBlock = 4
		return m
	}
	saver := func(id, group string, tokens []uint32) *messages.ReqMeta {
		m := newMeta(id, "s-"+id, tokens)
		m.Group = group
		return m
	}
	for _, g := range []string{"g0", "g1"} { // both ranks up
		p.run(t, saver("up-"+g, g, testenv.PromptTokens(24, blockSize+1)))
	}
	// Each rank takes its reader, then the saver the other group's reader
	// waits for: the saver's load is queued behind the reader's.
	metas := []*messages.ReqMeta{reader("x", "g0", "g1", forG1), reader("y", "g1", "g0", forG0), saver("w", "g0", forG0), saver("z", "g1", forG1)}
	if zFirst {
		metas = []*messages.ReqMeta{metas[3], metas[0], metas[1], metas[2]}
	}
	start := time.Now()
	for _, m := range metas {
		data, err := messages.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.nc.Publish(messages.Subjects{}.Meta(m.Group, m.SessionID), data); err != nil {
			t.Fatal(err)
		}
	}
	results := map[string]*messages.RankResult{}
	took = map[string]time.Duration{}
	for deadline := time.Now().Add(20 * time.Second); len(results) < 2 && time.Now().Before(deadline); {
		m, err := p.done.NextMsg(time.Until(deadline))
		if err != nil {
			break
		}
		if r, err := messages.DecodeRankResult(m.Data); err == nil && (r.ReqID == "x" || r.ReqID == "y") && !r.Received && !r.Prefilled {
			results[r.ReqID], took[r.ReqID] = r, time.Since(start)
		}
	}
	x, y = results["x"], results["y"]
	if x == nil || y == nil {
		t.Fatalf("results of the two readers: x %+v, y %+v; want both", x, y)
	}
	t.Logf("x done after %v (%d tokens loaded), y after %v (%d tokens loaded, %d blocks failed)", took["x"], x.LoadedTokens, took["y"], y.LoadedTokens, y.FailedBlocks)
	return x, y, took
}
