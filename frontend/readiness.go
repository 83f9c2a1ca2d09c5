package frontend

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// Readiness. Scheduler replicas announce themselves on
// kvbus.ann.scheduler.<id> every second, ready or not (a replica is ready
// when it consumes the request log and can place on a group with a synced
// KV index). The frontend follows those announcements: /healthz reports
// healthy, and requests are taken, only while a ready replica announced
// itself within SchedulerTimeout. Otherwise a request gets a fast 503
// no_ready_scheduler with Retry-After instead of waiting for its timeout.

// schedulerTable holds the last announcement of each scheduler replica.
// Safe for concurrent use.
type schedulerTable struct {
	mu      sync.Mutex
	timeout time.Duration
	m       map[string]schedulerSeen
	// since is when the frontend began to listen for announcements, or
	// last came back to NATS with none fresh (rejoined).
	since time.Time
	// rejoined is since when it was a reconnect, and reconnects the
	// connection's reconnect count last seen (reconnected).
	rejoined   time.Time
	reconnects uint64
	// readyHeard is closed at the first announcement of a ready replica.
	readyHeard chan struct{}
	// wake is closed, and replaced, at each ready announcement and each
	// that changes how long a scheduler holds requests (its stop): the
	// requests held then look again. Nil until a ready one was heard.
	wake chan struct{}
	// swept is when replicas silent past forgetAfter were last forgotten.
	swept time.Time
}

// firstAnnouncementWait bounds how long a request that reaches a frontend
// before it could have heard any scheduler waits for a ready one: each
// announces itself every second, and a loaded host may be a little late.
const firstAnnouncementWait = 1500 * time.Millisecond

// listen records that announcements are heard from now on.
func (t *schedulerTable) listen(now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.since = now
	if t.readyHeard == nil {
		t.readyHeard = make(chan struct{})
	}
}

// reconnected records that the frontend's connection to NATS reconnected
// (its reconnect count is n) at now. While it was cut off it heard no
// announcement, so one that is stale now says nothing of the schedulers: as
// at its start, requests wait up to firstAnnouncementWait for a ready one's
// next announcement. A frontend cut off from NATS for longer than the
// timeout (a partition, its NIC) refused every request of the second after
// its reconnect 503 no_ready_scheduler, "start one", while both
// schedulers were ready (33 requests in a review's compose cluster).
// An announcement still fresh at the reconnect changes nothing of that:
// heard before the cut, it goes stale within the timeout, perhaps before
// the next is heard (the schedulers reconnect on their own schedule, and
// what they announced meanwhile went to a server the frontend was not on),
// and the requests of that moment were refused 503 "no scheduler announced
// itself within 3s: start one" while both schedulers were ready (a review:
// `kvbus nats` killed -9 and restarted, 2 requests 0.3 s after a
// frontend's reconnect, 1.8 s after the cut began).
// Calls after the first for the same n do nothing.
func (t *schedulerTable) reconnected(n uint64, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if n <= t.reconnects {
		return
	}
	t.reconnects = n
	t.since, t.rejoined = now, now
	if t.readyHeard != nil {
		select {
		case <-t.readyHeard:
			t.readyHeard = make(chan struct{})
		default: // not heard yet: its waiters go on waiting
		}
	}
}

// awaitFirstReady waits, while the frontend has heard no ready scheduler
// since it began to listen, for the first ready one's announcement, at most
// until firstAnnouncementWait (and the timeout) after it began. A frontend
// just (re)started takes its HTTP connections before a second has passed
// for the schedulers to announce themselves: its first requests were
// refused 503 no_ready_scheduler while the schedulers were ready.
func (t *schedulerTable) awaitFirstReady(ctx context.Context, now time.Time) {
	t.mu.Lock()
	heard, since := t.readyHeard, t.since
	t.mu.Unlock()
	left := since.Add(min(firstAnnouncementWait, t.timeout)).Sub(now)
	if heard == nil || left <= 0 {
		return
	}
	timer := time.NewTimer(left)
	defer timer.Stop()
	select {
	case <-heard:
	case <-timer.C:
	case <-ctx.Done():
	}
}

// awaitReadyAgain holds a request while no scheduler is ready, after one
// was (a frontend that never saw one answers at once): for as long as a
// live scheduler whose request consumer runs holds a request for a worker
// group (its --no-group-wait), or until ctx ends. It reports whether one
// is ready. A lone group briefly away (a rank replaced, its index
// resyncing) made every request of those seconds a 503
// no_ready_scheduler, whatever --no-group-wait said. The hold ends as soon
// as no live scheduler holds any more (it announced its stop, or fell
// silent past the timeout): none would take the request meanwhile.
func (t *schedulerTable) awaitReadyAgain(ctx context.Context, now time.Time) bool {
	begin := now
	for {
		t.mu.Lock()
		// Read with the readiness under one lock: an announcement that
		// came after the caller's check closed the channel before this one.
		wake, ok := t.wake, t.readyLocked(now)
		hold, lapse := t.holdLocked(now)
		t.mu.Unlock()
		if ok {
			return true
		}
		end := begin.Add(hold)
		if hold <= 0 || wake == nil || !now.Before(end) {
			return false
		}
		wait := end.Sub(now)
		if lapse > 0 {
			wait = min(wait, lapse)
		}
		timer := time.NewTimer(wait)
		select {
		case <-wake:
		case <-timer.C:
		case <-ctx.Done():
			timer.Stop()
			return false
		}
		timer.Stop()
		now = time.Now()
	}
}

// holdLocked returns the longest hold of the live schedulers, and how long
// until the first of those that hold falls silent past the timeout (0:
// none holds); t.mu is held.
func (t *schedulerTable) holdLocked(now time.Time) (hold, lapse time.Duration) {
	for _, s := range t.m {
		left := s.at.Add(t.timeout).Sub(now)
		if left < 0 || s.holds <= 0 {
			continue
		}
		hold = max(hold, s.holds)
		if lapse == 0 || left < lapse {
			lapse = left + time.Millisecond // past, not at, the timeout
		}
	}
	return hold, lapse
}

type schedulerSeen struct {
	ready  bool
	reason string
	at     time.Time
	// holds is how long it holds a request for a worker group (0: none).
	holds time.Duration
	// models are the models of its ready groups; nil from a scheduler
	// that does not say (any model).
	models []string
}

// forgetAfter is how long after its last announcement a scheduler replica
// is forgotten: it is gone (each restart of one is a new id).
const forgetAfter = time.Minute

// forgetSweep is how often an announcement looks for replicas to forget:
// not at each one, as any client of the bus may announce any number of
// ids, and at each one the scan of them all made a flood quadratic.
const forgetSweep = time.Second

func (t *schedulerTable) observe(a *messages.Announcement, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[string]schedulerSeen{}
	}
	if now.Sub(t.swept) >= forgetSweep {
		t.swept = now
		for id, s := range t.m {
			if now.Sub(s.at) > forgetAfter {
				delete(t.m, id)
			}
		}
	}
	holds := time.Duration(a.NoGroupWaitMs) * time.Millisecond
	prev, seen := t.m[a.ID]
	t.m[a.ID] = schedulerSeen{ready: a.Ready, reason: a.Reason, at: now, models: a.ReadyModels, holds: holds}
	if a.Ready && t.readyHeard != nil {
		select {
		case <-t.readyHeard:
		default:
			close(t.readyHeard)
		}
	}
	if a.Ready || (t.wake != nil && (!seen || prev.holds != holds)) {
		if t.wake != nil {
			close(t.wake)
		}
		t.wake = make(chan struct{})
	}
}

// readyFor reports whether a ready scheduler announced within the timeout
// that it can place requests of model (a group of it, or of no named
// model, is ready).
func (t *schedulerTable) readyFor(model string, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, s := range t.m {
		if s.ready && now.Sub(s.at) <= t.timeout &&
			(s.models == nil || slices.Contains(s.models, model) || slices.Contains(s.models, "")) {
			return true
		}
	}
	return false
}

// heard reports whether a scheduler replica, ready or not, announced
// itself within the timeout.
func (t *schedulerTable) heard(now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, s := range t.m {
		if now.Sub(s.at) <= t.timeout {
			return true
		}
	}
	return false
}

// readyModels says which of models a ready scheduler can place, and which
// not (nil when all can).
func (t *schedulerTable) readyModels(models []string, now time.Time) (ready, not []string) {
	for _, m := range models {
		if t.readyFor(m, now) {
			ready = append(ready, m)
		} else {
			not = append(not, m)
		}
	}
	return ready, not
}

// readyLocked reports whether a ready scheduler announced itself within
// the timeout; t.mu is held.
func (t *schedulerTable) readyLocked(now time.Time) bool {
	for _, s := range t.m {
		if s.ready && now.Sub(s.at) <= t.timeout {
			return true
		}
	}
	return false
}

// ready reports whether a ready scheduler announced itself recently; if
// not, why, in words for an operator.
func (t *schedulerTable) ready(now time.Time) (bool, string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var why []string
	for id, s := range t.m {
		switch {
		case now.Sub(s.at) > t.timeout:
		case s.ready:
			return true, ""
		case t.wake != nil && s.holds > 0:
			// Once a scheduler was ready, requests wait for one again
			// rather than get a 503 at once: say so, or the 503 reads as
			// if every request were refused.
			why = append(why, fmt.Sprintf("scheduler %s: %s; requests wait up to %s for it (its --no-group-wait)", id, s.reason, s.holds))
		default:
			why = append(why, fmt.Sprintf("scheduler %s: %s", id, s.reason))
		}
	}
	if len(why) == 0 && !t.rejoined.IsZero() && t.rejoined.Equal(t.since) && now.Sub(t.since) < t.timeout {
		return false, fmt.Sprintf("no scheduler heard yet since this frontend reconnected to NATS %s ago (each announces itself every second)",
			now.Sub(t.since).Round(time.Millisecond))
	}
	if len(why) == 0 && len(t.m) == 0 && !t.since.IsZero() && now.Sub(t.since) < t.timeout {
		// Just started: the schedulers may all be there, not yet heard.
		return false, fmt.Sprintf("no scheduler heard yet: this frontend began listening for their announcements %s ago (each announces itself every second)",
			now.Sub(t.since).Round(time.Millisecond))
	}
	if len(why) == 0 {
		return false, fmt.Sprintf("no scheduler announced itself within %s: start one (kvbus scheduler) or check its NATS connection", t.timeout)
	}
	sort.Strings(why)
	return false, fmt.Sprintf("no scheduler is ready (%s)", joinShort(why))
}

func joinShort(parts []string) string {
	if len(parts) > 3 {
		parts = append(parts[:3:3], fmt.Sprintf("and %d more", len(parts)-3))
	}
	return strings.Join(parts, "; ")
}

func (s *Server) onAnnouncement(_ context.Context, m *nats.Msg) error {
	a, err := messages.DecodeAnnouncement(m.Data)
	if err != nil {
		return err
	}
	if a.Role == messages.RoleScheduler {
		s.schedulers.observe(a, time.Now())
	}
	return nil
}

// Healthy reports whether the frontend can take requests now: connected
// to NATS, not draining, and a ready scheduler exists. If not, it says why.
func (s *Server) Healthy() (bool, string) {
	switch {
	case s.draining.Load():
		return false, "shutting down"
	case !s.cfg.Conn.IsConnected():
		return false, "not connected to NATS"
	}
	now := time.Now()
	if ok, why := s.schedulers.ready(now); !ok {
		return false, why
	}
	// Ready while any served model can be placed (a request of another
	// waits the scheduler's --no-group-wait for a group of it, then gets a
	// 503 naming it): a frontend of one model whose workers are not up is
	// not ready, as a vLLM server without its engine.
	if ready, not := s.schedulers.readyModels(s.cfg.Models, now); len(ready) == 0 {
		return false, fmt.Sprintf("no worker group of the served model%s %s is ready: check that workers with --model %s run",
			plural(len(not)), strings.Join(not, ", "), strings.Join(not, " or "))
	}
	return true, ""
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

func (s *Server) serveHealthz(w http.ResponseWriter, _ *http.Request) {
	if ok, why := s.Healthy(); !ok {
		writeError(w, &APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: "not_ready",
			Message: why, RetryAfter: 1})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// serveHealth is vLLM's /health: 200 with an empty body while requests
// can be served, 503 with an empty body while they cannot (vLLM answers 503
// while its engine is dead or warming up). Load balancers and scripts that
// wait for a vLLM server poll it and send at once; they must not be let in
// before a ready scheduler is there to take their requests.
func (s *Server) serveHealth(w http.ResponseWriter, _ *http.Request) {
	if ok, _ := s.Healthy(); !ok {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// serveLivez answers 200 while the process serves HTTP: liveness, for
// restarts, as opposed to readiness (/healthz).
func (s *Server) serveLivez(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"status": "alive"})
}

// serveVersion is vLLM's /version: {"version": …}, here kvbus's
// (Config.Version).
func (s *Server) serveVersion(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"version": s.cfg.Version})
}
