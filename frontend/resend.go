package frontend

import (
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// A stream under way that lost outputs on the bus (an output index
// skipped, or nothing heard after a NATS reconnect) cannot be asked again
// from the start: the client has its first chunks. Its driver rank keeps
// the outputs of every stream (workers/replay.go), so the frontend asks it
// (messages.Resend: the schedulers on kvbus.ctl.resend say which group
// runs it, then that group's driver on kvbus.ctl.resend.<group>) to
// publish them again from the first index missing; outputs past it are
// dropped until they come again, in order, and the client's stream goes
// on where it was cut. A driver that does not answer within resendWait (it
// stopped: the scheduler moves the request, which ends the stream with
// group_failed; or it no longer keeps the outputs) ends the stream with
// 503 output_lost, as before.
//
// A request that heard nothing at all after a NATS reconnect is asked about
// the same way, from index 0: a driver that holds it (queued at its engine,
// or running) answers, sending again what it published, and the frontend
// waits on; only a request no driver holds is published again (askAgain).

// resendWait is how long the frontend waits for a driver's ResendReply,
// the schedulers' answer naming its group included (askDriver).
const resendWait = 2 * time.Second

// noRespondersRetry is how often a Resend that NATS answered "no
// responders" is sent again while the frontend has just reconnected
// (ask).
const noRespondersRetry = 100 * time.Millisecond

// maxResends is how many times one choice asks for lost outputs; a probe
// after a reconnect that found none missing is not counted.
const maxResends = 3

// resendOutcome is a driver's answer to a Resend, as the generation's
// queue carries it; or, with check set, the look resendWait after an
// answer at whether the outputs sent again arrived.
type resendOutcome struct {
	busID   string
	attempt int
	n       int    // outputs sent again
	err     string // none could be: why
	ask     int    // the choice's ask it answers (choiceState.resends)
	probe   bool   // the ask was a probe after a reconnect
	check   bool
}

// resend asks the driver of choice i for its outputs again from the first
// one missing; probe says it was asked after a reconnect, not for a loss
// seen. It reports whether it asked: not after maxResends asks.
func (g *generation) resend(i int, why string, probe bool) bool {
	c := g.choices[i]
	if c.resends-c.idleProbes >= maxResends {
		return false
	}
	rs := &messages.Resend{ReqID: c.busID, Attempt: c.attempt, FromIndex: c.nextIndex}
	data, err := messages.Marshal(rs)
	if err != nil {
		g.log.Error("encode resend", "err", err)
		return false
	}
	c.resends++
	c.resending = true
	g.s.m.resends.Inc()
	if c.started {
		g.log.Warn("outputs of a stream under way lost on the bus; asking its driver to send them again",
			"choice", i, "why", why, "req_id", rs.ReqID, "from_index", rs.FromIndex)
	} else {
		g.log.Info("asking the drivers whether one holds the request (and to send again what it published)",
			"choice", i, "why", why, "req_id", rs.ReqID)
	}
	s, q, ask := g.s, g.q, c.resends
	go func() {
		out := &resendOutcome{busID: rs.ReqID, attempt: rs.Attempt, ask: ask, probe: probe}
		reply, group, err := s.askDriver(data)
		switch {
		case errors.Is(err, nats.ErrTimeout) || errors.Is(err, nats.ErrNoResponders):
			unanswered := "no scheduler named the group running it"
			if group != "" {
				unanswered = "the driver of group " + group + " did not answer"
			}
			out.err = fmt.Sprintf("no worker holds its outputs (%s within %s)", unanswered, resendWait)
		case err != nil:
			out.err = err.Error()
		case reply.Error != "":
			out.err = reply.Error
		default:
			out.n = reply.Resent
		}
		q.pushResend(i, out)
	}()
	return true
}

// askDriver sends a Resend (data) to the driver that holds the request and
// waits up to resendWait for its answer: first to the schedulers, the one
// that knows the request's group answering with its name (a driver before
// 2026-12-07, which reads kvbus.ctl.resend, answers itself), then to that
// group's driver. group is the group a scheduler named ("" when none did).
func (s *Server) askDriver(data []byte) (reply *messages.ResendReply, group string, err error) {
	deadline := time.Now().Add(resendWait)
	reply, err = s.ask(s.cfg.Subjects.Resend(), data, deadline)
	if err != nil || reply.Group == "" {
		return reply, "", err // a driver before 2026-12-07 answered
	}
	group = reply.Group
	reply, err = s.ask(s.cfg.Subjects.ResendGroup(group), data, deadline)
	return reply, group, err
}

// ask sends a Resend (data) on subject and waits for the answer until
// deadline. A frontend that has just reconnected to NATS may be back
// before the schedulers or the drivers: their subscriptions are not on the
// server yet, and NATS answers "no responders" at once, which would end a
// stream whose driver holds every output with output_lost. So within
// LostOutputWait+resendWait of a reconnect the request is sent again every
// noRespondersRetry until the deadline is near; otherwise "no responders"
// is the answer (no scheduler runs, or the group's driver is gone). A
// driver that keeps no outputs (--stream-replay 0) reads no asks and its
// heartbeats say so: no scheduler names its group, and the ask times out.
// The schedulers are waited for also while one announced itself within
// the timeout: it is the one reconnecting (a NATS server of a cluster
// stopped under it and under a driver, whose outputs it lost; the driver,
// back first, shows the frontend the gap).
func (s *Server) ask(subject string, data []byte, deadline time.Time) (*messages.ResendReply, error) {
	for {
		msg, err := s.cfg.Conn.Request(subject, data, time.Until(deadline))
		if err == nil {
			return messages.DecodeResendReply(msg.Data)
		}
		if !errors.Is(err, nats.ErrNoResponders) || time.Until(deadline) < 2*noRespondersRetry ||
			!s.reconnectedWithin(s.cfg.LostOutputWait+resendWait) &&
				(subject != s.cfg.Subjects.Resend() || !s.schedulers.heard(time.Now())) {
			return nil, err
		}
		time.Sleep(noRespondersRetry)
	}
}

// resendAnswered applies a driver's answer to choice i: nil when the stream
// goes on (the outputs come again, or none were missing), or the error
// output that ends it when they cannot come.
func (g *generation) resendAnswered(i int, r *resendOutcome) *messages.Output {
	c := g.choices[i]
	if r.probe && r.err == "" && r.n == 0 && r.busID == c.busID && r.attempt == c.attempt {
		// A probe that found nothing lost is not one of the choice's
		// maxResends, even answered after outputs came.
		c.idleProbes++
	}
	if c.done || !c.resending || r.busID != c.busID || r.attempt != c.attempt || r.ask != c.resends {
		return nil // an answer to an older ask, or outputs came since
	}
	switch {
	case r.check:
		// The outputs sent again reach the frontend before the answer
		// (one publisher, one connection): none in resendWait after it
		// were lost on the bus too, and are asked for once more.
		if g.resend(i, "the outputs sent again were lost too", false) {
			return nil
		}
		r.err = fmt.Sprintf("they were lost again each of the %d times its driver sent them", maxResends)
	case r.err == "" && r.n == 0:
		// Nothing after nextIndex yet: the request runs on, and its
		// next output is the one wanted.
		c.resending = false
		return nil
	case r.err == "":
		check := &resendOutcome{busID: r.busID, attempt: r.attempt, ask: r.ask, check: true}
		time.AfterFunc(resendWait, func() { g.q.pushResend(i, check) })
		return nil
	}
	c.resending = false
	if !c.started {
		// Held by no driver (or its outputs cannot come): the caller
		// asks it again, and this is the answer if it cannot.
		return &messages.Output{ReqID: c.busID, Attempt: c.attempt, Index: c.nextIndex, Error: &messages.OutputError{Code: codeOutputLost,
			Message: "the answer was lost on the bus while NATS reconnected and " + r.err + "; retry the request"}}
	}
	g.log.Warn("outputs of a stream under way lost on the bus cannot be sent again; the answer ends with an error",
		"req_id", c.busID, "from_index", c.nextIndex, "err", r.err)
	return &messages.Output{ReqID: c.busID, Attempt: c.attempt, Index: c.nextIndex, Error: &messages.OutputError{Code: codeOutputLost,
		Message: "part of the streamed answer was lost on the bus and " + r.err + "; retry the request"}}
}
