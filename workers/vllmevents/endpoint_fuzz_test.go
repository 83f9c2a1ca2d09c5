package vllmevents

import (
	"net"
	"strconv"
	"strings"
	"testing"
)

// FuzzCheckEndpoint: CheckEndpoint reads --kv-events and
// --kv-events-replay. It never panics; what it accepts to connect to it
// accepts to bind too; and what it accepts is a transport of the package's
// with, over tcp, a port number (or * to bind).
func FuzzCheckEndpoint(f *testing.F) {
	for _, ep := range []string{
		"tcp://127.0.0.1:5557", "tcp://vllm-0.vllm:5557", "tcp://*:5557", "tcp://127.0.0.1:0", "ipc:///tmp/kv.sock",
		"", "127.0.0.1:5557", "udp://127.0.0.1:5557", "tcp://127.0.0.1", "ipc://", "tcp://[::1]:5557",
		"tcp://vllm-0:555x", "tcp://vllm-0:70000", "tcp://h:http", "tcp://*:*",
	} {
		f.Add(ep)
	}
	f.Fuzz(func(t *testing.T, ep string) {
		connectErr, bindErr := CheckEndpoint(ep, false), CheckEndpoint(ep, true)
		if connectErr == nil && bindErr != nil {
			t.Errorf("CheckEndpoint(%q): connect ok, bind %v", ep, bindErr)
		}
		if bindErr != nil {
			return
		}
		scheme, addr, _ := strings.Cut(ep, "://")
		if transports[scheme] == "" {
			t.Errorf("CheckEndpoint(%q) ok: transport %q is not the package's", ep, scheme)
		}
		if scheme != "tcp" {
			return
		}
		_, port, err := net.SplitHostPort(addr)
		if err != nil {
			t.Fatalf("CheckEndpoint(%q) ok: %v", ep, err)
		}
		if n, err := strconv.ParseUint(port, 10, 16); port != "*" && err != nil || connectErr == nil && n == 0 {
			t.Errorf("CheckEndpoint(%q) ok: port %q", ep, port)
		}
	})
}
