package testenv_test

import (
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestPlanStreamOutlivesANATSRestart: the plan stream (in memory) is lost
// when the NATS server restarts, even with its store on disk; the
// scheduler makes it again, and the plans of requests dispatched after the
// restart are kept in it for a replica that starts later. Before, nothing
// made it again until a scheduler restarted, and a lone replica that then
// died left its requests to their deadline.
func TestPlanStreamOutlivesANATSRestart(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	name := messages.Subjects{}.PlanStream()
	planStream := func() (*jetstream.StreamInfo, error) {
		js, err := jetstream.New(testenv.Connect(t, c.NATS))
		if err != nil {
			return nil, err
		}
		st, err := js.Stream(t.Context(), name)
		if err != nil {
			return nil, err
		}
		return st.Info(t.Context())
	}
	before, err := planStream()
	if err != nil {
		t.Fatalf("plan stream before the restart: %v", err)
	}
	if err := c.Cluster.RestartNATS(); err != nil {
		t.Fatal(err)
	}
	var after *jetstream.StreamInfo
	testenv.Eventually(t, 15*time.Second, "the plan stream made again after the NATS restart", func() bool {
		after, err = planStream()
		if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Logf("plan stream: %v", err)
		}
		return err == nil
	})
	if after.Created.Equal(before.Created) {
		t.Fatalf("the plan stream was created at %v before and after the restart: the restart did not lose it, and the test shows nothing", before.Created)
	}
	testenv.Eventually(t, 15*time.Second, "a request answered after the NATS restart", func() bool {
		status, _, _ := testenv.Send(t, http.MethodPost, c.URL+"/v1/chat/completions",
			fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"after the restart"}],"max_tokens":2}`, c.Model), nil)
		return status == http.StatusOK
	})
	testenv.Eventually(t, 5*time.Second, "its plan in the plan stream", func() bool {
		info, err := planStream()
		return err == nil && info.State.Msgs > 0
	})
}
