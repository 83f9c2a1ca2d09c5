package replay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/messages"
)

// busGrace bounds how long a replay waits for the bus to tell what it
// learns there of requests already answered.
const busGrace = time.Second

// awaitBus waits, up to busGrace, until the ReqMeta of every answered
// request, and through HTTP its final Output, have been read from the bus:
// through HTTP they can come after the answer, and the subscriptions
// deliver apart, so an Output read says nothing of its ReqMeta.
func (r *Replayer) awaitBus(ctx context.Context, results []Result) {
	deadline := time.Now().Add(busGrace)
	for {
		missing := false
		r.mu.Lock()
		for i := range results {
			if results[i].Err != "" || results[i].E2E <= 0 {
				continue
			}
			_, group := r.groups[results[i].ReqID]
			_, remote := r.remote[results[i].ReqID]
			if !group || (r.http != nil && !remote) {
				missing = true
				break
			}
		}
		r.mu.Unlock()
		if !missing || !sleepUntil(ctx, time.Now().Add(10*time.Millisecond)) || time.Now().After(deadline) {
			return
		}
	}
}

// subscribe listens for outputs (nats target) and ReqMetas (to learn
// groups).
func (r *Replayer) subscribe(ctx context.Context) ([]*nats.Subscription, error) {
	nc, subj := r.cfg.Conn, r.cfg.Subjects
	var subs []*nats.Subscription
	meta, err := nc.Subscribe(subj.MetaGroup("*"), func(m *nats.Msg) {
		// kvbus.meta.<group>.<key>: decode only the id, cheaply.
		parts := strings.Split(m.Subject, ".")
		id := reqIDOf(m.Data)
		if len(parts) >= 4 && id != "" {
			r.mu.Lock()
			r.groups[id] = parts[len(parts)-2]
			if client := clientRequestID(id); client != "" {
				r.groups[client] = parts[len(parts)-2]
			}
			r.mu.Unlock()
		}
	})
	if err != nil {
		return nil, err
	}
	meta.SetPendingLimits(-1, -1)
	subs = append(subs, meta)
	if r.js != nil {
		out, err := nc.Subscribe(subj.Out(r.frontendID), func(m *nats.Msg) { r.onOutput(m) })
		if err != nil {
			return subs, err
		}
		out.SetPendingLimits(-1, -1)
		subs = append(subs, out)
	} else {
		// Through HTTP, the frontends' outputs tell how much of each
		// request's cache was read from another group.
		out, err := nc.Subscribe(subj.Out("*"), func(m *nats.Msg) {
			id, u := usageOf(m.Data)
			if u == nil || !strings.HasPrefix(id, "rp-") {
				return // not the end of a replayed request
			}
			r.mu.Lock()
			r.remote[id] = u.RemoteCachedTokens
			if client := clientRequestID(id); client != "" {
				r.remote[client] = u.RemoteCachedTokens
			}
			r.mu.Unlock()
		})
		if err != nil {
			return subs, err
		}
		out.SetPendingLimits(-1, -1)
		subs = append(subs, out)
	}
	if r.js != nil {
		// The request log acknowledges each publish on this connection's
		// inbox: a key that may not read it (the observer's, which may
		// publish no request either) would wait for every acknowledgement
		// until the replay's context ends.
		inbox, err := nc.SubscribeSync(nc.NewInbox())
		if err != nil {
			return subs, err
		}
		subs = append(subs, inbox)
	}
	if err := nc.Flush(); err != nil {
		return subs, err
	}
	// A refused subscription is said on the connection, not by Subscribe:
	// onto the bus, the replay would wait for answers it cannot read
	// until --timeout, blaming the scheduler.
	if err := nc.LastError(); errors.Is(err, nats.ErrPermissionViolation) {
		if r.js != nil {
			return subs, fmt.Errorf("replay: %w: a replay onto the bus publishes requests and reads the answers (kvbus.out.*), ReqMetas and the request log's acknowledgements (its _INBOX); give it the admin key (--nats-nkey admin.nk)", err)
		}
		r.log.Warn("the bus refused to let replay read ReqMetas: the groups that served the requests will not be reported (give it the admin key, --nats-nkey admin.nk)", "err", err)
	}
	return subs, nil
}

// schedulerGrace is how long a replay onto the bus waits for a ready
// scheduler's announcement before it warns that none answers.
const schedulerGrace = 3 * time.Second

// warnWithoutScheduler warns when no scheduler announces itself ready
// within grace: published requests would then wait out their timeout in
// silence. It does not delay the replay.
func (r *Replayer) warnWithoutScheduler(ctx context.Context, grace time.Duration) (stop func(), err error) {
	ready := make(chan struct{})
	var once sync.Once
	sub, err := r.cfg.Conn.Subscribe(r.cfg.Subjects.AnnounceRole(messages.RoleScheduler), func(m *nats.Msg) {
		if a, err := messages.DecodeAnnouncement(m.Data); err == nil && a.Ready {
			once.Do(func() { close(ready) })
		}
	})
	if err != nil {
		return nil, err
	}
	wctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-ready:
		case <-wctx.Done():
		case <-t.C:
			r.log.Warn("no ready scheduler has announced itself on this bus: requests wait until one comes, or until --timeout",
				"subject", r.cfg.Subjects.AnnounceRole(messages.RoleScheduler), "timeout", r.cfg.Timeout)
		}
	})
	return func() { cancel(); wg.Wait(); _ = sub.Unsubscribe() }, nil
}

// usageOf reads req_id and usage from an Output without decoding its
// text or token ids; usage is nil but on a request's final Output.
func usageOf(data []byte) (string, *messages.Usage) {
	var m struct {
		ReqID string          `msgpack:"req_id"`
		Usage *messages.Usage `msgpack:"usage"`
	}
	if messages.Unmarshal(data, &m) != nil {
		return "", nil
	}
	return m.ReqID, m.Usage
}

// clientRequestID is the X-Request-Id a frontend's bus request id was made
// from ("" if none): the frontend suffixes it with "-" and an id of its
// own, and a request it publishes again (its answer lost on the bus) with
// "-again" and a count besides.
func clientRequestID(busID string) string {
	if i := strings.LastIndex(busID, "-again"); i > 0 && isDigits(busID[i+len("-again"):]) {
		busID = busID[:i]
	}
	if i := strings.LastIndexByte(busID, '-'); i > 0 {
		return busID[:i]
	}
	return ""
}

func isDigits(s string) bool {
	for _, c := range []byte(s) {
		if c < '0' || c > '9' {
			return false
		}
	}
	return s != ""
}

// reqIDOf reads req_id from a ReqMeta without decoding its token ids.
func reqIDOf(data []byte) string {
	var m struct {
		ReqID string `msgpack:"req_id"`
	}
	if messages.Unmarshal(data, &m) != nil {
		return ""
	}
	return m.ReqID
}

func (r *Replayer) onOutput(m *nats.Msg) {
	now := time.Now()
	o, err := messages.DecodeOutput(m.Data)
	if err != nil {
		r.log.Warn("replay: malformed output", "err", err)
		return
	}
	// The result is written under the lock, so that abandon (a timeout)
	// and this never both finish a request.
	r.mu.Lock()
	p := r.pending[o.ReqID]
	if p == nil {
		r.mu.Unlock()
		return
	}
	switch {
	case o.Attempt < p.attempt:
		// Of an attempt given up (its group failed; a newer one superseded
		// it, and may end it with an error): a frontend drops it too.
		r.mu.Unlock()
		return
	case o.Attempt > p.attempt && p.got && p.stream && o.Error == nil:
		// Moved after its answer began to stream: a frontend cannot splice
		// the new attempt into what its client has, and ends the answer
		// so. An answer that does not stream has reached no client yet: a
		// frontend follows the new attempt from its start, and so does
		// this (its time to first token stays the first attempt's).
		o = &messages.Output{ReqID: o.ReqID, Attempt: o.Attempt, Error: &messages.OutputError{Code: "group_failed",
			Message: "the request moved to another worker group after its answer had begun"}}
	}
	p.attempt = o.Attempt
	if !p.got {
		p.got = true
		p.res.TTFT = now.Sub(p.res.Sent)
	}
	final := o.Final()
	if final {
		delete(r.pending, o.ReqID)
		p.res.E2E = now.Sub(p.res.Sent)
		if u := o.Usage; u != nil {
			p.res.CachedTokens, p.res.RemoteTokens = u.CachedTokens, u.RemoteCachedTokens
			// An engine (--engine openai) may count the prompt in its own
			// tokens: the bound is the larger count.
			if prompt := max(p.res.PromptTokens, u.PromptTokens); u.CachedTokens < 0 || u.CachedTokens > prompt ||
				u.RemoteCachedTokens < 0 || u.RemoteCachedTokens > u.CachedTokens {
				// A count that would put a hit ratio over 1: as readStream.
				p.res.Err = fmt.Sprintf("usage: %d cached tokens (%d remote) of a prompt of %d: the engine's count is wrong",
					u.CachedTokens, u.RemoteCachedTokens, prompt)
				p.res.CachedTokens, p.res.RemoteTokens = 0, 0
			}
		}
		if o.Error != nil {
			p.res.Err = o.Error.Code + ": " + o.Error.Message
		}
	}
	r.mu.Unlock()
	if final {
		close(p.done)
	}
}

func (r *Replayer) doNATS(ctx context.Context, req *messages.Request, res *Result) {
	data, err := messages.Marshal(req)
	if err != nil {
		res.Err = err.Error()
		return
	}
	p := &pendingReq{res: res, done: make(chan struct{}), stream: req.Stream}
	r.mu.Lock()
	r.pending[req.RequestID] = p
	r.mu.Unlock()
	res.Sent = time.Now()
	ack, err := r.js.PublishMsgAsync(&nats.Msg{Subject: r.cfg.Subjects.Request(req.Model), Data: data, Header: nats.Header{}},
		jetstream.WithMsgID(req.RequestID))
	if err == nil {
		select {
		case <-ack.Ok():
		case err = <-ack.Err():
		case <-ctx.Done():
			err = ctx.Err()
		}
	}
	if err != nil || r.cfg.NoWait {
		r.mu.Lock()
		delete(r.pending, req.RequestID)
		r.mu.Unlock()
		switch {
		case errors.Is(err, jetstream.ErrNoStreamResponse):
			res.Err = fmt.Sprintf("publish: no request log takes %s: give the cluster's --subject-prefix, or start its frontend or scheduler first (%v)",
				r.cfg.Subjects.Request(req.Model), err)
		case err != nil:
			res.Err = "publish: " + err.Error()
		default:
			res.E2E = time.Since(res.Sent) // acknowledged by the log
		}
		return
	}
	timer := time.NewTimer(r.cfg.Timeout)
	defer timer.Stop()
	select {
	case <-p.done:
	case <-timer.C:
		r.abandon(req.RequestID, res, messages.AbortReasonTimeout+": no answer within "+r.cfg.Timeout.String())
	case <-ctx.Done():
		r.abandon(req.RequestID, res, "stopped: "+ctx.Err().Error())
	}
}

func (r *Replayer) abandon(id string, res *Result, why string) {
	r.mu.Lock()
	_, waiting := r.pending[id]
	delete(r.pending, id)
	if waiting {
		res.Err = why
	}
	r.mu.Unlock()
	if waiting {
		if data, err := messages.Marshal(&messages.Abort{ReqID: id, Reason: why}); err == nil {
			_ = r.cfg.Conn.Publish(r.cfg.Subjects.Abort(), data)
		}
	}
}
