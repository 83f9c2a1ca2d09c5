package testenv_test

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestTheRanksOfAGroupEvictAlike: the four ranks of a tensor-parallel group
// each keep a shard of the same blocks, and a block is usable only while
// every rank holds its shard. Under a store far smaller than the sessions'
// prompts, 12 conversations sent concurrently (each turn the moment the
// previous answer arrived) must leave the ranks holding the same blocks.
// Before, each rank ordered its blocks by when its own load and store
// threads happened to touch them, so the ranks evicted different blocks:
// 135 of 160 held by all four here (0 of 160 under the load of a CI run),
// and a review measured 75 of 187 on the real binary. --evict session is
// logged, not held to it: there one decision evicts a whole conversation,
// and the race a rank's order cannot close (a later request's load
// touching a block before an earlier save evicts on one rank, after on
// another) still costs one now and then under load (67 of 135 held by all
// in one run of 16; 67 of 134 every run before).
func TestTheRanksOfAGroupEvictAlike(t *testing.T) {
	for _, evict := range []string{"lru", "session"} {
		t.Run(evict, func(t *testing.T) {
			// tiny at TP 4: 256 bytes a block per rank; a conversation's
			// prompt is ~40 blocks at its first turn and ~80 at its sixth.
			const capacityBlocks = 160
			const convs, turns = 12, 6
			c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 1, KVCapacity: capacityBlocks * 256, Evict: evict})
			client := &http.Client{Timeout: 30 * time.Second}
			var wg sync.WaitGroup
			errs := make(chan error, convs)
			for conv := range convs {
				wg.Go(func() {
					_, err := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 7100 + conv,
						Headers: map[string]string{"X-Session-ID": fmt.Sprint("alike-", conv)}}.Run(t.Context(), turns)
					if err != nil {
						errs <- err
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			nc, err := nats.Connect(c.NATSURL)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			// Every rank's store, once the last saves are made: the last
			// answer reaches its client before the ranks' store threads
			// save its prompt, and the scheduler logs a request done only
			// once every rank's result, sent after its saves, is in. (Read
			// while a full store held as many blocks 100 ms apart, a rank
			// read before its last saves held none of the blocks the
			// others did: 0 of 160.)
			testenv.Eventually(t, 10*time.Second, "every rank's result of every turn", func() bool {
				return len(c.Logs.Lines("request done")) == convs*turns
			})
			var held []map[uint64]bool
			for r := range 4 {
				held = append(held, dumpOf(t, nc, "g0", r))
			}
			all := 0
			for h := range held[0] {
				if held[1][h] && held[2][h] && held[3][h] {
					all++
				}
			}
			for r := range 4 {
				t.Logf("%s: rank %d holds %d blocks, %d of them held by every rank", evict, r, len(held[r]), all)
				if len(held[r]) < capacityBlocks/2 {
					t.Fatalf("rank %d holds %d blocks: the store never filled (capacity %d), so nothing was evicted", r, len(held[r]), capacityBlocks)
				}
				// Not quite all: see above (159 of 160 seen under load).
				if evict == "lru" && all < len(held[r])*95/100 {
					t.Errorf("%s: rank %d holds %d blocks, only %d of them held by every rank of the group (want at least 95%%)", evict, r, len(held[r]), all)
				}
			}
			if t.Failed() {
				explainDisagreement(t, c, held)
			}
		})
	}
}

// explainDisagreement logs, for a failed run, what the ranks' logs say of
// the blocks they do not all hold: which requests' store threads saved
// each such block's prompt on which rank is not logged, but every store
// thread's line (stored, skipped, loaded), a rank that skipped or failed a
// save, or a load that waited out --save-wait, is.
// (The residual disagreement is rare: seen once in some 30 runs.)
func explainDisagreement(t *testing.T, c *testenv.Cluster, held []map[uint64]bool) {
	t.Helper()
	for r := range held {
		alone := 0
		for h := range held[r] {
			for o := range held {
				if !held[o][h] {
					alone++
					break
				}
			}
		}
		t.Logf("rank %d: %d of its %d blocks not held by every rank", r, alone, len(held[r]))
	}
	for _, level := range []string{"level=WARN", "level=ERROR"} {
		lines := c.Logs.Lines(level)
		t.Logf("%d %s lines; the first 40:", len(lines), level)
		for _, l := range lines[:min(len(lines), 40)] {
			t.Log(l)
		}
	}
	for _, l := range c.Logs.Lines("msg=\"store thread\"") {
		t.Log(l)
	}
}

// dumpOf is the set of blocks rank r of group holds, from its dump.
func dumpOf(t *testing.T, nc *nats.Conn, group string, r int) map[uint64]bool {
	t.Helper()
	msg, err := nc.Request(messages.Subjects{}.Dump(group, r), nil, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	b, err := messages.DecodeKVEventBatch(msg.Data)
	if err != nil {
		t.Fatal(err)
	}
	if b.DumpChunks > 1 {
		t.Fatalf("a dump of %d chunks; this test reads one", b.DumpChunks)
	}
	held := map[uint64]bool{}
	for _, ev := range b.Events {
		for _, h := range ev.BlockHashes {
			held[h] = true
		}
	}
	return held
}
