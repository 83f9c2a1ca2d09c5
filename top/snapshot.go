package top

import (
	"container/heap"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kvbus/kvbus/internal/quantile"
)

// Snapshot is the cluster as the bus showed it at At; `kvbus top --once
// --json` prints one. Its lists are never null (empty: []).
type Snapshot struct {
	At        time.Time `json:"at"`
	WindowSec float64   `json:"window_sec"` // of the rates, percentiles and ratios
	// Disconnected is set while top has lost NATS: the rows are the last
	// known ones (Stale), judged as of the disconnection.
	Disconnected *Disconnection `json:"disconnected,omitempty"`
	Stale        bool           `json:"stale,omitempty"`
	Groups       []GroupRow     `json:"groups"`
	Schedulers   []SchedulerRow `json:"schedulers"`
	// NoReadyScheduler: no scheduler announced itself ready within the
	// frontend's 3 s, so frontends answer 503 no_ready_scheduler (false
	// during top's first 3 s, before it could have heard one).
	NoReadyScheduler bool `json:"no_ready_scheduler"`
	// RequestsPerSec are the requests finished per second over the window
	// (or since the watcher started, if that is shorter).
	RequestsPerSec float64 `json:"requests_per_sec"`
	Finished       int     `json:"finished"`
	// Failed are the finished requests that ended in an error, timed out
	// or were cut off by a stopping frontend.
	Failed int `json:"failed"`
	// Aborted are the requests whose client went away, over the window
	// (not in Finished). Requests the request log refused never ran and
	// are not counted at all.
	Aborted int `json:"aborted"`
	// InFlight are the requests top saw start and not end, or, when more,
	// those the live groups' driver ranks say they hold (requests sent
	// before top subscribed).
	InFlight int `json:"in_flight"`
	// TTFT from the request's arrival at the frontend (its clock) to its
	// first output reaching top: a top reading late overstates it. None
	// for a request answered in one output (an engine's, not streamed).
	TTFTP50Ms float64 `json:"ttft_p50_ms"`
	TTFTP95Ms float64 `json:"ttft_p95_ms"`
	// HitRatio is cached over prompt tokens of the finished requests, by
	// turn depth of their session ("1", "2", "3", "4+").
	HitRatio map[string]float64 `json:"hit_ratio_by_turn"`
	// Sessions are the busiest sessions (matching the filter, if any), of
	// SessionsTracked followed (at most Config.MaxSessions).
	Sessions        []SessionRow `json:"sessions"`
	SessionsTracked int          `json:"sessions_tracked"`
}

// Disconnection says which NATS top lost, and when.
type Disconnection struct {
	URL   string    `json:"url"` // password hidden
	Since time.Time `json:"since"`
}

// GroupRow is one worker group.
type GroupRow struct {
	Name string `json:"name"`
	// State is ready, draining, not_ready (an engine fails its health
	// check), incomplete (fewer live ranks than its world size), conflict
	// (its live ranks disagree on the world size or the model: Conflict
	// says how; the schedulers place nothing there) or
	// down (every rank silent; listed for 5 minutes).
	State    string `json:"state"`
	Conflict string `json:"conflict,omitempty"`
	// Model is the model the group serves, as its driver rank (else the
	// most recently heard rank) says.
	Model string `json:"model,omitempty"`
	Ranks int    `json:"ranks"`
	// WorldSize is what the driver rank (else the most recently heard
	// rank) says.
	WorldSize int `json:"world_size"`
	// LastHeardMs is the time since any rank's last heartbeat.
	LastHeardMs         int64 `json:"last_heard_ms"`
	Inflight            int   `json:"inflight"`
	QueuedPrefillTokens int64 `json:"queued_prefill_tokens"`
	QueuedLoadTokens    int64 `json:"queued_load_tokens"`
	// Blocks and CapacityBlocks are the group's, the fewest any live rank
	// reports: each rank holds its shard of the same blocks, and a block
	// serves a load only while every rank holds it (a rank restarted empty
	// leaves the group none); Bytes is the sum over the live ranks.
	Blocks         int64 `json:"blocks"`
	Bytes          int64 `json:"bytes"`
	CapacityBlocks int64 `json:"capacity_blocks"`
	// PoolIn and PoolOut are blocks this group's requests read from other
	// groups, and other groups' requests read from it, over the window.
	PoolIn  int `json:"pool_in_blocks"`
	PoolOut int `json:"pool_out_blocks"`
}

// SchedulerRow is one scheduler replica's last announcement.
type SchedulerRow struct {
	ID string `json:"id"`
	// State is ready, not_ready (Reason says why), silent (not heard for
	// over 3 s: the frontends no longer count it) or stopped (it said so).
	State       string `json:"state"`
	Ready       bool   `json:"ready"` // State is ready
	ReadyGroups int    `json:"ready_groups"`
	Reason      string `json:"reason,omitempty"`
	AgeMs       int64  `json:"age_ms"` // since it was last heard
}

// SessionRow is one conversation.
type SessionRow struct {
	ID       string  `json:"id"`
	Model    string  `json:"model"`
	Group    string  `json:"group"`
	Turns    int     `json:"turns"`
	Recent   int     `json:"recent"` // requests within the window
	HitRatio float64 `json:"hit_ratio"`
}

// SnapshotOptions choose a Snapshot's sessions.
type SnapshotOptions struct {
	// Sessions is how many of the busiest are listed (0: none).
	Sessions int
	// Filter, if set, keeps the sessions whose id, raw or as displayed,
	// contains it.
	Filter string
}

// Depth labels, as the scheduler's metrics.
func depthLabel(d int) string {
	switch {
	case d <= 1:
		return "1"
	case d == 2:
		return "2"
	case d == 3:
		return "3"
	}
	return "4+"
}

// Snapshot returns the cluster as of now, with Config.Sessions sessions.
func (w *Watcher) Snapshot(now time.Time) Snapshot {
	return w.SnapshotWith(now, SnapshotOptions{Sessions: w.cfg.Sessions})
}

// SnapshotWith returns the cluster as of now, with the sessions o asks.
func (w *Watcher) SnapshotWith(now time.Time, o SnapshotOptions) Snapshot {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := Snapshot{At: now, WindowSec: w.cfg.Window.Seconds(), HitRatio: map[string]float64{}, InFlight: len(w.reqs),
		Groups: []GroupRow{}, Schedulers: []SchedulerRow{}, Sessions: []SessionRow{}, SessionsTracked: len(w.sessions)}
	if w.running {
		w.connStatus(w.cfg.Conn.Status(), now)
	}
	// Liveness is judged as of the last moment top heard the bus.
	asOf := now
	if !w.discSince.IsZero() {
		s.Disconnected = &Disconnection{URL: w.url, Since: w.discSince}
		s.Stale = true
		asOf = w.discSince
	}
	cut := now.Add(-w.cfg.Window)
	in, out := map[string]int{}, map[string]int{}
	for _, p := range w.pool {
		if !p.at.Before(cut) {
			in[p.to] += p.blocks
			out[p.from] += p.blocks
		}
	}
	for name, g := range w.groups {
		if len(g.ranks) == 0 {
			continue // KV events only: no heartbeat yet
		}
		s.Groups = append(s.Groups, w.groupRow(name, g, asOf, in[name], out[name]))
	}
	sort.Slice(s.Groups, func(i, j int) bool { return naturalLess(s.Groups[i].Name, s.Groups[j].Name) })
	// The requests top saw start are not all that run: those sent before
	// it subscribed are in the live drivers' counts only (a --once
	// snapshot said 0 in flight beside groups of 15 each).
	onGroups := 0
	for _, g := range s.Groups {
		onGroups += g.Inflight
	}
	s.InFlight = max(s.InFlight, onGroups)
	for id, sc := range w.schedulers {
		age := max(asOf.Sub(sc.seen), 0)
		row := SchedulerRow{ID: id, ReadyGroups: sc.ann.ReadyGroups, Reason: sc.ann.Reason, AgeMs: age.Milliseconds()}
		switch {
		case sc.ann.Stopped:
			row.State = "stopped"
		case age > schedulerSilence:
			row.State = "silent"
		case sc.ann.Ready:
			row.State, row.Ready = "ready", true
		default:
			row.State = "not_ready"
		}
		s.Schedulers = append(s.Schedulers, row)
	}
	sort.Slice(s.Schedulers, func(i, j int) bool { return naturalLess(s.Schedulers[i].ID, s.Schedulers[j].ID) })
	s.NoReadyScheduler = w.running && asOf.Sub(w.started) > schedulerSilence
	for _, sc := range s.Schedulers {
		s.NoReadyScheduler = s.NoReadyScheduler && !sc.Ready
	}

	var ttfts []time.Duration
	prompt, cached := map[string]int{}, map[string]int{}
	for _, d := range w.done {
		if d.at.Before(cut) {
			continue
		}
		// A first token counts whatever came after it (its client left,
		// the request failed or timed out), as the frontend's TTFT does.
		if d.ttft > 0 {
			ttfts = append(ttfts, d.ttft)
		}
		if d.aborted {
			s.Aborted++
			continue
		}
		s.Finished++
		if d.failed {
			s.Failed++
			continue
		}
		l := depthLabel(d.depth)
		prompt[l] += d.prompt
		cached[l] += d.cached
	}
	for l, p := range prompt {
		if p > 0 {
			s.HitRatio[l] = float64(cached[l]) / float64(p)
		}
	}
	span := min(w.cfg.Window, now.Sub(w.started))
	if span > 0 {
		s.RequestsPerSec = float64(s.Finished) / span.Seconds()
	}
	slices.Sort(ttfts)
	s.TTFTP50Ms, s.TTFTP95Ms = quantileMs(ttfts, 0.5), quantileMs(ttfts, 0.95)
	s.Sessions = w.busiest(cut, o)
	return s
}

// groupRow is group g as of asOf. Call with w.mu held.
func (w *Watcher) groupRow(name string, g *groupView, asOf time.Time, poolIn, poolOut int) GroupRow {
	row := GroupRow{Name: name, PoolIn: poolIn, PoolOut: poolOut}
	var lastHeard time.Time
	draining, notReady := false, false
	sizes, models := map[int]bool{}, map[string]bool{}
	driverSize, latestSize := 0, 0
	driverModel, latestModel := "", ""
	for tp, r := range g.ranks {
		if r.seen.After(lastHeard) {
			lastHeard, latestSize, latestModel = r.seen, r.hb.WorldSize, r.hb.Model
		}
		if asOf.Sub(r.seen) > w.cfg.HeartbeatTimeout {
			continue
		}
		row.Ranks++
		sizes[r.hb.WorldSize] = true
		models[r.hb.Model] = true
		draining = draining || r.hb.Draining
		notReady = notReady || r.hb.NotReady
		if row.Ranks == 1 { // the first live rank
			row.Blocks, row.CapacityBlocks = r.hb.UsedBlocks, r.hb.CapacityBlocks
		}
		row.Blocks = min(row.Blocks, r.hb.UsedBlocks)
		row.CapacityBlocks = min(row.CapacityBlocks, r.hb.CapacityBlocks)
		row.Bytes += r.hb.UsedBytes
		if tp == 0 {
			driverSize, driverModel = r.hb.WorldSize, r.hb.Model
			row.Inflight, row.QueuedPrefillTokens = r.hb.InflightRequests, r.hb.QueuedPrefillTokens
			row.QueuedLoadTokens = r.hb.QueuedLoadTokens + r.hb.QueuedRemoteLoadTokens
		}
	}
	row.LastHeardMs = max(asOf.Sub(lastHeard), 0).Milliseconds()
	row.WorldSize = latestSize
	if driverSize > 0 {
		row.WorldSize, row.Model = driverSize, driverModel
	} else {
		row.Model = latestModel
	}
	var conflicts []string
	if len(sizes) > 1 {
		ws := slices.Sorted(maps.Keys(sizes))
		parts := make([]string, len(ws))
		for i, n := range ws {
			parts[i] = strconv.Itoa(n)
		}
		conflicts = append(conflicts, "world size "+strings.Join(parts, " vs "))
	}
	if len(models) > 1 { // workers of two models in one group
		conflicts = append(conflicts, "models "+strings.Join(slices.Sorted(maps.Keys(models)), " vs "))
	}
	switch {
	case row.Ranks == 0:
		row.State = "down"
	case len(conflicts) > 0:
		row.State = "conflict"
		row.Conflict = strings.Join(conflicts, "; ")
	case notReady:
		row.State = "not_ready"
	case row.Ranks < row.WorldSize:
		row.State = "incomplete"
	case draining:
		row.State = "draining"
	default:
		row.State = "ready"
	}
	return row
}

// busiest are the o.Sessions busiest sessions matching o.Filter, by
// requests within the window, then turns, then id: a bounded heap, not a
// sort of every session. Call with w.mu held.
func (w *Watcher) busiest(cut time.Time, o SnapshotOptions) []SessionRow {
	k := max(o.Sessions, 0)
	h := make(sessionHeap, 0, min(k, len(w.sessions)))
	for key, sv := range w.sessions {
		id := key.id
		recent := 0
		for _, t := range sv.inWindow {
			if !t.Before(cut) {
				recent++
			}
		}
		sv.inWindow = sv.inWindow[len(sv.inWindow)-recent:]
		if k == 0 {
			continue
		}
		if o.Filter != "" && !strings.Contains(id, o.Filter) && !strings.Contains(Printable(id), o.Filter) {
			continue
		}
		row := SessionRow{ID: id, Model: key.model, Group: sv.group, Turns: sv.turns, Recent: recent}
		if sv.prompt > 0 {
			row.HitRatio = float64(sv.cached) / float64(sv.prompt)
		}
		if len(h) == k {
			if !busier(row, h[0]) {
				continue
			}
			h[0] = row
			heap.Fix(&h, 0)
		} else {
			heap.Push(&h, row)
		}
	}
	rows := make([]SessionRow, len(h))
	for i := len(h) - 1; i >= 0; i-- {
		rows[i] = heap.Pop(&h).(SessionRow)
	}
	return rows
}

// busier orders sessions, busiest first.
func busier(a, b SessionRow) bool {
	if a.Recent != b.Recent {
		return a.Recent > b.Recent
	}
	if a.Turns != b.Turns {
		return a.Turns > b.Turns
	}
	if a.ID != b.ID {
		return a.ID < b.ID
	}
	return a.Model < b.Model
}

// sessionHeap is a min-heap by busier: its root is the least busy kept.
type sessionHeap []SessionRow

func (h sessionHeap) Len() int           { return len(h) }
func (h sessionHeap) Less(i, j int) bool { return busier(h[j], h[i]) }
func (h sessionHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *sessionHeap) Push(x any)        { *h = append(*h, x.(SessionRow)) }
func (h *sessionHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// naturalLess orders names with their digit runs as numbers: g2 before
// g10.
func naturalLess(a, b string) bool {
	for a != "" && b != "" {
		da, db := digitPrefix(a), digitPrefix(b)
		if da > 0 && db > 0 {
			na, nb := strings.TrimLeft(a[:da], "0"), strings.TrimLeft(b[:db], "0")
			if len(na) != len(nb) {
				return len(na) < len(nb)
			}
			if na != nb {
				return na < nb
			}
			if da != db {
				return da < db // fewer leading zeros first
			}
			a, b = a[da:], b[db:]
			continue
		}
		if a[0] != b[0] {
			return a[0] < b[0]
		}
		a, b = a[1:], b[1:]
	}
	return len(a) < len(b)
}

func digitPrefix(s string) int {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return i
}

// quantileMs is the q-quantile of sorted durations, in milliseconds (0 for
// none).
func quantileMs(sorted []time.Duration, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return float64(quantile.NearestRank(sorted, q).Microseconds()) / 1000
}
