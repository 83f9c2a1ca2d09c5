package frontend

import (
	"context"
	"math"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// Outputs lost across a reconnect. While the frontend is cut off from NATS
// (a NATS server restarting, or the frontend's server of a cluster
// stopped), outputs routed to it are dropped, and a driver rank that
// reconnects first flushes the outputs it buffered to a server where this
// frontend has not yet subscribed again. A later output shows the gap (the
// request is asked again at once); but a request whose answer ended in
// that window hears nothing more, and waited for its deadline
// (--request-timeout, 60 s) while its client hung. So a request in flight
// at a reconnect that hears nothing within Config.LostOutputWait (3 s)
// after it gets an output_lost verdict. Its drivers are asked first
// (resend.go): the one that holds it (queued, running, or waiting for its
// blocks) sends again what it published, and the request goes on; a stream
// under way gets the outputs it missed. One no driver holds is published
// again by generation.askAgain, which, since it may only be queued in the
// request log, keeps the first one too; the first of the two to answer is
// followed.

// reconnectCheckEvery is how often the frontend looks for a reconnect.
const reconnectCheckEvery = 250 * time.Millisecond

// suspect is a bus request in flight at a reconnect, with the outputs it
// had heard then.
type suspect struct {
	id    string
	rt    route
	heard int64
}

// watchReconnects runs until ctx ends.
func (s *Server) watchReconnects(ctx context.Context) {
	seen := s.cfg.Conn.Stats().Reconnects
	s.reconnects.Store(seen)
	var suspects []suspect
	var due time.Time // when suspects are judged
	tick := time.NewTicker(reconnectCheckEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			if n := s.cfg.Conn.Stats().Reconnects; n != seen {
				seen = n
				s.reconnectedAt.Store(now.UnixNano())
				s.reconnects.Store(n)
				s.schedulers.reconnected(n, now)
				// A second reconnect restarts the wait, for every request.
				suspects, due = s.inFlight(), now.Add(s.cfg.LostOutputWait)
				if len(suspects) > 0 {
					s.log.Info("reconnected to NATS: requests in flight that hear nothing more may have lost their answer on the bus",
						"requests", len(suspects), "wait", s.cfg.LostOutputWait)
				}
			}
			if len(suspects) > 0 && !now.Before(due) {
				s.endLost(suspects)
				suspects = nil
			}
		}
	}
}

// reconnectedWithin reports whether the frontend's connection reconnected
// to NATS within d, or did since watchReconnects last looked.
func (s *Server) reconnectedWithin(d time.Duration) bool {
	if s.cfg.Conn.Stats().Reconnects != s.reconnects.Load() {
		return true
	}
	at := s.reconnectedAt.Load()
	return at != 0 && time.Since(time.Unix(0, at)) < d
}

// inFlight returns the requests in flight, with the outputs they heard.
func (s *Server) inFlight() []suspect {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]suspect, 0, len(s.pending))
	for id, rt := range s.pending {
		out = append(out, suspect{id, rt, rt.q.heard(rt.choice, id)})
	}
	return out
}

// endLost ends with output_lost each suspect still in flight that heard no
// output since.
func (s *Server) endLost(suspects []suspect) {
	lost := 0
	for _, sp := range suspects {
		s.mu.Lock()
		cur, ok := s.pending[sp.id]
		s.mu.Unlock()
		if !ok || cur.q != sp.rt.q || sp.rt.q.heard(sp.rt.choice, sp.id) != sp.heard {
			continue // answered, or hearing outputs
		}
		lost++
		// Of any attempt: it ends the choice, whichever attempt runs.
		// Not news of the request (add, not push): a later reconnect
		// judges it by its own outputs again.
		sp.rt.q.add(choiceOutput{choice: sp.rt.choice, out: &messages.Output{ReqID: sp.id, Attempt: math.MaxInt32, Error: &messages.OutputError{Code: codeOutputLost,
			Message: "the answer was lost on the bus while NATS reconnected; retry the request"}}})
	}
	if lost > 0 {
		s.log.Warn("requests heard nothing after a NATS reconnect: their answers may be lost on the bus; their drivers are asked for them, and those no driver holds are published again",
			"requests", lost, "wait", s.cfg.LostOutputWait)
	}
}
