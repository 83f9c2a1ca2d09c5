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
	pt.heard("sched-a", 1, false, t0)
	pt.heard("sched-c", 1, false, t0)
	pt.dispatched("sched-a", "r1", 11, t0)
	pt.dispatched("sched-a", "r2", 12, t0.Add(time.Second))
	pt.dispatched("sched-c", "r3", 13, t0)
	pt.dispatched("sched-a", "r0", 0, t0) // no sequence: an older replica's plan, not adoptable

	if got := pt.dead("sched-b", t0.Add(timeout), timeout); got != nil {
		t.Fatalf("dead at the timeout: %v; want none", got)
	}
	// sched-c keeps announcing, sched-a falls silent: of the live
	// replicas, sched-b has the lowest id, so it adopts a's dispatches.
	pt.heard("sched-c", 1, false, t0.Add(3*time.Second))
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
	pt2.heard("sched-a", 1, false, t0.Add(10*time.Second))
	pt2.heard("sched-c", 1, false, t0)
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
	pt.heard("sched-y", 1, false, t0)
	pt.dispatched("sched-y", "r2", 2, t0)
	pt.heard("sched-y", 1, true, t0.Add(time.Second))
	if got := pt.dead("sched-b", t0.Add(time.Hour), timeout); got != nil {
		t.Fatalf("a replica that stopped cleanly had its requests adopted: %v", got)
	}
	// This replica's own reconnect gives every peer a timeout from then.
	pt.heard("sched-z", 1, false, t0)
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
	pt.heard("sched-a", 1, false, t0)
	for i := range 3000 {
		pt.dispatched("sched-a", fmt.Sprint("r", i), uint64(i+1), t0.Add(time.Duration(i)*time.Second))
	}
	if n := len(pt.peers["sched-a"].dispatches); n > 1100 {
		t.Fatalf("%d dispatches kept of 3,000 over 50 minutes; want them trimmed to the last 10 s as they grow", n)
	}
	got := pt.dead("sched-b", t0.Add(3005*time.Second), 3*time.Second)
	if n := len(got["sched-a"]); n != 5 || got["sched-a"][0].reqID != "r2995" {
		t.Fatalf("%d dispatches adopted at 3,005 s: %v; want those of the last 10 s (2,995..2,999 s: 5), oldest first", n, got["sched-a"])
	}
}

// TestPeerTableEndedAndRestarted: a peer's requests that it said ended are
// not adopted (14 of 15 requests a review saw re-run had been answered);
// a peer heard again under its id with another start died in between
// (a fixed --id restarted at once), and what the earlier process
// dispatched is adopted.
func TestPeerTableEndedAndRestarted(t *testing.T) {
	t0 := time.Unix(1_000, 0)
	const timeout = 3 * time.Second
	pt := newPeerTable(time.Minute, t0)
	pt.heard("sched-a", 100, false, t0)
	pt.dispatched("sched-a", "r1", 1, t0)
	pt.dispatched("sched-a", "r2", 2, t0)
	pt.dispatched("sched-a", "r3", 3, t0)
	pt.ended("sched-a", []string{"r1", "r3"})
	got := pt.dead("sched-b", t0.Add(5*time.Second), timeout)
	if len(got["sched-a"]) != 1 || got["sched-a"][0].reqID != "r2" {
		t.Fatalf("dead: %v; want only r2, the request sched-a had not ended", got)
	}

	pt.heard("sched-c", 100, false, t0)
	pt.dispatched("sched-c", "r4", 4, t0)
	pt.heard("sched-c", 200, false, t0.Add(time.Second)) // a new process
	pt.dispatched("sched-c", "r5", 5, t0.Add(time.Second))
	got = pt.dead("sched-b", t0.Add(2*time.Second), timeout)
	if len(got["sched-c"]) != 1 || got["sched-c"][0].reqID != "r4" {
		t.Fatalf("dead after sched-c restarted: %v; want r4, its earlier process's", got)
	}
	if got := pt.dead("sched-b", t0.Add(3*time.Second), timeout); got != nil {
		t.Fatalf("adopted again: %v", got)
	}
}

// TestPeerTableReplayedFromThePlanStream: what the plan stream says
// replicas dispatched and had not ended enters the table at start. A
// replica named there that is never heard (it died before this one
// started) is adopted once the timeout passed since this start; one that
// announces is not, but its dispatches made before its process's announced
// start are an earlier process's, adopted. A request ended live while the
// stream was read is not taken for running.
func TestPeerTableReplayedFromThePlanStream(t *testing.T) {
	t0 := time.Unix(1_000, 0)
	const timeout = 3 * time.Second
	start := t0.Add(10 * time.Second) // this replica's start
	pt := newPeerTable(time.Minute, start)
	pt.replay()
	pt.ended("sched-live", []string{"ended-meanwhile"})
	byID := func(ds ...peerDispatch) map[string]peerDispatch {
		out := map[string]peerDispatch{}
		for _, d := range ds {
			out[d.reqID] = d
		}
		return out
	}
	pt.replayed(map[string]map[string]peerDispatch{
		"sched-dead": byID(peerDispatch{reqID: "d1", seq: 1, at: t0}, peerDispatch{reqID: "d2", seq: 2, at: t0.Add(time.Second)}),
		"sched-live": byID(peerDispatch{reqID: "old", seq: 3, at: t0}, peerDispatch{reqID: "new", seq: 4, at: t0.Add(5 * time.Second)},
			peerDispatch{reqID: "ended-meanwhile", seq: 5, at: t0.Add(5 * time.Second)}),
		"sched-done": {}, // every request it dispatched ended
	})
	if pt.tombs != nil {
		t.Error("the read's tombs were kept after it")
	}
	if _, known := pt.peers["sched-done"]; known {
		t.Error("a replica whose requests all ended was entered")
	}
	ids := func(ds []peerDispatch) (out []string) {
		for _, d := range ds {
			out = append(out, d.reqID)
		}
		return out
	}
	// sched-live's process started at t0+2s: "old" was its predecessor's,
	// adopted at once; sched-dead is not judged before the timeout.
	pt.heard("sched-live", t0.Add(2*time.Second).UnixMilli(), false, start.Add(time.Second))
	if got := pt.dead("sched-a", start.Add(timeout), timeout); len(got) != 1 || fmt.Sprint(ids(got["sched-live"])) != "[old]" {
		t.Fatalf("adopted %v at the timeout since this start; want only sched-live's predecessor's old", got)
	}
	pt.heard("sched-live", t0.Add(2*time.Second).UnixMilli(), false, start.Add(3*time.Second))
	if got := pt.dead("sched-a", start.Add(timeout+time.Millisecond), timeout); len(got) != 1 || fmt.Sprint(ids(got["sched-dead"])) != "[d1 d2]" {
		t.Fatalf("adopted %v past the timeout; want sched-dead's d1 and d2", got)
	}
	if p := pt.peers["sched-live"]; p == nil || len(p.dispatches) != 1 || p.dispatches["new"].seq != 4 {
		t.Fatalf("sched-live's own dispatch: %+v; want only new, not adopted", pt.peers["sched-live"])
	}
}
