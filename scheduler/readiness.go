package scheduler

import (
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// Readiness. A replica is ready when its request consumer runs and at
// least one worker group is ready with a synced index. It places requests
// only on ready groups whose index is synced (PlaceableGroups), so every
// request is placed on what the ranks really hold, and a group that joins
// or resyncs does not make the replica unready. Replicas announce their
// readiness on kvbus.ann.scheduler.<id>; frontends report healthy only
// while a ready replica exists.

// Ready reports whether the replica is ready, and if not, why.
func (s *Scheduler) Ready() (bool, string) {
	if !s.consuming.Load() {
		return false, "request consumer not running"
	}
	groups := s.groups.ready(time.Now())
	if len(groups) == 0 {
		return false, "no ready worker group"
	}
	if len(s.index.placeable(groups)) > 0 {
		return true, ""
	}
	return false, fmt.Sprintf("KV index of the %d ready group(s) not synced yet", len(groups))
}

// PlaceableGroups returns the ready groups whose index is synced (or that
// a full index does not track), or all ready groups when none is (a resync
// in progress everywhere must not stop placement).
func (s *Scheduler) PlaceableGroups(now time.Time) []GroupState {
	return s.placeableOf(s.groups.ready(now))
}

// placeableOf returns the groups of groups whose index is synced, or all
// of them when none is.
func (s *Scheduler) placeableOf(groups []GroupState) []GroupState {
	if synced := s.index.placeable(groups); len(synced) > 0 {
		return synced
	}
	return groups
}

// Groups returns the ready groups as this replica sees them, load
// included.
func (s *Scheduler) Groups() []GroupState { return s.groups.ready(time.Now()) }

// announcement is the last Announcement sent.
type announcement struct {
	mu     sync.Mutex
	ready  bool
	reason string
	at     time.Time
}

// announce publishes the replica's readiness when it changed, every second
// otherwise, or at once when force is set.
func (s *Scheduler) announce(now time.Time, force bool) {
	ready, reason := s.Ready()
	a := &s.announced
	a.mu.Lock()
	if !force && ready == a.ready && reason == a.reason && now.Sub(a.at) < time.Second {
		a.mu.Unlock()
		return
	}
	if ready != a.ready {
		s.log.Info("scheduler readiness", "ready", ready, "reason", reason)
	}
	a.ready, a.reason, a.at = ready, reason, now
	a.mu.Unlock()
	groups := s.groups.ready(now)
	var models []string // the frontends' readiness per model
	for _, g := range groups {
		if !slices.Contains(models, g.Model) {
			models = append(models, g.Model)
		}
	}
	slices.Sort(models)
	var holds time.Duration // what the frontends may hold a request for meanwhile
	if s.consuming.Load() {
		holds = s.cfg.NoGroupWait
	}
	data, err := messages.Marshal(&messages.Announcement{
		Role: messages.RoleScheduler, ID: s.cfg.ID, Ready: ready, Reason: reason,
		ReadyGroups: len(groups), UnixMs: now.UnixMilli(), StartedUnixMs: s.started.UnixMilli(), ReadyModels: models,
		NoGroupWaitMs: holds.Milliseconds(),
	})
	if err == nil {
		err = s.cfg.Conn.Publish(s.cfg.Subjects.Announce(messages.RoleScheduler, s.cfg.ID), data)
	}
	if err != nil {
		s.log.Warn("cannot announce readiness", "err", err)
	}
}

// announceStopped is the replica's last announcement after a clean stop
// with no request left: the other replicas forget it at once, with
// nothing to adopt.
func (s *Scheduler) announceStopped() {
	data, err := messages.Marshal(&messages.Announcement{
		Role: messages.RoleScheduler, ID: s.cfg.ID, Reason: "stopped", Stopped: true, UnixMs: time.Now().UnixMilli(),
		StartedUnixMs: s.started.UnixMilli(),
	})
	if err == nil {
		err = s.cfg.Conn.Publish(s.cfg.Subjects.Announce(messages.RoleScheduler, s.cfg.ID), data)
	}
	if err != nil {
		s.log.Warn("cannot announce the stop", "err", err)
	}
}
