package bus

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/nats-io/nats.go"
)

// TestBrokenConnectionIsNoError: a reconnect's handshake cut off by a
// server going away (what nats.go reports as an async error while kvbus
// nats restarts) is told apart from a real error, which workers logged at
// ERROR as "nats async error … broken pipe" at every restart of the server.
func TestBrokenConnectionIsNoError(t *testing.T) {
	for _, tc := range []struct {
		err    error
		broken bool
	}{
		{&net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", syscall.EPIPE)}, true},
		{&net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ECONNRESET)}, true},
		{io.EOF, true},
		{net.ErrClosed, true},
		{nats.ErrSlowConsumer, false},
		{nats.ErrBadHeaderMsg, false},
		{errors.New("nats: maximum control line exceeded"), false},
	} {
		if got := brokenConnection(tc.err); got != tc.broken {
			t.Errorf("brokenConnection(%v) = %v, want %v", tc.err, got, tc.broken)
		}
	}
}
