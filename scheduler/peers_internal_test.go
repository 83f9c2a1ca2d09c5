package scheduler

import (
	"fmt"
	"testing"
	"time"
)

func TestPeerTableAdopter(t *testing.T) {
	t0 := time.Unix(1_000, 0)
	const timeout = 3 * time.Second
	pt := newPeerTable(time.Minute, t0)
	pt.heard("sched-a", false, t0)
	pt.heard("sched-c", false, t0)
	pt.dispatched("sched-a", "r1", 11, t0)
	pt.dispatched("sched-a", "r2", 12, t0.Add(time.Second))
	pt.dispatched("sched-c", "r3", 13, t0)
	pt.dispatched("sched-a", "r0", 0, t0) // no sequence: an older replica's plan, not adoptable

	if got := pt.dead("sched-b", t0.Add(timeout), timeout); got != nil {
		t.Fatalf("dead at the timeout: %v; want none", got)
	}
	// sched-c keeps announcing, sched-a falls silent: of the live
	// replicas, sched-b has the lowest id, so it adopts a's dispatches.
	pt.heard("sched-c", false, t0.Add(3*time.Second))
	got := pt.dead("sched-b", t0.Add(4*time.Second), timeout)
	if len(got) != 1 || len(got["sched-a"]) != 2 || got["sched-a"][0].reqID != "r1" || got["sched-a"][1].seq != 12 {
		t.Fatalf("dead: %v; want sched-a's r1 and r2", got)
	}
	if got := pt.dead("sched-b", t0.Add(4*time.Second), timeout); got != nil {
		t.Fatalf("a dead peer is adopted once; got %v again", got)
	}

	// sched-c dies while sched-a (a lower id than sched-d) lives: a adopts,
	// d only forgets c.
	pt2 := newPeerTable(time.Minute, t0)
	pt2.heard("sched-a", false, t0.Add(10*time.Second))
	pt2.heard("sched-c", false, t0)
	pt2.dispatched("sched-c", "r3", 13, t0)
	if got := pt2.dead("sched-d", t0.Add(10*time.Second), timeout); len(got) != 0 {
		t.Fatalf("sched-d adopted %v while sched-a (a lower id) lives", got)
	}
	if len(pt2.peers) != 1 {
		t.Fatalf("the dead peer is forgotten by every replica; %d peers left", len(pt2.peers))
	}
}

func TestPeerTableStoppedAndSilentPeers(t *testing.T) {
	t0 := time.Unix(1_000, 0)
	const timeout = 3 * time.Second
	pt := newPeerTable(time.Minute, t0)
	// A peer known only from its plans (its announcements refused, or not
	// yet heard) is never judged by its silence.
	pt.dispatched("sched-x", "r1", 1, t0)
	if got := pt.dead("sched-b", t0.Add(30*time.Second), timeout); got != nil {
		t.Fatalf("a peer never heard to announce was judged dead: %v", got)
	}
	if _, kept := pt.peers["sched-x"]; !kept {
		t.Fatal("a peer known from a recent plan was forgotten")
	}
	pt.dead("sched-b", t0.Add(2*time.Minute), timeout)
	if _, kept := pt.peers["sched-x"]; kept {
		t.Fatal("a peer known only from plans older than the request timeout is kept for ever")
	}
	// A clean stop leaves nothing to adopt.
	pt.heard("sched-y", false, t0)
	pt.dispatched("sched-y", "r2", 2, t0)
	pt.heard("sched-y", true, t0.Add(time.Second))
	if got := pt.dead("sched-b", t0.Add(time.Hour), timeout); got != nil {
		t.Fatalf("a replica that stopped cleanly had its requests adopted: %v", got)
	}
	// This replica's own reconnect gives every peer a timeout from then.
	pt.heard("sched-z", false, t0)
	pt.dispatched("sched-z", "r3", 3, t0)
	pt.reconnected(t0.Add(10 * time.Second))
	if got := pt.dead("sched-b", t0.Add(12*time.Second), timeout); got != nil {
		t.Fatalf("a peer was judged dead for this replica's own disconnection: %v", got)
	}
	if got := pt.dead("sched-b", t0.Add(14*time.Second), timeout); len(got["sched-z"]) != 1 {
		t.Fatalf("a peer silent for the timeout after the reconnect: %v; want its r3 adopted", got)
	}
}

func TestPeerTableKeepsOnlyRecentDispatches(t *testing.T) {
	t0 := time.Unix(1_000, 0)
	pt := newPeerTable(10*time.Second, t0)
	pt.heard("sched-a", false, t0)
	for i := range 100 {
		pt.dispatched("sched-a", fmt.Sprint("r", i), uint64(i+1), t0.Add(time.Duration(i)*time.Second))
	}
	if n := len(pt.peers["sched-a"].dispatches); n != 11 {
		t.Fatalf("%d dispatches kept; want the last 10 s worth (11)", n)
	}
	got := pt.dead("sched-b", t0.Add(105*time.Second), 3*time.Second)
	if n := len(got["sched-a"]); n != 5 {
		t.Fatalf("%d dispatches adopted at 105 s: %v; want those of the last 10 s (95..99 s: 5)", n, got["sched-a"])
	}
}
