package workers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

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
	// Size is the ranks per group (the TP size).
	Size int
	// MaxGroups bounds the groups tried (default messages.MaxGroups, as
	// many as a scheduler's KV index tracks).
	MaxGroups int
	// TTL is how long a claim lives without a refresh (default 10 s); the
	// holder refreshes it every TTL/3.
	TTL time.Duration
	// Owner identifies the claimant (its host name, say).
	Owner    string
	Replicas int
	Logger   *slog.Logger
}

// Slot is a claimed (group, rank). Keep it with Hold; Release frees it.
type Slot struct {
	Group string
	Rank  int
	kv    jetstream.KeyValue
	key   string
	rev   uint64
	cfg   SlotConfig
}

// ClaimSlot claims the first free slot, groups in order and ranks in order
// within a group, with a compare-and-set create: two workers never hold one
// slot. A slot whose holder stopped refreshing it expires after the TTL and
// is claimed by the next worker.
func ClaimSlot(ctx context.Context, js jetstream.JetStream, cfg SlotConfig) (*Slot, error) {
	if cfg.GroupPrefix == "" {
		cfg.GroupPrefix = "g"
	}
	if cfg.MaxGroups <= 0 {
		cfg.MaxGroups = messages.MaxGroups
	}
	if cfg.TTL <= 0 {
		cfg.TTL = 10 * time.Second
	}
	if cfg.Bucket == "" {
		cfg.Bucket = SlotBucket
	}
	if cfg.Size < 1 {
		return nil, fmt.Errorf("%w: --tp-size must be at least 1", ErrConfig)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	kv, err := bus.Retry(ctx, func(ctx context.Context) (jetstream.KeyValue, error) {
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
	})
	if err != nil {
		return nil, fmt.Errorf("workers: slot bucket %s: %w", cfg.Bucket, err)
	}
	for g := range cfg.MaxGroups {
		group := fmt.Sprintf("%s%d", cfg.GroupPrefix, g)
		for r := range cfg.Size {
			key := fmt.Sprintf("%s.%d", group, r)
			rev, err := kv.Create(ctx, key, []byte(cfg.Owner))
			if errors.Is(err, jetstream.ErrKeyExists) {
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("workers: claim slot %s: %w", key, err)
			}
			cfg.Logger.Info("claimed a worker slot", "group", group, "tp_rank", r, "owner", cfg.Owner)
			return &Slot{Group: group, Rank: r, kv: kv, key: key, rev: rev, cfg: cfg}, nil
		}
	}
	return nil, fmt.Errorf("%w in %d groups of %d", ErrNoSlot, cfg.MaxGroups, cfg.Size)
}

// Hold refreshes the claim every TTL/3 until ctx ends. It returns an error
// if the claim was lost (someone else holds the slot): the worker must stop.
func (s *Slot) Hold(ctx context.Context) error {
	t := time.NewTicker(s.cfg.TTL / 3)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, s.cfg.TTL/3)
		rev, err := s.kv.Update(rctx, s.key, []byte(s.cfg.Owner), s.rev)
		cancel()
		switch {
		case err == nil:
			s.rev = rev
		case errors.Is(err, jetstream.ErrKeyExists), errors.Is(err, jetstream.ErrKeyRevisionMismatch):
			return fmt.Errorf("workers: lost slot %s to another worker", s.key)
		case ctx.Err() != nil:
			return nil
		default:
			s.cfg.Logger.Warn("cannot refresh the worker slot; retrying", "slot", s.key, "err", err)
		}
	}
}

// Release frees the slot for the next worker.
func (s *Slot) Release(ctx context.Context) error {
	return s.kv.Delete(ctx, s.key, jetstream.LastRevision(s.rev))
}
