package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"

	"github.com/kvbus/kvbus/frontend"
)

// listener is one address a command listens on, and the flag that gives it.
type listener struct{ flag, addr string }

// distinctListeners refuses two of one process's listeners on the same
// port of overlapping hosts (the same host, or either unspecified), before
// any binds: kvbus nats with --monitor-addr equal to --addr waited 30 s for
// a client listener that could not bind, then asked whether the port was
// in use; kvbus serve with --http-addr equal to --nats-addr started every
// role before it said the address was taken, as if by another kvbus. An
// empty address, one that is no HOST:PORT (each role refuses it itself,
// naming its flag) and port 0 (a free port) are skipped.
func distinctListeners(ls ...listener) error {
	type hostPort struct{ host, port string }
	seen := make([]hostPort, len(ls))
	for i, l := range ls {
		h, p, err := net.SplitHostPort(l.addr)
		if l.addr == "" || err != nil || p == "0" || p == "" {
			continue
		}
		seen[i] = hostPort{h, p}
		for j := range i {
			o := seen[j]
			if o.port != p || !hostsOverlap(o.host, h) {
				continue
			}
			return fmt.Errorf("%s %s and %s %s are the same listen address: one process cannot listen there twice; give each its own port",
				ls[j].flag, ls[j].addr, l.flag, l.addr)
		}
	}
	return nil
}

// hostsOverlap reports whether listeners on hosts a and b of one port
// collide: the same host, or either is every address of the machine.
func hostsOverlap(a, b string) bool {
	unspecified := func(h string) bool {
		ip := net.ParseIP(h)
		return h == "" || ip != nil && ip.IsUnspecified()
	}
	return a == b || unspecified(a) || unspecified(b)
}

// portFree fails at once when the frontend's --http-addr is in use, as a
// scheduler's or a worker's --metrics-addr does: with NATS not up, the
// frontend said only "cannot connect to NATS" after 10 s, and the port
// was found taken once NATS was there. It listens and closes at once: the
// port is not held while the role connects (clients would wait on it
// unanswered); the frontend's own listen still reports a port taken since.
func portFree(ctx context.Context, addr string, reusePort bool) error {
	ln, err := frontend.Listen(ctx, addr, reusePort) // with --reuse-port, free for it
	if errors.Is(err, syscall.EADDRINUSE) || errors.Is(err, frontend.ErrConfig) {
		return err
	}
	if err != nil {
		return nil // a malformed address: the frontend's configuration names it
	}
	return ln.Close()
}
