package bus_test

import (
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
)

// TestFromStream: what the server sends out of a stream, to any subject a
// client names (a direct get's answer or a republish: a Nats-Stream
// header; a push consumer's delivery: a $JS.ACK reply; its flow control
// and idle heartbeats: a Status header), is told from a client's publish.
func TestFromStream(t *testing.T) {
	withHeader := func(k, v string) nats.Header { h := nats.Header{}; h.Set(k, v); return h }
	for _, c := range []struct {
		name string
		msg  *nats.Msg
		want bool
	}{
		{"direct get or republish", &nats.Msg{Subject: "kvbus.meta.g1.s", Header: withHeader("Nats-Stream", "KV_KVBUS_RANKS")}, true},
		{"push delivery", &nats.Msg{Subject: "kvbus.meta.g1.s", Reply: "$JS.ACK.KV_KVBUS_RANKS.c.1.1.1.1.0"}, true},
		{"flow control", &nats.Msg{Subject: "kvbus.meta.g1.s", Header: withHeader("Status", "100")}, true},
		{"a publish", &nats.Msg{Subject: "kvbus.meta.g1.s"}, false},
		{"a request", &nats.Msg{Subject: "kvbus.pool.g1.0", Reply: "_INBOX_worker_g.g0.abc"}, false},
	} {
		if _, got := bus.FromStream(c.msg); got != c.want {
			t.Errorf("%s: FromStream %v, want %v", c.name, got, c.want)
		}
	}
}
