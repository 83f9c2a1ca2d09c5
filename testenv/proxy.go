package testenv

import (
	"bytes"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// FaultProxy forwards TCP connections on a loopback port to a target (a
// NATS server) and breaks them on demand, as a network or a host does:
// Silence makes the connections open at that moment drop every byte, both
// ways, with their sockets kept open (a host that stopped or was cut off);
// Swallow drops only what their clients send, keeping a copy (the bytes a
// process wrote just before its server stopped, which the server never
// read); Hold keeps every byte, both ways, until Release delivers it (a
// process paused with SIGSTOP: its server queues what it sends it, and
// what the process wrote just before goes out when it wakes); Cut closes
// them. Connections made later are forwarded whole.
// Its methods are safe for concurrent use; the proxy closes with the test.
type FaultProxy struct {
	ln      net.Listener
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []*faultConn
	dropped atomic.Int64
}

// faultConn is one forwarded connection.
type faultConn struct {
	client, server net.Conn
	// silent drops both ways; swallowing drops what the client sends
	// and keeps it in swallowed (under mu).
	silent, swallowing atomic.Bool
	mu                 sync.Mutex
	swallowed          bytes.Buffer
	// held, under mu, keeps what each way carries (toClient, toServer)
	// until Release.
	held               bool
	toClient, toServer bytes.Buffer
}

// StartFaultProxy listens on a free loopback port and forwards every
// connection to target (host:port) until the test ends.
func StartFaultProxy(t testing.TB, target string) *FaultProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &FaultProxy{ln: ln}
	t.Cleanup(func() {
		ln.Close()
		p.Cut()
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
			c := &faultConn{client: client, server: server}
			p.mu.Lock()
			p.conns = append(p.conns, c)
			p.mu.Unlock()
			p.wg.Go(func() { p.forward(c, server, client, true) })
			p.wg.Go(func() { p.forward(c, client, server, false) })
		}
	})
	return p
}

// forward copies src to dst until either closes, dropping what c carries
// once it is silent, or what its client sends (fromClient) once it
// swallows.
func (p *FaultProxy) forward(c *faultConn, dst, src net.Conn, fromClient bool) {
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			switch {
			case c.silent.Load():
				p.dropped.Add(int64(n))
			case fromClient && c.swallowing.Load():
				p.dropped.Add(int64(n))
				c.mu.Lock()
				c.swallowed.Write(buf[:n])
				c.mu.Unlock()
			default:
				// Written outside mu, so that one way blocked on its reader
				// does not stop the other; this goroutine is the way's only
				// writer but for Release, which writes only what it held.
				c.mu.Lock()
				held := c.held
				switch {
				case held && fromClient:
					c.toServer.Write(buf[:n])
				case held:
					c.toClient.Write(buf[:n])
				}
				c.mu.Unlock()
				if !held {
					if _, werr := dst.Write(buf[:n]); werr != nil {
						return
					}
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// URL is the proxy's address as a NATS URL.
func (p *FaultProxy) URL() string { return "nats://" + p.ln.Addr().String() }

// Silence makes the open connections drop every byte, both ways.
func (p *FaultProxy) Silence() {
	p.each(func(c *faultConn) { c.silent.Store(true) })
}

// Swallow makes the open connections drop what their clients send, and
// keep it (Swallowed).
func (p *FaultProxy) Swallow() {
	p.each(func(c *faultConn) { c.swallowing.Store(true) })
}

// Hold makes the open connections keep what they carry, both ways, until
// Release.
func (p *FaultProxy) Hold() {
	p.each(func(c *faultConn) {
		c.mu.Lock()
		c.held = true
		c.mu.Unlock()
	})
}

// Release delivers what the connections held, in order, and forwards
// again.
func (p *FaultProxy) Release() {
	p.each(func(c *faultConn) {
		c.mu.Lock()
		defer c.mu.Unlock()
		_, _ = c.server.Write(c.toServer.Bytes())
		_, _ = c.client.Write(c.toClient.Bytes())
		c.toServer.Reset()
		c.toClient.Reset()
		c.held = false
	})
}

// Dropped is the number of bytes the connections dropped.
func (p *FaultProxy) Dropped() int64 { return p.dropped.Load() }

// Swallowed is what the connections' clients sent while they swallowed.
func (p *FaultProxy) Swallowed() string {
	var b bytes.Buffer
	p.each(func(c *faultConn) {
		c.mu.Lock()
		b.Write(c.swallowed.Bytes())
		c.mu.Unlock()
	})
	return b.String()
}

// Cut closes the open connections and forgets them.
func (p *FaultProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.client.Close()
		c.server.Close()
	}
	p.conns = nil
}

func (p *FaultProxy) each(f func(*faultConn)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		f(c)
	}
}
