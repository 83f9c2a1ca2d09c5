package workers

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// maxMetricsBytes bounds how much of an engine's /metrics is read looking
// for its start time (vLLM's is tens to hundreds of KB).
const maxMetricsBytes = 16 << 20

// startTimeMetric is the Prometheus process collector's start time of the
// process serving /metrics, in seconds since the epoch: vLLM's API server
// exports it (prometheus_client's default registry), as do most servers.
const startTimeMetric = "process_start_time_seconds"

// EngineRestart tells that the model server behind a driver rank restarted:
// its KV cache is empty.
type EngineRestart struct {
	// Why says how the restart was found, for logs.
	Why string
	// LastSeen is when the engine that restarted was last seen alive (a
	// health poll's start). Evidence of the restart from after it (the
	// engine's KV event sequence starting over) is about the new process.
	LastSeen time.Time
}

// EngineRestarts is implemented by engine health watchers that also tell
// when the model server restarted (OpenAIEngine).
type EngineRestarts interface {
	EngineHealth
	// WatchHealthAndRestarts is WatchHealth that also calls restarted when
	// the engine restarted, on the watching goroutine, before the health
	// change the same poll makes (so before changed, and before the
	// heartbeat that says the engine is ready again).
	WatchHealthAndRestarts(ctx context.Context, changed func(), restarted func(EngineRestart))
}

// restartRules decide from an engine's health polls whether it restarted
// (a crash and a restart by its supervisor at the same URL). A poll that is
// slow or fails is never a restart by itself: the engine may be busy, and
// its cache is intact. After the engine failed a poll, or could not be
// connected to, and then passes one, its identity is read: its /metrics
// process_start_time_seconds (one GET, only then: a healthy engine is
// never asked). The rules, in order:
//
//  1. A start time read at an earlier recovery is known: another value is
//     a restart, the same is not, whatever failed in between (a network
//     blip, a hung engine).
//  2. None known yet: a start time later than the last poll that saw the
//     engine healthy is a restart (the process began after the old one
//     was last seen; the engine's clock is taken to agree with the
//     worker's to well within the engine's restart time), an earlier one
//     is not.
//  3. No start time (no /metrics, no such series, or it could not be
//     read): an engine that could not be connected to at all (refused, no
//     such host) since its last success, by a poll or a request, and that
//     answers again restarted: nothing listened at its address, and what
//     listens now is a new process. Slow or failed polls that did connect
//     are not a restart.
//  4. Nothing before the engine's first successful poll is a restart: a
//     worker that starts before its engine is waiting for it.
//
// An engine that restarts between two polls (no poll saw it gone) is not
// found here: its KV events starting over tell it (see engineKV).
//
// Not safe for concurrent use: one health watcher owns it.
type restartRules struct {
	seen bool // the engine passed a poll once
	// start is the process_start_time_seconds read at the last recovery
	// (0: unknown), startAt when it was read: then the engine of start was
	// seen alive.
	start   float64
	startAt time.Time
	lastOK  time.Time // the last poll that passed began then
	away    bool      // since the last success, a poll or request could not connect
	failed  bool      // since the last success, a poll failed
}

func newRestartRules() *restartRules { return &restartRules{} }

// pollFailed records a failed poll; gone means it could not connect at all.
func (r *restartRules) pollFailed(gone bool) {
	r.failed = true
	r.away = r.away || gone
}

// requestFoundGone records that a request could not connect to the engine.
func (r *restartRules) requestFoundGone() { r.away = true }

// wantIdentity reports whether the successful poll being recorded should
// read the engine's start time first: it comes back after failing.
func (r *restartRules) wantIdentity() bool { return r.seen && (r.failed || r.away) }

// pollPassed records a successful poll that began at `at`. read tells
// whether the start time was read for it, and start what it was (0: the
// engine has none to read). It returns the restart the rules find, if any.
func (r *restartRules) pollPassed(at time.Time, read bool, start float64) (EngineRestart, bool) {
	away := r.away
	r.away, r.failed = false, false
	defer func() { r.lastOK = at }()
	known := read && start > 0
	if !r.seen {
		r.seen = true
		return EngineRestart{}, false
	}
	lastOK := float64(r.lastOK.UnixMicro()) / 1e6
	var rs EngineRestart
	switch {
	case known && r.start > 0 && start != r.start:
		rs = EngineRestart{LastSeen: r.startAt,
			Why: fmt.Sprintf("its %s went from %s to %s (a new process)", startTimeMetric, fmtStart(r.start), fmtStart(start))}
	case known && r.start == 0 && start > lastOK:
		rs = EngineRestart{LastSeen: r.lastOK,
			Why: fmt.Sprintf("its %s is %s, after it was last seen healthy at %s (a new process)", startTimeMetric, fmtStart(start), fmtStart(lastOK))}
	case !known && away:
		rs = EngineRestart{LastSeen: r.lastOK,
			Why: fmt.Sprintf("it could not be connected to and now answers again, and its /metrics has no %s to tell whether it is the same process", startTimeMetric)}
	default: // the same engine
		if known {
			r.start, r.startAt = start, at
		}
		return EngineRestart{}, false
	}
	r.start, r.startAt = 0, at
	if known {
		r.start = start
	}
	return rs, true
}

func fmtStart(s float64) string {
	return time.Unix(0, int64(s*1e9)).UTC().Format(time.RFC3339Nano)
}

// startTime reads the engine's process_start_time_seconds from GET
// /metrics, within HealthTimeout; 0 when the engine serves none (no
// /metrics, no such series) or it cannot be read now.
func (e *OpenAIEngine) startTime(ctx context.Context) float64 {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.HealthTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.base+"/metrics", nil)
	if err != nil {
		return 0
	}
	e.authorize(req.Header)
	resp, err := e.client.Do(req)
	if err != nil {
		e.log.Debug("engine identity: GET /metrics failed", "err", err)
		return 0
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		e.log.Debug("engine identity: GET /metrics answered", "status", resp.StatusCode)
		return 0
	}
	return parseStartTime(io.LimitReader(resp.Body, maxMetricsBytes))
}

// parseStartTime returns the value of the first process_start_time_seconds
// sample in a Prometheus text exposition, or 0.
func parseStartTime(r io.Reader) float64 {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), startTimeMetric)
		if !ok || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue // a comment, another series, or a longer name
		}
		if rest[0] == '{' {
			_, rest, ok = strings.Cut(rest, "}")
			if !ok {
				continue
			}
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil || !(v > 0) || math.IsInf(v, 0) { // NaN too
			return 0
		}
		return v
	}
	return 0
}
