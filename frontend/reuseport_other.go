//go:build !linux

package frontend

import (
	"fmt"
	"net"
)

// listenConfig is Listen's; reusePort (SO_REUSEPORT, --reuse-port) is
// supported on Linux only.
func listenConfig(reusePort bool) (net.ListenConfig, error) {
	if reusePort {
		return net.ListenConfig{}, fmt.Errorf("%w: --reuse-port needs Linux (SO_REUSEPORT as Linux gives it); leave it off here", ErrConfig)
	}
	return net.ListenConfig{}, nil
}
