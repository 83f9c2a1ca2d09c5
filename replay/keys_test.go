package replay_test

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

// TestReplayOntoTheBusNeedsTheAdminKey: with keys on the bus, a replay
// onto it with a role's key says which key it needs at once; it waited
// until --timeout (10 min by default), warning that no scheduler was ready.
// Its errors never show the URL's password.
func TestReplayOntoTheBusNeedsTheAdminKey(t *testing.T) {
	srv, dir := testenv.StartKeyedNATS(t)
	// The observer key reads every kvbus subject, the answers too, but
	// may neither publish a request nor read the log's acknowledgements:
	// with it the replay waited until --timeout too, silently.
	for _, key := range []string{"worker.nk", "observer.nk"} {
		nc, err := bus.Connect(t.Context(), bus.Config{URL: srv.ClientURL(), NKeySeedFile: filepath.Join(dir, key)})
		if err != nil {
			t.Fatal(err)
		}
		r, err := replay.New(replay.Config{Target: srv.ClientURL(), Conn: nc, Timeout: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		items := []replay.Item{{SessionID: "s", Prompt: testenv.PromptTokens(1, 32), OutputTokens: 1}}
		_, _, err = r.Run(ctx, items)
		if err == nil || !strings.Contains(err.Error(), "admin key") || ctx.Err() != nil {
			t.Errorf("replay with %s: %v (context %v); want an error naming the admin key, at once", key, err, ctx.Err())
		}
		cancel()
		nc.Close()
	}

	_, err := replay.New(replay.Config{Target: "nats://alice:s3cret@127.0.0.1:1%zz"})
	if err == nil || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("a --target that is no URL: %v; want an error without its password", err)
	}
}
