package main

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/workers"
)

// TestRankAutoWithAGroupsKey: workers that hold a key of one group
// (worker-g1.nk) claim their ranks with --rank auto --group g1: each takes a
// rank of g1 and beats as it, and a third finds the group full. Before,
// --rank auto claimed slots in any group and read the any-group reply
// inbox, so a key of one group could not be used with it at all.
func TestRankAutoWithAGroupsKey(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t, "g1")
	key, err := nats.NkeyOptionFromSeed(filepath.Join(dir, "admin.nk"))
	if err != nil {
		t.Fatal(err)
	}
	admin, err := nats.Connect(srv.ClientURL(), key)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	beats, err := admin.SubscribeSync("kvbus.hb.>")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	run := func() chan error {
		c := parseCLI(t, "worker", "--rank", "auto", "--group", "g1", "--tp-size", "2", "--time-scale", "0", "--kv-capacity", "64MiB",
			"--metrics-addr", "", "--heartbeat-interval", "100ms", "--slot-ttl", "3s",
			"--nats-url", srv.ClientURL(), "--nats-nkey", filepath.Join(dir, "worker-g1.nk"), "--log-level", "error")
		errc := make(chan error, 1)
		go func() { errc <- c.Worker.Run(ctx) }()
		return errc
	}
	first, second := run(), run()
	seen := map[string]bool{}
	deadline := time.Now().Add(20 * time.Second)
	for len(seen) < 2 && time.Now().Before(deadline) {
		m, err := beats.NextMsg(time.Until(deadline))
		if err != nil {
			break
		}
		seen[m.Subject] = true
	}
	if !seen["kvbus.hb.g1.0"] || !seen["kvbus.hb.g1.1"] || len(seen) != 2 {
		t.Fatalf("heartbeats on %v, want kvbus.hb.g1.0 and kvbus.hb.g1.1 only", seen)
	}
	select {
	case err := <-run():
		if !errors.Is(err, workers.ErrNoSlot) || !strings.Contains(err.Error(), "group g1") {
			t.Errorf("a third worker of g1: %v, want ErrNoSlot naming g1", err)
		}
	case <-time.After(20 * time.Second):
		t.Error("a third worker of a full group still runs")
	}
	cancel()
	for _, errc := range []chan error{first, second} {
		if err := <-errc; err != nil {
			t.Errorf("a worker of g1 ended with %v", err)
		}
	}
}

// TestRankAutoWithAKeyItCannotUseSaysSo: a --rank auto worker whose key may
// not read what it needs stops at once saying which key or flag to give: a
// key of one group without --group (it needs --group g1), or another role's
// key. Before, it logged one permissions violation for its reply inbox and
// then waited for ever for the slot bucket's JetStream answers, which that
// inbox never received.
func TestRankAutoWithAKeyItCannotUseSaysSo(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t, "g1")
	for _, tc := range []struct {
		name, key string
		args      []string
		want      []string
	}{
		{"a group's key without --group", "worker-g1.nk", nil, []string{"kvbus.meta.*.>", "add --group <g>", "DIR/worker.nk"}},
		{"another role's key", "frontend.nk", []string{"--group", "g1"}, []string{"kvbus.meta.g1.>", "DIR/worker-g1.nk"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"worker", "--rank", "auto", "--tp-size", "2", "--time-scale", "0", "--kv-capacity", "64MiB",
				"--metrics-addr", "", "--nats-url", srv.ClientURL(), "--nats-nkey", filepath.Join(dir, tc.key), "--log-level", "error"}, tc.args...)
			c := parseCLI(t, args...)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			errc := make(chan error, 1)
			go func() { errc <- c.Worker.Run(ctx) }()
			select {
			case err := <-errc:
				if !errors.Is(err, bus.ErrPermission) {
					t.Errorf("the worker ended with %v, want a permissions error", err)
				}
				for _, w := range tc.want {
					if err != nil && !strings.Contains(err.Error(), w) {
						t.Errorf("the worker's error does not say %q: %v", w, err)
					}
				}
			case <-time.After(15 * time.Second):
				cancel()
				<-errc
				t.Error("the worker still waits after 15 s, saying nothing")
			}
		})
	}
}
