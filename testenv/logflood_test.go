package testenv_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestGarbageOnTheBusIsNoLogFlood: a publisher of messages kvbus cannot
// decode, 2,000 on each of kvbus.ctl.abort and kvbus.ctl.resend (the
// schedulers listen), kvbus.ctl.abort.g0 (g0's ranks listen) and
// kvbus.ctl.resend.g0 (g0's driver listens), gets one line per handler and
// process, naming the subject and what to do, not one per message: a
// review's 1,000 msg/s of garbage made every role log "message handler
// failed" 140 to 490 times a second for as long as it lasted. Every message
// is still counted malformed.
func TestGarbageOnTheBusIsNoLogFlood(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 2})
	nc := testenv.Connect(t, c.NATS)
	const n = 2000
	subj := messages.Subjects{}
	subjects := map[string]string{"scheduler_abort": subj.Abort(), "worker_abort": subj.AbortGroup("g0"),
		"scheduler_resend": subj.Resend(), "worker_resend": subj.ResendGroup("g0")}
	for range n {
		for _, subject := range subjects {
			if err := nc.Publish(subject, []byte{0xc1, 0x00}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	malformed := func(handler string) float64 {
		return testenv.CounterSum(t, c.Registry, "kvbus_bus_messages_total", map[string]string{"handler": handler, "outcome": "malformed"})
	}
	testenv.Eventually(t, 10*time.Second, "every garbage message handled", func() bool {
		return malformed("scheduler_abort") == n && malformed("worker_abort") == 2*n && // two ranks, one registry
			malformed("scheduler_resend") == n && malformed("worker_resend") == n // the driver
	})
	for handler, want := range map[string]int{"scheduler_abort": 1, "worker_abort": 2, "scheduler_resend": 1, "worker_resend": 1} {
		lines := c.Logs.Lines("handler="+handler, "level=WARN")
		if len(lines) != want {
			t.Errorf("%d warn lines from %s for %d malformed messages, want %d (one per process):\n%s",
				len(lines), handler, n, want, strings.Join(lines[:min(len(lines), 5)], "\n"))
			continue
		}
		for _, l := range lines {
			if !strings.Contains(l, "subject="+subjects[handler]) || !strings.Contains(l, "kvbus tap") {
				t.Errorf("the line names no subject or nothing to do:\n%s", l)
			}
		}
	}
}
