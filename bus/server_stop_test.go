package bus_test

import (
	"sync"
	"testing"
	"time"

	"github.com/kvbus/kvbus/bus"
)

// TestShutdownDuringLameDuck: kvbus nats stops in lame duck mode on SIGUSR2
// (LameDuck, in a goroutine) and a SIGTERM meanwhile cuts it short
// (Shutdown): the two stops run at once, and each stops the store's
// watcher. Both return, and neither closes the watcher's stop channel a
// second time (a panic) nor races on it.
func TestShutdownDuringLameDuck(t *testing.T) {
	for i := range 5 {
		srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", LameDuckDuration: 30 * time.Second, LameDuckGracePeriod: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		wg.Go(srv.LameDuck)
		if i%2 == 0 {
			time.Sleep(10 * time.Millisecond)
		}
		srv.Shutdown()
		wg.Wait()
	}
}
