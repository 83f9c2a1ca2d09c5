package main

import (
	"strings"
	"testing"
	"time"
)

// TestOneListenAddressTwiceIsRefused: two listeners of one command on the
// same address are refused at once, naming both flags. kvbus nats with
// --monitor-addr equal to --addr waited 30 s, then asked whether the port
// was in use; kvbus serve with --http-addr equal to --nats-addr started
// every role, then said another kvbus had the address; a scheduler or a
// worker with --pprof-addr equal to --metrics-addr asked whether the role
// was already running.
func TestOneListenAddressTwiceIsRefused(t *testing.T) {
	addr := freeAddr(t)
	port := addr[strings.LastIndex(addr, ":"):]
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"nats", "--addr", addr, "--monitor-addr", addr}, []string{"--addr", "--monitor-addr"}},
		{[]string{"nats", "--addr", addr, "--monitor-addr", "0.0.0.0" + port}, []string{"--addr", "--monitor-addr"}},
		{[]string{"nats", "--addr", addr, "--cluster-addr", port, "--routes", "nats://127.0.0.1:1"}, []string{"--addr", "--cluster-addr"}},
		{[]string{"nats", "--addr", addr, "--pprof-addr", addr}, []string{"--addr", "--pprof-addr"}},
		{[]string{"serve", "--nats-addr", addr, "--http-addr", addr}, []string{"--nats-addr", "--http-addr"}},
		{[]string{"scheduler", "--metrics-addr", addr, "--pprof-addr", addr}, []string{"--metrics-addr", "--pprof-addr"}},
		{[]string{"worker", "--metrics-addr", port, "--pprof-addr", addr}, []string{"--metrics-addr", "--pprof-addr"}},
	} {
		took, err := runArgs(t, tc.args, 5*time.Second)
		for _, w := range tc.want {
			if err == nil || !strings.Contains(err.Error(), w) || took > 2*time.Second {
				t.Errorf("%v: %v after %v; want an error at once naming %s", tc.args, err, took.Round(time.Millisecond), w)
			}
		}
	}
	// Distinct hosts of one port, port 0 and unset addresses are no clash.
	for _, ok := range [][]listener{
		{{"--addr", "127.0.0.1:4222"}, {"--monitor-addr", "127.0.0.2:4222"}},
		{{"--addr", "127.0.0.1:0"}, {"--monitor-addr", "127.0.0.1:0"}},
		{{"--addr", "127.0.0.1:4222"}, {"--monitor-addr", ""}, {"--cluster-addr", ""}},
	} {
		if err := distinctListeners(ok...); err != nil {
			t.Errorf("%v: %v", ok, err)
		}
	}
}
