package workers_test

import (
	"context"
	"fmt"
	"testing"
	"time"

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
