package workers_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/workers"
)

// poolSource runs rank 1 of group g1 (Llama-3.1-8B at TP 4: 512 KiB
// blocks) on a server with the given max payload, stores blocks blocks in
// it through a ReqMeta, and returns a pool client and the stored hashes.
func poolSource(t testing.TB, maxPayload int32, blocks int) (workers.PoolClient, []uint64) {
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
	rank, err := workers.NewRank(workers.RankConfig{
		Conn: testenv.Connect(t, srv), Group: "g1", TPRank: 1, TPSize: 4, EPRank: 1, EPSize: 4,
		Model: testModel, Profile: profile, CapacityBytes: 1 << 30, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := rank.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	t.Cleanup(func() { cancel(); wg.Wait() })

	nc := testenv.Connect(t, srv)
	done, err := nc.SubscribeSync(messages.Subjects{}.Done(testSchedID))
	if err != nil {
		t.Fatal(err)
	}
	tokens := testenv.PromptTokens(42, blocks*blockSize+3)
	meta := newMeta("fill", "", tokens)
	meta.Group = "g1"
	data, _ := messages.Marshal(meta)
	testenv.Eventually(t, waitFor, "the rank to store the blocks", func() bool {
		if err := nc.Publish(messages.Subjects{}.Meta("g1", ""), data); err != nil {
			t.Fatal(err)
		}
		m, err := done.NextMsg(200 * time.Millisecond)
		if err != nil {
			return false // not subscribed yet: send again (a duplicate is answered from memory)
		}
		r, err := messages.DecodeRankResult(m.Data)
		return err == nil && !r.Received && r.StoredBlocks+r.SkippedBlocks == blocks
	})
	return workers.PoolClient{Conn: nc}, scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), tokens, blockSize)
}

// TestPoolRead: rank 1 of another group reads blocks from g1's rank 1:
// every block it holds arrives whole and verified, through a server whose
// max payload (64 KiB) is smaller than one block (512 KiB), and a block it
// does not hold comes back nil.
func TestPoolRead(t *testing.T) {
	const blocks, size = 8, 512 << 10
	client, hashes := poolSource(t, 64<<10, blocks)
	want := append(hashes[:blocks:blocks], 0xdead) // the last one is held by nobody
	got, err := client.Read(t.Context(), "g1", 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: want})
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
	got, err = client.Read(t.Context(), "g1", 1, &messages.PoolRead{Model: testModel, TPRank: 2, BlockHashes: want[:2]})
	if err != nil || got[0] != nil || got[1] != nil {
		t.Errorf("tp_rank 2's blocks from rank 1: %v, %v", got, err)
	}
	// Nobody serves g9: the read ends with the context, with an error.
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if _, err := client.Read(ctx, "g9", 1, &messages.PoolRead{Model: testModel, TPRank: 1, BlockHashes: want}); err == nil {
		t.Error("a read from a group that does not exist succeeded")
	}
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
		got, err := client.Read(context.Background(), "g1", 1, req)
		if err != nil || got[blocks-1] == nil {
			b.Fatal(fmt.Sprint("read: ", err))
		}
	}
}
