package scheduler

import (
	"sync"
	"time"

	"github.com/kvbus/kvbus/internal/recent"
	"github.com/kvbus/kvbus/messages"
)

// RequestTracker is the scheduler's state for one request, named after
// vLLM's mooncake connector RequestTracker: what was asked, where it went,
// and what every rank reported. The session id is kept across re-dispatch.
type RequestTracker struct {
	ReqID       string
	SessionID   string
	Model       string
	FrontendID  string
	TokenLen    int
	TokenIDs    []uint32
	BlockHashes []uint64
	Request     *messages.Request
	Received    time.Time
	Deadline    time.Time

	// TurnDepth is 1 for a session's first turn (or no session), then 2, 3…
	TurnDepth int

	// Set when placed.
	Group     string
	WorldSize int
	Attempt   int
	// LocalBlocks of the LoadSpec are in the group's own segments, Remote
	// the runs read from other groups (global pool).
	LocalBlocks int
	Remote      []messages.RemoteRun
	sources     []string // groups whose held blocks may be read (see groupTable.sources)
	savers      []string // groups whose planned blocks may be read (see savers)
	// LoadBlocks is the LoadSpec's prefix in blocks (the prediction);
	// PrefillBlocks the blocks left to prefill.
	LoadBlocks    int
	PrefillBlocks int
	// foreignLoad: taken over at another replica's group and attempt, the
	// ranks run that replica's LoadSpec, not LoadBlocks (made here from an
	// index that may hold the request's own blocks by then): no prediction
	// of this replica's to count.
	foreignLoad bool
	// queued is PrefillBlocks plus the prefill time of its loads (in
	// blocks) until the driver reports the prefill, then 0: what the
	// request adds to its group's queue.
	queued int
	// Prefilled is set when the driver reported the prefill: output has
	// started, so the request can no longer move to another group.
	Prefilled bool
	// Results holds the RankResult of each tp_rank for the current attempt.
	Results map[int]*messages.RankResult
	// Heard holds the tp_ranks that answered the current attempt (a
	// receipt, the prefill report or the result), each with the
	// started_unix_ms of the process that last did (0: not said);
	// Dispatched is when its ReqMeta was last published, meta its subject
	// and bytes, and Resends how often it was published again for ranks not
	// heard from.
	Heard      map[int]int64
	Dispatched time.Time
	// logSeq is the request's sequence in the request log (0: unknown),
	// announced with its save plan for a replica that adopts it.
	logSeq   uint64
	Resends  int
	metaSubj string
	metaData []byte
	// reconnectedAt is when this replica's NATS connection came back while
	// the request was in flight: a rank's result published across the
	// server's restart can be lost although the rank was heard before it.
	reconnectedAt time.Time
	// strandedAt is when the request, not started, was first found on a
	// lost group with no ready group of its model to move to (zero: it is
	// not): it waits NoGroupWait from then, as a new request does.
	strandedAt time.Time
}

// trackerTable holds the live trackers by request id. It is safe for
// concurrent use.
type trackerTable struct {
	mu sync.Mutex
	m  map[string]*RequestTracker
	// ended remembers recently ended requests, so that a redelivery of one
	// from the request log is not run twice. Bounded by count and age.
	ended *recent.Memory[endedRequest]
	// endedIDs are the requests ended since takeEnded last ran, for the
	// other replicas (not to adopt them).
	endedIDs []string
}

// endedRequest is what the tracker table remembers of an ended request:
// the outcome of an Abort that came before it was dispatched (see abort),
// or the group it ran on last, for a frontend's Resend (see route).
type endedRequest struct {
	outcome requestOutcome
	group   string
}

func newTrackerTable(ended recent.Config) (*trackerTable, error) {
	mem, err := recent.New[endedRequest](ended)
	if err != nil {
		return nil, err
	}
	return &trackerTable{m: map[string]*RequestTracker{}, ended: mem}, nil
}

// endLocked removes a tracker and remembers where it ran.
func (tt *trackerTable) endLocked(t *RequestTracker) {
	delete(tt.m, t.ReqID)
	tt.ended.Put(t.ReqID, endedRequest{group: t.Group}, time.Now())
	tt.endedIDs = append(tt.endedIDs, t.ReqID)
}

// takeEnded returns the requests ended since it last ran.
func (tt *trackerTable) takeEnded() []string {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	ids := tt.endedIDs
	tt.endedIDs = nil
	return ids
}

// handOver removes the tracker of a request another replica now watches
// (it adopted or took it over while this one was cut off or paused) and
// returns it, nil if there was none; the id is remembered as ended here.
// It also returns what take (the held counts' take, see addResult) gives
// for the id, under the same lock as addResult's end and hold: a request
// ended here is held by then, one not ended is still tracked.
func (tt *trackerTable) handOver(id string, take func(string) *RequestTracker) (t, held *RequestTracker) {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	t = tt.m[id]
	if t != nil {
		delete(tt.m, id)
		tt.ended.Put(id, endedRequest{}, time.Now()) // the other replica answers its Resends
	}
	return t, take(id)
}

// add inserts t unless a tracker with its id exists or the request ended
// (an abort that came before it: see abort); it reports whether t was
// added.
func (tt *trackerTable) add(t *RequestTracker) bool {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	if _, ok := tt.m[t.ReqID]; ok {
		return false
	}
	if _, ended := tt.ended.Get(t.ReqID, time.Now()); ended {
		return false
	}
	tt.m[t.ReqID] = t
	return true
}

func (tt *trackerTable) has(id string) bool {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	_, ok := tt.m[id]
	return ok
}

// seen reports whether a request is live or ended recently.
func (tt *trackerTable) seen(id string) bool {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	_, live := tt.m[id]
	_, ended := tt.ended.Get(id, time.Now())
	return live || ended
}

// drop removes a tracker without remembering it (its dispatch failed and
// the request log will deliver it again).
func (tt *trackerTable) drop(id string) {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	delete(tt.m, id)
}

// abort ends a request its client gave up on and returns its tracker, nil
// if it had none yet: the id is remembered either way, so a request aborted
// while it still waits in the request log (a backlog is when clients give
// up) is never dispatched; such a request is remembered with outcome (see
// abortedInLog).
func (tt *trackerTable) abort(id string, outcome requestOutcome) *RequestTracker {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	t := tt.m[id]
	if t != nil {
		tt.endLocked(t)
		return t
	}
	if _, ended := tt.ended.Get(id, time.Now()); !ended { // an abort again, or one of a request that ended, changes nothing
		tt.ended.Put(id, endedRequest{outcome: outcome}, time.Now())
		tt.endedIDs = append(tt.endedIDs, id)
	}
	return nil
}

// abortedInLog returns the outcome of the Abort that ended a request before
// it was dispatched, once: the request log's delivery of it counts it.
func (tt *trackerTable) abortedInLog(id string) (requestOutcome, bool) {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	var outcome requestOutcome
	tt.ended.Update(id, time.Now(), func(e *endedRequest) { outcome, e.outcome = e.outcome, outcomeCompleted })
	return outcome, outcome != outcomeCompleted
}

// addResult records a rank's result; when every rank of the current attempt
// has reported, it removes and returns the tracker.
//
// hold, if not nil, is called with a request that r ends, under the lock
// handOver takes: it returns whether it held the request's count back
// (held reports it), so that a save plan handled beside r finds the
// request either tracked or held, never neither.
func (tt *trackerTable) addResult(r *messages.RankResult, hold func(*RequestTracker) bool) (done *RequestTracker, held, known bool) {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	t := tt.m[r.ReqID]
	if t == nil || r.Attempt != t.Attempt || r.Group != t.Group || r.TPRank < 0 || r.TPRank >= t.WorldSize {
		return nil, false, false
	}
	if t.Heard == nil {
		t.Heard = map[int]int64{}
	}
	t.Heard[r.TPRank] = r.StartedUnixMs
	if r.Prefilled || r.Received {
		return nil, false, true // see prefilled
	}
	t.Results[r.TPRank] = r
	if len(t.Results) < t.WorldSize {
		return nil, false, true
	}
	tt.endLocked(t)
	return t, hold != nil && hold(t), true
}

// prefilled records the driver's prefill report and returns the request's
// group and its work in blocks of prefill time (0 when already reported or
// unknown): the work is off the group's queue, so its end takes nothing
// more off.
func (tt *trackerTable) prefilled(r *messages.RankResult) (group string, work int) {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	t := tt.m[r.ReqID]
	if t == nil || r.Attempt != t.Attempt || r.Group != t.Group {
		return "", 0
	}
	work, t.queued = t.queued, 0
	t.Prefilled = true
	return t.Group, work
}

// stranded returns the trackers whose group lost their work (gone, called
// under the table's lock): those that can be dispatched again are left in
// the table, the others removed. A streamed answer that has started cannot
// be (its client has part of it), nor one the driver has answered; a
// non-streamed one under way can while a group of its model is ready
// (elsewhere, called under the lock): the frontend holds it until its end,
// and replaces it whole with a newer attempt's. With none ready it ends
// now (a retryable 503), not at its deadline.
func (tt *trackerTable) stranded(gone func(t *RequestTracker) bool, elsewhere func(model string) bool) (movable, lost []*RequestTracker) {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	for _, t := range tt.m {
		if t.Group == "" || !gone(t) {
			continue
		}
		started := t.Prefilled && (t.Request == nil || t.Request.Stream || !elsewhere(t.Model))
		if t.Results[0] != nil || started {
			lost = append(lost, t)
			tt.endLocked(t)
		} else {
			movable = append(movable, t)
		}
	}
	return movable, lost
}

// route returns the group a request runs on, or ran on last if it ended
// within the memory of ended requests (its driver keeps the outputs for a
// while after the end: workers' --stream-replay-age); "" when it is unknown
// here, not placed yet, or another replica's now.
func (tt *trackerTable) route(id string) string {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	if t := tt.m[id]; t != nil {
		return t.Group
	}
	e, _ := tt.ended.Get(id, time.Now())
	return e.group
}

// update runs f on a live tracker under the table's lock; it reports whether
// the tracker was still there.
func (tt *trackerTable) update(id string, f func(t *RequestTracker)) bool {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	t := tt.m[id]
	if t != nil {
		f(t)
	}
	return t != nil
}

// resendItem is a ReqMeta to publish again.
type resendItem struct {
	subject, reqID, sessionID, group string
	attempt                          int
	data                             []byte
	// silent are the tp_ranks that sent neither a receipt nor a result,
	// or, when all sent a receipt (a resend after a reconnect), those
	// whose result has not come.
	silent []int
}

// silent returns the ReqMetas to publish again: of trackers whose ranks
// have not all answered within after of the last publication (at most 3
// times).
func (tt *trackerTable) silent(now time.Time, after time.Duration) []resendItem {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	var out []resendItem
	for _, t := range tt.m {
		// A rank not heard from; or, since a reconnect, one whose result
		// has not come within after (a rank still working answers the copy
		// with a receipt, one done sends its result again).
		missing := len(t.Heard) < t.WorldSize ||
			!t.reconnectedAt.IsZero() && len(t.Results) < t.WorldSize && now.Sub(t.reconnectedAt) >= after
		if t.metaData == nil || !missing || t.Resends >= 3 || now.Sub(t.Dispatched) < after {
			continue
		}
		t.Resends++
		t.Dispatched = now
		var silent []int
		for r := range t.WorldSize {
			if _, ok := t.Heard[r]; !ok {
				silent = append(silent, r)
			}
		}
		if len(silent) == 0 {
			// Every rank sent its receipt (before a reconnect): the
			// silent ones are those whose result has not come.
			for r := range t.WorldSize {
				if _, ok := t.Results[r]; !ok {
					silent = append(silent, r)
				}
			}
		}
		out = append(out, resendItem{t.metaSubj, t.ReqID, t.SessionID, t.Group, t.Attempt, t.metaData, silent})
	}
	return out
}

// reconnected marks the live trackers as in flight at a reconnect at now
// (see silent).
func (tt *trackerTable) reconnected(now time.Time) {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	for _, t := range tt.m {
		t.reconnectedAt = now
	}
}

// expired removes and returns the trackers whose deadline is before now.
func (tt *trackerTable) expired(now time.Time) []*RequestTracker {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	var out []*RequestTracker
	for _, t := range tt.m {
		if now.After(t.Deadline) {
			out = append(out, t)
			tt.endLocked(t)
		}
	}
	return out
}

// frontends returns the frontends of the live trackers.
func (tt *trackerTable) frontends() map[string]bool {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	ids := map[string]bool{}
	for _, t := range tt.m {
		ids[t.FrontendID] = true
	}
	return ids
}

// ofFrontend returns the live trackers of frontend id.
func (tt *trackerTable) ofFrontend(id string) []*RequestTracker {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	var out []*RequestTracker
	for _, t := range tt.m {
		if t.FrontendID == id {
			out = append(out, t)
		}
	}
	return out
}

// Len returns the number of live trackers.
func (tt *trackerTable) Len() int {
	tt.mu.Lock()
	defer tt.mu.Unlock()
	return len(tt.m)
}
