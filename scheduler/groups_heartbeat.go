package scheduler

import (
	"slices"
	"strings"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// reconnected says this replica was cut off from NATS from at most since
// until now: the ranks' silence before says nothing about them.
func (t *groupTable) reconnected(now, since time.Time) {
	t.mu.Lock()
	t.heardFrom, t.cutSince = now, since
	t.mu.Unlock()
}

// rejoining reports whether, within the heartbeat timeout of this
// replica's last reconnect, one of groups (a request's candidates: a
// rank of a group it cannot go to, another model's, is no reason for it
// to wait) has a rank not heard since the cut.
// After a NATS restart every role reconnects on its own schedule (¼ s
// apart, with jitter): a rank not back yet misses the ReqMetas published
// meanwhile (core NATS), and though the driver answers and a resend
// reaches the rank a second later, the rank did not register the
// request's saves, so the next turn, sent the moment the answer came,
// loaded none of those blocks there and recomputed them.
func (t *groupTable) rejoining(now time.Time, groups []GroupState) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.heardFrom.IsZero() || now.Sub(t.heardFrom) >= t.timeout {
		return false
	}
	for _, c := range groups {
		g := t.groups[c.Name]
		if g == nil {
			continue
		}
		// A group alive when the cut began (a group dead before it is
		// no reason to wait) with a rank not heard since.
		oldest := g.status.oldestSeen
		if g.worldSize > 0 && g.status.complete && !oldest.After(t.cutSince) && t.cutSince.Sub(oldest) <= t.timeout {
			return true
		}
	}
	return false
}

// reconnectedAt is when this replica last reconnected to NATS (zero:
// never cut off).
func (t *groupTable) reconnectedAt() time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.heardFrom
}

// heardLocked reports whether a rank last heard at seen was heard within
// the timeout, counting from the last reconnect when it was heard before
// it. Called with t.mu held.
func (t *groupTable) heardLocked(seen, now time.Time) bool {
	return now.Sub(maxTime(seen, t.heardFrom)) <= t.timeout
}

// dupReportEvery is how often a rank claimed by two processes is reported.
const dupReportEvery = time.Minute

// olderLocked reports whether the process that started at started is a
// second, older process given rank while the rank's own process is heard
// from (see observe). Called with t.mu held.
//
// Which of two processes is the older is what this replica heard when it
// can tell: the process the rank's replaced here is; a process first heard
// after the rank's had been heard for the timeout is not (a running
// process is heard within every timeout: it began later), whatever the
// clocks of their hosts say. Otherwise (this replica has heard the rank's
// process for less than that: both were running when it began to listen)
// the earlier started_unix_ms is the older. Read from started_unix_ms
// alone, a rank replaced by a process on a host whose clock is behind was
// that process's "older" rival: its heartbeats ignored and reported as a
// second process of the rank until the first was silent for the timeout,
// for a whole drain when the first was draining.
func (t *groupTable) olderLocked(g *groupInfo, rank int, started int64, now time.Time) bool {
	prev, known := g.ranks[rank]
	switch {
	case !known || started == prev.started || now.Sub(prev.seen) > t.timeout:
		return false
	case started == prev.replaced:
		return true
	case now.Sub(maxTime(prev.since, t.heardFrom)) >= t.timeout:
		return false
	}
	return started < prev.started
}

// notTheRank reports whether a message of the process that started at
// started comes from a second, older process given rank of group, whose
// heartbeats observe ignores: its KV events are not the rank's either. A
// started of zero (a worker that does not say) is taken as the rank's.
func (t *groupTable) notTheRank(group string, rank int, started int64, now time.Time) bool {
	if started == 0 {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	g := t.groups[group]
	return g != nil && t.olderLocked(g, rank, started, now)
}

// observe records a heartbeat. Another started_unix_ms than the rank's is
// a restart, unless it is the older process (see olderLocked) and the
// rank's process is still heard from: then it comes from a second, older
// process with the same identity (two workers given one --tp-rank), which
// is not the rank (stale), and report says to tell the operator (at most
// once a minute per rank). Once the newer process is silent for the
// timeout, the older one is the rank.
//
// gap is how long after the process's previous heartbeat this one was
// handled (0 for its first).
func (t *groupTable) observe(hb *messages.Heartbeat, now time.Time) (stale, report bool, gap time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	g := t.groups[hb.Group]
	if g == nil {
		g = &groupInfo{name: hb.Group, ranks: map[int]rankInfo{}}
		t.groups[hb.Group] = g
		i, _ := slices.BinarySearchFunc(t.order, hb.Group, func(g *groupInfo, name string) int { return strings.Compare(g.name, name) })
		t.order = slices.Insert(t.order, i, g)
	}
	if g.worldSize != hb.WorldSize {
		// A group re-formed with another size: forget the old ranks.
		g.worldSize = hb.WorldSize
		g.ranks = map[int]rankInfo{}
	}
	prev, known := g.ranks[hb.TPRank]
	if t.olderLocked(g, hb.TPRank, hb.StartedUnixMs, now) {
		if report = now.Sub(prev.dupSaid) >= dupReportEvery; report {
			prev.dupSaid = now
			g.ranks[hb.TPRank] = prev
		}
		return true, report, 0
	}
	restarted, since, replaced := prev.restarted, prev.since, prev.replaced
	if known && hb.StartedUnixMs != prev.started {
		restarted, replaced = now, prev.started
	}
	if !known || hb.StartedUnixMs != prev.started {
		since = now
	}
	if known && hb.StartedUnixMs == prev.started {
		// Not counting a time this replica was cut off from NATS.
		gap = now.Sub(maxTime(prev.seen, t.heardFrom))
	}
	g.ranks[hb.TPRank] = rankInfo{seen: now, started: hb.StartedUnixMs, since: since, replaced: replaced, restarted: restarted, dupSaid: prev.dupSaid, aheadSaid: prev.aheadSaid,
		queueDepth: max(hb.QueueDepth, 0), draining: hb.Draining, notReady: hb.NotReady, model: hb.Model,
		capacityBlocks: max(hb.CapacityBlocks, 0)}
	g.refresh()
	if hb.TPRank == 0 { // the driver knows the group's load
		// A count below 0 (a driver of an older kvbus whose counters
		// drifted, a hand-made heartbeat) is none: taken as it is, it hid
		// the requests dispatched there since, the group idle as it filled.
		g.hbInflight = max(hb.InflightRequests, 0)
		bs := int64(t.blockSize)
		g.hbQueued = int((max(hb.QueuedPrefillTokens, 0)+bs-1)/bs) +
			loadWork(int(max(hb.QueuedLoadTokens, 0)/bs), int(max(hb.QueuedRemoteLoadTokens, 0)/bs), t.localLoad, t.remoteLoad)
		g.hbAt = now
		g.prefilling = time.Duration(max(hb.PrefillingUs, 0)) * time.Microsecond
		g.prefillingBlocks = int((max(hb.PrefillingTokens, 0) + bs - 1) / bs)
		g.inflight, g.queued = 0, 0
		g.resendByGroup = hb.ResendByGroup
	}
	return false, false, gap
}

// sayAhead reports whether to say now that the clock of a rank of group
// is ahead of this host's: at most once a minute per rank (dupReportEvery).
func (t *groupTable) sayAhead(group string, rank int, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if g := t.groups[group]; g != nil {
		if r, ok := g.ranks[rank]; ok {
			if now.Sub(r.aheadSaid) < dupReportEvery {
				return false
			}
			r.aheadSaid = now
			g.ranks[rank] = r
		}
	}
	return true
}

// mixedModels returns the models the live ranks of group serve when they
// are more than one, sorted, and whether to report it now (at most once a
// minute per group).
func (t *groupTable) mixedModels(group string, now time.Time) (models []string, report bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	g := t.groups[group]
	if g == nil {
		return nil, false
	}
	for _, r := range g.ranks {
		if t.heardLocked(r.seen, now) && !slices.Contains(models, r.model) {
			models = append(models, r.model)
		}
	}
	if len(models) < 2 {
		return nil, false
	}
	slices.Sort(models)
	if report = now.Sub(g.mixedSaid) >= dupReportEvery; report {
		g.mixedSaid = now
	}
	return models, report
}

// rankRestart is a rank's last restart: when this replica heard it, and
// the new process's started_unix_ms.
type rankRestart struct {
	at      time.Time
	started int64
}

// restarts returns, per group, the last restart of each rank that
// restarted (a rank that never did is left out).
func (t *groupTable) restarts() map[string]map[int]rankRestart {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out map[string]map[int]rankRestart
	for name, g := range t.groups {
		for r, ri := range g.ranks {
			if ri.restarted.IsZero() {
				continue
			}
			if out == nil {
				out = map[string]map[int]rankRestart{}
			}
			if out[name] == nil {
				out[name] = map[int]rankRestart{}
			}
			out[name][r] = rankRestart{ri.restarted, ri.started}
		}
	}
	return out
}
