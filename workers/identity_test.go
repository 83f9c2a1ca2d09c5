package workers_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/workers"
)

// TestSecondProcessOfARankRefused: a worker started with the identity of a
// rank that another process serves (a copy started by mistake, compose's
// --scale on a fixed-rank service) ran every request of its group a second
// time; it now refuses to start, naming the rank. Once that rank has
// stopped, a new process of it starts.
func TestSecondProcessOfARankRefused(t *testing.T) {
	e := startRanks(t, rankEnvConfig{})
	newRank := func() *workers.Rank {
		t.Helper()
		nc, err := nats.Connect(e.nc.ConnectedUrl())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		profile, _ := workers.LookupModelProfile("tiny")
		engine, _ := workers.NewSimEngine(workers.SimConfig{})
		r, err := workers.NewRank(workers.RankConfig{
			Conn: nc, Subjects: e.subj, Group: testGroup, TPRank: 1, TPSize: worldSize, EPRank: 1, EPSize: worldSize,
			Model: testModel, Profile: profile, CapacityBytes: testCapacity, Engine: engine, BlockSize: blockSize,
			HeartbeatInterval: 200 * time.Millisecond, ShutdownTimeout: time.Second, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	err := newRank().Run(ctx)
	if !errors.Is(err, workers.ErrRankServed) || !strings.Contains(err.Error(), "group g0 rank 1") {
		t.Fatalf("a second process of g0 rank 1: %v; want ErrRankServed naming the rank", err)
	}

	e.stopRank(1)
	runCtx, stop := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- newRank().Run(runCtx) }()
	select {
	case err := <-done:
		t.Fatalf("a new process of a stopped rank did not start: %v", err)
	case <-time.After(time.Second): // past the 300 ms it listens (the others heartbeat every 20 ms)
	}
	stop()
	if err := <-done; err != nil {
		t.Errorf("the new process: %v", err)
	}
}
