package workers_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/internal/validatetest"
	"github.com/kvbus/kvbus/workers"
)

// TestMemStoreConfigValidate: a positive capacity with the default or
// either eviction policy passes; a capacity of zero or less, or another
// policy, is refused wrapping ErrConfig and naming the flag, and
// NewMemStore refuses it with Validate's error.
func TestMemStoreConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  workers.MemStoreConfig
		want string // "" for valid
	}{
		{"default policy", workers.MemStoreConfig{Capacity: 1}, ""},
		{"lru", workers.MemStoreConfig{Capacity: 1 << 30, Evict: workers.EvictLRU}, ""},
		{"session", workers.MemStoreConfig{Capacity: 1 << 30, Evict: workers.EvictSession,
			OnEvict: func(string, uint64, string) {}, EvictIdle: func(time.Duration) {}}, ""},

		{"zero", workers.MemStoreConfig{}, "--kv-capacity"},
		{"negative capacity", workers.MemStoreConfig{Capacity: -1}, "--kv-capacity"},
		{"unknown policy", workers.MemStoreConfig{Capacity: 1, Evict: "fifo"}, "--evict"},
	} {
		err := tc.cfg.Validate()
		if !validatetest.Refused(t, tc.name, err, workers.ErrConfig, tc.want) {
			continue
		}
		_, nerr := workers.NewMemStore(tc.cfg)
		validatetest.SameError(t, tc.name, "NewMemStore", nerr, err)
	}
}

// TestSlotConfigValidate: a config with a TP size and every other field
// zero (its default), or the one kvbus worker --rank auto makes, passes;
// each bad field is refused wrapping ErrConfig and naming its flag or
// field, and ClaimSlot refuses it with Validate's error before it asks
// JetStream anything (it is given none).
func TestSlotConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  workers.SlotConfig
		want string // "" for valid
	}{
		{"defaults", workers.SlotConfig{Size: 1}, ""},
		{"kvbus worker", workers.SlotConfig{Bucket: "KVBUS_RANKS_other-prefix", Group: "g7", Model: "org/m#v2", Size: 4, TTL: 10 * time.Second,
			Owner: "host-1", Replicas: 3}, ""},
		{"prefix and max groups", workers.SlotConfig{Size: 2, GroupPrefix: "dp_", MaxGroups: 4}, ""},
		{"longest prefix", workers.SlotConfig{Size: 2, GroupPrefix: strings.Repeat("p", 28)}, ""}, // p…p1023: 32 characters

		{"zero", workers.SlotConfig{}, "--tp-size"},
		{"negative size", workers.SlotConfig{Size: -1}, "--tp-size"},
		{"negative max groups", workers.SlotConfig{Size: 1, MaxGroups: -1}, "MaxGroups"},
		{"negative ttl", workers.SlotConfig{Size: 1, TTL: -time.Second}, "--slot-ttl"},
		{"negative replicas", workers.SlotConfig{Size: 1, Replicas: -1}, "--stream-replicas"},
		{"group with a dot", workers.SlotConfig{Size: 1, Group: "g.1"}, "--group"},
		{"group too long", workers.SlotConfig{Size: 1, Group: strings.Repeat("g", 33)}, "--group"},
		{"prefix with a space", workers.SlotConfig{Size: 1, GroupPrefix: "g "}, "GroupPrefix"},
		{"prefix too long", workers.SlotConfig{Size: 1, GroupPrefix: strings.Repeat("p", 29)}, "GroupPrefix"},
		{"bucket with a dot", workers.SlotConfig{Size: 1, Bucket: "KVBUS.RANKS"}, "bucket"},
	} {
		err := tc.cfg.Validate()
		if !validatetest.Refused(t, tc.name, err, workers.ErrConfig, tc.want) {
			continue
		}
		_, cerr := workers.ClaimSlot(t.Context(), nil, tc.cfg)
		validatetest.SameError(t, tc.name, "ClaimSlot", cerr, err)
	}
}
