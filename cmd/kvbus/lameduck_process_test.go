package main

import (
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/testenv"
)

// TestNATSLameDuckOnSIGUSR2: two clustered `kvbus nats` processes; SIGUSR2
// to the one a client is connected to enters lame duck mode, as
// nats-server's does: the client is told (nats.go's lame duck handler),
// is moved to the other server, and the process exits 0 once the mode's
// duration is over, saying so. SIGTERM still stops a server at once.
func TestNATSLameDuckOnSIGUSR2(t *testing.T) {
	dir := t.TempDir()
	bin := buildBinary(t, dir)
	clientA, clientB := freeAddr(t), freeAddr(t)
	routeA, routeB := freeAddr(t), freeAddr(t)
	a := startProc(t, bin, dir, "nats-a", "nats", "--addr", clientA, "--server-name", "a", "--data-dir", t.TempDir(),
		"--cluster-addr", routeA, "--routes", "nats://"+routeB, "--lame-duck-duration", "3s", "--lame-duck-grace-period", "1s")
	b := startProc(t, bin, dir, "nats-b", "nats", "--addr", clientB, "--server-name", "b", "--data-dir", t.TempDir(),
		"--cluster-addr", routeB, "--routes", "nats://"+routeA)
	var told atomic.Bool
	var nc *nats.Conn
	testenv.Eventually(t, 20*time.Second, "a client connected to server a", func() bool {
		c, err := nats.Connect("nats://"+clientA, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond),
			nats.LameDuckModeHandler(func(*nats.Conn) { told.Store(true) }))
		if err != nil {
			return false
		}
		nc = c
		return true
	})
	defer nc.Close()
	testenv.Eventually(t, 20*time.Second, "the client to learn of server b", func() bool {
		return len(nc.DiscoveredServers()) > 0
	})

	testenv.Eventually(t, 20*time.Second, "server a's ready line", func() bool {
		logs, _ := os.ReadFile(a.log)
		return strings.Contains(string(logs), "nats server ready")
	})
	start := time.Now()
	a.signal(t, syscall.SIGUSR2)
	testenv.Eventually(t, 10*time.Second, "the client told of lame duck mode", told.Load)
	testenv.Eventually(t, 10*time.Second, "the client moved to server b", func() bool {
		return nc.IsConnected() && strings.Contains(nc.ConnectedUrl(), clientB)
	})
	code, ok := a.exitWithin(15 * time.Second)
	if !ok || code != 0 {
		t.Fatalf("server a after SIGUSR2: exited %v, code %d; want 0", ok, code)
	}
	if took := time.Since(start); took < time.Second {
		t.Errorf("lame duck mode took %v; want about --lame-duck-duration (3s)", took)
	}
	logs, _ := os.ReadFile(a.log)
	if !strings.Contains(string(logs), "entering lame duck mode") || !strings.Contains(string(logs), "stopped after lame duck mode") {
		t.Errorf("server a's log does not say it went through lame duck mode:\n%s", logs)
	}
	// The client goes on through server b.
	if err := nc.Publish("after", []byte("x")); err != nil || nc.Flush() != nil {
		t.Errorf("publish through server b: %v", err)
	}
	if err := b.stop(t); err != nil {
		t.Errorf("server b on SIGTERM: %v", err)
	}
}
