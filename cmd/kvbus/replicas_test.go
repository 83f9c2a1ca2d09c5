package main

import (
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestStreamReplicasTheServerCannotGive: a --stream-replicas one NATS
// server alone cannot keep fails naming the flag and what to give. It
// failed with the server's words alone ("replicas > 1 not supported in
// non-clustered mode", and above 5, after connecting, "maximum replicas is
// 5"), naming neither the flag nor what to do.
func TestStreamReplicasTheServerCannotGive(t *testing.T) {
	srv := testenv.StartNATS(t)
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"frontend", "--stream-replicas", "3", "--http-addr", "127.0.0.1:0"}, []string{"--stream-replicas 3", "--stream-replicas 1"}},
		{[]string{"scheduler", "--stream-replicas", "3", "--metrics-addr="}, []string{"--stream-replicas 3", "--stream-replicas 1"}},
		{[]string{"worker", "--stream-replicas", "3", "--metrics-addr=", "--rank", "auto", "--tp-size", "1", "--kv-capacity", "64MiB"}, []string{"--stream-replicas 3", "--stream-replicas 1"}},
		{[]string{"frontend", "--stream-replicas", "7", "--http-addr", "127.0.0.1:0"}, []string{"--stream-replicas 7", "at most 5"}},
	} {
		_, err := runArgs(t, append(tc.args, "--nats-url", srv.ClientURL()), 10*time.Second)
		for _, w := range tc.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("%v: %v; want an error naming %q", tc.args, err, w)
			}
		}
	}
}
