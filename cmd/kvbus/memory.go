package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"runtime/debug"
	"strconv"
	"strings"

	"github.com/kvbus/kvbus/workers"
)

// fitStores checks that the block stores of ranks ranks fit in this
// process's memory (checkMemory), and with --kv-payload bytes sets the Go
// runtime's soft memory limit (softMemoryLimit), unless GOMEMLIMIT does:
// the collector lets the heap grow to twice what is live, and ranks making
// blocks at GB/s held three times their stores' bytes, freed but not yet
// returned.
//
// roles is what the process holds beside its ranks: rolesNone for a
// worker, rolesCluster for serve and bench, which also run NATS, the
// schedulers and the frontend.
func fitStores(payload, capacityFlag string, ranks int, perRank, roles int64) error {
	limit := memoryLimit()
	if err := checkMemory(payload, capacityFlag, ranks, perRank, limit); err != nil {
		return err
	}
	if payload == workers.PayloadBytes && os.Getenv("GOMEMLIMIT") == "" {
		if soft := softMemoryLimit(ranks, perRank, roles, limit); soft > 0 {
			debug.SetMemoryLimit(soft)
		}
	}
	return nil
}

// storeOverhead is what a process of ranks holds beyond their stores'
// blocks, in the soft memory limit: a rank's memory of outputs (64 MiB),
// a load's or save's batch of blocks (64 MiB), a hand-off's copies, the
// NATS client's buffers, the collector's own. rolesCluster is what the
// other roles of serve and bench hold: the NATS server's in-memory plan
// stream (up to 256 MiB) and message-id window, the schedulers' index and
// trackers, the frontend's token cache (64 MiB); a 75 s run of serve at
// c=64 held 726 MB live beside its stores.
const (
	storeOverhead = 512 << 20
	rolesNone     = 0
	rolesCluster  = 1536 << 20
)

// softMemoryLimit is the Go runtime's soft memory limit for ranks ranks of
// perRank bytes of blocks each and roles bytes of other roles, in a process
// that may use limit bytes (0: unknown): the stores, a quarter more,
// storeOverhead and roles, at most three quarters of limit; 0 for no
// limit. Three quarters of the machine alone let every worker process of a
// host grow to twice its stores (a rank of --kv-capacity 1GiB held 2.2 GiB
// of RSS; four processes of 4 GiB ranks took a 24 GiB machine's memory
// and stalled every role on it).
func softMemoryLimit(ranks int, perRank, roles, limit int64) int64 {
	soft := int64(-1)
	if ranks > 0 && perRank > 0 {
		soft = int64(ranks)*perRank/4*5 + storeOverhead + roles
	}
	if limit > 0 && (soft < 0 || limit/4*3 < soft) {
		soft = limit / 4 * 3
	}
	return max(soft, 0)
}

// checkMemory refuses block stores that cannot fit in this process's
// memory. With --kv-payload bytes a rank keeps every block's bytes up to
// --kv-capacity, and the Go collector lets the heap grow to twice what is
// live, so ranks stores filling past half the machine's memory (or the
// container's limit) left the host thrashing, every role on it stalled,
// long before an out-of-memory kill said why. limit is what the process
// may use in bytes (0: unknown, nothing is checked); accounting stores keep
// an 8-byte digest per block and are not checked.
func checkMemory(payload, capacityFlag string, ranks int, perRank, limit int64) error {
	if payload != workers.PayloadBytes || limit <= 0 || ranks < 1 {
		return nil
	}
	if room := limit / 2 / int64(ranks); perRank > room && room < 64<<20 {
		// Not a capacity to lower: the ranks are too many for one process
		// (serve --groups 100000 said "give at most 0.0 GiB per rank").
		return fmt.Errorf("%d ranks in this process (--groups × --ranks with serve) leave %s of memory each, too little for a block store of --kv-payload bytes: "+
			"give fewer --groups or --ranks, or keep digests only with --kv-payload accounting", ranks, mib(room))
	} else if perRank > room {
		return fmt.Errorf("--kv-capacity %s × %d ranks in this process is %s of block bytes (--kv-payload bytes), more than half the %s of memory here "+
			"(Go's collector lets the heap grow to twice what is live): give at most %s per rank with --kv-capacity, or keep digests only with --kv-payload accounting",
			capacityFlag, ranks, gib(perRank*int64(ranks)), gib(limit), gib(room))
	}
	return nil
}

// mib formats n bytes in MiB.
func mib(n int64) string { return strconv.FormatFloat(float64(n)/(1<<20), 'f', 1, 64) + " MiB" }

// gib formats n bytes in GiB.
func gib(n int64) string { return strconv.FormatFloat(float64(n)/(1<<30), 'f', 1, 64) + " GiB" }

// memoryLimit is the memory this process may use: the machine's
// (/proc/meminfo MemTotal), or its cgroup's limit when lower. 0: unknown
// (not Linux).
func memoryLimit() int64 {
	read := func(path string) []byte { data, _ := os.ReadFile(path); return data }
	limit := parseMemTotal(read("/proc/meminfo"))
	for _, path := range []string{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"} {
		if n := parseCgroupLimit(read(path)); n > 0 && (limit == 0 || n < limit) {
			limit = n
		}
	}
	return limit
}

// parseMemTotal reads MemTotal (in kB) from /proc/meminfo's text, in
// bytes; 0 when absent or malformed.
func parseMemTotal(meminfo []byte) int64 {
	sc := bufio.NewScanner(bytes.NewReader(meminfo))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil || kb <= 0 || kb >= 1<<53 {
				return 0
			}
			return kb << 10
		}
	}
	return 0
}

// parseCgroupLimit reads a cgroup memory limit in bytes; 0 when unlimited
// ("max", or v1's huge sentinel) or malformed.
func parseCgroupLimit(data []byte) int64 {
	n, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	if err != nil || n <= 0 || n >= 1<<62 {
		return 0
	}
	return n
}
