package bus_test

import (
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/testenv"
)

// silentProxy forwards TCP connections to a server. silence makes the
// connections open at that moment drop every byte, both ways, and keep
// their sockets open: what a client sees of a server whose host stopped or
// was cut off. Connections made later are forwarded.
type silentProxy struct {
	ln      net.Listener
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []*silencedConn
	dropped atomic.Int64 // bytes dropped
}

type silencedConn struct {
	client, server net.Conn
	silent         atomic.Bool
}

func startSilentProxy(t *testing.T, target string) *silentProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &silentProxy{ln: ln}
	t.Cleanup(func() {
		ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.client.Close()
			c.server.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	p.wg.Go(func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", target)
			if err != nil {
				client.Close()
				continue
			}
			c := &silencedConn{client: client, server: server}
			p.mu.Lock()
			p.conns = append(p.conns, c)
			p.mu.Unlock()
			p.wg.Go(func() { p.copy(c, server, client) })
			p.wg.Go(func() { p.copy(c, client, server) })
		}
	})
	return p
}

// copy forwards from src to dst until either closes, dropping what c
// carries once it is silent.
func (p *silentProxy) copy(c *silencedConn, dst, src net.Conn) {
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if c.silent.Load() {
				p.dropped.Add(int64(n))
			} else if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *silentProxy) url() string { return "nats://" + p.ln.Addr().String() }

// silence makes the open connections drop everything.
func (p *silentProxy) silence() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.silent.Store(true)
	}
}

// TestSilentServerIsLeftAfterThreePings: a server that stops answering
// without closing its socket is taken for dead after the pings go
// unanswered, and the role reconnects (here through the proxy again, to a
// server that answers), where nats.go's default waited 4 to 6 minutes. A
// connection pinging once a minute, silenced alike, is still connected:
// the pings, not the fault alone, found the silence.
func TestSilentServerIsLeftAfterThreePings(t *testing.T) {
	srv := startServer(t, "")
	proxy := startSilentProxy(t, strings.TrimPrefix(srv.ClientURL(), "nats://"))
	const ping = 100 * time.Millisecond
	nc, err := bus.Connect(t.Context(), bus.Config{URL: proxy.url(), Name: "pinging", PingInterval: ping})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	slow, err := bus.Connect(t.Context(), bus.Config{URL: proxy.url(), Name: "slow", PingInterval: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()

	proxy.silence()
	silenced := time.Now()
	testenv.Eventually(t, 5*time.Second, "the silenced connection reconnected", func() bool {
		return nc.Stats().Reconnects == 1 && nc.IsConnected()
	})
	took := time.Since(silenced)
	// Stale after MaxPingsOutstanding+1 unanswered pings; the first of them
	// goes out up to one interval after the silence.
	if took < bus.MaxPingsOutstanding*ping || took > 4*time.Second {
		t.Errorf("reconnected %v after the silence; want after about %v", took, (bus.MaxPingsOutstanding+1)*ping)
	}
	if proxy.dropped.Load() == 0 {
		t.Fatal("the proxy dropped nothing: the silence did not take effect")
	}
	if slow.Stats().Reconnects != 0 || !slow.IsConnected() {
		t.Errorf("the connection pinging once a minute reconnected too (%d): something other than the pings broke the silenced connections", slow.Stats().Reconnects)
	}
	// The new connection carries messages.
	sub, err := nc.SubscribeSync("after")
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish("after", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := sub.NextMsg(2 * time.Second); err != nil {
		t.Fatalf("no message over the new connection: %v", err)
	}
}
