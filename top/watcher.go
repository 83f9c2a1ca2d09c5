// Package top keeps a live view of a kvbus cluster built from the bus alone
// (heartbeats, KV events, requests, ReqMetas, outputs and the schedulers'
// announcements), so it works against `make run`, a multi-process cluster
// and compose alike: per group its state, ranks, queue, in-flight requests,
// blocks and pool traffic; cluster-wide requests/s, TTFT percentiles over
// the last minute, the hit ratio by turn depth and the busiest sessions.
// `kvbus top` draws it in the terminal (Model) or prints one Snapshot as
// JSON. Reading every request and output needs the admin key.
//
// A Watcher is safe for concurrent use: Run feeds it from NATS callbacks,
// Snapshot reads it.
package top

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// Config configures a Watcher.
type Config struct {
	// Conn is the watcher's connection (the admin key); the caller owns it.
	Conn     *nats.Conn
	Subjects messages.Subjects
	// Window is the span of the rates and percentiles (0: 1 min).
	Window time.Duration
	// HeartbeatTimeout: a rank silent for longer is gone (default 3 s, the
	// schedulers' default).
	HeartbeatTimeout time.Duration
	// Sessions is how many busiest sessions a Snapshot lists (0: 10).
	Sessions int
	// MaxSessions bounds the sessions followed: past it the least
	// recently active is forgotten (0: DefaultMaxSessions). Its next turn
	// then counts as a first turn.
	MaxSessions int
	// URL names the NATS server in the disconnection banner when the
	// connection cannot (passwords hidden by the caller); optional.
	URL string
}

// DefaultMaxSessions is Config.MaxSessions' default.
const DefaultMaxSessions = 10_000

const (
	// schedulerSilence is the frontend's rule: a scheduler not heard for
	// longer is not ready (frontend --scheduler-timeout, 3 s).
	schedulerSilence = 3 * time.Second
	// schedulerForget: a silent or stopped scheduler is listed this long.
	schedulerForget = time.Minute
	// groupForget: a group whose ranks all went silent is listed as down
	// this long.
	groupForget = 5 * time.Minute
)

// abortPublishFailed begins the reason of a frontend's Abort of a request
// that never entered the log, and never ran (frontend/generate.go).
const abortPublishFailed = "publish failed"

// Validate checks the configuration.
func (c *Config) Validate() error {
	if c.Conn == nil {
		return errors.New("top: no NATS connection")
	}
	if c.Window < 0 {
		return fmt.Errorf("top: Window is negative (%s); give a span, or 0 for 1 min", c.Window)
	}
	if c.HeartbeatTimeout < 0 {
		return fmt.Errorf("top: HeartbeatTimeout is negative (%s); give a timeout, or 0 for 3 s", c.HeartbeatTimeout)
	}
	if c.Sessions < 0 {
		return fmt.Errorf("top: Sessions is negative (%d); give a count, or 0 for 10", c.Sessions)
	}
	if c.MaxSessions < 0 {
		return fmt.Errorf("top: MaxSessions is negative (%d); give a count, or 0 for %d", c.MaxSessions, DefaultMaxSessions)
	}
	return c.Subjects.Validate()
}

// Watcher follows the bus. See the package doc.
type Watcher struct {
	cfg   Config
	ready chan struct{} // closed once Run's subscriptions are in place

	mu         sync.Mutex
	started    time.Time
	running    bool // Run follows the connection's status
	groups     map[string]*groupView
	schedulers map[string]schedulerView
	reqs       map[string]*reqView         // requests in flight, by req_id
	sessions   map[sessionKey]*sessionView // by model and session id
	lru        list.List                   // of *sessionView, most recently active first
	done       []doneReq                   // finished within the window, oldest first
	pool       []poolRun                   // remote runs within the window
	// again are the turns asked again (Request.again_of) with a copy in
	// flight, by the turn's first request id.
	again map[string]*againTurn
	// The connection: lost since discSince (zero while connected), to url.
	discSince time.Time
	url       string
}

type groupView struct {
	ranks     map[int]rankView // each with its own world size
	kvBatches uint64
}

type schedulerView struct {
	ann  messages.Announcement
	seen time.Time // on top's clock, as the frontend judges silence
}

type rankView struct {
	seen time.Time
	hb   messages.Heartbeat
}

type reqView struct {
	arrived   time.Time // on top's clock
	start     time.Time // the frontend's arrival (its clock), else arrived
	session   sessionKey
	depth     int
	group     string
	prompt    int
	firstByte time.Time
	// whole: an engine answers it in one output, the whole answer (an
	// --engine openai request that does not stream): no TTFT.
	whole bool
	// poolFrom: the ReqMetas of attempts below it were counted in the
	// pool traffic (a ReqMeta published again reads nothing again).
	poolFrom int
	again    *againTurn // nil: never asked again
}

// ttft is the time from the request's arrival to its first output
// reaching top; 0 when none did (0 or less, clocks apart: no sample).
func (rv *reqView) ttft() time.Duration {
	if rv.firstByte.IsZero() {
		return 0
	}
	return rv.firstByte.Sub(rv.start)
}

// againTurn is a request the frontend published again, under other ids,
// because its answer was lost on the bus: one turn of its session, ended
// by its last copy in flight.
type againTurn struct {
	id    string // the first request's
	live  int    // its copies in flight
	depth int
}

// sessionKey names a conversation: a session id of one model. The same
// id sent with another model is another conversation, with turns of its
// own, as the schedulers bind and count it.
type sessionKey struct{ model, id string }

type sessionView struct {
	sessionKey
	elem     *list.Element // in Watcher.lru
	turns    int
	group    string
	last     time.Time
	prompt   int // tokens over its completed turns (not failed)
	cached   int
	inWindow []time.Time // its requests' arrivals within the window
}

type doneReq struct {
	at      time.Time
	ttft    time.Duration // 0: no output reached the client
	depth   int
	prompt  int
	cached  int
	failed  bool
	aborted bool // its client went away (an Abort): no answer was due
	session sessionKey
}

type poolRun struct {
	at       time.Time
	from, to string
	blocks   int
}

// New returns a Watcher; Run starts it.
func New(cfg Config) (*Watcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Window <= 0 {
		cfg.Window = time.Minute
	}
	if cfg.HeartbeatTimeout <= 0 {
		cfg.HeartbeatTimeout = 3 * time.Second
	}
	if cfg.Sessions <= 0 {
		cfg.Sessions = 10
	}
	if cfg.MaxSessions <= 0 {
		cfg.MaxSessions = DefaultMaxSessions
	}
	return &Watcher{cfg: cfg, ready: make(chan struct{}), groups: map[string]*groupView{}, schedulers: map[string]schedulerView{},
		reqs: map[string]*reqView{}, again: map[string]*againTurn{}, sessions: map[sessionKey]*sessionView{}, url: cfg.URL}, nil
}

// Subscribed is closed once Run follows the bus: what is published after
// it is seen.
func (w *Watcher) Subscribed() <-chan struct{} { return w.ready }

// Run subscribes and follows the bus until ctx ends. Call it once. Malformed messages are
// skipped.
func (w *Watcher) Run(ctx context.Context) error {
	s := w.cfg.Subjects
	nc := w.cfg.Conn
	// Follow the connection (the snapshot also asks it: events can be
	// dropped): while it is lost, the view says so and keeps the last rows.
	status := nc.StatusChanged()
	defer nc.RemoveStatusListener(status)
	w.mu.Lock()
	w.started = time.Now()
	w.running = true
	w.connStatus(nc.Status(), w.started)
	w.mu.Unlock()
	// One subscription, so that messages are handled in the order the
	// server delivers them: a request before its outputs.
	handlers := map[string]func(*nats.Msg, time.Time){
		messages.KindHeartbeat: w.onHeartbeat, messages.KindKV: w.onKV, messages.KindRequest: w.onRequest,
		messages.KindMeta: w.onMeta, messages.KindOut: w.onOutput, messages.KindAnnounce: w.onAnnouncement,
		messages.KindControl: w.onControl,
	}
	sub, err := w.cfg.Conn.Subscribe(s.All(), func(m *nats.Msg) {
		if _, ok := bus.FromStream(m); ok {
			// No kvbus role publishes a stream's message onto a kvbus
			// subject: the server sent it where a key allowed that
			// stream's API asked (a direct get's reply, a push
			// consumer's deliver subject), past its publish permissions.
			// The roles drop it (bus.Subscribe); so does top.
			return
		}
		kind, _ := s.Kind(m.Subject)
		if fn := handlers[kind]; fn != nil {
			fn(m, time.Now())
		}
	})
	if err != nil {
		return fmt.Errorf("top: subscribe %s: %w", s.All(), err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	// The whole bus passes here: do not let a burst drop messages.
	if err := sub.SetPendingLimits(-1, 512<<20); err != nil {
		return fmt.Errorf("top: %w", err)
	}
	if err := w.cfg.Conn.Flush(); err != nil {
		return fmt.Errorf("top: %w", err)
	}
	if err := w.cfg.Conn.LastError(); errors.Is(err, nats.ErrPermissionViolation) {
		return fmt.Errorf("top: %w: kvbus top reads the whole bus; give it the observer key (--nats-nkey DIR/observer.nk, "+
			"written by `kvbus auth init DIR`) or the admin key", err)
	}
	close(w.ready)
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-t.C:
			w.expire(now)
		case st := <-status:
			w.mu.Lock()
			w.connStatus(st, time.Now())
			w.mu.Unlock()
		}
	}
}

// connStatus records the connection's status st, seen at now. Call with
// w.mu held.
func (w *Watcher) connStatus(st nats.Status, now time.Time) {
	if st == nats.CONNECTED {
		w.discSince = time.Time{}
		if u := w.cfg.Conn.ConnectedUrlRedacted(); u != "" {
			w.url = u
		}
		return
	}
	if w.discSince.IsZero() {
		w.discSince = now
	}
}

func (w *Watcher) onHeartbeat(m *nats.Msg, now time.Time) {
	hb, err := messages.DecodeHeartbeat(m.Data)
	if err != nil || m.Subject != w.cfg.Subjects.Heartbeat(hb.Group, hb.TPRank) {
		// A rank publishes only as itself (its key allows only its group's
		// subjects): one whose body names another group or rank is forged,
		// and the schedulers drop it too.
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	// Each rank keeps the world size it says: ranks that disagree show as
	// a conflict, where resetting the group at each disagreement made it
	// flap between incomplete 1/4 and 3/4.
	w.group(hb.Group).ranks[hb.TPRank] = rankView{seen: now, hb: *hb}
}

func (w *Watcher) group(name string) *groupView {
	g := w.groups[name]
	if g == nil {
		g = &groupView{ranks: map[int]rankView{}}
		w.groups[name] = g
	}
	return g
}

func (w *Watcher) onKV(m *nats.Msg, _ time.Time) {
	b, err := messages.DecodeKVEventBatch(m.Data)
	if err != nil || m.Subject != w.cfg.Subjects.KV(b.Group, b.Rank) {
		return
	}
	w.mu.Lock()
	w.group(b.Group).kvBatches++
	w.mu.Unlock()
}

func (w *Watcher) onAnnouncement(m *nats.Msg, now time.Time) {
	a, err := messages.DecodeAnnouncement(m.Data)
	if err != nil {
		return
	}
	w.mu.Lock()
	w.schedulers[a.ID] = schedulerView{ann: *a, seen: now}
	w.mu.Unlock()
}

func (w *Watcher) onRequest(m *nats.Msg, now time.Time) {
	req, err := messages.DecodeRequest(m.Data)
	if err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.reqs[req.RequestID]; ok {
		return // a redelivery
	}
	key := sessionKey{req.Model, req.SessionID}
	rv := &reqView{arrived: now, start: now, session: key, depth: 1, prompt: len(req.PromptTokenIDs),
		whole: len(req.Body) > 0 && !req.Stream}
	if req.ArrivalUnixMs > 0 {
		// The frontend's clock: a top that reads its backlog late (paused,
		// behind) would otherwise stamp both ends at once.
		// The stamp is in whole milliseconds: take the end of that
		// millisecond (understating by less than 1 ms rather than
		// overstating), and never after top read the request.
		if t := time.UnixMilli(req.ArrivalUnixMs).Add(time.Millisecond - 1); t.Before(now) {
			rv.start = t
		}
	}
	if req.AgainOf != "" {
		// The same turn asked again: not one more turn of its session.
		at := w.again[req.AgainOf]
		if at == nil {
			at = &againTurn{id: req.AgainOf, depth: 1}
			if first := w.reqs[req.AgainOf]; first != nil {
				at.live, at.depth = 1, first.depth
				first.again = at
			} else if sv := w.sessions[key]; sv != nil {
				at.depth = max(sv.turns, 1)
			}
			w.again[req.AgainOf] = at
		}
		at.live++
		rv.again, rv.depth = at, at.depth
		if sv := w.sessions[key]; sv != nil {
			w.lru.MoveToFront(sv.elem)
			sv.last = now
		}
	} else if req.SessionID != "" {
		sv := w.sessions[key]
		if sv == nil {
			sv = &sessionView{sessionKey: key}
			sv.elem = w.lru.PushFront(sv)
			w.sessions[key] = sv
			for w.lru.Len() > w.cfg.MaxSessions {
				w.forget(w.lru.Back().Value.(*sessionView))
			}
		} else {
			w.lru.MoveToFront(sv.elem)
		}
		sv.turns++
		sv.last = now
		sv.inWindow = append(sv.inWindow, now)
		rv.depth = sv.turns
	}
	w.reqs[req.RequestID] = rv
}

func (w *Watcher) onMeta(m *nats.Msg, now time.Time) {
	meta, err := messages.DecodeReqMeta(m.Data)
	if err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	counted := false
	if rv := w.reqs[meta.ReqID]; rv != nil {
		rv.group = meta.Group
		if sv := w.sessions[rv.session]; sv != nil {
			sv.group = meta.Group
		}
		// The same attempt again (a rank had not answered, or a replica
		// adopted it): the ranks that have it read nothing again.
		counted = meta.Attempt < rv.poolFrom
		rv.poolFrom = max(rv.poolFrom, meta.Attempt+1)
	}
	if ls := meta.LoadSpec; ls != nil && !counted {
		for _, run := range ls.Remote {
			w.pool = append(w.pool, poolRun{at: now, from: run.Group, to: meta.Group, blocks: run.Blocks})
		}
	}
}

func (w *Watcher) onOutput(m *nats.Msg, now time.Time) {
	o, err := messages.DecodeOutput(m.Data)
	if err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	rv := w.reqs[o.ReqID]
	if rv == nil {
		return
	}
	if rv.firstByte.IsZero() && o.Error == nil && !rv.whole {
		rv.firstByte = now
	}
	if !o.Final() {
		return
	}
	d := doneReq{at: now, ttft: rv.ttft(), depth: rv.depth, prompt: rv.prompt, failed: o.Error != nil, session: rv.session}
	if u := o.Usage; u != nil {
		d.prompt, d.cached = u.PromptTokens, u.CachedTokens
	}
	if sv := w.sessions[rv.session]; sv != nil && !d.failed { // a failed turn loaded nothing: no miss
		sv.prompt += d.prompt
		sv.cached += d.cached
	}
	w.done = append(w.done, d)
	w.end(o.ReqID, rv)
}

// end drops request id, in flight, and its copy of a turn asked again.
// Call with w.mu held.
func (w *Watcher) end(id string, rv *reqView) {
	delete(w.reqs, id)
	if at := rv.again; at != nil {
		if at.live--; at.live <= 0 {
			delete(w.again, at.id)
		}
	}
}

// forget drops session sv. Call with w.mu held.
func (w *Watcher) forget(sv *sessionView) {
	w.lru.Remove(sv.elem)
	delete(w.sessions, sv.sessionKey)
}

// onControl follows the frontend's aborts: the driver sends no final
// output for an aborted request, so it ends here. Only a client that went
// away counts as aborted; a timeout or a stopping frontend is a failure;
// a request whose publication failed (the log refused it: 503
// request_log_full) never ran, and is forgotten with its session turn. A
// scheduler's withdrawal from one group (Abort.group) is not an end: the
// request goes on.
func (w *Watcher) onControl(m *nats.Msg, now time.Time) {
	if m.Subject != w.cfg.Subjects.Abort() {
		return
	}
	a, err := messages.DecodeAbort(m.Data)
	if err != nil || a.Group != "" {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	rv := w.reqs[a.ReqID]
	if rv == nil {
		return
	}
	w.end(a.ReqID, rv)
	switch {
	case rv.again != nil && rv.again.live > 0:
		// A copy given up for another of the same turn, still in flight
		// (asked again, or another answered first): that one ends the turn.
	case a.Reason == messages.AbortReasonClientGone:
		// A first token that reached its client before it left was a
		// time to first token, as the frontend counts it.
		w.done = append(w.done, doneReq{at: now, ttft: rv.ttft(), depth: rv.depth, prompt: rv.prompt, aborted: true, session: rv.session})
	case strings.HasPrefix(a.Reason, abortPublishFailed):
		if sv := w.sessions[rv.session]; sv != nil && rv.again == nil { // a copy added no turn
			sv.turns--
			if k := len(sv.inWindow) - 1; k >= 0 && sv.inWindow[k].Equal(rv.arrived) {
				sv.inWindow = sv.inWindow[:k]
			}
			if sv.turns <= 0 {
				w.forget(sv)
			}
		}
	default: // a timeout, a stopping frontend or replayer
		w.done = append(w.done, doneReq{at: now, ttft: rv.ttft(), depth: rv.depth, prompt: rv.prompt, failed: true, session: rv.session})
	}
}

// expire drops what is older than the window (requests that never ended
// after 10 minutes, sessions idle for 30, ranks silent for groupForget,
// schedulers for schedulerForget).
func (w *Watcher) expire(now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	cut := now.Add(-w.cfg.Window)
	i := 0
	for i < len(w.done) && w.done[i].at.Before(cut) {
		i++
	}
	w.done = append(w.done[:0:0], w.done[i:]...)
	j := 0
	for j < len(w.pool) && w.pool[j].at.Before(cut) {
		j++
	}
	w.pool = append(w.pool[:0:0], w.pool[j:]...)
	for id, rv := range w.reqs {
		if now.Sub(rv.arrived) > 10*time.Minute {
			w.end(id, rv)
		}
	}
	for e := w.lru.Back(); e != nil; e = w.lru.Back() {
		sv := e.Value.(*sessionView)
		if now.Sub(sv.last) <= 30*time.Minute {
			break
		}
		w.forget(sv)
	}
	if !w.discSince.IsZero() {
		return // nothing is heard: keep the last rows
	}
	for name, g := range w.groups {
		for tp, r := range g.ranks {
			if now.Sub(r.seen) > groupForget {
				delete(g.ranks, tp)
			}
		}
		if len(g.ranks) == 0 {
			delete(w.groups, name)
		}
	}
	for id, sc := range w.schedulers {
		if now.Sub(sc.seen) > schedulerForget {
			delete(w.schedulers, id)
		}
	}
}
