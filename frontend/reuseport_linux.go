package frontend

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// listenConfig is Listen's: with reusePort, SO_REUSEPORT is set on the
// socket before it binds.
func listenConfig(reusePort bool) (net.ListenConfig, error) {
	if !reusePort {
		return net.ListenConfig{}, nil
	}
	return net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
		}); err != nil {
			return err
		}
		return serr
	}}, nil
}
