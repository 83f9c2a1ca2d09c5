package cluster_test

import (
	"context"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/cluster"
	"github.com/kvbus/kvbus/internal/validatetest"
	"github.com/kvbus/kvbus/messages"
)

// TestConfigValidate: the zero Config (every field its default) and the
// shapes kvbus serve, kvbus bench and testenv start pass; each bad field is
// refused wrapping ErrConfig and naming its flag or field, and Start
// refuses it with Validate's error before it starts anything.
func TestConfigValidate(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	for _, tc := range []struct {
		name string
		cfg  cluster.Config
		want string // "" for valid
	}{
		{"zero", cluster.Config{}, ""},
		{"serve", cluster.Config{Subjects: messages.Subjects{Prefix: "other"}, Groups: 2, Ranks: 8, Model: "m", ModelProfile: "llama-3.1-70b", Schedulers: 3}, ""},
		{"tiny", cluster.Config{Groups: 1, Ranks: 1, ModelProfile: "tiny"}, ""},
		{"engines ignore groups and ranks", cluster.Config{Engines: make([]cluster.EngineBackend, 2), Groups: -1, Ranks: -1}, ""},

		{"negative groups", cluster.Config{Groups: -1}, "--groups"},
		{"negative ranks", cluster.Config{Ranks: -2}, "--ranks"},
		{"negative schedulers", cluster.Config{Schedulers: -1}, "Schedulers"},
		{"unknown profile", cluster.Config{ModelProfile: "llama-9"}, "--model-profile"},
		{"subject prefix", cluster.Config{Subjects: messages.Subjects{Prefix: "a.b"}}, "--subject-prefix"},
		// Refused by the schedulers too, but only once NATS and every rank
		// had started.
		{"unknown policy", cluster.Config{Policy: "sticky"}, "--policy"},
		{"epsilon", cluster.Config{Policy: "session", SessionEpsilon: new(-1.0)}, "--session-epsilon"},
		{"unknown pool", cluster.Config{Pool: "shared"}, "--pool"},
		{"policy and pool", cluster.Config{Policy: "least-loaded", Pool: "local"}, ""},
	} {
		err := tc.cfg.Validate()
		if !validatetest.Refused(t, tc.name, err, cluster.ErrConfig, tc.want) {
			continue
		}
		c, serr := cluster.Start(context.Background(), tc.cfg)
		if c != nil {
			c.Stop()
			_ = c.Wait()
		}
		validatetest.SameError(t, tc.name, "Start", serr, err)
	}
}
