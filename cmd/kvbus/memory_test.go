package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/workers"
)

func TestCheckMemory(t *testing.T) {
	const gb = int64(1) << 30
	for _, tc := range []struct {
		payload       string
		ranks         int
		perRank       int64
		limit         int64
		wantRefusal   bool
		wantInMessage []string
	}{
		{workers.PayloadBytes, 2, gb, 8 * gb, false, nil},
		{workers.PayloadBytes, 4, gb, 8 * gb, false, nil}, // exactly half the memory
		{workers.PayloadBytes, 16, gb, 8 * gb, true, []string{"--kv-capacity 1GiB × 16 ranks", "16.0 GiB", "half the 8.0 GiB of memory", "at most 0.2 GiB per rank", "--kv-payload accounting"}},
		{workers.PayloadBytes, 1, 1 << 62, 8 * gb, true, []string{"at most 4.0 GiB per rank"}},
		{workers.PayloadAccounting, 16, 1 << 50, 8 * gb, false, nil}, // digests only
		{workers.PayloadBytes, 16, 1 << 50, 0, false, nil},           // memory unknown
	} {
		err := checkMemory(tc.payload, "1GiB", tc.ranks, tc.perRank, tc.limit)
		if (err != nil) != tc.wantRefusal {
			t.Errorf("%s, %d ranks of %d bytes, %d bytes of memory: %v, want refused %v", tc.payload, tc.ranks, tc.perRank, tc.limit, err, tc.wantRefusal)
			continue
		}
		for _, want := range tc.wantInMessage {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%v: want %q in it", err, want)
			}
		}
	}
}

// TestSoftMemoryLimit: a process's soft memory limit follows its stores
// (a quarter more and storeOverhead), within three quarters of the
// machine. It was three quarters of the machine whatever the stores, and
// a worker of one 1 GiB rank grew to 2.2 GiB of RSS (1.7 GiB now), four
// of 4 GiB took a 24 GiB machine's memory.
func TestSoftMemoryLimit(t *testing.T) {
	const gb = int64(1) << 30
	for _, tc := range []struct {
		ranks                 int
		perRank, roles, limit int64
		want                  int64
	}{
		{1, gb, rolesNone, 24 * gb, gb/4*5 + storeOverhead},
		{1, 4 * gb, rolesNone, 24 * gb, 5*gb + storeOverhead},
		{4, gb, rolesCluster, 24 * gb, 5*gb + storeOverhead + rolesCluster}, // make run
		{16, gb, rolesCluster, 24 * gb, 18 * gb},                            // the stores' own: 22 GiB
		{1, gb, rolesNone, 0, gb/4*5 + storeOverhead},                       // the machine's memory unknown
		{0, 0, rolesNone, 8 * gb, 6 * gb},                                   // no store
		{0, 0, rolesNone, 0, 0},                                             // nothing known: no limit
	} {
		if got := softMemoryLimit(tc.ranks, tc.perRank, tc.roles, tc.limit); got != tc.want {
			t.Errorf("softMemoryLimit(%d ranks, %d bytes each, %d of roles, %d bytes of memory) = %d, want %d", tc.ranks, tc.perRank, tc.roles, tc.limit, got, tc.want)
		}
	}
}

func TestParseMemoryLimits(t *testing.T) {
	meminfo := "MemTotal:       24683664 kB\nMemFree:        23000000 kB\n"
	if got := parseMemTotal([]byte(meminfo)); got != 24683664<<10 {
		t.Errorf("MemTotal = %d", got)
	}
	for _, bad := range []string{"", "MemFree: 1 kB\n", "MemTotal: lots kB\n", "MemTotal:\n", "MemTotal: -5 kB\n"} {
		if got := parseMemTotal([]byte(bad)); got != 0 {
			t.Errorf("parseMemTotal(%q) = %d, want 0", bad, got)
		}
	}
	for in, want := range map[string]int64{"8589934592\n": 8 << 30, "max\n": 0, "9223372036854771712\n": 0, "": 0, "-1": 0} {
		if got := parseCgroupLimit([]byte(in)); got != want {
			t.Errorf("parseCgroupLimit(%q) = %d, want %d", in, got, want)
		}
	}
	if limit := memoryLimit(); limit < 0 {
		t.Errorf("memoryLimit() = %d", limit)
	}
}

func FuzzParseMemoryLimits(f *testing.F) {
	f.Add([]byte("MemTotal:       24683664 kB\n"))
	f.Add([]byte("max\n"))
	f.Add([]byte("8589934592"))
	f.Fuzz(func(t *testing.T, data []byte) {
		if n := parseMemTotal(data); n < 0 {
			t.Errorf("parseMemTotal = %d", n)
		}
		if n := parseCgroupLimit(data); n < 0 || n >= 1<<62 {
			t.Errorf("parseCgroupLimit = %d", n)
		}
	})
}

// TestStoresLargerThanMemoryAreRefused: serve, worker and bench refuse
// --kv-payload bytes stores that add up to more than this machine's memory
// before anything starts, and take the same capacity with accounting
// payloads (or a model server's own cache).
func TestStoresLargerThanMemoryAreRefused(t *testing.T) {
	limit := memoryLimit()
	if limit == 0 {
		t.Skip("this machine's memory is unknown (no /proc/meminfo)")
	}
	huge := "1000TiB"
	refused := func(err error) bool {
		return err != nil && strings.Contains(err.Error(), "more than half the") && strings.Contains(err.Error(), "--kv-payload accounting")
	}
	c := parseCLI(t, "serve", "--kv-capacity", huge)
	if _, err := c.Serve.clusterConfig(); !refused(err) {
		t.Errorf("serve --kv-capacity %s: %v, want a refusal", huge, err)
	}
	c = parseCLI(t, "serve", "--kv-capacity", huge, "--kv-payload", "accounting")
	if _, err := c.Serve.clusterConfig(); err != nil {
		t.Errorf("serve --kv-capacity %s --kv-payload accounting: %v", huge, err)
	}
	c = parseCLI(t, "worker", "--group", "g0", "--nats-url", "nats://127.0.0.1:1", "--kv-capacity", huge)
	if err := c.Worker.Run(t.Context()); !refused(err) {
		t.Errorf("worker --kv-capacity %s: %v, want a refusal", huge, err)
	}
	c = parseCLI(t, "worker", "--group", "g0", "--nats-url", "nats://127.0.0.1:1", "--kv-capacity", huge, "--kv-payload", "accounting")
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond) // no NATS runs here
	defer cancel()
	if err := c.Worker.Run(ctx); err == nil || refused(err) {
		t.Errorf("worker --kv-capacity %s --kv-payload accounting: %v, want it past the check (to the connection)", huge, err)
	}
	trace := filepath.Join(t.TempDir(), "t.jsonl") // never read: the check comes first
	if err := os.WriteFile(trace, []byte("not a trace\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	c = parseCLI(t, "bench", "--trace", trace, "--kv-capacity", huge, "--kv-payload", "bytes")
	if err := c.Bench.Run(t.Context()); !refused(err) {
		t.Errorf("bench --kv-payload bytes --kv-capacity %s: %v, want a refusal", huge, err)
	}
}
