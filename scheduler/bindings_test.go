package scheduler_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/testenv"
)

var discardLog = slog.New(slog.NewTextHandler(io.Discard, nil))

// bindingReplica is one scheduler replica's SessionBindings, on its own
// connection, running until the test ends.
type bindingReplica struct {
	b  *scheduler.SessionBindings
	js jetstream.JetStream
}

// startBindingReplicas opens the session bucket n times on one bus, each on
// its own connection, and runs each.
func startBindingReplicas(t *testing.T, n int, ttl time.Duration) []bindingReplica {
	t.Helper()
	logs := &testenv.LogBuffer{}
	t.Cleanup(func() {
		if t.Failed() {
			for _, l := range logs.Lines() {
				t.Log(l)
			}
		}
	})
	srv := testenv.StartNATS(t)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var out []bindingReplica
	for range n {
		js, err := jetstream.New(testenv.Connect(t, srv))
		if err != nil {
			t.Fatal(err)
		}
		b, err := scheduler.OpenSessionBindings(t.Context(), js, scheduler.SessionBindingsConfig{Bucket: scheduler.SessionBucket, TTL: ttl,
			Logger: slog.New(slog.NewTextHandler(logs, nil)).With("replica", len(out))})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			if err := b.Run(ctx); err != nil {
				t.Errorf("SessionBindings.Run: %v", err)
			}
		})
		out = append(out, bindingReplica{b, js})
	}
	// Registered after the connections: runs before they close.
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	return out
}

// storedBinding reads a session's binding straight from the bucket.
func storedBinding(t *testing.T, js jetstream.JetStream, session string) (scheduler.Binding, error) {
	t.Helper()
	kv, err := js.KeyValue(t.Context(), scheduler.SessionBucket)
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(t.Context(), messages.SessionKey(session))
	if err != nil {
		return scheduler.Binding{}, err
	}
	var b scheduler.Binding
	if err := json.Unmarshal(e.Value(), &b); err != nil {
		t.Fatalf("binding of %s in the bucket: %v", session, err)
	}
	return b, nil
}

func TestSessionBindingsReplicate(t *testing.T) {
	rs := startBindingReplicas(t, 2, time.Minute)
	a, b := rs[0].b, rs[1].b
	want := scheduler.Binding{Group: "g2", Blocks: 12, LastHash: 0xfeedface, Turn: 1}
	a.Record("conv-1", want)
	var got scheduler.Binding
	testenv.Eventually(t, waitFor, "the other replica sees the binding", func() bool {
		var ok bool
		got, ok = b.Get("conv-1")
		return ok
	})
	if got.UpdatedUnixMs == 0 || time.Since(time.UnixMilli(got.UpdatedUnixMs)) > time.Minute {
		t.Errorf("UpdatedUnixMs = %d, want about now", got.UpdatedUnixMs)
	}
	want.UpdatedUnixMs = got.UpdatedUnixMs
	if got != want {
		t.Errorf("replica b: %+v, want %+v", got, want)
	}
	testenv.Eventually(t, waitFor, "the writer sees its own binding", func() bool {
		g, ok := a.Get("conv-1")
		return ok && sameBinding(g, want)
	})
	if s, err := storedBinding(t, rs[0].js, "conv-1"); err != nil || !sameBinding(s, want) {
		t.Errorf("bucket holds %+v, %v; want %+v", s, err, want)
	}
	// Other sessions are unbound; the empty session never is.
	if g, ok := b.Get("conv-2"); ok {
		t.Errorf("Get(unbound) = %+v", g)
	}
	a.Record("", scheduler.Binding{Group: "g0", Turn: 1})
	for _, r := range rs {
		if g, ok := r.b.Get(""); ok {
			t.Errorf("Get(\"\") = %+v, true", g)
		}
	}
}

// TestSessionBindingsConcurrentRecordsConverge: both replicas record the same
// turn of a session on different groups at once. It depends on how each
// replica's Run interleaves its watcher and its write;
// TestSessionBindingsWriteAfterObservingAnotherReplica forces the ordering
// that leaves the replicas disagreeing.
func TestSessionBindingsConcurrentRecordsConverge(t *testing.T) {
	rs := startBindingReplicas(t, 2, time.Minute)
	for k := range 20 {
		session := fmt.Sprint("race-", k)
		// The same turn (the same prompt) placed on different groups by
		// the two replicas at once.
		var wg sync.WaitGroup
		for i, r := range rs {
			wg.Go(func() { r.b.Record(session, scheduler.Binding{Group: fmt.Sprint("g", i), Blocks: 4, Turn: 1}) })
		}
		wg.Wait()
		// Both replicas agree, and the bucket holds exactly that binding.
		var final scheduler.Binding
		for deadline := time.Now().Add(waitFor); ; time.Sleep(10 * time.Millisecond) {
			x, okx := rs[0].b.Get(session)
			y, oky := rs[1].b.Get(session)
			s, err := storedBinding(t, rs[0].js, session)
			if okx && oky && sameBinding(x, y) && err == nil && sameBinding(s, x) {
				final = x
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: replicas did not converge in %s: replica 0 %+v (%v), replica 1 %+v (%v), bucket %+v (%v)",
					session, waitFor, x, okx, y, oky, s, err)
			}
		}
		if final.Turn != 1 || final.Blocks != 4 || final.Group != "g0" && final.Group != "g1" {
			t.Errorf("%s: converged to %+v, not one of the two recorded bindings", session, final)
		}
		// It stays so: nothing is still in flight that changes it.
		time.Sleep(20 * time.Millisecond)
		for i, r := range rs {
			if g, _ := r.b.Get(session); !sameBinding(g, final) {
				t.Errorf("%s: replica %d moved to %+v after agreeing on %+v", session, i, g, final)
			}
		}
	}
}

func TestSessionBindingsLaterTurnOverwrites(t *testing.T) {
	rs := startBindingReplicas(t, 2, time.Minute)
	rs[0].b.Record("conv", scheduler.Binding{Group: "g0", Blocks: 4, Turn: 1})
	testenv.Eventually(t, waitFor, "turn 1 on replica b", func() bool {
		g, ok := rs[1].b.Get("conv")
		return ok && g.Turn == 1
	})
	// The next turn, placed by the other replica on another group.
	rs[1].b.Record("conv", scheduler.Binding{Group: "g3", Blocks: 9, Turn: 2})
	for i, r := range rs {
		testenv.Eventually(t, waitFor, fmt.Sprintf("turn 2 on replica %d", i), func() bool {
			g, ok := r.b.Get("conv")
			return ok && g.Turn == 2 && g.Group == "g3" && g.Blocks == 9
		})
	}
	if s, err := storedBinding(t, rs[0].js, "conv"); err != nil || s.Turn != 2 || s.Group != "g3" {
		t.Errorf("bucket holds %+v, %v; want turn 2 on g3", s, err)
	}
	// The same replica writes turn 3 right after: still in order.
	rs[1].b.Record("conv", scheduler.Binding{Group: "g1", Blocks: 15, Turn: 3})
	testenv.Eventually(t, waitFor, "turn 3 on replica a", func() bool {
		g, ok := rs[0].b.Get("conv")
		return ok && g.Turn == 3 && g.Group == "g1"
	})
}

func TestSessionBindingsExpire(t *testing.T) {
	const ttl = time.Second
	rs := startBindingReplicas(t, 2, ttl)
	rs[0].b.Record("short-lived", scheduler.Binding{Group: "g1", Blocks: 3, Turn: 1})
	testenv.Eventually(t, waitFor, "the binding on both replicas", func() bool {
		_, ok0 := rs[0].b.Get("short-lived")
		_, ok1 := rs[1].b.Get("short-lived")
		return ok0 && ok1
	})
	recorded := time.Now()
	testenv.Eventually(t, ttl+5*time.Second, "the binding gone everywhere after its TTL", func() bool {
		_, ok0 := rs[0].b.Get("short-lived")
		_, ok1 := rs[1].b.Get("short-lived")
		_, err := storedBinding(t, rs[1].js, "short-lived")
		return !ok0 && !ok1 && errors.Is(err, jetstream.ErrKeyNotFound)
	})
	if d := time.Since(recorded); d < ttl/2 {
		t.Errorf("binding gone after %s, TTL %s", d, ttl)
	}
	if _, err := scheduler.OpenSessionBindings(t.Context(), rs[0].js, scheduler.SessionBindingsConfig{Bucket: scheduler.SessionBucket, Logger: discardLog}); !errors.Is(err, scheduler.ErrConfig) {
		t.Errorf("OpenSessionBindings(ttl 0) = %v, want ErrConfig", err)
	}
}

// TestSchedulerReplicasAgreeOnBinding runs two scheduler replicas with the
// session policy on one bus: whichever dispatches a session's turn, both
// end up with the same binding.
func TestSchedulerReplicasAgreeOnBinding(t *testing.T) {
	srv := testenv.StartNATS(t)
	nc := testenv.Connect(t, srv)
	var subj messages.Subjects
	groups := []string{"g0", "g1", "g2", "g3"}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var scheds []*scheduler.Scheduler
	for i := range 2 {
		s, err := scheduler.New(scheduler.Config{
			Conn: testenv.Connect(t, srv), ID: fmt.Sprint("sched-", i), Policy: &scheduler.SessionPolicy{Epsilon: 0.25},
			HeartbeatTimeout: time.Second, Logger: discardLog,
		})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			if err := s.Run(ctx); err != nil {
				t.Errorf("replica %d: Run: %v", i, err)
			}
		})
		scheds = append(scheds, s)
	}
	// Fake ranks: one per group, heartbeating every 50 ms, answering every
	// ReqMeta with a RankResult.
	metas := make(chan *messages.ReqMeta, 16)
	sub, err := nc.Subscribe(subj.MetaGroup("*"), func(m *nats.Msg) {
		meta, err := messages.DecodeReqMeta(m.Data)
		if err != nil {
			t.Errorf("bad ReqMeta: %v", err)
			return
		}
		metas <- meta
		data, err := messages.Marshal(&messages.RankResult{ReqID: meta.ReqID, Group: meta.Group, Attempt: meta.Attempt,
			StoredBlocks: len(meta.BlockHashes)})
		if err == nil {
			err = nc.Publish(meta.ResultSubject, data)
		}
		if err != nil && !errors.Is(err, nats.ErrConnectionClosed) { // closed: the test is ending
			t.Errorf("answer: %v", err)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	// Each rank answers a dump request: it holds nothing yet.
	for _, g := range groups {
		if _, err := nc.Subscribe(subj.Dump(g, 0), func(m *nats.Msg) {
			data, err := messages.Marshal(&messages.KVEventBatch{Group: g, Rank: 0,
				Events: []messages.KVEvent{{Type: messages.EventAllBlocksCleared}}})
			if err == nil {
				err = m.Respond(data)
			}
			if err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
				t.Errorf("dump: %v", err)
			}
		}); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	hbDone := make(chan struct{})
	go func() {
		defer close(hbDone)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			for _, g := range groups {
				data, _ := messages.Marshal(&messages.Heartbeat{Group: g, WorldSize: 1, Model: testModel, StartedUnixMs: 1})
				_ = nc.Publish(subj.Heartbeat(g, 0), data)
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-hbDone
		wg.Wait()
		_ = sub.Unsubscribe()
	})
	for i, s := range scheds {
		testenv.Eventually(t, waitFor, fmt.Sprintf("replica %d sees 4 ready groups", i), func() bool { return s.ReadyGroups() == 4 })
	}

	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	const session = "shared-conversation"
	req := newRequest("turn-1", session, testenv.PromptTokens(11, 200))
	data, err := messages.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(t.Context(), subj.Request(testModel), data, jetstream.WithMsgID(req.RequestID)); err != nil {
		t.Fatal(err)
	}
	var meta *messages.ReqMeta
	select {
	case meta = <-metas:
	case <-time.After(waitFor):
		t.Fatal("no ReqMeta for turn 1")
	}
	if meta.ReqID != "turn-1" || meta.SessionID != session {
		t.Fatalf("ReqMeta %s of session %q", meta.ReqID, meta.SessionID)
	}
	for i, s := range scheds {
		testenv.Eventually(t, waitFor, fmt.Sprintf("replica %d bound the session to %s", i, meta.Group), func() bool {
			b, ok := s.Bindings().Get(session)
			return ok && b.Group == meta.Group && b.Turn == 1 && b.Blocks == 200/16
		})
	}
	b0, _ := scheds[0].Bindings().Get(session)
	b1, _ := scheds[1].Bindings().Get(session)
	if !sameBinding(b0, b1) {
		t.Errorf("replicas disagree: %+v vs %+v", b0, b1)
	}
	wantHashes := scheduler.HashBlocks(nil, scheduler.HashSeed(testModel), req.PromptTokenIDs, 16)
	if b0.LastHash != wantHashes[len(wantHashes)-1] {
		t.Errorf("LastHash %x, want the last block's %x", b0.LastHash, wantHashes[len(wantHashes)-1])
	}
	for i, s := range scheds {
		testenv.Eventually(t, waitFor, fmt.Sprintf("replica %d has no trackers left", i), func() bool { return s.Trackers() == 0 })
	}
	// Turn 2 extends the prompt: whichever replica takes it, it goes to the
	// bound group as turn 2.
	req2 := newRequest("turn-2", session, testenv.PromptTokens(11, 260))
	copy(req2.PromptTokenIDs, req.PromptTokenIDs)
	if data, err = messages.Marshal(req2); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(t.Context(), subj.Request(testModel), data, jetstream.WithMsgID(req2.RequestID)); err != nil {
		t.Fatal(err)
	}
	select {
	case m2 := <-metas:
		if m2.ReqID != "turn-2" || m2.Group != meta.Group {
			t.Errorf("turn 2: ReqMeta %s on %s, want turn-2 on the bound %s", m2.ReqID, m2.Group, meta.Group)
		}
	case <-time.After(waitFor):
		t.Fatal("no ReqMeta for turn 2")
	}
	for i, s := range scheds {
		testenv.Eventually(t, waitFor, fmt.Sprintf("replica %d sees turn 2", i), func() bool {
			b, ok := s.Bindings().Get(session)
			return ok && b.Group == meta.Group && b.Turn == 2 && b.Blocks == 260/16
		})
	}
}

// TestBindingAgeWhateverTheWritersClock: a binding's age, which decides
// whether the turn's blocks are credited to its group before their KV
// events come (PlanTTL) and whether the group lost its cache since, is
// the age its writer gave it, not its updated_unix_ms read on the
// reader's clock. Entries are written into the bucket as replicas whose
// clocks run a minute behind and a minute ahead write them: read on the
// reader's clock, the first's binding made just now was a minute old (its
// blocks never credited), the second's, made 11 s before, 49 s in the
// future (credited for 70 s). A binding of an older kvbus (no
// written_unix_ms) is read on the reader's clock, as before, but is never
// newer than its receipt; and one the bucket held when the watch began is
// no newer than it says.
func TestBindingAgeWhateverTheWritersClock(t *testing.T) {
	const planTTL = 10 * time.Second // the scheduler's default PlanTTL
	rs := startBindingReplicas(t, 2, time.Hour)
	reader := rs[1].b
	kv, err := rs[0].js.KeyValue(t.Context(), scheduler.SessionBucket)
	if err != nil {
		t.Fatal(err)
	}
	put := func(session string, v map[string]any) {
		t.Helper()
		data, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := kv.Put(t.Context(), messages.SessionKey(session), data); err != nil {
			t.Fatal(err)
		}
	}
	// The reader's watcher runs: a binding written by the other replica
	// reaches it.
	rs[0].b.Record("warm-up", scheduler.Binding{Group: "g0", Blocks: 1, LastHash: 1, Turn: 1})
	testenv.Eventually(t, waitFor, "the reader watching", func() bool { _, ok := reader.Get("warm-up"); return ok })

	now := time.Now()
	ms := func(d time.Duration) int64 { return now.Add(d).UnixMilli() }
	// A replica a minute behind, its binding made as it wrote it.
	put("behind", map[string]any{"model": "m", "group": "g1", "blocks": 4, "last_hash": 7, "turn": 2,
		"updated_unix_ms": ms(-time.Minute), "written_unix_ms": ms(-time.Minute)})
	// A replica a minute ahead, its binding made 11 s before it wrote it,
	// and another model's made 3 s before.
	put("ahead", map[string]any{"model": "m", "group": "g2", "blocks": 4, "last_hash": 7, "turn": 2,
		"updated_unix_ms": ms(time.Minute - 11*time.Second), "written_unix_ms": ms(time.Minute),
		"others": map[string]any{"n": map[string]any{"model": "n", "group": "g3", "blocks": 1, "last_hash": 1, "turn": 1,
			"updated_unix_ms": ms(time.Minute - 3*time.Second)}}})
	// An older kvbus's, a minute ahead and 3 s behind.
	put("old-ahead", map[string]any{"group": "g4", "blocks": 4, "last_hash": 7, "turn": 2, "updated_unix_ms": ms(time.Minute)})
	put("old-behind", map[string]any{"group": "g5", "blocks": 4, "last_hash": 7, "turn": 2, "updated_unix_ms": ms(-3 * time.Second)})

	// ageOn is how old a binding is on the reader's clock, once it has it.
	ageOn := func(r *scheduler.SessionBindings, model, session string) time.Duration {
		t.Helper()
		var b scheduler.Binding
		testenv.Eventually(t, waitFor, session+" heard", func() bool {
			var ok bool
			b, ok = r.GetModel(model, session)
			return ok
		})
		return time.Since(time.UnixMilli(b.UpdatedUnixMs))
	}
	age := func(model, session string) time.Duration { t.Helper(); return ageOn(reader, model, session) }
	between := func(what string, got, lo, hi time.Duration) {
		t.Helper()
		if got < lo || got > hi {
			t.Errorf("%s: %v old on the reader's clock, want %v to %v", what, got.Round(time.Millisecond), lo, hi)
		}
	}
	slack := 2 * time.Second // delivery, and the time since now
	between("a binding just made by a replica a minute behind", age("m", "behind"), 0, slack)
	if a := age("m", "behind"); a >= planTTL {
		t.Errorf("a binding just made is not fresh (%v old)", a)
	}
	between("a binding made 11 s before by a replica a minute ahead", age("m", "ahead"), 11*time.Second, 11*time.Second+slack)
	between("its session's binding of another model, made 3 s before", age("n", "ahead"), 3*time.Second, 3*time.Second+slack)
	between("an older kvbus's binding, a minute ahead", age("", "old-ahead"), 0, slack)
	between("an older kvbus's binding, 3 s behind", age("", "old-behind"), 3*time.Second, 3*time.Second+slack)

	// What the bucket held when a watch begins may have waited there: a
	// replica that starts now takes the behind replica's binding as its
	// updated_unix_ms says (older, not fresher), the ahead replica's as no
	// newer than its age when written.
	late := startBindingReplicasOn(t, rs[0].js, time.Hour)
	lateAge := func(model, session string) time.Duration { t.Helper(); return ageOn(late, model, session) }
	between("a replayed binding of a replica a minute behind", lateAge("m", "behind"), time.Minute, time.Minute+slack)
	if a := lateAge("m", "ahead"); a < 11*time.Second {
		t.Errorf("a replayed binding made 11 s before its write is %v old", a.Round(time.Millisecond))
	}
}

// startBindingReplicasOn opens and runs one more replica's SessionBindings
// on js, until the test ends.
func startBindingReplicasOn(t *testing.T, js jetstream.JetStream, ttl time.Duration) *scheduler.SessionBindings {
	t.Helper()
	b, err := scheduler.OpenSessionBindings(t.Context(), js, scheduler.SessionBindingsConfig{Bucket: scheduler.SessionBucket, TTL: ttl, Logger: discardLog})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := b.Run(ctx); err != nil {
			t.Errorf("SessionBindings.Run: %v", err)
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return b
}

// sameBinding reports whether two replicas' copies of a binding agree: one
// replica's updated_unix_ms is the writer's, less the time the other took
// to hear it (TestBindingAgeWhateverTheWritersClock).
func sameBinding(a, b scheduler.Binding) bool {
	d := a.UpdatedUnixMs - b.UpdatedUnixMs
	a.UpdatedUnixMs = b.UpdatedUnixMs
	return a == b && d > -1000 && d < 1000
}

// TestSessionMarkersLiveAMinute: an expired binding leaves a delete marker
// (its watchers hear of the expiry) for a minute at most. It lived the
// bucket's TTL (30 min by default), so the bucket held a marker for every
// binding expired in the last TTL: about twice the live bindings in a
// soak. A bucket whose TTL is shorter keeps its markers that long.
func TestSessionMarkersLiveAMinute(t *testing.T) {
	for _, tc := range []struct{ ttl, want time.Duration }{
		{30 * time.Minute, time.Minute},
		{5 * time.Second, 5 * time.Second},
	} {
		srv := testenv.StartNATS(t)
		js, err := jetstream.New(testenv.Connect(t, srv))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := scheduler.OpenSessionBindings(t.Context(), js, scheduler.SessionBindingsConfig{Bucket: scheduler.SessionBucket, TTL: tc.ttl, Logger: discardLog}); err != nil {
			t.Fatal(err)
		}
		st, err := js.Stream(t.Context(), "KV_"+scheduler.SessionBucket)
		if err != nil {
			t.Fatal(err)
		}
		if got := st.CachedInfo().Config.SubjectDeleteMarkerTTL; got != tc.want {
			t.Errorf("session TTL %s: delete markers live %s, want %s", tc.ttl, got, tc.want)
		}
	}
}
