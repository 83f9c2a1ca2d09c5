package testenv

import (
	"context"
	"testing"

	"github.com/kvbus/kvbus/top"
)

// StartTop runs a kvbus top watcher on its own connection to the cluster
// (named "top": the admin key when the cluster has keys) and returns it
// once it is subscribed; it stops when the test ends.
func (c *Cluster) StartTop(t testing.TB) *top.Watcher {
	t.Helper()
	nc, err := c.Cluster.Connect("top")
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
	t.Cleanup(func() { cancel(); <-done })
	<-w.Subscribed()
	return w
}
