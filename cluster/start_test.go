package cluster_test

import (
	"context"
	"net"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvbus/kvbus/cluster"
)

// TestFailedStartLeavesNothing: a cluster whose NATS server cannot start
// (its port is taken) returns the error and leaves no goroutine behind,
// even under a context that never ends.
func TestFailedStartLeavesNothing(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	if c, err := cluster.Start(context.Background(), cluster.Config{NATSAddr: taken.Addr().String()}); err == nil {
		c.Stop()
		_ = c.Wait()
		t.Fatal("a cluster started on a taken NATS port")
	}
}
