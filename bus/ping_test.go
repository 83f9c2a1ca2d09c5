package bus_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/testenv"
)

// TestSilentServerIsLeftAfterThreePings: a server that stops answering
// without closing its socket is taken for dead after the pings go
// unanswered, and the role reconnects (here through the proxy again, to a
// server that answers), where nats.go's default waited 4 to 6 minutes. A
// connection pinging once a minute, silenced alike, is still connected:
// the pings, not the fault alone, found the silence.
func TestSilentServerIsLeftAfterThreePings(t *testing.T) {
	srv := startServer(t, "")
	proxy := testenv.StartFaultProxy(t, strings.TrimPrefix(srv.ClientURL(), "nats://"))
	const ping = 100 * time.Millisecond
	nc, err := bus.Connect(t.Context(), bus.Config{URL: proxy.URL(), Name: "pinging", PingInterval: ping})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	slow, err := bus.Connect(t.Context(), bus.Config{URL: proxy.URL(), Name: "slow", PingInterval: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()

	proxy.Silence()
	silenced := time.Now()
	testenv.Eventually(t, 5*time.Second, "the silenced connection reconnected", func() bool {
		return nc.Stats().Reconnects == 1 && nc.IsConnected()
	})
	took := time.Since(silenced)
	// Stale after MaxPingsOutstanding+1 unanswered pings; the first of them
	// goes out up to one interval after the silence.
	if took < bus.MaxPingsOutstanding*ping || took > 4*time.Second {
		t.Errorf("reconnected %v after the silence; want after about %v", took, (bus.MaxPingsOutstanding+1)*ping)
	}
	if proxy.Dropped() == 0 {
		t.Fatal("the proxy dropped nothing: the silence did not take effect")
	}
	if slow.Stats().Reconnects != 0 || !slow.IsConnected() {
		t.Errorf("the connection pinging once a minute reconnected too (%d): something other than the pings broke the silenced connections", slow.Stats().Reconnects)
	}
	// The new connection carries messages.
	sub, err := nc.SubscribeSync("after")
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish("after", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := sub.NextMsg(2 * time.Second); err != nil {
		t.Fatalf("no message over the new connection: %v", err)
	}
}
