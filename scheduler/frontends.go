package scheduler

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// A frontend that dies (killed, its host lost) sends no Abort for the
// requests it had in flight: their groups went on generating answers nobody
// would read, holding prefill slots and decode capacity for as long as the
// answers took (a client's max_tokens, up to its deadline). vLLM frees a
// request's work the moment its client's connection drops; so do its
// gateways. Frontends announce nothing, so the replica asks the bus: every
// probeEvery, for each frontend with requests in flight here, it sends a
// request onto the frontend's output subject (kvbus.out.<id>, where only
// that frontend listens) whose answer it does not expect. A frontend that
// listens receives it (an Output for messages.FrontendProbeReqID, which no
// request has: frontends, top and replays ignore it) and says nothing: the
// request times out. With nobody listening the server answers at once that
// there are no responders. A frontend found so for FrontendGoneAfter in a row (longer
// than a reconnect to another server of a NATS cluster, during which its
// subscription is gone too) is gone: its requests here are aborted on
// their groups, outcome aborted.

const (
	// probeEvery is how often a frontend with requests in flight is asked
	// after.
	probeEvery = time.Second
	// probeWait is how long a probe waits for the server's "no responders":
	// it comes at once, and a frontend that listens never answers.
	probeWait = 500 * time.Millisecond
)

// frontendWatch is what the replica knows of the frontends it probes. It is
// safe for concurrent use.
type frontendWatch struct {
	mu sync.Mutex
	// probed is when each frontend was last asked after, and gone the run
	// of probes of it that found nobody listening (absent: the last found
	// it, or it was not asked yet).
	probed map[string]time.Time
	gone   map[string]goneRun
	// running counts the probes in flight (Run waits for them).
	running sync.WaitGroup
}

// goneRun is a run of probes of a frontend that found nobody listening:
// when the first and the last of them were sent.
type goneRun struct{ first, last time.Time }

func newFrontendWatch() *frontendWatch {
	return &frontendWatch{probed: map[string]time.Time{}, gone: map[string]goneRun{}}
}

// watchFrontends probes the frontends with requests in flight here that
// were not asked after lately, and aborts the requests of those gone for
// FrontendGoneAfter. Sweep calls it while the replica is connected.
func (s *Scheduler) watchFrontends(ctx context.Context, now time.Time) {
	live := s.trackers.frontends()
	w := s.frontends
	w.mu.Lock()
	var gone []string
	for id := range w.probed {
		if !live[id] { // no request of it left here
			delete(w.probed, id)
			delete(w.gone, id)
		}
	}
	for id := range live {
		// Gone by the last probe too, FrontendGoneAfter after the first.
		if run, ok := w.gone[id]; ok && run.last.Sub(run.first) >= s.cfg.FrontendGoneAfter {
			gone = append(gone, id)
			delete(w.gone, id)
			continue
		}
		if now.Sub(w.probed[id]) < probeEvery {
			continue
		}
		w.probed[id] = now
		w.running.Go(func() { s.probeFrontend(ctx, id, now) })
	}
	w.mu.Unlock()
	for _, id := range gone {
		s.abortFrontend(id, now)
	}
}

// probeFrontend asks whether frontend id still listens, and notes the
// answer.
func (s *Scheduler) probeFrontend(ctx context.Context, id string, at time.Time) {
	ctx, cancel := context.WithTimeout(ctx, probeWait)
	defer cancel()
	_, err := s.cfg.Conn.RequestWithContext(ctx, s.cfg.Subjects.Out(id), s.probe)
	w := s.frontends
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		run, ok := w.gone[id]
		if !ok {
			run.first = at
		}
		run.last = at
		w.gone[id] = run
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout), err == nil:
		delete(w.gone, id) // it listens (an answer, of anyone's, says so too)
	}
	// Any other error (this replica cut off, stopping) says nothing of it.
}

// reconnected forgets what the probes found: while this replica was cut
// off, and until a frontend is back on the server after a restart, nobody
// listened anywhere.
func (w *frontendWatch) reconnected() {
	w.mu.Lock()
	clear(w.gone)
	w.mu.Unlock()
}

// abortFrontend aborts the requests of frontend id in flight here: nobody
// will read their answers.
func (s *Scheduler) abortFrontend(id string, now time.Time) {
	var n int
	for _, t := range s.trackers.ofFrontend(id) {
		if s.trackers.abort(t.ReqID, outcomeAborted) == nil {
			continue // ended meanwhile
		}
		n++
		s.groups.addInflight(t.Group, -1, -t.queued)
		s.m.requests.WithLabelValues(outcomeAborted.String()).Inc()
		data, err := messages.Marshal(&messages.Abort{V: messages.Version, ReqID: t.ReqID, Reason: messages.AbortReasonFrontendGone})
		if err == nil {
			s.sendAbort(t.Group, t.ReqID, data)
		}
		s.log.Info("request aborted", "req_id", t.ReqID, "session_id", t.SessionID, "group", t.Group, "reason", messages.AbortReasonFrontendGone)
	}
	if n > 0 {
		s.m.frontendsGone.Inc()
		s.log.Warn("a frontend with requests in flight is gone (nobody listens on its output subject): its requests were aborted on their groups",
			"frontend_id", id, "requests", n, "gone_for", s.cfg.FrontendGoneAfter)
	}
}
