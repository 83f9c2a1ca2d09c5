package vllmevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"

	"github.com/kvbus/kvbus/messages"
)

// handshakeTimeout bounds how long a new connection may take to complete
// its ZMTP handshake (a variable for tests).
var handshakeTimeout = 10 * time.Second

// zmtpGreetingBytes is the size of a ZMTP 3 greeting.
const zmtpGreetingBytes = 64

// go-zeromq runs a connection's ZMTP handshake synchronously, without
// deadlines and outside its socket's context: a peer that accepts TCP but
// never greets (a wrong port, a black-holed network) would hang Dial past
// the end of the context, and a client that connects to a binding socket
// and never greets would block its accept loop, and then leak it. The
// package's sockets therefore use these transports, registered with zmq4
// under their own names: their connections close when the socket's
// context ends, and must deliver their greeting within handshakeTimeout.
var (
	transports = map[string]string{"tcp": "vllmevents-tcp", "ipc": "vllmevents-ipc"}
	registerMu sync.Once
)

func registerTransports() {
	registerMu.Do(func() {
		for _, network := range []struct{ scheme, net string }{{"tcp", "tcp"}, {"ipc", "unix"}} {
			if err := zmq4.RegisterTransport(transports[network.scheme], ctxTransport{base: transport.New(network.net)}); err != nil {
				panic(err) // only a second registration could fail, which the Once prevents
			}
		}
	})
}

// zmqEndpoint maps an endpoint to the package's transports.
func zmqEndpoint(ep string) string {
	registerTransports()
	scheme, rest, _ := strings.Cut(ep, "://")
	return transports[scheme] + "://" + rest
}

type ctxTransport struct{ base transport.Transport }

func (t ctxTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.base.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return newCtxConn(ctx, c), nil
}

func (t ctxTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := t.base.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return ctxListener{Listener: l, ctx: ctx}, nil
}

func (t ctxTransport) Addr(ep string) (string, error) { return t.base.Addr(ep) }

type ctxListener struct {
	net.Listener
	ctx context.Context
}

func (l ctxListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		if l.ctx.Err() == nil {
			// go-zeromq retries at once; do not spin on a persistent error.
			time.Sleep(10 * time.Millisecond)
		}
		return nil, err
	}
	return newCtxConn(l.ctx, c), nil
}

// ctxConn closes when its context ends, and unless go-zeromq starts a
// read after the ZMTP handshake (greeting and READY command) within
// handshakeTimeout: go-zeromq does not close a connection whose handshake
// failed, and reads a connection it keeps at once and for its lifetime.
type ctxConn struct {
	net.Conn
	stop  func() bool // the context's AfterFunc
	timer *time.Timer
	done  atomic.Bool // the handshake is over and the connection kept

	// Owned by the reading goroutine.
	head   []byte // the first bytes read, up to the READY command's size
	got    int    // bytes read
	need   int    // handshake bytes, once known
	frames frameLimit
}

// zmtpHeadBytes holds a greeting and a command frame header of the long
// form: flags and an 8-byte size.
const zmtpHeadBytes = zmtpGreetingBytes + 9

func newCtxConn(ctx context.Context, c net.Conn) *ctxConn {
	cc := &ctxConn{Conn: c}
	_ = c.SetReadDeadline(time.Now().Add(handshakeTimeout))
	cc.stop = context.AfterFunc(ctx, func() { _ = c.Close() })
	cc.timer = time.AfterFunc(handshakeTimeout, func() {
		if !cc.done.Load() {
			cc.stop()
			_ = c.Close()
		}
	})
	return cc
}

func (c *ctxConn) Read(p []byte) (int, error) {
	if !c.done.Load() && c.need > 0 && c.got >= c.need {
		// A read after the handshake: the connection is in use.
		c.done.Store(true)
		c.timer.Stop()
		_ = c.Conn.SetReadDeadline(time.Time{})
	}
	n, err := c.Conn.Read(p)
	frames := p[:n] // what of it follows the handshake
	if !c.done.Load() {
		before := c.got
		c.track(p[:n])
		if c.need > zmtpGreetingBytes+9+maxCommandBytes {
			err = fmt.Errorf("vllmevents: a ZMTP handshake command of %d bytes, above %d: closing the connection", c.need-zmtpHeadBytes, maxCommandBytes)
		}
		frames = p[min(max(c.need-before, 0), n):n]
		if c.need == 0 {
			frames = nil
		}
		if err != nil {
			_ = c.Close() // the handshake failed
			return 0, err
		}
	}
	// The bytes go to go-zeromq only once their frame header was found
	// within the limit: it allocates whatever size a header names.
	if ferr := c.frames.feed(frames); ferr != nil {
		_ = c.Close()
		return 0, ferr
	}
	return n, err
}

// track counts handshake bytes and finds the READY command's size.
func (c *ctxConn) track(b []byte) {
	c.got += len(b)
	if len(c.head) < zmtpHeadBytes {
		c.head = append(c.head, b[:min(len(b), zmtpHeadBytes-len(c.head))]...)
	}
	if c.need > 0 || len(c.head) < zmtpGreetingBytes+2 {
		return
	}
	if flags := c.head[zmtpGreetingBytes]; flags&0x02 == 0 { // short frame
		c.need = zmtpGreetingBytes + 2 + int(c.head[zmtpGreetingBytes+1])
	} else if len(c.head) == zmtpHeadBytes {
		size := binary.BigEndian.Uint64(c.head[zmtpGreetingBytes+1:])
		c.need = zmtpHeadBytes + int(min(size, 1<<30))
	}
}

func (c *ctxConn) Close() error {
	c.stop()
	c.timer.Stop()
	return c.Conn.Close()
}

// maxCommandBytes bounds the READY command of a handshake (a socket type
// and an identity of at most 255 bytes).
const maxCommandBytes = 64 << 10

// maxZMTPMessageBytes bounds one message, all its frames: vLLM's topic,
// sequence number and a batch of KV events, which Decode takes up to
// messages.MaxMessageBytes.
const maxZMTPMessageBytes = messages.MaxMessageBytes + 64<<10

// frameLimit follows the ZMTP frames of a connection's stream (after its
// handshake) and refuses a frame or message above maxZMTPMessageBytes:
// go-zeromq allocates the size a frame's header names, and any peer of a
// binding socket could have it allocate up to 2^63 bytes, or send frames
// without end as one message. Owned by the reading goroutine.
type frameLimit struct {
	hdr  [9]byte // a frame's flags and size, as read so far
	hdrN int     // bytes of hdr read
	body uint64  // bytes of the current frame's body still to come
	msg  uint64  // bytes of the current message's frames
}

// ZMTP frame flags.
const (
	zmtpMore    = 0x01
	zmtpLong    = 0x02
	zmtpCommand = 0x04
)

// feed follows b, the next bytes of the stream.
func (f *frameLimit) feed(b []byte) error {
	for len(b) > 0 {
		if f.body > 0 {
			k := min(uint64(len(b)), f.body)
			f.body -= k
			b = b[k:]
			continue
		}
		f.hdr[f.hdrN] = b[0]
		f.hdrN++
		b = b[1:]
		flags := f.hdr[0]
		need := 2
		if flags&zmtpLong != 0 {
			need = 9
		}
		if f.hdrN < need {
			continue
		}
		size := uint64(f.hdr[1])
		if need == 9 {
			size = binary.BigEndian.Uint64(f.hdr[1:9])
		}
		f.hdrN = 0
		if flags&zmtpCommand != 0 { // a command (PING, PONG), no message's part
			if size > maxCommandBytes {
				return fmt.Errorf("vllmevents: a ZMTP command of %d bytes, above %d: closing the connection", size, maxCommandBytes)
			}
			f.body = size
			continue
		}
		if size > maxZMTPMessageBytes || f.msg+size > maxZMTPMessageBytes {
			return fmt.Errorf("vllmevents: a ZMTP message of more than %d bytes (a frame of %d after %d): closing the connection; a batch of KV events is at most %d",
				maxZMTPMessageBytes, size, f.msg, messages.MaxMessageBytes)
		}
		f.body = size
		if f.msg += size; flags&zmtpMore == 0 {
			f.msg = 0
		}
	}
	return nil
}
