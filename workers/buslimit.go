package workers

import (
	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// busLimit is the largest message the workers publish: the NATS server's
// max payload, but no more than every kvbus decoder (and the JetStream
// streams' MaxMsgSize) takes, messages.MaxMessageBytes. An external
// server's max_payload may be up to 64 MiB: a message between the two
// passed the server and was refused by its reader (an answer's output
// lost on the bus, a pool read unanswered). 0 when not connected, as
// nc.MaxPayload.
func busLimit(nc *nats.Conn) int64 {
	return min(nc.MaxPayload(), messages.MaxMessageBytes)
}
