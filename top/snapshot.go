package top

import (
	"slices"
	"sort"
	"time"

	"github.com/kvbus/kvbus/internal/quantile"
)

// Snapshot is the cluster as the bus showed it at At; `kvbus top --once
// --json` prints one.
type Snapshot struct {
	At         time.Time      `json:"at"`
	WindowSec  float64        `json:"window_sec"` // of the rates, percentiles and ratios
	Groups     []GroupRow     `json:"groups"`
	Schedulers []SchedulerRow `json:"schedulers"`
	// RequestsPerSec are the requests finished per second over the window
	// (or since the watcher started, if that is shorter).
	RequestsPerSec float64 `json:"requests_per_sec"`
	Finished       int     `json:"finished"`
	Failed         int     `json:"failed"`
	// Aborted are the requests whose client went away, over the window
	// (not in Finished).
	Aborted   int     `json:"aborted"`
	InFlight  int     `json:"in_flight"`
	TTFTP50Ms float64 `json:"ttft_p50_ms"`
	TTFTP95Ms float64 `json:"ttft_p95_ms"`
	// HitRatio is cached over prompt tokens of the finished requests, by
	// turn depth of their session ("1", "2", "3", "4+").
	HitRatio map[string]float64 `json:"hit_ratio_by_turn"`
	Sessions []SessionRow       `json:"sessions"`
}

// GroupRow is one worker group.
type GroupRow struct {
	Name string `json:"name"`
	// State is ready, draining, not_ready (an engine fails its health
	// check) or incomplete (fewer live ranks than its world size).
	State               string `json:"state"`
	Ranks               int    `json:"ranks"`
	WorldSize           int    `json:"world_size"`
	Inflight            int    `json:"inflight"`
	QueuedPrefillTokens int64  `json:"queued_prefill_tokens"`
	QueuedLoadTokens    int64  `json:"queued_load_tokens"`
	Blocks              int64  `json:"blocks"`
	Bytes               int64  `json:"bytes"`
	CapacityBlocks      int64  `json:"capacity_blocks"`
	// PoolIn and PoolOut are blocks this group's requests read from other
	// groups, and other groups' requests read from it, over the window.
	PoolIn  int `json:"pool_in_blocks"`
	PoolOut int `json:"pool_out_blocks"`
}

// SchedulerRow is one scheduler replica's last announcement.
type SchedulerRow struct {
	ID          string `json:"id"`
	Ready       bool   `json:"ready"`
	ReadyGroups int    `json:"ready_groups"`
	Reason      string `json:"reason,omitempty"`
	AgeMs       int64  `json:"age_ms"`
}

// SessionRow is one conversation.
type SessionRow struct {
	ID       string  `json:"id"`
	Group    string  `json:"group"`
	Turns    int     `json:"turns"`
	Recent   int     `json:"recent"` // requests within the window
	HitRatio float64 `json:"hit_ratio"`
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

// Snapshot returns the cluster as of now.
func (w *Watcher) Snapshot(now time.Time) Snapshot {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := Snapshot{At: now, WindowSec: w.cfg.Window.Seconds(), HitRatio: map[string]float64{}, InFlight: len(w.reqs)}
	cut := now.Add(-w.cfg.Window)
	in, out := map[string]int{}, map[string]int{}
	for _, p := range w.pool {
		if !p.at.Before(cut) {
			in[p.to] += p.blocks
			out[p.from] += p.blocks
		}
	}
	for name, g := range w.groups {
		row := GroupRow{Name: name, WorldSize: g.worldSize, PoolIn: in[name], PoolOut: out[name]}
		draining, notReady := false, false
		for tp, r := range g.ranks {
			if now.Sub(r.seen) > w.cfg.HeartbeatTimeout {
				continue
			}
			row.Ranks++
			draining = draining || r.hb.Draining
			notReady = notReady || r.hb.NotReady
			row.Blocks += r.hb.UsedBlocks
			row.Bytes += r.hb.UsedBytes
			row.CapacityBlocks += r.hb.CapacityBlocks
			if tp == 0 {
				row.Inflight, row.QueuedPrefillTokens = r.hb.InflightRequests, r.hb.QueuedPrefillTokens
				row.QueuedLoadTokens = r.hb.QueuedLoadTokens + r.hb.QueuedRemoteLoadTokens
			}
		}
		switch {
		case row.Ranks == 0 && g.worldSize > 0:
			continue // gone
		case notReady:
			row.State = "not_ready"
		case row.Ranks < g.worldSize:
			row.State = "incomplete"
		case draining:
			row.State = "draining"
		default:
			row.State = "ready"
		}
		s.Groups = append(s.Groups, row)
	}
	sort.Slice(s.Groups, func(i, j int) bool { return s.Groups[i].Name < s.Groups[j].Name })
	for id, a := range w.schedulers {
		age := now.Sub(time.UnixMilli(a.UnixMs))
		if age > 10*time.Second {
			continue
		}
		s.Schedulers = append(s.Schedulers, SchedulerRow{ID: id, Ready: a.Ready, ReadyGroups: a.ReadyGroups, Reason: a.Reason, AgeMs: age.Milliseconds()})
	}
	sort.Slice(s.Schedulers, func(i, j int) bool { return s.Schedulers[i].ID < s.Schedulers[j].ID })

	var ttfts []time.Duration
	prompt, cached := map[string]int{}, map[string]int{}
	for _, d := range w.done {
		if d.at.Before(cut) {
			continue
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
		if d.ttft > 0 {
			ttfts = append(ttfts, d.ttft)
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

	for id, sv := range w.sessions {
		recent := 0
		for _, t := range sv.inWindow {
			if !t.Before(cut) {
				recent++
			}
		}
		sv.inWindow = sv.inWindow[len(sv.inWindow)-recent:]
		row := SessionRow{ID: id, Group: sv.group, Turns: sv.turns, Recent: recent}
		if sv.prompt > 0 {
			row.HitRatio = float64(sv.cached) / float64(sv.prompt)
		}
		s.Sessions = append(s.Sessions, row)
	}
	sort.Slice(s.Sessions, func(i, j int) bool {
		a, b := s.Sessions[i], s.Sessions[j]
		if a.Recent != b.Recent {
			return a.Recent > b.Recent
		}
		if a.Turns != b.Turns {
			return a.Turns > b.Turns
		}
		return a.ID < b.ID
	})
	return s
}

// quantileMs is the q-quantile of sorted durations, in milliseconds (0 for
// none).
func quantileMs(sorted []time.Duration, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return float64(quantile.NearestRank(sorted, q).Microseconds()) / 1000
}
