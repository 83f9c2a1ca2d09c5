package workers

import (
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

func TestMemStoreRecent(t *testing.T) {
	ctx := t.Context()
	s, _ := newTestStore(t, 1000)
	for i, k := range []string{"a", "b", "c", "d"} {
		s.BatchPut(ctx, []Object{{Key: k, Hash: uint64(i), Value: val(10, byte(i)), Size: 100, Group: "s" + k}})
	}
	s.BatchGet(ctx, []string{"a"}, RecencyNow) // recency, newest first: a d c b
	keys := func(objs []Object) []string {
		var out []string
		for _, o := range objs {
			out = append(out, o.Key)
		}
		return out
	}
	if got := keys(s.Recent(250)); !slices.Equal(got, []string{"a", "d"}) {
		t.Fatalf("Recent(250) = %v, want [a d] (charged sizes count, newest first)", got)
	}
	if got := keys(s.Recent(1 << 20)); !slices.Equal(got, []string{"a", "d", "c", "b"}) {
		t.Fatalf("Recent(all) = %v", got)
	}
	if got := s.Recent(99); len(got) != 0 {
		t.Fatalf("Recent(99) = %v, want nothing (no object fits)", got)
	}
	// Listing does not touch recency: b is still the least recently used.
	if got := keys(s.Recent(1 << 20)); got[3] != "b" {
		t.Fatalf("after Recent, recency = %v", got)
	}
	if o := s.Recent(100)[0]; o.Value != nil || o.Group != "sa" || o.Hash != 0 || o.Size != 100 {
		t.Fatalf("Recent entry = %+v, want hash, size and group without the value", o)
	}
}

// drainingRank is rank 0 of g0 (one rank, the tiny profile) with a store
// of 100 blocks and a hand-off budget of budget blocks; blk is a block's
// size.
func drainingRank(t *testing.T, budget int64) (r *Rank, store *MemStore, blk int64) {
	t.Helper()
	profile, err := LookupModelProfile("tiny")
	if err != nil {
		t.Fatal(err)
	}
	r = &Rank{cfg: RankConfig{Group: "g0", Model: "m", BlockSize: 16, Profile: profile, TPSize: 1, HeartbeatInterval: time.Second}}
	blk = int64(r.blockBytes(16))
	r.cfg.DrainHandoff = budget * blk
	store, _ = newTestStore(t, 100*blk)
	r.store = store
	return r, store, blk
}

// TestDrainPlan: whole sessions, newest first, within the budget; each to
// the ready group (same model and world size, every rank fresh, none
// draining) with the most free room left.
func TestDrainPlan(t *testing.T) {
	ctx := t.Context()
	r, store, blk := drainingRank(t, 5)
	put := func(session string, hashes ...uint64) {
		for _, h := range hashes {
			store.BatchPut(ctx, []Object{{Key: StoreKey("m", 0, h), Hash: h, Value: []byte{1}, Size: blk, Group: session}})
		}
	}
	put("old", 1, 2)                   // beyond the listing
	put("big", 20, 21, 22, 23, 24, 25) // 6 blocks: cut by the listing, and over the budget
	put("s3", 30, 31)                  // 2 blocks
	put("s1", 10, 11, 12)              // newest, 3 blocks
	hb := func(group, model string, rank, world int, draining bool, used int64) {
		data, _ := messages.Marshal(&messages.Heartbeat{Group: group, TPRank: rank, WorldSize: world, Model: model,
			CapacityBlocks: 100, UsedBlocks: used, Draining: draining})
		subject := messages.Subjects{Prefix: "kvbus"}.Heartbeat(group, rank)
		if err := r.peers.onHeartbeat(ctx, &nats.Msg{Subject: subject, Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	hb("g0", "m", 0, 1, true, 0)   // itself
	hb("g1", "m", 0, 1, false, 98) // 2 blocks free
	hb("g2", "m", 0, 1, false, 96) // 4 blocks free
	hb("g3", "m", 0, 1, true, 0)   // draining too
	hb("g4", "other", 0, 1, false, 0)
	hb("g5", "m", 0, 2, false, 0) // one of its two ranks is silent
	hb("g6", "m", 0, 2, false, 0) // all free, but two ranks where g0 has one
	hb("g6", "m", 1, 2, false, 0)
	plan := r.drainPlan()
	want := []messages.HandoffTarget{
		{Group: "g2", Runs: []messages.HandoffRun{{Session: "s1", BlockHashes: messages.BlockHashes{12, 11, 10}}}},
		{Group: "g1", Runs: []messages.HandoffRun{{Session: "s3", BlockHashes: messages.BlockHashes{31, 30}}}},
	}
	if len(plan.Targets) != len(want) {
		t.Fatalf("plan targets %+v, want %+v", plan.Targets, want)
	}
	for i := range want {
		got := plan.Targets[i]
		if got.Group != want[i].Group || len(got.Runs) != 1 || got.Runs[0].Session != want[i].Runs[0].Session ||
			!slices.Equal(got.Runs[0].BlockHashes, want[i].Runs[0].BlockHashes) {
			t.Fatalf("plan target %d = %+v, want %+v", i, got, want[i])
		}
	}
	if plan.Group != "g0" || plan.Model != "m" || plan.BlockSize != 16 {
		t.Fatalf("plan header %+v", plan)
	}
}

func TestLoadTokens(t *testing.T) {
	meta := &messages.ReqMeta{BlockSize: 16, LoadSpec: &messages.LoadSpec{CanLoad: true, KVPoolCachedTokens: 10 * 16,
		Remote: []messages.RemoteRun{{Group: "g1", FromBlock: 4, Blocks: 3}, {Group: "g2", FromBlock: 7, Blocks: 9}}}}
	// Blocks 0-3 local, 4-9 remote (the second run is cut at the 10 loaded blocks).
	if local, remote := loadTokens(meta); local != 4*16 || remote != 6*16 {
		t.Fatalf("loadTokens = %d local, %d remote; want %d, %d", local, remote, 4*16, 6*16)
	}
	meta.LoadSpec.CanLoad = false
	if local, remote := loadTokens(meta); local != 0 || remote != 0 {
		t.Fatalf("loadTokens without CanLoad = %d, %d", local, remote)
	}
}

// TestDrainPlanLeavesOutCutSessions: a session of which the listing saw
// only its newest blocks — its oldest, the head of its prefix, fell past
// the end — is not handed off; a whole one listed after it is.
func TestDrainPlanLeavesOutCutSessions(t *testing.T) {
	ctx := t.Context()
	r, store, blk := drainingRank(t, 3) // 6 blocks listed
	put := func(session string, h uint64) {
		store.BatchPut(ctx, []Object{{Key: StoreKey("m", 0, h), Hash: h, Value: []byte{1}, Size: blk, Group: session}})
	}
	// Oldest first: A's head (1) is the least recently used block.
	put("A", 1)
	put("C", 31)
	put("C", 32)
	put("A", 2)
	put("B", 21)
	put("B", 22)
	put("A", 3)
	data, err := messages.Marshal(&messages.Heartbeat{Group: "g1", TPRank: 0, WorldSize: 1, Model: "m", CapacityBlocks: 100})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.peers.onHeartbeat(ctx, &nats.Msg{Subject: messages.Subjects{Prefix: "kvbus"}.Heartbeat("g1", 0), Data: data}); err != nil {
		t.Fatal(err)
	}
	var sessions []string
	for _, tg := range r.drainPlan().Targets {
		for _, run := range tg.Runs {
			sessions = append(sessions, run.Session)
		}
	}
	if !slices.Equal(sessions, []string{"B"}) {
		t.Errorf("handed off sessions %v, want [B]: A is cut (its head is past the listing), C would exceed the budget after B", sessions)
	}
}
