package cluster

import "testing"

// TestSessionEpsilonZeroIsAValue: `kvbus serve --policy session
// --session-epsilon 0` (and bench) runs with no slack, as `kvbus scheduler
// --session-epsilon 0` does; it ran with 0.25. Unset, it is 0.25.
func TestSessionEpsilonZeroIsAValue(t *testing.T) {
	zero := 0.0
	cfg := Config{Policy: "session", SessionEpsilon: &zero}
	cfg.defaults()
	if *cfg.SessionEpsilon != 0 {
		t.Errorf("--session-epsilon 0 became %g", *cfg.SessionEpsilon)
	}
	unset := Config{Policy: "session"}
	unset.defaults()
	if *unset.SessionEpsilon != 0.25 {
		t.Errorf("unset: %g, want 0.25", *unset.SessionEpsilon)
	}
}
