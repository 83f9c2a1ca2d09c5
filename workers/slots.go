package workers

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// SlotBucket is the JetStream KV bucket where `kvbus worker --rank auto`
// claims (group, rank) slots, under the default prefix
// (messages.Subjects.SlotBucket names it for any).
const SlotBucket = messages.SlotBucket

// ErrNoSlot is returned when every slot of MaxGroups groups is taken.
var ErrNoSlot = errors.New("workers: no free (group, rank) slot")

// SlotConfig configures slot claiming.
type SlotConfig struct {
	// Bucket is the KV bucket of the slots (default SlotBucket).
	Bucket string
	// GroupPrefix names groups <prefix>0, <prefix>1, … (default "g").
	GroupPrefix string
	// Group, when set, is the only group whose ranks are claimed (a
	// worker with a key of that group, worker-<group>.nk): no other group
	// is tried, and the slot never moves to another (regroup).
	Group string
	// Size is the ranks per group (the TP size).
	Size int
	// MaxGroups bounds the groups tried (default messages.MaxGroups, as
	// many as a scheduler's KV index tracks).
	MaxGroups int
	// TTL is how long a claim lives without a refresh (default 10 s); the
	// holder refreshes it every TTL/3.
	TTL time.Duration
	// Owner identifies the claimant (its host name, say).
	Owner string
	// Model is the model the claimant serves: a group some of whose slots
	// are held for another model is not joined ("" joins any, and is
	// joined by any: a worker of a kvbus before models were told apart).
	Model    string
	Replicas int
	Logger   *slog.Logger
}

// Slot is a claimed (group, rank). Keep it with Hold; Release frees it.
type Slot struct {
	Group string
	Rank  int
	js    jetstream.JetStream
	kv    jetstream.KeyValue
	key   string
	rev   uint64
	// token is what the slot's key holds: the owner and a per-claim id,
	// so that two workers of one host are told apart.
	token string
	cfg   SlotConfig
	// misplaced counts the checks in a row that found a group to move to.
	misplaced int
	// settle: no regroup before it. A claim the bucket forgot (a NATS
	// restart) was forgotten for every holder, and each claims its own
	// again at its next refresh, some after an update timed out: until
	// then their groups look incomplete and their slots free.
	settle time.Time
}

// Validate checks that Size (--tp-size) is at least 1; that MaxGroups, TTL
// (--slot-ttl) and Replicas (--stream-replicas) are not negative (0: their
// defaults); that Group (--group), if set, is a group name, and so is the
// last group GroupPrefix would name; and that Bucket, if set, is a
// JetStream bucket name (ClaimSlot retried a bad one until its context
// ended). The other fields take any value. Errors wrap ErrConfig.
// ClaimSlot calls it.
func (c SlotConfig) Validate() error {
	switch {
	case c.Size < 1:
		return fmt.Errorf("%w: --tp-size must be at least 1", ErrConfig)
	case c.MaxGroups < 0:
		return fmt.Errorf("%w: MaxGroups %d must be >= 0 (0: %d)", ErrConfig, c.MaxGroups, messages.MaxGroups)
	case c.TTL < 0:
		return fmt.Errorf("%w: --slot-ttl %s must be >= 0 (0: 10s)", ErrConfig, c.TTL)
	case c.Replicas < 0:
		return fmt.Errorf("%w: --stream-replicas %d must be >= 0 (0: 1)", ErrConfig, c.Replicas)
	}
	if c.Group != "" {
		if err := messages.ValidateGroup(c.Group); err != nil {
			return fmt.Errorf("%w: --group: %w", ErrConfig, err)
		}
	}
	if c.GroupPrefix != "" {
		last := c.GroupPrefix + strconv.Itoa(cmp.Or(c.MaxGroups, messages.MaxGroups)-1)
		if err := messages.ValidateGroup(last); err != nil {
			return fmt.Errorf("%w: GroupPrefix %q names groups up to %s: %w", ErrConfig, c.GroupPrefix, last, err)
		}
	}
	if c.Bucket != "" && strings.ContainsFunc(c.Bucket, notBucketRune) {
		return fmt.Errorf("%w: slot bucket %q must match [A-Za-z0-9_-]+ (it is named after --subject-prefix)", ErrConfig, c.Bucket)
	}
	return nil
}

// notBucketRune reports a rune JetStream refuses in a bucket name, which
// is [A-Za-z0-9_-]+.
func notBucketRune(r rune) bool {
	return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-')
}

// ClaimSlot claims the first free slot, groups in order and ranks in order
// within a group, with a compare-and-set create: two workers never hold one
// slot. A slot whose holder stopped refreshing it expires after the TTL and
// is claimed by the next worker.
//
// It reads the bucket once (one listing) and tries only the slots the
// listing found free, skipping the groups it found held by a worker of
// another kind: a worker started late in a deployment of a thousand groups
// makes a handful of requests, not one create per slot held before its own.
// A create another worker won moves on to the next free slot of the
// listing; when every one of them was taken so, the bucket is listed again.
func ClaimSlot(ctx context.Context, js jetstream.JetStream, cfg SlotConfig) (*Slot, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.GroupPrefix == "" {
		cfg.GroupPrefix = "g"
	}
	if cfg.MaxGroups == 0 {
		cfg.MaxGroups = messages.MaxGroups
	}
	if cfg.TTL == 0 {
		cfg.TTL = 10 * time.Second
	}
	if cfg.Bucket == "" {
		cfg.Bucket = SlotBucket
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	kv, err := bus.Retry(ctx, func(ctx context.Context) (jetstream.KeyValue, error) { return openSlotBucket(ctx, js, cfg) })
	if err != nil {
		return nil, fmt.Errorf("workers: slot bucket %s: %w", cfg.Bucket, err)
	}
	token := slotToken(cfg.Owner, nuid.Next(), slotKind{cfg.Model, cfg.Size})
	groups := func(yield func(string) bool) {
		if cfg.Group != "" {
			yield(cfg.Group)
			return
		}
		for g := range cfg.MaxGroups {
			if !yield(fmt.Sprintf("%s%d", cfg.GroupPrefix, g)) {
				return
			}
		}
	}
	for lost := true; lost; {
		list, err := listSlots(ctx, kv, cfg)
		if err != nil {
			return nil, fmt.Errorf("workers: list the slots of %s: %w", cfg.Bucket, err)
		}
		lost = false // a create another worker won since the listing: it is stale
	candidates:
		for group := range groups {
			if cfg.Group == "" && list.other[group] {
				continue
			}
			for r := range cfg.Size {
				key := fmt.Sprintf("%s.%d", group, r)
				if list.held[key] {
					continue
				}
				rev, err := kv.Create(ctx, key, []byte(token))
				if errors.Is(err, jetstream.ErrKeyExists) {
					lost = true
					continue
				}
				if err != nil {
					return nil, fmt.Errorf("workers: claim slot %s: %w", key, err)
				}
				// A free rank of a group a worker of another model or size
				// holds a rank of is no slot for this worker: it would make a
				// group of two models, which takes no request, or of two world
				// sizes, and no regroup undoes it. The listing skipped the
				// groups it saw so; checked again after the create, so that of
				// two workers of different kinds claiming one group at once
				// the later to check sees the other and leaves.
				if cfg.Group == "" && heldByAnotherKind(ctx, kv, group, r, cfg) {
					if err := kv.Delete(ctx, key, jetstream.LastRevision(rev)); err != nil {
						cfg.Logger.Warn("cannot release a worker slot of another model's group; it expires after --slot-ttl", "slot", key, "err", err)
					}
					continue candidates
				}
				cfg.Logger.Info("claimed a worker slot", "group", group, "tp_rank", r, "owner", cfg.Owner)
				return &Slot{Group: group, Rank: r, js: js, kv: kv, key: key, rev: rev, token: token, cfg: cfg}, nil
			}
		}
	}
	if cfg.Group != "" {
		return nil, fmt.Errorf("%w: all %d ranks of group %s are held. A stopped worker's slot frees within --slot-ttl (%s): "+
			"if a worker of %s just stopped, start this one again then; otherwise give this worker another --group (and that group's key)",
			ErrNoSlot, cfg.Size, cfg.Group, cfg.TTL, cfg.Group)
	}
	return nil, fmt.Errorf("%w: all %d groups of %d ranks are held, the most a scheduler tracks. "+
		"A stopped worker's slot frees within --slot-ttl (%s): if workers just stopped, start this one again then; "+
		"otherwise the cluster is full: stop workers it does not need, or run another deployment under its own --subject-prefix",
		ErrNoSlot, cfg.MaxGroups, cfg.Size, cfg.TTL)
}

// slotListTimeout bounds one listing of the slot bucket, as long as the
// JetStream client gives a request without a deadline.
const slotListTimeout = 5 * time.Second

// slotList is what one listing of the slot bucket found.
type slotList struct {
	held  map[string]bool // the keys (<group>.<rank>) held
	other map[string]bool // the groups with a rank held by a worker of another kind than the claimant's
}

// listSlots reads the slots held, all of them or, for a worker bound to a
// group, that group's, through one watch of the bucket (its consumer's
// deliveries, not one request per key).
func listSlots(ctx context.Context, kv jetstream.KeyValue, cfg SlotConfig) (slotList, error) {
	ctx, cancel := context.WithTimeout(ctx, slotListTimeout)
	defer cancel()
	keys := jetstream.AllKeys
	if cfg.Group != "" {
		keys = cfg.Group + ".*"
	}
	w, err := kv.Watch(ctx, keys, jetstream.IgnoreDeletes())
	if err != nil {
		return slotList{}, err
	}
	defer func() { _ = w.Stop() }()
	list := slotList{held: map[string]bool{}, other: map[string]bool{}}
	for {
		select {
		case <-ctx.Done():
			return slotList{}, ctx.Err()
		case e, ok := <-w.Updates():
			if !ok {
				return slotList{}, errors.New("the watch ended before every slot was read")
			}
			if e == nil { // every key seen
				return list, nil
			}
			list.held[e.Key()] = true
			if group, _, ok := strings.Cut(e.Key(), "."); ok && !parseSlotKind(e.Value()).joins(cfg.kind()) {
				list.other[group] = true
			}
		}
	}
}

// slotKind is what a slot's holder serves: its model and its group's size
// (--tp-size). Workers of two kinds in one group make a group that takes no
// request (two models) or whose ranks disagree on its world size.
type slotKind struct {
	model string
	size  int
}

// slotToken is what a slot's key holds: owner#claim#model#size. The owner
// (a host name) and the claim (a nuid) hold no '#'; the model may.
func slotToken(owner, claim string, k slotKind) string {
	return owner + "#" + claim + "#" + k.model + "#" + strconv.Itoa(k.size)
}

// parseSlotKind reads a slot's token (slotToken; owner#claim#model in a
// token of an older kvbus, owner#claim in an older one still: "" and 0 are
// any). The size is after the last '#', since the model may hold some: a
// model a#b was read as model a of any size.
func parseSlotKind(token []byte) slotKind {
	parts := strings.SplitN(string(token), "#", 3)
	if len(parts) < 3 {
		return slotKind{}
	}
	k := slotKind{model: parts[2]}
	if i := strings.LastIndexByte(k.model, '#'); i >= 0 {
		if n, err := strconv.Atoi(k.model[i+1:]); err == nil {
			k.model, k.size = k.model[:i], n
		}
	}
	return k
}

// kind is what a worker of c serves.
func (c SlotConfig) kind() slotKind { return slotKind{c.Model, c.Size} }

// joins reports whether workers of kinds k and o may share a group (""
// and 0 are any).
func (k slotKind) joins(o slotKind) bool {
	return (k.model == o.model || k.model == "" || o.model == "") && (k.size == o.size || k.size == 0 || o.size == 0)
}

// holderKind is the kind of the worker holding key, if it can be read.
func holderKind(ctx context.Context, kv jetstream.KeyValue, key string) (slotKind, bool) {
	e, err := kv.Get(ctx, key)
	if err != nil {
		return slotKind{}, false
	}
	return parseSlotKind(e.Value()), true
}

// heldByAnotherKind reports whether a rank of group other than rank is
// held by a worker of another model or --tp-size than cfg's (ranks past
// cfg.Size included: a group of a larger size).
func heldByAnotherKind(ctx context.Context, kv jetstream.KeyValue, group string, rank int, cfg SlotConfig) bool {
	lister, err := kv.ListKeysFiltered(ctx, group+".*")
	if err != nil {
		return false // cannot say: the regroup and the schedulers catch a mixed group
	}
	defer func() { _ = lister.Stop() }()
	for key := range lister.Keys() {
		if key == fmt.Sprintf("%s.%d", group, rank) {
			continue
		}
		if k, ok := holderKind(ctx, kv, key); ok && !k.joins(cfg.kind()) {
			return true
		}
	}
	return false
}

// openSlotBucket returns the slot bucket, creating it when missing.
func openSlotBucket(ctx context.Context, js jetstream.JetStream, cfg SlotConfig) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, cfg.Bucket)
	if err == nil {
		return kv, nil
	}
	kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket: cfg.Bucket, Description: "kvbus worker slots: <group>.<rank> → the worker holding it",
		TTL: cfg.TTL, History: 1, Storage: jetstream.MemoryStorage, Replicas: max(cfg.Replicas, 1),
	})
	if errors.Is(err, jetstream.ErrBucketExists) {
		kv, err = js.KeyValue(ctx, cfg.Bucket)
	}
	return kv, err
}

// Hold refreshes the claim every third of the TTL until ctx ends (of the
// bucket's TTL when that is shorter: the worker that created the bucket set
// it). It returns an error if the claim was lost (another worker holds the
// slot): the worker must stop. A claim the bucket forgot — the bucket lives
// in the NATS server's memory, so a restarted server has none, or a new
// one another worker made — is made again.
//
// It returns ErrRegrouped when it moved the slot to another group to make
// a whole one (see regroup): Group and Rank then name the new slot, which
// it holds, and the worker must serve it as a new rank.
func (s *Slot) Hold(ctx context.Context) error {
	t := time.NewTicker(s.refreshEvery(ctx))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		err := s.refresh(ctx)
		switch {
		case err == nil:
			if s.regroup(ctx) {
				return ErrRegrouped
			}
		case errors.Is(err, errSlotLost):
			return err
		case ctx.Err() != nil:
			return nil
		default:
			s.cfg.Logger.Warn("cannot refresh the worker slot; retrying", "slot", s.key, "err", err)
		}
	}
}

// ErrRegrouped is returned by Hold when it moved the slot to another group.
var ErrRegrouped = errors.New("workers: slot moved to another group")

// regroup moves the slot to another group when that helps make whole
// groups: compose removes the workers it scales down by container number,
// not by group, so "--scale worker=8 → 4" can leave two groups with two or
// three ranks each, neither able to serve. A worker of an incomplete group
// moves to the incomplete group with more holders (ties: the lower group)
// once it has seen that twice in a row (a crashed worker's slot is free
// only until it is back). Every move makes the larger group larger, so the
// workers settle with at most one incomplete group. The new slot is
// claimed before the old one is released.
func (s *Slot) regroup(ctx context.Context) bool {
	if time.Now().Before(s.settle) {
		s.misplaced = 0
		return false
	}
	target, ok := s.regroupTarget(ctx)
	if !ok {
		s.misplaced = 0
		return false
	}
	if s.misplaced++; s.misplaced < 2 {
		return false
	}
	s.misplaced = 0
	for r := range s.cfg.Size {
		key := fmt.Sprintf("%s.%d", target, r)
		rev, err := s.kv.Create(ctx, key, []byte(s.token))
		if err != nil {
			continue // held (or the bucket cannot say): the next rank
		}
		if err := s.kv.Delete(ctx, s.key, jetstream.LastRevision(s.rev)); err != nil {
			s.cfg.Logger.Warn("cannot release the old worker slot; it expires after --slot-ttl", "slot", s.key, "err", err)
		}
		s.cfg.Logger.Info("moved to another worker slot to make a whole group", "from", s.key, "group", target, "tp_rank", r)
		s.Group, s.Rank, s.key, s.rev = target, r, key, rev
		return true
	}
	return false
}

// regroupTarget is the group this slot should move to, if any.
func (s *Slot) regroupTarget(ctx context.Context) (string, bool) {
	if s.cfg.Group != "" { // bound to its group
		return "", false
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.TTL/3)
	defer cancel()
	// A worker of a whole group never moves: it reads its own group's
	// slots, and the whole bucket only when one is free. Every worker
	// listing every slot at every refresh cost O(workers²) messages per
	// refresh round (706 a second for 48 idle workers).
	if s.groupWhole(ctx) {
		return "", false
	}
	w, err := s.kv.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return "", false
	}
	defer func() { _ = w.Stop() }()
	held := map[string]int{}
	other := map[string]bool{} // groups with a holder of another kind
	for listed := false; !listed; {
		select {
		case <-ctx.Done():
			return "", false
		case e, ok := <-w.Updates():
			if !ok {
				return "", false
			}
			if listed = e == nil; listed { // every key seen
				break
			}
			group, rank, ok := strings.Cut(e.Key(), ".")
			if n, err := strconv.Atoi(rank); ok && err == nil && n >= 0 && n < s.cfg.Size {
				held[group]++
				if !parseSlotKind(e.Value()).joins(s.cfg.kind()) {
					other[group] = true
				}
			}
		}
	}
	for group := range other {
		if group != s.Group {
			delete(held, group) // never a target
		}
	}
	mine := held[s.Group]
	if mine >= s.cfg.Size {
		return "", false
	}
	best, bestN := "", mine
	for group, n := range held {
		if group == s.Group || n >= s.cfg.Size {
			continue
		}
		tie := best
		if tie == "" {
			tie = s.Group // a group as held as this one wins if it is lower
		}
		if n > bestN || n == bestN && groupBefore(group, tie, s.cfg.GroupPrefix) {
			best, bestN = group, n
		}
	}
	return best, best != ""
}

// groupWhole reports whether every rank of the slot's group is held (by a
// worker of any kind, as regroupTarget counts them), or the bucket cannot
// say: either way the slot stays where it is.
func (s *Slot) groupWhole(ctx context.Context) bool {
	for r := range s.cfg.Size {
		if r == s.Rank {
			continue // just refreshed
		}
		_, err := s.kv.Get(ctx, fmt.Sprintf("%s.%d", s.Group, r))
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return false
		}
		if err != nil {
			return true // cannot say: no move
		}
	}
	return true
}

// groupBefore orders group names by their number (g2 before g10).
func groupBefore(a, b, prefix string) bool {
	na, ea := strconv.Atoi(strings.TrimPrefix(a, prefix))
	nb, eb := strconv.Atoi(strings.TrimPrefix(b, prefix))
	if ea != nil || eb != nil {
		return a < b
	}
	return na < nb
}

// errSlotLost: another worker holds the slot.
var errSlotLost = errors.New("workers: lost slot")

// refreshEvery is a third of the shorter of the worker's TTL and the
// bucket's.
func (s *Slot) refreshEvery(ctx context.Context) time.Duration {
	ttl := s.cfg.TTL
	if st, err := s.kv.Status(ctx); err == nil && st.TTL() > 0 && st.TTL() < ttl {
		s.cfg.Logger.Warn("the worker slot bucket expires claims sooner than --slot-ttl (another worker created it with its own): refreshing at the bucket's pace",
			"slot", s.key, "bucket_ttl", st.TTL(), "slot_ttl", ttl)
		ttl = st.TTL()
	}
	return max(ttl/3, time.Millisecond)
}

// refresh renews the claim, or makes it again where the bucket no longer
// has it. Each step's calls to the server have a third of the TTL.
func (s *Slot) refresh(parent context.Context) error {
	uctx, ucancel := context.WithTimeout(parent, s.cfg.TTL/3)
	rev, err := s.kv.Update(uctx, s.key, []byte(s.token), s.rev)
	ucancel()
	switch {
	case err == nil:
		s.rev = rev
		return nil
	case errors.Is(err, jetstream.ErrKeyExists), errors.Is(err, jetstream.ErrKeyRevisionMismatch):
	default:
		if err := s.remakeBucket(parent, err); err != nil {
			return err
		}
	}
	rctx, rcancel := context.WithTimeout(parent, s.cfg.TTL/3)
	defer rcancel()
	return s.reclaim(rctx)
}

// remakeBucket makes the bucket again when it is gone (a NATS server
// restarted without it), else returns updateErr: an update of a missing
// stream's subject may only time out.
func (s *Slot) remakeBucket(parent context.Context, updateErr error) error {
	ctx, cancel := context.WithTimeout(parent, s.cfg.TTL/3)
	defer cancel()
	if _, err := s.js.KeyValue(ctx, s.cfg.Bucket); !errors.Is(err, jetstream.ErrBucketNotFound) {
		return updateErr
	}
	kv, err := openSlotBucket(ctx, s.js, s.cfg)
	if err != nil {
		return fmt.Errorf("%w (and the bucket cannot be made again: %w)", updateErr, err)
	}
	s.kv = kv
	return nil
}

// reclaim looks at a key not at the claim's revision: still ours (adopt
// its revision), forgotten (create it again) or another worker's (lost).
func (s *Slot) reclaim(ctx context.Context) error {
	e, err := s.kv.Get(ctx, s.key)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound), errors.Is(err, jetstream.ErrKeyDeleted):
		rev, err := s.kv.Create(ctx, s.key, []byte(s.token))
		if errors.Is(err, jetstream.ErrKeyExists) {
			return fmt.Errorf("%w %s to another worker", errSlotLost, s.key)
		}
		if err != nil {
			return err
		}
		s.rev = rev
		// Every holder refreshes within TTL/3, its update timing out
		// first within another TTL/3: a TTL from now, all are back.
		s.settle = time.Now().Add(s.cfg.TTL)
		s.cfg.Logger.Info("claimed the worker slot again: the bucket had forgotten it (a NATS restart, or the slot expired while this worker could not refresh it: cut off from NATS for longer than --slot-ttl)", "slot", s.key)
		return nil
	case err != nil:
		return err
	case string(e.Value()) == s.token:
		s.rev = e.Revision()
		return nil
	}
	return fmt.Errorf("%w %s to another worker (%s)", errSlotLost, s.key, e.Value())
}

// Release frees the slot for the next worker.
func (s *Slot) Release(ctx context.Context) error {
	return s.kv.Delete(ctx, s.key, jetstream.LastRevision(s.rev))
}
