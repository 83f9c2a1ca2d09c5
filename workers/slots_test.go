package workers_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/workers"
)

func TestClaimSlots(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	cfg := workers.SlotConfig{Size: 4, TTL: time.Second}
	var slots []*workers.Slot
	for i := range 6 {
		cfg.Owner = fmt.Sprint("w", i)
		s, err := workers.ClaimSlot(t.Context(), js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		slots = append(slots, s)
	}
	// Groups fill in order, ranks in order.
	for i, s := range slots {
		if want := fmt.Sprintf("g%d/%d", i/4, i%4); fmt.Sprintf("%s/%d", s.Group, s.Rank) != want {
			t.Errorf("worker %d got %s/%d, want %s", i, s.Group, s.Rank, want)
		}
	}
	// A released slot goes to the next worker.
	if err := slots[1].Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	next, err := workers.ClaimSlot(t.Context(), js, cfg)
	if err != nil || next.Group != "g0" || next.Rank != 1 {
		t.Fatalf("after a release: %+v, %v; want g0/1", next, err)
	}
	// Held slots stay; an abandoned one expires after the TTL and is taken.
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	for _, s := range []*workers.Slot{slots[0], next, slots[2], slots[3], slots[4]} {
		go func() { _ = s.Hold(ctx) }()
	}
	testenv.Eventually(t, 5*time.Second, "the abandoned slot g1/1 taken", func() bool {
		s, err := workers.ClaimSlot(t.Context(), js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if s.Group == "g1" && s.Rank == 1 {
			return true
		}
		_ = s.Release(t.Context()) // a new slot (g1/2): not the one we wait for
		return false
	})
}

// TestClaimSlotsOfOneGroup: a worker given a group (--rank auto --group g7,
// the way a key of one group is used) claims only that group's ranks, says
// so when they are all held, and never moves to another group to make it
// whole.
func TestClaimSlotsOfOneGroup(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	// g0 has one rank held: a worker of any group would make it whole.
	if _, err := workers.ClaimSlot(t.Context(), js, workers.SlotConfig{Size: 2, TTL: 10 * time.Second, Owner: "other"}); err != nil {
		t.Fatal(err)
	}
	cfg := workers.SlotConfig{Size: 2, TTL: 600 * time.Millisecond, Group: "g7"}
	var slots []*workers.Slot
	for i := range 2 {
		cfg.Owner = fmt.Sprint("w", i)
		s, err := workers.ClaimSlot(t.Context(), js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if s.Group != "g7" || s.Rank != i {
			t.Errorf("worker %d of g7 got %s/%d, want g7/%d", i, s.Group, s.Rank, i)
		}
		slots = append(slots, s)
	}
	if _, err := workers.ClaimSlot(t.Context(), js, cfg); !errors.Is(err, workers.ErrNoSlot) || !strings.Contains(err.Error(), "group g7") {
		t.Errorf("a third worker of g7: %v, want ErrNoSlot naming g7", err)
	}
	// Release g7/1: g7/0 is alone in its group, g0 has one rank too; a
	// worker bound to g7 stays there (an unbound one would move to g0).
	if err := slots[1].Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 1500*time.Millisecond)
	defer cancel()
	if err := slots[0].Hold(ctx); err != nil {
		t.Errorf("a worker bound to g7 left its slot: %v (now %s/%d)", err, slots[0].Group, slots[0].Rank)
	}
}

// TestSlotsKeepModelsApart: workers of two models claiming --rank auto
// slots of one bucket form groups of one model each: a worker skips a group
// held for another model, and regroups only into a group of its own. Before,
// slots ignored the model, so workers started a, b, a, b made two groups of
// both models, which the schedulers refuse.
func TestSlotsKeepModelsApart(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	claim := func(model string) *workers.Slot {
		t.Helper()
		s, err := workers.ClaimSlot(t.Context(), js, workers.SlotConfig{Size: 3, TTL: 600 * time.Millisecond, Owner: "w-" + model, Model: model})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	got := func(s *workers.Slot) string { return fmt.Sprintf("%s/%d", s.Group, s.Rank) }
	a1, b1, b2, a2, a3, a4 := claim("a"), claim("b"), claim("b"), claim("a"), claim("a"), claim("a")
	for s, want := range map[*workers.Slot]string{a1: "g0/0", b1: "g1/0", b2: "g1/1", a2: "g0/1", a3: "g0/2", a4: "g2/0"} {
		if got(s) != want {
			t.Errorf("a worker got %s, want %s", got(s), want)
		}
	}
	// g0 keeps a1 alone, g1 two of b's, g2 a4 alone: a4 moves to g0, the
	// incomplete group of its model, not to g1, the larger one.
	for _, s := range []*workers.Slot{a2, a3} {
		if err := s.Release(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	for _, s := range []*workers.Slot{a1, b1, b2} {
		go func() { _ = s.Hold(ctx) }()
	}
	if err := a4.Hold(ctx); !errors.Is(err, workers.ErrRegrouped) || a4.Group != "g0" {
		t.Errorf("a4 holding g2/0: %v, now %s; want it moved to g0", err, got(a4))
	}
}

// TestSlotsSkipAGroupWhoseFirstRankIsFree: a group of model a whose rank 0
// stopped (its slot released, rank 1 still held) is no slot for a worker of
// model b. Before, a worker looked at a group's holders only when its first
// rank was held: b took a's free rank 0 and made a group of two models, which
// the schedulers never place on and no regroup undid.
func TestSlotsSkipAGroupWhoseFirstRankIsFree(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	claim := func(model string) *workers.Slot {
		t.Helper()
		s, err := workers.ClaimSlot(t.Context(), js, workers.SlotConfig{Size: 2, TTL: 10 * time.Second, Owner: "w-" + model, Model: model})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	a0, a1 := claim("a"), claim("a")
	if a0.Group != "g0" || a1.Group != "g0" {
		t.Fatalf("model a's workers got %s/%d and %s/%d, want g0", a0.Group, a0.Rank, a1.Group, a1.Rank)
	}
	if err := a0.Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	if b := claim("b"); b.Group == "g0" {
		t.Errorf("a worker of model b took %s/%d, in model a's group", b.Group, b.Rank)
	}
	// The rank stays free for a's next worker.
	if a := claim("a"); a.Group != "g0" || a.Rank != 0 {
		t.Errorf("model a's next worker got %s/%d, want g0/0", a.Group, a.Rank)
	}
}

// TestNoFreeSlotSaysWhatToDo: with every slot held, the error names the
// limit and what an operator can do.
func TestNoFreeSlotSaysWhatToDo(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	cfg := workers.SlotConfig{Size: 2, MaxGroups: 2, TTL: 3 * time.Second, Owner: "w"}
	for range 4 {
		if _, err := workers.ClaimSlot(t.Context(), js, cfg); err != nil {
			t.Fatal(err)
		}
	}
	_, err = workers.ClaimSlot(t.Context(), js, cfg)
	if !errors.Is(err, workers.ErrNoSlot) {
		t.Fatalf("a fifth worker for 2 groups of 2: %v, want ErrNoSlot", err)
	}
	for _, want := range []string{"all 2 groups of 2 ranks", "--slot-ttl (3s)", "stop workers", "--subject-prefix"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

// TestClaimSlotsBeyond64Groups: workers given their rank by slot (kvbus
// worker --rank auto, which sets no MaxGroups) form more than 64 groups, as
// the scheduler's KV index tracks up to messages.MaxGroups (the default
// stopped at 64).
func TestClaimSlotsBeyond64Groups(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	cfg := workers.SlotConfig{Size: 1, TTL: time.Minute}
	for i := range 70 {
		cfg.Owner = fmt.Sprint("w", i)
		s, err := workers.ClaimSlot(t.Context(), js, cfg)
		if err != nil {
			t.Fatalf("worker %d: %v", i, err)
		}
		if want := fmt.Sprint("g", i); s.Group != want || s.Rank != 0 {
			t.Fatalf("worker %d got %s/%d, want %s/0", i, s.Group, s.Rank, want)
		}
	}
}

// TestSlotsSurviveABucketLoss: the slot bucket lives in the NATS server's
// memory, so a server that restarts has none. Workers holding slots make
// their claims again instead of exiting ("lost slot"), and a worker that
// comes after gets a free slot, not one of theirs. Before, every holder's
// refresh failed ("no response from stream") until a new worker made a new
// bucket, and then every holder exited.
func TestSlotsSurviveABucketLoss(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	// Each bucket operation may take TTL/3: room for a busy host.
	cfg := workers.SlotConfig{Size: 2, TTL: 1500 * time.Millisecond}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	held := make(chan error, 4)
	for range 4 {
		cfg.Owner = "host" // one host: its workers differ by claim, not by name
		s, err := workers.ClaimSlot(t.Context(), js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		go func() { held <- s.Hold(ctx) }()
	}
	if err := js.DeleteKeyValue(t.Context(), workers.SlotBucket); err != nil {
		t.Fatal(err)
	}
	if _, err := js.KeyValue(t.Context(), workers.SlotBucket); !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Fatalf("the bucket is not gone: %v", err)
	}
	// Every claim is back, each its holder's.
	testenv.Eventually(t, 15*time.Second, "the four claims made again", func() bool {
		kv, err := js.KeyValue(t.Context(), workers.SlotBucket)
		if err != nil {
			return false
		}
		keys, err := kv.ListKeys(t.Context())
		if err != nil {
			return false
		}
		n := 0
		for range keys.Keys() {
			n++
		}
		return n == 4
	})
	next, err := workers.ClaimSlot(t.Context(), js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if next.Group != "g2" || next.Rank != 0 {
		t.Errorf("a new worker after the loss got %s/%d, want g2/0 (the first free slot)", next.Group, next.Rank)
	}
	time.Sleep(2 * cfg.TTL) // refreshes go on, none lost
	select {
	case err := <-held:
		t.Fatalf("a holder stopped: %v", err)
	default:
	}
	// A slot really taken by another is still lost: its holder stops.
	kv, err := js.KeyValue(t.Context(), workers.SlotBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(t.Context(), "g0.0", []byte("intruder")); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-held:
		if err == nil || !strings.Contains(err.Error(), "lost slot g0.0") {
			t.Fatalf("holder of g0.0 stopped with %v, want lost slot g0.0", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the holder of g0.0 did not notice another worker took it")
	}
}

// TestSlotTTLOfTheBucketWins: the bucket's TTL is its creator's --slot-ttl.
// A worker with a longer one refreshes at the bucket's pace; before, its
// claim expired between refreshes, and it exited saying another worker took
// its slot when none had.
func TestSlotTTLOfTheBucketWins(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	short, err := workers.ClaimSlot(t.Context(), js, workers.SlotConfig{Size: 2, TTL: 500 * time.Millisecond, Owner: "a"})
	if err != nil {
		t.Fatal(err)
	}
	long, err := workers.ClaimSlot(t.Context(), js, workers.SlotConfig{Size: 2, TTL: 10 * time.Second, Owner: "b"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	held := make(chan error, 2)
	for _, s := range []*workers.Slot{short, long} {
		go func() { held <- s.Hold(ctx) }()
	}
	kv, err := js.KeyValue(t.Context(), workers.SlotBucket)
	if err != nil {
		t.Fatal(err)
	}
	for range 8 { // 2 s: four bucket TTLs
		time.Sleep(250 * time.Millisecond)
		if _, err := kv.Get(t.Context(), "g0.1"); err != nil {
			t.Fatalf("the long-TTL worker's claim g0.1 expired: %v", err)
		}
	}
	select {
	case err := <-held:
		t.Fatalf("a holder stopped: %v", err)
	default:
	}
}

// TestSlotsRegroupIntoWholeGroups: compose scales workers down by container
// number, not by group, and can leave no group whole (here g0 with rank 0
// and g1 with ranks 0-2 of 4, as a review saw after --scale worker=8 → 4:
// every request got 503 until it scaled back up). The worker of the smaller
// incomplete group moves to the larger one; a whole group stays put.
func TestSlotsRegroupIntoWholeGroups(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	logs := &testenv.LogBuffer{}
	cfg := workers.SlotConfig{Size: 4, TTL: 600 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil))}
	var slots []*workers.Slot
	for i := range 12 {
		cfg.Owner = fmt.Sprint("w", i)
		s, err := workers.ClaimSlot(t.Context(), js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		slots = append(slots, s)
	}
	// Scaled down: g0 keeps rank 0, g1 ranks 0-2, g2 stays whole.
	var kept []*workers.Slot
	for _, s := range slots {
		if (s.Group == "g0" && s.Rank > 0) || (s.Group == "g1" && s.Rank == 3) {
			if err := s.Release(t.Context()); err != nil {
				t.Fatal(err)
			}
			continue
		}
		kept = append(kept, s)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var moves atomic.Int32
	for _, s := range kept {
		go func() {
			for {
				err := s.Hold(ctx) // as the worker does: serve the new slot
				if !errors.Is(err, workers.ErrRegrouped) {
					return
				}
				moves.Add(1)
			}
		}()
	}
	testenv.Eventually(t, 10*time.Second, "g1 whole again", func() bool {
		kv, err := js.KeyValue(t.Context(), workers.SlotBucket)
		if err != nil {
			return false
		}
		for r := range 4 {
			if _, err := kv.Get(t.Context(), fmt.Sprintf("g1.%d", r)); err != nil {
				return false
			}
		}
		return true
	})
	time.Sleep(time.Second) // no further move
	cancel()
	if moves.Load() != 1 || !strings.Contains(logs.String(), "moved to another worker slot") {
		t.Errorf("%d moves, want the one worker of g0 to move:\n%s", moves.Load(), logs)
	}
}

// TestSlotsDoNotRegroupWhileClaimsComeBack: a NATS restart empties the
// in-memory slot bucket and every holder claims its slot again at its next
// refresh, some only after an update sent while the server was away timed
// out. A worker that had claimed its slot again saw the group of holders
// already back as an incomplete group with more holders and, at its next
// check (at once: a tick waits while a refresh times out), moved into a
// slot whose holder had not claimed it yet, and that holder exited "lost
// slot": in a compose fault review's NATS restart, g1/3 moved to g0/3 and
// g0/3's worker exited, came back as g1/3, and both groups lost a rank's
// store. A worker that claimed its slot again does not regroup for a TTL,
// by when every live holder has claimed its own.
func TestSlotsDoNotRegroupWhileClaimsComeBack(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	logs := &testenv.LogBuffer{}
	cfg := workers.SlotConfig{Size: 3, TTL: 1500 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil))}
	slots := map[string]*workers.Slot{}
	for i := range 6 {
		cfg.Owner = fmt.Sprint("w", i)
		s, err := workers.ClaimSlot(t.Context(), js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		slots[fmt.Sprintf("%s.%d", s.Group, s.Rank)] = s
	}
	if err := js.DeleteKeyValue(t.Context(), workers.SlotBucket); err != nil { // the server restarted
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	held := make(chan error, 6)
	hold := func(keys ...string) {
		for _, k := range keys {
			go func() { held <- slots[k].Hold(ctx) }()
		}
	}
	// g0's first two holders claim again first, then g1/0; g0/2, g1/1 and
	// g1/2 are late (each one's update was timing out).
	hold("g0.0", "g0.1")
	testenv.Eventually(t, 5*time.Second, "g0/0 and g0/1 claimed again", func() bool {
		kv, err := js.KeyValue(t.Context(), workers.SlotBucket)
		if err != nil {
			return false
		}
		_, err0 := kv.Get(t.Context(), "g0.0")
		_, err1 := kv.Get(t.Context(), "g0.1")
		return err0 == nil && err1 == nil
	})
	hold("g1.0")
	time.Sleep(800 * time.Millisecond)
	hold("g0.2", "g1.1", "g1.2")
	select {
	case err := <-held:
		t.Fatalf("a holder stopped or moved: %v\n%s", err, logs)
	case <-time.After(2 * cfg.TTL):
	}
	if strings.Contains(logs.String(), "moved to another worker slot") {
		t.Errorf("a worker moved while the others claimed their slots again:\n%s", logs)
	}
}

// TestSlotsKeepTPSizesApart: workers of another --tp-size do not take the
// free ranks of a group whose holders have a size of their own: two
// --tp-size 2 workers started beside two --tp-size 1 workers took g0/1 and
// g1/1, and both working groups then disagreed on their world size.
func TestSlotsKeepTPSizesApart(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	claim := func(size int) string {
		t.Helper()
		s, err := workers.ClaimSlot(t.Context(), js, workers.SlotConfig{Size: size, TTL: 5 * time.Second, Owner: "w", Model: "m"})
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("%s/%d", s.Group, s.Rank)
	}
	got := []string{claim(1), claim(1), claim(2), claim(2), claim(1)}
	if want := []string{"g0/0", "g1/0", "g2/0", "g2/1", "g3/0"}; !slices.Equal(got, want) {
		t.Errorf("slots of --tp-size 1, 1, 2, 2, 1: %v, want %v", got, want)
	}
}

// TestWholeGroupsRefreshWithoutReadingEverySlot: at each refresh (every
// --slot-ttl/3) every --rank auto worker listed the whole slot bucket, to
// see whether its group should move, though a worker of a whole group never
// moves: each refresh read every holder's slot, O(workers²) per refresh
// round across a deployment. A review's 12 groups of 4 `kvbus worker
// --rank auto` processes, idle, had NATS deliver 706 slot messages a second
// (48 listings of 48 keys every 3.3 s, besides a consumer made and deleted
// per listing); at 1,024 groups that is 5M a second. A worker of a whole
// group now asks for its own group's slots alone.
func TestWholeGroupsRefreshWithoutReadingEverySlot(t *testing.T) {
	srv := testenv.StartNATS(t)
	nc := testenv.Connect(t, srv)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	const groups, size = 8, 2
	cfg := workers.SlotConfig{Size: size, TTL: 600 * time.Millisecond}
	var slots []*workers.Slot
	for i := range groups * size {
		cfg.Owner = fmt.Sprint("w", i)
		s, err := workers.ClaimSlot(t.Context(), js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		slots = append(slots, s)
	}
	// Every message on the slots' subjects: the holders' refreshes (their
	// updates), and the slots delivered to whoever reads them through a
	// consumer (its deliveries carry a $JS.ACK reply subject).
	var refreshes, delivered atomic.Int64
	prefix := "$KV." + workers.SlotBucket + "."
	sub, err := testenv.Connect(t, srv).Subscribe(">", func(m *nats.Msg) {
		if !strings.HasPrefix(m.Subject, prefix) {
			return
		}
		if strings.HasPrefix(m.Reply, "$JS.ACK.") {
			delivered.Add(1)
		} else {
			refreshes.Add(1)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	for _, s := range slots {
		go func() { _ = s.Hold(ctx) }()
	}
	rounds := int64(5)
	testenv.Eventually(t, 10*time.Second, "five refreshes of every slot", func() bool {
		return refreshes.Load() >= rounds*groups*size
	})
	cancel()
	// Every group is whole: no holder has a reason to read another
	// group's slot. Before, each refresh read all 16.
	if per := float64(delivered.Load()) / float64(refreshes.Load()); per > 1 {
		t.Errorf("%d slots read over %d refreshes (%.1f each) with %d whole groups of %d: a refresh reads every slot",
			delivered.Load(), refreshes.Load(), per, groups, size)
	}
}

// fillSlots holds every slot of groups × size except those in free, with
// tokens of workers of model m and size size, as workers that claimed
// them would (owner#claim#model#size).
func fillSlots(t *testing.T, js jetstream.JetStream, groups, size int, free ...string) {
	t.Helper()
	kv, err := js.KeyValue(t.Context(), workers.SlotBucket)
	if err != nil {
		t.Fatal(err)
	}
	for g := range groups {
		for r := range size {
			key := fmt.Sprintf("g%d.%d", g, r)
			if slices.Contains(free, key) {
				continue
			}
			if _, err := kv.Create(t.Context(), key, fmt.Appendf(nil, "filler#%s#m#%d", key, size)); err != nil && !errors.Is(err, jetstream.ErrKeyExists) {
				t.Fatal(err)
			}
		}
	}
}

// TestLateClaimerReadsTheSlotsOnce: a --rank auto worker started when 799
// of 200 groups' 800 slots are held claims the free one with a handful of
// requests. Before, it tried every slot in order with one create each, 800
// round trips to the NATS server (1,024 groups of 4: ~4,000), and workers
// started together all raced through the same held slots. Now it lists
// the bucket once and tries the free slots alone, in the same order.
func TestLateClaimerReadsTheSlotsOnce(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	const groups, size = 200, 4
	cfg := workers.SlotConfig{Size: size, TTL: time.Minute, Model: "m"}
	if _, err := workers.ClaimSlot(t.Context(), js, cfg); err != nil { // makes the bucket: g0.0
		t.Fatal(err)
	}
	fillSlots(t, js, groups, size, "g199.3")

	nc := testenv.Connect(t, srv) // the late worker's own connection: its requests alone
	late, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	before := nc.Stats()
	start := time.Now()
	s, err := workers.ClaimSlot(t.Context(), late, cfg)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	sent := nc.Stats().OutMsgs - before.OutMsgs
	if s.Group != "g199" || s.Rank != 3 {
		t.Errorf("the late worker got %s/%d, want g199/3, the only free slot", s.Group, s.Rank)
	}
	// Its requests: the listing's consumer, the create, and the check of
	// its group's holders (a consumer and 3 gets); before, 800 creates.
	if sent > 16 {
		t.Errorf("claiming the one free slot of %d groups of %d sent %d messages to NATS in %s, want at most 16 (not one per held slot)", groups, size, sent, took)
	}
	t.Logf("claimed %s/%d with %d messages sent in %s", s.Group, s.Rank, sent, took)

	// With g199 whole, the next worker opens g200, again without a create
	// per held slot.
	before = nc.Stats()
	s, err = workers.ClaimSlot(t.Context(), late, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if sent := nc.Stats().OutMsgs - before.OutMsgs; s.Group != "g200" || s.Rank != 0 || sent > 16 {
		t.Errorf("the next worker got %s/%d with %d messages sent, want g200/0 with at most 16", s.Group, s.Rank, sent)
	}
}

// TestClaimersAtOnceHoldDistinctSlots: workers started together (a
// scale-out, a rolling restart), each on its own connection, read the
// same listing and race for the same free slots: every one ends with a
// slot of its own, the free slots of the held groups first, in order, then
// new groups; those the groups cannot hold are told so. A create lost to
// another worker moves on to the next free slot, and a worker all of whose
// listed free slots were taken so lists the bucket again.
func TestClaimersAtOnceHoldDistinctSlots(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	const size, held = 4, 8 // g0–g7 held but for 4 slots; g8–g10 free
	cfg := workers.SlotConfig{Size: size, TTL: time.Minute, Model: "m", MaxGroups: held + 3}
	first, err := workers.ClaimSlot(t.Context(), js, cfg) // makes the bucket: g0.0
	if err != nil {
		t.Fatal(err)
	}
	free := []string{"g1.2", "g3.0", "g5.3", "g7.1"}
	fillSlots(t, js, held, size, free...)

	const claimers = 20 // 4 free slots + 3 new groups of 4, and 4 too many
	type claim struct {
		slot *workers.Slot
		err  error
	}
	got := make(chan claim, claimers)
	startAll := make(chan struct{})
	for i := range claimers {
		cjs, err := jetstream.New(testenv.Connect(t, srv))
		if err != nil {
			t.Fatal(err)
		}
		c := cfg
		c.Owner = fmt.Sprint("w", i)
		go func() {
			<-startAll
			s, err := workers.ClaimSlot(t.Context(), cjs, c)
			got <- claim{s, err}
		}()
	}
	close(startAll)
	var slots []*workers.Slot
	var keys []string
	full := 0
	for range claimers {
		c := <-got
		switch {
		case errors.Is(c.err, workers.ErrNoSlot):
			full++
		case c.err != nil:
			t.Fatal(c.err)
		default:
			slots = append(slots, c.slot)
			keys = append(keys, fmt.Sprintf("%s.%d", c.slot.Group, c.slot.Rank))
		}
	}
	want := slices.Clone(free)
	for g := held; g < held+3; g++ {
		for r := range size {
			want = append(want, fmt.Sprintf("g%d.%d", g, r))
		}
	}
	slices.Sort(keys)
	slices.Sort(want)
	if !slices.Equal(keys, want) || full != claimers-len(want) {
		t.Fatalf("%d workers at once got %v and %d no slot; want each of %v once and %d no slot", claimers, keys, full, want, claimers-len(want))
	}
	// Each claim is the bucket's last word on its slot: a release at the
	// claim's revision succeeds (a slot claimed twice would fail one).
	for _, s := range append(slots, first) {
		if err := s.Release(t.Context()); err != nil {
			t.Errorf("release %s/%d: %v", s.Group, s.Rank, err)
		}
	}
}

// TestSlotsOfAModelNamedWithAHash: a slot's token is owner#claim#model#size,
// and a model name may hold a '#' (--model takes any name): the token of a
// worker of model a#b was read as model a of size 0, not the worker's own
// kind, so the next worker of a#b took every group held by one as another
// model's and claimed a group of its own: no group of --tp-size 2 ever
// filled, and no request was placed.
func TestSlotsOfAModelNamedWithAHash(t *testing.T) {
	srv := testenv.StartNATS(t)
	js, err := jetstream.New(testenv.Connect(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for i := range 4 {
		s, err := workers.ClaimSlot(t.Context(), js, workers.SlotConfig{Size: 2, TTL: 5 * time.Second, Owner: fmt.Sprint("w", i), Model: "org/m#v2"})
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("%s/%d", s.Group, s.Rank))
	}
	if want := []string{"g0/0", "g0/1", "g1/0", "g1/1"}; !slices.Equal(got, want) {
		t.Errorf("four workers of model org/m#v2, --tp-size 2: %v, want %v", got, want)
	}
}
