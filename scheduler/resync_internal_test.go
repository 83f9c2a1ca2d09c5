package scheduler

import (
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// TestDumpsInFlightAreBounded: a scheduler that hears 24 ranks at once (as
// one started in a running cluster does) asks each for its dump, but has at
// most maxDumpsInFlight of them on the way: the ranks hold the asks they
// get until as many as the bound are held, and count them. Every rank's dump is
// applied. Before, all 24 were asked at once, and a scheduler's memory was
// the sum of every rank's dump.
func TestDumpsInFlightAreBounded(t *testing.T) {
	nc := embeddedConn(t)
	s, err := New(Config{Conn: nc, ID: "s0", Policy: KVPolicy{}, HeartbeatTimeout: 10 * time.Second, DumpTimeout: 10 * time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	const ranks = 24
	var (
		held, peak atomic.Int32
		answers    sync.WaitGroup
	)
	defer answers.Wait()
	for g := range ranks {
		group := fmt.Sprint("d", g)
		sub, err := nc.Subscribe(s.cfg.Subjects.Dump(group, 0), func(m *nats.Msg) {
			n := held.Add(1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			answers.Go(func() {
				// Held until as many asks as the bound are (or 2 s have
				// passed: a machine too slow to have them all out at once),
				// and 50 ms more, for any past the bound to arrive.
				for start := time.Now(); held.Load() < maxDumpsInFlight && time.Since(start) < 2*time.Second; {
					time.Sleep(5 * time.Millisecond)
				}
				time.Sleep(50 * time.Millisecond)
				data, err := messages.Marshal(&messages.KVEventBatch{Group: group, Rank: 0, Seq: 1,
					Events: []messages.KVEvent{clearedAll(), stored(distinct(g*10, 10)...)}})
				held.Add(-1) // before its answer: the next ask may come at once
				if err == nil {
					_ = m.Respond(data)
				}
			})
		})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = sub.Unsubscribe() }()
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	for g := range ranks {
		group := fmt.Sprint("d", g)
		hb, err := messages.Marshal(&messages.Heartbeat{Group: group, TPRank: 0, WorldSize: 1, StartedUnixMs: 1, CapacityBlocks: 100})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.onHeartbeat(t.Context(), &nats.Msg{Subject: s.cfg.Subjects.Heartbeat(group, 0), Data: hb}); err != nil {
			t.Fatal(err)
		}
	}
	s.dumps.Wait()
	if p := peak.Load(); p != maxDumpsInFlight {
		t.Errorf("%d dumps asked at once at most, want %d", p, maxDumpsInFlight)
	}
	for g := range ranks {
		group := fmt.Sprint("d", g)
		if !s.index.Synced(group) || rankHeld(s.index, group, 0) != 10 {
			t.Errorf("%s: synced %v, holds %d blocks, want its dump's 10", group, s.index.Synced(group), rankHeld(s.index, group, 0))
		}
	}
}
