package testenv

import (
	"context"
	"testing"

	"github.com/kvbus/kvbus/top"
)

// StartTop runs a kvbus top watcher on its own connection to the cluster
// (the observer key when the cluster has keys, as an operator runs it) and
// returns it once it is subscribed; it stops when the test ends, failing it
// if it ended in an error.
func (c *Cluster) StartTop(t testing.TB) *top.Watcher {
	t.Helper()
	nc, err := c.Cluster.Connect("kvbus-observer-top")
	if err != nil {
		t.Fatal(err)
	}
	w, err := top.New(top.Config{Conn: nc})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	select {
	case <-w.Subscribed():
	case err := <-done:
		cancel()
		t.Fatalf("kvbus top: %v", err)
	}
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("kvbus top: %v", err)
		}
	})
	return w
}
