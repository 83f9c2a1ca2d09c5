package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// embeddedConn connects to an embedded server of the test's own.
func embeddedConn(t *testing.T) *nats.Conn {
	t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// openTestBindings opens the session bucket on an embedded server without
// running the watcher: the test feeds observe and write itself, in the order
// Run could interleave them.
func openTestBindings(t *testing.T) (*SessionBindings, jetstream.KeyValue) {
	t.Helper()
	js, err := jetstream.New(embeddedConn(t))
	if err != nil {
		t.Fatal(err)
	}
	b, err := OpenSessionBindings(t.Context(), js, SessionBindingsConfig{Bucket: SessionBucket, TTL: time.Minute, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	return b, b.kv
}

func bucketBinding(t *testing.T, kv jetstream.KeyValue, key string) (Binding, jetstream.KeyValueEntry) {
	t.Helper()
	e, err := kv.Get(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	var b Binding
	if err := json.Unmarshal(e.Value(), &b); err != nil {
		t.Fatal(err)
	}
	return b, e
}

// TestSessionBindingsWriteAfterObservingAnotherReplica: this replica records
// g1 for a session; before its queued write runs, its watcher delivers
// another replica's binding (g0) of the same session. The write then
// compare-and-sets g1 over g0 and succeeds, so the bucket — and every other
// replica — holds g1. This replica must hold g1 too; it must not keep g0
// under g1's revision (the watcher's copy of g1 would then be ignored and the
// replicas would disagree for good).
func TestSessionBindingsWriteAfterObservingAnotherReplica(t *testing.T) {
	b, kv := openTestBindings(t)
	const session = "shared"
	key := messages.SessionKey(session)
	ctx := context.Background()

	// Another replica's binding, already in the bucket.
	other := Binding{Group: "g0", Blocks: 4, Turn: 1, UpdatedUnixMs: time.Now().UnixMilli()}
	data, _ := json.Marshal(other)
	if _, err := kv.Create(ctx, key, data); err != nil {
		t.Fatal(err)
	}
	// This replica decides g1 for the same turn.
	b.Record(session, Binding{Group: "g1", Blocks: 5, Turn: 1})
	wr := <-b.writes
	// Run's select takes the watcher's entry first, then the write.
	_, e := bucketBinding(t, kv, key)
	b.observe(e, true)
	b.write(ctx, wr)

	stored, e2 := bucketBinding(t, kv, key)
	// The watcher now delivers what the write stored.
	b.observe(e2, true)
	local, ok := b.Get(session)
	if !ok {
		t.Fatal("no local binding")
	}
	if local.Group != stored.Group || local.Blocks != stored.Blocks {
		t.Errorf("local binding %+v (rev %d), bucket %+v (rev %d): the replica disagrees with the bucket",
			local, b.local[key].rev, stored, e2.Revision())
	}
}

// TestSessionBindingsRecordThenWrite: without interference the local copy,
// the revision and the bucket agree after the write.
func TestSessionBindingsRecordThenWrite(t *testing.T) {
	b, kv := openTestBindings(t)
	ctx := context.Background()
	for turn := 1; turn <= 3; turn++ {
		want := Binding{Group: "g2", Blocks: 4 * turn, Turn: turn}
		b.Record("conv", want)
		got, ok := b.Get("conv")
		if !ok || got.Group != want.Group || got.Turn != turn {
			t.Fatalf("turn %d: before the write, Get = %+v, %v; want its own decision at once", turn, got, ok)
		}
		b.write(ctx, <-b.writes)
		stored, e := bucketBinding(t, kv, messages.SessionKey("conv"))
		if stored != got || b.local[messages.SessionKey("conv")].rev != e.Revision() {
			t.Errorf("turn %d: bucket %+v rev %d, local %+v rev %d", turn, stored, e.Revision(), got, b.local[messages.SessionKey("conv")].rev)
		}
	}
}

// TestSessionBindingsLaggingReplicaNumbersTheNextTurn: another replica
// recorded turn 2; this one, whose watcher has heard only of turn 1, places
// the next turn and numbers it 2 again. Its write finds turn 2 stored with
// a shorter prompt: it is the turn after, stored as turn 3 (it was dropped,
// and both replicas kept turn 2 for good).
func TestSessionBindingsLaggingReplicaNumbersTheNextTurn(t *testing.T) {
	b, kv := openTestBindings(t)
	const session = "lagging"
	key := messages.SessionKey(session)
	ctx := context.Background()
	put := func(bd Binding, rev uint64) jetstream.KeyValueEntry {
		bd.UpdatedUnixMs = time.Now().UnixMilli()
		data, _ := json.Marshal(bd)
		var err error
		if rev == 0 {
			_, err = kv.Create(ctx, key, data)
		} else {
			_, err = kv.Update(ctx, key, data, rev)
		}
		if err != nil {
			t.Fatal(err)
		}
		_, e := bucketBinding(t, kv, key)
		return e
	}
	e1 := put(Binding{Group: "g0", Blocks: 4, Turn: 1}, 0)
	b.observe(e1, true)                                          // this replica heard of turn 1 ...
	put(Binding{Group: "g0", Blocks: 8, Turn: 2}, e1.Revision()) // ... not yet of turn 2

	prev, _ := b.Get(session)
	b.Record(session, Binding{Group: "g0", Blocks: 12, Turn: prev.Turn + 1})
	b.write(ctx, <-b.writes)
	stored, _ := bucketBinding(t, kv, key)
	if stored.Turn != 3 || stored.Blocks != 12 {
		t.Fatalf("bucket holds %+v; want the 12-block prompt as turn 3", stored)
	}
	if local, _ := b.Get(session); local.Turn != 3 {
		t.Errorf("this replica holds %+v; want turn 3", local)
	}
}

// TestBindingTurnOf: a request is the turn after its session's binding,
// unless it is that turn asked again (redelivered, adopted, or the
// frontend's copy of a request whose answer was lost) with its prompt.
func TestBindingTurnOf(t *testing.T) {
	b := Binding{Blocks: 3, LastHash: 30, Turn: 2}
	for _, tt := range []struct {
		name   string
		hashes []uint64
		again  bool
		want   int
	}{
		{"the next turn", []uint64{10, 20, 30, 40}, false, 3},
		{"the next turn, asked again", []uint64{10, 20, 30, 40}, true, 3},
		{"the same prompt, not asked again (a client's retry is a new request)", []uint64{10, 20, 30}, false, 3},
		{"the same prompt asked again", []uint64{10, 20, 30}, true, 2},
		{"as many blocks, another prompt", []uint64{10, 20, 31}, true, 3},
		{"fewer blocks", []uint64{10, 20}, true, 3},
	} {
		if got := b.turnOf(tt.hashes, tt.again); got != tt.want {
			t.Errorf("%s: turn %d, want %d", tt.name, got, tt.want)
		}
	}
	if got := (Binding{Turn: 1}).turnOf(nil, true); got != 1 {
		t.Errorf("a prompt shorter than a block asked again after such a turn: turn %d, want 1", got)
	}
}

// TestDroppedBindingWritesArePruned: bindings whose write never reached
// the bucket (dropped from a full queue, or failed) get no expiry marker
// from it; they leave this replica's memory once expired, as the others
// do, instead of staying for good. A live one stays.
func TestDroppedBindingWritesArePruned(t *testing.T) {
	b, _ := openTestBindings(t) // TTL 1 min; not running: writes queue, then drop
	n := cap(b.writes) + 100
	for i := range n {
		b.Record(fmt.Sprintf("s-%d", i), Binding{Group: "g0", Blocks: 1, Turn: 1})
	}
	b.mu.RLock()
	held := len(b.local)
	b.mu.RUnlock()
	if held != n {
		t.Fatalf("%d bindings held, want %d", held, n)
	}
	b.pruneExpired(time.Now())
	if _, ok := b.Get("s-0"); !ok {
		t.Fatal("a live binding was pruned")
	}
	b.pruneExpired(time.Now().Add(b.ttl + time.Second))
	b.mu.RLock()
	left := len(b.local)
	b.mu.RUnlock()
	if left != 0 {
		t.Errorf("%d of %d bindings (%d of them dropped from the full queue) still held after their TTL", left, n, n-cap(b.writes))
	}
}

// TestSessionBindingsKeepALaterTurnOverAnEarlierWrite: this replica placed
// a session's turn 2 on g1 (or heard from another replica's save plan that
// turn 3 went to g2) when its watcher delivers the bucket's write of an
// earlier turn, made by another replica. The later turn stays this
// replica's binding until its own write is stored; before, the earlier
// write replaced it, and a next turn placed in between credited the turn
// before's group (a review with two replicas, 4 groups of 4 worker
// processes and 60 conversations: turns that found 384 of 480 due tokens,
// the turn before's prefix).
func TestSessionBindingsKeepALaterTurnOverAnEarlierWrite(t *testing.T) {
	b, kv := openTestBindings(t)
	const session = "later"
	key := messages.SessionKey(session)
	ctx := context.Background()
	put := func(bd Binding) jetstream.KeyValueEntry {
		bd.UpdatedUnixMs = time.Now().UnixMilli()
		data, _ := json.Marshal(sessionEntry{Binding: bd, WrittenUnixMs: bd.UpdatedUnixMs})
		e, err := kv.Get(ctx, key)
		if err == nil {
			_, err = kv.Update(ctx, key, data, e.Revision())
		} else {
			_, err = kv.Create(ctx, key, data)
		}
		if err != nil {
			t.Fatal(err)
		}
		_, e = bucketBinding(t, kv, key)
		return e
	}
	b.RecordModel("m", session, Binding{Group: "g1", Blocks: 14, LastHash: 14, Turn: 2})
	wr := <-b.writes // queued behind others
	b.observe(put(Binding{Model: "m", Group: "g0", Blocks: 8, LastHash: 8, Turn: 1}), true)
	if got, _ := b.GetModel("m", session); got.Group != "g1" || got.Turn != 2 {
		t.Errorf("after another replica's write of turn 1, the binding is %+v; want turn 2 on g1, recorded here", got)
	}
	b.write(ctx, wr)
	if stored, _ := bucketBinding(t, kv, key); stored.Group != "g1" || stored.Turn != 2 {
		t.Errorf("the bucket holds %+v; want turn 2 on g1", stored)
	}

	// Turn 3, heard from another replica's save plan, then the bucket's
	// write of turn 2 by a third.
	b.heard("m", key, Binding{Group: "g2", Blocks: 20, LastHash: 20, Turn: 3})
	b.observe(put(Binding{Model: "m", Group: "g1", Blocks: 14, LastHash: 14, Turn: 2}), true)
	if got, _ := b.GetModel("m", session); got.Group != "g2" || got.Turn != 3 {
		t.Errorf("after the bucket's write of turn 2, the binding is %+v; want turn 3 on g2, heard from its plan", got)
	}
	// Its own write confirms it; a later write of another replica wins.
	b.observe(put(Binding{Model: "m", Group: "g2", Blocks: 20, LastHash: 20, Turn: 3}), true)
	b.observe(put(Binding{Model: "m", Group: "g3", Blocks: 26, LastHash: 26, Turn: 4}), true)
	if got, _ := b.GetModel("m", session); got.Group != "g3" || got.Turn != 4 {
		t.Errorf("after the bucket's write of turn 4, the binding is %+v; want turn 4 on g3", got)
	}
}

// TestSessionBindingsWriteConflictKeepsALaterTurn: this replica recorded
// turns 2 and 3 of a session, both writes queued, when another replica's
// write of turn 1 is stored. The write of turn 2 meets it, rereads and
// stores turn 2 after it; this replica holds turn 3 all along (before, the
// reread put turn 1 in its place, and the stored turn 2 stayed until turn
// 3's write ran: a next turn placed meanwhile credited turn 2's group).
func TestSessionBindingsWriteConflictKeepsALaterTurn(t *testing.T) {
	b, kv := openTestBindings(t)
	const session = "conflict"
	key := messages.SessionKey(session)
	ctx := context.Background()
	b.RecordModel("m", session, Binding{Group: "g1", Blocks: 14, LastHash: 14, Turn: 2})
	wr2 := <-b.writes
	time.Sleep(2 * time.Millisecond) // turn 3 is recorded later
	b.RecordModel("m", session, Binding{Group: "g2", Blocks: 20, LastHash: 20, Turn: 3})
	wr3 := <-b.writes
	now := time.Now().UnixMilli()
	data, _ := json.Marshal(sessionEntry{Binding: Binding{Model: "m", Group: "g0", Blocks: 8, LastHash: 8, Turn: 1, UpdatedUnixMs: now}, WrittenUnixMs: now})
	if _, err := kv.Create(ctx, key, data); err != nil {
		t.Fatal(err)
	}
	b.write(ctx, wr2)
	if stored, _ := bucketBinding(t, kv, key); stored.Group != "g1" || stored.Turn != 2 {
		t.Errorf("the bucket holds %+v; want turn 2 on g1", stored)
	}
	if got, _ := b.GetModel("m", session); got.Group != "g2" || got.Turn != 3 {
		t.Errorf("after turn 2's write met turn 1, this replica holds %+v; want turn 3 on g2", got)
	}
	b.write(ctx, wr3)
	if stored, _ := bucketBinding(t, kv, key); stored.Group != "g2" || stored.Turn != 3 {
		t.Errorf("the bucket holds %+v; want turn 3 on g2", stored)
	}
}
