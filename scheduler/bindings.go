package scheduler

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// SessionBucket is the JetStream KV bucket of session bindings under the
// default prefix (messages.Subjects.SessionBucket names it for any).
const SessionBucket = messages.SessionBucket

// Binding says where a session's previous turn ran: its group, how many
// full blocks its prompt had and the hash of the last of them (so that the
// next turn can check it extends that prompt), and the turn number.
type Binding struct {
	// Model is the model of the turn (its group serves it); "" from a
	// kvbus before bindings were per model.
	Model         string `json:"model,omitempty"`
	Group         string `json:"group"`
	Blocks        int    `json:"blocks"`
	LastHash      uint64 `json:"last_hash"`
	Turn          int    `json:"turn"`
	UpdatedUnixMs int64  `json:"updated_unix_ms"`
	// continuesLegacy marks the binding of a model's turn that continued a
	// binding naming no model (an older kvbus's): that binding was this
	// model's, and is not kept for the others (see sessionEntry.with). Not
	// stored.
	continuesLegacy bool
}

// sessionEntry is a session's value in the bucket: the binding of its
// latest turn at the top level, as every kvbus reads it, and in Others the
// latest binding of each other model the session id was used with. One
// session id sent with two models is two conversations, on each model's
// own groups: each model's turns follow its own previous turn.
type sessionEntry struct {
	Binding
	Others map[string]Binding `json:"others,omitempty"`
	// WrittenUnixMs is the writer's clock when it wrote the entry, on
	// which it also wrote every updated_unix_ms of the entry: a reader
	// takes the bindings' ages from their difference, not from its own
	// clock (0: written by an older kvbus; see onThisClock).
	WrittenUnixMs int64 `json:"written_unix_ms,omitempty"`
}

// onThisClock moves the updated_unix_ms of e's bindings onto this host's
// clock, e having been received at now (unix ms). Read on this clock as
// written, one replica's write time was judged on another's: a replica a
// minute behind the writer took every binding for fresh for 70 s (its
// group credited with blocks it may have lost meanwhile), one more than
// PlanTTL ahead never did. A binding is as old as its writer says it was
// when written (written_unix_ms − updated_unix_ms, both on the writer's
// clock), plus the time since: live (heard as written, within the
// watcher's delivery time) that is none. An entry replayed when the watch
// began (or reread after a conflict) may have waited in the bucket for any
// time: its bindings are taken as no newer than that and than their
// updated_unix_ms read on this clock. An entry of an older kvbus (no
// written_unix_ms) is read on this clock, as it was, but no binding is
// newer than its receipt.
func (e *sessionEntry) onThisClock(now int64, live bool) {
	at := func(b Binding) Binding {
		t := b.UpdatedUnixMs
		if e.WrittenUnixMs != 0 {
			t = now - max(e.WrittenUnixMs-b.UpdatedUnixMs, 0)
			if !live {
				t = min(t, b.UpdatedUnixMs)
			}
		}
		b.UpdatedUnixMs = min(t, now)
		return b
	}
	e.Binding = at(e.Binding)
	for m, o := range e.Others {
		e.Others[m] = at(o)
	}
}

// of returns the binding of model. A binding that names no model (written
// by a kvbus before bindings were per model, or for a caller that names
// none) is any model's: at the top level, or kept under "" in Others until
// the model whose conversation it was continues it (see with).
func (e sessionEntry) of(model string) (Binding, bool) {
	if e.Group != "" && (e.Model == model || e.Model == "" || model == "") {
		return e.Binding, true
	}
	if b, ok := e.Others[model]; ok {
		return b, true
	}
	b, ok := e.Others[""]
	return b, ok
}

// with returns e with b as its latest binding, the previous latest kept
// under its model unless it is b's. A binding naming no model (an older
// kvbus's) that b does not continue (b.continuesLegacy) is kept under "":
// it is the conversation of a model not known, which another model's turn
// with the same session id must not take from it.
func (e sessionEntry) with(b Binding) sessionEntry {
	out := sessionEntry{Binding: b}
	keep := func(m string, o Binding) {
		if out.Others == nil {
			out.Others = map[string]Binding{}
		}
		out.Others[m] = o
	}
	legacyTaken := b.Model == "" || b.continuesLegacy
	for m, o := range e.Others {
		if m != b.Model && (m != "" || !legacyTaken) {
			keep(m, o)
		}
	}
	switch {
	case e.Group == "" || e.Model == b.Model:
	case e.Model != "":
		keep(e.Model, e.Binding)
	case !legacyTaken:
		keep("", e.Binding)
	}
	return out
}

// DefaultMaxSessions is SessionBindingsConfig.MaxSessions's default: about
// 250 MB of bindings in each replica at most.
const DefaultMaxSessions = 1_000_000

// SessionBindingsConfig configures OpenSessionBindings.
type SessionBindingsConfig struct {
	// Bucket is the KV bucket's name; required.
	Bucket string
	// TTL is how long a binding lives after its session's last turn;
	// required (positive).
	TTL time.Duration
	// Replicas is the bucket's JetStream replication (0: 1).
	Replicas int
	// MaxSessions bounds the sessions bound at once: a replica binds no new
	// session while it knows this many (the bucket's, every replica's), and
	// such a session's turns are placed by their prompt alone (the KV index
	// still finds a prefix) until older bindings expire. Without it a
	// client that sends a new session id with every request (a gateway's
	// X-Correlation-ID) grows the bucket and every replica's copy by its
	// request rate × TTL. Zero means DefaultMaxSessions.
	MaxSessions int
	// Logger; nil means slog.Default().
	Logger *slog.Logger
}

// Validate checks c.
func (c *SessionBindingsConfig) Validate() error {
	switch {
	case c.Bucket == "":
		return fmt.Errorf("%w: no session bucket", ErrConfig)
	case c.TTL <= 0:
		return fmt.Errorf("%w: --session-ttl must be positive", ErrConfig)
	case c.MaxSessions < 0:
		return fmt.Errorf("%w: --max-sessions must be positive", ErrConfig)
	}
	return nil
}

// SessionBindings keeps (session, model) → group bindings in a JetStream KV bucket
// with a TTL, shared by all scheduler replicas. Reads come from a local copy
// that a watcher keeps current, so placement never waits on the network;
// writes are compare-and-set, applied in the background. Safe for concurrent
// use.
type SessionBindings struct {
	kv   jetstream.KeyValue
	open func(context.Context) (jetstream.KeyValue, error) // creates the bucket unless it exists
	ttl  time.Duration
	max  int
	log  *slog.Logger

	mu    sync.RWMutex
	local map[string]boundEntry // by session key
	// unbound counts the turns of new sessions left unbound for
	// MaxSessions (each turn of one, not each session); warned is when
	// that was last logged.
	unbound atomic.Int64
	warned  atomic.Int64

	writes  chan bindingWrite
	rewatch chan struct{} // remake made the bucket again
}

type boundEntry struct {
	sessionEntry
	rev uint64
	// mine marks a decision of this replica not yet confirmed by the
	// bucket.
	mine bool
	// heard marks a binding taken from another replica's save plan, not
	// yet confirmed by the bucket.
	heard bool
}

// fromBucket is the entry v, read from the bucket at rev, as this replica takes
// it in place of cur: with cur's latest binding kept on top when that is a
// decision not yet confirmed (this replica's, or another's heard from its
// save plan) of a later turn of its model than v holds (see follows). A
// write of an earlier turn (another replica's, or one of this replica's
// own that met a conflict and was reread) came after a later turn was
// recorded here; taken whole, it put the session back a turn until the
// later turn's write came round, and a turn placed meanwhile credited the
// turn before's group and recomputed the previous turn's blocks.
func fromBucket(cur boundEntry, known bool, v sessionEntry, rev uint64) boundEntry {
	if known && (cur.mine || cur.heard) && cur.Group != "" {
		later := true
		if sb, ok := v.of(cur.Model); ok && sb.Model == cur.Model {
			_, later = cur.Binding.follows(sb)
		}
		if later {
			return boundEntry{sessionEntry: v.with(cur.Binding), rev: rev, mine: cur.mine, heard: cur.heard}
		}
	}
	return boundEntry{sessionEntry: v, rev: rev}
}

type bindingWrite struct {
	key string
	b   Binding
}

// sessionMarkerTTL bounds how long an expired binding's delete marker
// stays in the session bucket.
const sessionMarkerTTL = time.Minute

// OpenSessionBindings creates or opens the bucket.
func OpenSessionBindings(ctx context.Context, js jetstream.JetStream, cfg SessionBindingsConfig) (*SessionBindings, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	bucket, ttl, replicas, log := cfg.Bucket, cfg.TTL, cfg.Replicas, cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	open := func(ctx context.Context) (jetstream.KeyValue, error) {
		return bus.Retry(ctx, func(ctx context.Context) (jetstream.KeyValue, error) {
			kv, err := js.KeyValue(ctx, bucket) // an existing bucket is used as it is
			if err == nil {
				return kv, nil
			}
			kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
				Bucket:      bucket,
				Description: "kvbus session bindings: session key → worker group of the previous turn",
				TTL:         ttl,
				History:     1,
				Storage:     jetstream.FileStorage,
				Replicas:    max(replicas, 1),
				// Watchers hear about expiry from a marker. It needs to
				// outlive only a watcher's reconnect (one that misses it
				// prunes the binding by its age): kept the TTL, markers
				// doubled the bucket (every binding expired in the last
				// TTL left one).
				LimitMarkerTTL: min(max(ttl, time.Second), sessionMarkerTTL),
			})
			if errors.Is(err, jetstream.ErrBucketExists) {
				kv, err = js.KeyValue(ctx, bucket)
			}
			return kv, err
		})
	}
	kv, err := open(ctx)
	if err != nil {
		return nil, fmt.Errorf("scheduler: session bucket %s: %w", bucket, err)
	}
	return &SessionBindings{kv: kv, open: open, ttl: ttl, max: cmp.Or(cfg.MaxSessions, DefaultMaxSessions), log: log, local: map[string]boundEntry{},
		writes: make(chan bindingWrite, 4096), rewatch: make(chan struct{}, 1)}, nil
}

// remake makes the bucket again after the NATS server lost it (with the
// request log: a server restarted without its store) and watches it anew:
// a watcher on the lost bucket waits for sequences the new one reaches
// only much later. The bindings this replica knows are kept; their next
// writes create their keys again.
func (s *SessionBindings) remake(ctx context.Context) {
	if _, err := s.open(ctx); err != nil {
		s.log.Warn("cannot make the session bucket again; sessions are bound by this replica only until it can", "bucket", s.kv.Bucket(), "err", err)
		return
	}
	select {
	case s.rewatch <- struct{}{}:
	default:
	}
}

// Run watches the bucket and applies queued writes until ctx ends.
func (s *SessionBindings) Run(ctx context.Context) error {
	w, err := s.kv.WatchAll(ctx)
	if err != nil {
		return fmt.Errorf("scheduler: watch %s: %w", s.kv.Bucket(), err)
	}
	defer func() { _ = w.Stop() }()
	updates, live := w.Updates(), false
	prune := time.NewTicker(max(s.ttl/2, time.Second))
	defer prune.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-prune.C:
			s.pruneExpired(now)
		case e, ok := <-updates:
			if !ok {
				updates = nil // stopped; a rewatch may start another
				continue
			}
			if e == nil {
				live = true // what the bucket held is read: what follows is heard as written
				continue
			}
			s.observe(e, live)
		case <-s.rewatch:
			_ = w.Stop()
			nw, err := s.kv.WatchAll(ctx)
			if err != nil {
				s.log.Warn("cannot watch the session bucket made again; other replicas' bindings are not seen", "bucket", s.kv.Bucket(), "err", err)
				updates = nil
				continue
			}
			w, updates, live = nw, nw.Updates(), false
		case wr := <-s.writes:
			s.write(ctx, wr)
		}
	}
}

// pruneExpired drops the local entries none of whose bindings is live. The
// bucket's expiry reaches the watcher for those it held; one whose write
// was dropped (a full queue) or failed never got there, and was kept for
// good. Found under the read lock: lookups go on meanwhile.
func (s *SessionBindings) pruneExpired(now time.Time) {
	cut := now.Add(-s.ttl).UnixMilli()
	expired := func(e boundEntry) bool {
		if e.UpdatedUnixMs > cut {
			return false
		}
		for _, o := range e.Others {
			if o.UpdatedUnixMs > cut {
				return false
			}
		}
		return true
	}
	var keys []string
	s.mu.RLock()
	for k, e := range s.local {
		if expired(e) {
			keys = append(keys, k)
		}
	}
	s.mu.RUnlock()
	if len(keys) == 0 {
		return
	}
	s.mu.Lock()
	for _, k := range keys {
		if e, ok := s.local[k]; ok && expired(e) { // not recorded again since
			delete(s.local, k)
		}
	}
	s.mu.Unlock()
}

// observe takes an entry the watcher delivered; live: heard as it was
// written, not replayed from what the bucket held when the watch began.
func (s *SessionBindings) observe(e jetstream.KeyValueEntry, live bool) {
	now := time.Now().UnixMilli()
	s.mu.Lock()
	defer s.mu.Unlock()
	if e.Operation() != jetstream.KeyValuePut {
		delete(s.local, e.Key())
		return
	}
	var v sessionEntry
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		s.log.Warn("ignoring a malformed session binding", "key", e.Key(), "err", err)
		return
	}
	cur, known := s.local[e.Key()]
	if known && cur.rev >= e.Revision() {
		return
	}
	v.onThisClock(now, live)
	s.local[e.Key()] = fromBucket(cur, known, v, e.Revision())
}

// GetModel returns the live binding of a session id for model: where the
// session's previous turn of that model ran.
func (s *SessionBindings) GetModel(model, sessionID string) (Binding, bool) {
	if sessionID == "" {
		return Binding{}, false
	}
	s.mu.RLock()
	e, ok := s.local[messages.SessionKey(sessionID)]
	s.mu.RUnlock()
	if !ok {
		return Binding{}, false
	}
	b, ok := e.of(model)
	if !ok || time.Since(time.UnixMilli(b.UpdatedUnixMs)) > s.ttl {
		return Binding{}, false
	}
	return b, true
}

// Get returns the live binding of a session id's latest turn, of whatever
// model: what tools and tests ask. Placement uses GetModel.
func (s *SessionBindings) Get(sessionID string) (Binding, bool) { return s.GetModel("", sessionID) }

// Record queues a binding for a session id's latest turn, of no model in
// particular (see sessionEntry.of); placement uses RecordModel.
func (s *SessionBindings) Record(sessionID string, b Binding) { s.RecordModel("", sessionID, b) }

// RecordModel queues a binding for a session id's turn of model; it never
// blocks (a full queue drops the write: the next turn writes again).
func (s *SessionBindings) RecordModel(model, sessionID string, b Binding) {
	if sessionID == "" {
		return
	}
	b.UpdatedUnixMs = time.Now().UnixMilli()
	b.Model = model
	key := messages.SessionKey(sessionID)
	// This replica sees its own decision at once; the revision stays the one
	// the compare-and-set will be checked against.
	s.mu.Lock()
	cur, known := s.local[key]
	if !known && len(s.local) >= s.max {
		s.mu.Unlock()
		s.refuse(key)
		return
	}
	s.local[key] = boundEntry{sessionEntry: cur.with(b), rev: cur.rev, mine: true}
	s.mu.Unlock()
	select {
	case s.writes <- bindingWrite{key: key, b: b}:
	default:
		s.log.Warn("session binding queue full; dropping a write", "session_key", key)
	}
}

// heard takes the binding of a session's turn of model that another
// replica dispatched, from its save plan: this replica knows it at once,
// as the dispatching one does, where the bucket's watcher tells it only
// after the write (and the next turn, sent the moment the answer came, may
// be here first). Nothing is written: the dispatching replica writes it. A
// binding this replica knows of a later turn (or of a longer prompt of the
// same turn) is kept.
func (s *SessionBindings) heard(model, key string, b Binding) {
	if key == "" || b.Group == "" {
		return
	}
	b.UpdatedUnixMs = time.Now().UnixMilli()
	b.Model = model
	s.mu.Lock()
	defer s.mu.Unlock()
	cur, known := s.local[key]
	if !known && len(s.local) >= s.max {
		return
	}
	if prev, ok := cur.of(model); known && ok && (prev.Turn > b.Turn || prev.Turn == b.Turn && prev.Blocks >= b.Blocks) {
		return
	}
	s.local[key] = boundEntry{sessionEntry: cur.with(b), rev: cur.rev, heard: true}
}

// refuse counts a turn of a new session left unbound for MaxSessions, and
// says so at most once a minute.
func (s *SessionBindings) refuse(key string) {
	n := s.unbound.Add(1)
	now := time.Now().UnixNano()
	if last := s.warned.Load(); now-last < int64(time.Minute) || !s.warned.CompareAndSwap(last, now) {
		return
	}
	s.log.Warn("as many sessions are bound as --max-sessions allows: a new session's turns are placed by their prompt alone until older bindings expire",
		"max_sessions", s.max, "session_ttl", s.ttl, "session_key", key, "unbound_total", n,
		"hint", "a client sending a new session id with every request (a gateway's X-Correlation-ID) binds one per request: have it send a conversation's id (X-Session-ID), or lower --session-ttl, or raise --max-sessions")
}

// Sessions is how many sessions this replica knows bound.
func (s *SessionBindings) Sessions() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.local)
}

// Unbound is how many turns of new sessions were left unbound for
// MaxSessions.
func (s *SessionBindings) Unbound() int64 { return s.unbound.Load() }

// write stores a binding with compare-and-set: it creates the key, or
// updates the revision it knows. On a conflict it rereads; a stored binding
// that is not before it (see follows) wins, otherwise it retries once.
func (s *SessionBindings) write(ctx context.Context, wr bindingWrite) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var reread *boundEntry // what a conflict found stored
	for attempt := 0; attempt < 2; attempt++ {
		s.mu.RLock()
		cur := s.local[wr.key]
		s.mu.RUnlock()
		if reread != nil {
			// Compared with what is stored, whatever this replica holds
			// meanwhile (a later turn kept over it, see fromBucket).
			cur = *reread
		}
		if !cur.mine && cur.rev > 0 {
			// Another replica's binding of this model's turn, not an older
			// kvbus's this turn did not continue.
			if prev, ok := cur.of(wr.b.Model); ok && (prev.Model != "" || wr.b.Model == "" || wr.b.continuesLegacy) {
				if wr.b, ok = wr.b.follows(prev); !ok {
					return // another replica recorded this turn (or a later one) first: it wins
				}
			}
		}
		// The session's other models' bindings are kept.
		val := cur.with(wr.b)
		val.WrittenUnixMs = time.Now().UnixMilli() // the clock of every updated_unix_ms here
		data, err := json.Marshal(val)
		if err != nil {
			return
		}
		var rev uint64
		if cur.rev > 0 {
			rev, err = s.kv.Update(ctx, wr.key, data, cur.rev)
		} else {
			rev, err = s.kv.Create(ctx, wr.key, data)
		}
		if err == nil {
			s.mu.Lock()
			switch e := s.local[wr.key]; {
			case e.rev >= rev: // the watcher already has this or a later write
			case (e.mine || e.heard) && e.UpdatedUnixMs > wr.b.UpdatedUnixMs: // a later turn, recorded or heard, is not stored yet
				s.local[wr.key] = boundEntry{sessionEntry: e.sessionEntry, rev: rev, mine: e.mine, heard: e.heard}
			default:
				s.local[wr.key] = boundEntry{sessionEntry: val, rev: rev}
			}
			s.mu.Unlock()
			return
		}
		if !errors.Is(err, jetstream.ErrKeyExists) && !errors.Is(err, jetstream.ErrKeyRevisionMismatch) && !errors.Is(err, jetstream.ErrKeyNotFound) {
			s.log.Warn("cannot write a session binding", "session_key", wr.key, "err", err)
			return
		}
		// Someone else wrote (or the key expired): reread; the next attempt
		// compares with what is stored.
		e, gerr := s.kv.Get(ctx, wr.key)
		s.mu.Lock()
		var v sessionEntry
		if gerr == nil && json.Unmarshal(e.Value(), &v) == nil {
			v.onThisClock(time.Now().UnixMilli(), false)
			reread = &boundEntry{sessionEntry: v, rev: e.Revision()}
			cur, known := s.local[wr.key]
			s.local[wr.key] = fromBucket(cur, known, v, e.Revision())
		} else {
			reread = &boundEntry{}
			delete(s.local, wr.key)
		}
		s.mu.Unlock()
	}
}

// extendedBy reports whether a prompt of these block hashes extends the
// binding's turn: it has the turn's full blocks, the last of them the same.
func (b Binding) extendedBy(hashes []uint64) bool {
	n := b.Blocks
	return n > 0 && n <= len(hashes) && hashes[n-1] == b.LastHash
}

// turnOf is the turn number of a request of these block hashes in the
// session whose latest turn is b's: the next one, or b's own when the
// request is that turn asked again (a redelivery, a replica's adoption, the
// frontend's ask again of a lost answer) with b's prompt.
func (b Binding) turnOf(hashes []uint64, again bool) int {
	n := len(hashes)
	if again && b.Blocks == n && (n == 0 || hashes[n-1] == b.LastHash) {
		return b.Turn
	}
	return b.Turn + 1
}

// follows says whether b, recorded by this replica, comes after the stored
// binding, and returns the binding to write. A later turn does. So does a
// prompt of more blocks numbered as the same turn or an earlier one: the
// next turn, placed by a replica whose watcher had not yet heard of the
// previous one (it numbers that turn again); it is written as the turn
// after the stored one. A binding of the same turn and no more blocks (the
// same request placed twice, or a race on the first turn) does not: the
// first write wins.
func (b Binding) follows(stored Binding) (Binding, bool) {
	switch {
	case b.Turn > stored.Turn:
		return b, true
	case b.Blocks > stored.Blocks:
		b.Turn = stored.Turn + 1
		return b, true
	}
	return b, false
}
