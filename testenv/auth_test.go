package testenv_test

import (
	"bytes"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

// TestPipelineWithKeys runs the whole pipeline with one key per role and
// the generated subject permissions: conversations keep their cache, a
// group that loses a rank is routed around, and an admin key captures the
// request log and replays it. No role logs a permissions violation: each
// has every subject it uses, and (TestPermissionMatrix) nothing more.
func TestPipelineWithKeys(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Ranks: 2, AuthDir: dir})
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	for conv := range 2 {
		turns, err := testenv.Conversation{BaseURL: c.URL, Client: client, Model: c.Model, Seed: 900 + conv,
			Headers: map[string]string{"X-Session-ID": fmt.Sprint("keys-", conv)}}.Run(t.Context(), 3)
		if err != nil {
			t.Fatal(err)
		}
		for i, share := range testenv.PreviousShares(turns, 16) {
			if share < 0.95 {
				t.Errorf("conversation %d turn %d: %.2f of the previous prompt cached, want >= 0.95", conv, i+2, share)
			}
		}
	}

	// Capture the request log and replay it, as an operator with the admin key.
	admin, err := c.Cluster.Connect("admin-capture")
	if err != nil {
		t.Fatal(err)
	}
	var capture bytes.Buffer
	n, err := replay.Capture(t.Context(), replay.CaptureConfig{Conn: admin}, &capture)
	if err != nil || n != 6 {
		t.Fatalf("captured %d requests (%v), want 6", n, err)
	}
	tr, err := replay.ReadTrace(&capture, replay.FormatCapture)
	if err != nil {
		t.Fatal(err)
	}
	r, err := replay.New(replay.Config{Target: c.NATSURL, Conn: admin, Model: c.Model, Timeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	results, _, err := r.Run(t.Context(), tr.Items)
	if err != nil {
		t.Fatal(err)
	}
	for i, res := range results {
		if res.Err != "" {
			t.Errorf("replayed request %d: %s", i, res.Err)
		}
	}

	// A rank dies: its group leaves placement and requests go to the other.
	c.KillRank(t, "g0", 1)
	testenv.Eventually(t, 10*time.Second, "requests served without g0", func() bool {
		status, _, _ := testenv.Send(t, "POST", c.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"after the kill","max_tokens":2}`, c.Model), nil)
		return status == http.StatusOK && len(c.Scheduler.PlaceableGroups(time.Now())) == 1
	})
	if lines := c.Logs.Lines("permissions violation"); len(lines) > 0 {
		t.Errorf("a role used a subject its key may not:\n%v", lines)
	}
}
