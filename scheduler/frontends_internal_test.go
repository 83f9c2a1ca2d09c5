package scheduler

import (
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvbus/kvbus/messages"
)

// TestRequestsOfAGoneFrontendAreAborted: a frontend that died with requests
// in flight (killed -9: it sends no Abort) no longer listens on its output
// subject; after FrontendGoneAfter of probes that found nobody there, its
// requests are aborted on their groups (outcome aborted). Before, they ran
// to their end: three streams of max_tokens 3,000 held their groups for
// 31 s after their frontend was killed. A frontend that listens, or is back
// within FrontendGoneAfter (a reconnect), keeps its requests.
func TestRequestsOfAGoneFrontendAreAborted(t *testing.T) {
	s, nc := newBareScheduler(t)
	s.cfg.FrontendGoneAfter = time.Second
	fe := map[string]string{"dead-1": "fe-dead", "dead-2": "fe-dead", "live": "fe-live", "back": "fe-back"}
	for id, f := range fe {
		tr := promptTracker(id, 1)
		tr.FrontendID, tr.Group = f, "g0"
		s.trackers.add(tr)
	}
	live, err := nc.SubscribeSync(s.cfg.Subjects.Out("fe-live"))
	if err != nil {
		t.Fatal(err)
	}
	aborts, err := nc.SubscribeSync(s.cfg.Subjects.AbortGroup("*"))
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var back *nats.Subscription
	for time.Since(start) < 3*time.Second {
		if back == nil && time.Since(start) > 500*time.Millisecond { // after its first probe found nobody
			if back, err = nc.SubscribeSync(s.cfg.Subjects.Out("fe-back")); err != nil {
				t.Fatal(err)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
		}
		s.watchFrontends(t.Context(), time.Now())
		time.Sleep(100 * time.Millisecond)
	}
	s.frontends.running.Wait()

	var aborted []string
	for {
		m, err := aborts.NextMsg(200 * time.Millisecond)
		if err != nil {
			break
		}
		a, err := messages.DecodeAbort(m.Data)
		if err != nil || a.Reason != messages.AbortReasonFrontendGone || !a.ByClient() || m.Subject != s.cfg.Subjects.AbortGroup("g0") {
			t.Fatalf("abort %s %+v (%v); want g0's, by a gone frontend", m.Subject, a, err)
		}
		aborted = append(aborted, a.ReqID)
	}
	slices.Sort(aborted)
	if !slices.Equal(aborted, []string{"dead-1", "dead-2"}) {
		t.Errorf("aborted on their group: %v; want the dead frontend's two requests", aborted)
	}
	for _, id := range []string{"dead-1", "dead-2"} {
		if s.trackers.has(id) {
			t.Errorf("%s still tracked", id)
		}
	}
	var gone dto.Metric
	if err := s.m.frontendsGone.Write(&gone); err != nil || gone.GetCounter().GetValue() != 1 {
		t.Errorf("kvbus_scheduler_frontends_gone_total %v (%v); want 1 (fe-dead)", gone.GetCounter().GetValue(), err)
	}
	for _, id := range []string{"live", "back"} {
		if !s.trackers.has(id) {
			t.Errorf("%s, of a frontend that listens, was ended", id)
		}
	}
	// The probes reached the frontends that listen, as Outputs no request has.
	for name, sub := range map[string]*nats.Subscription{"fe-live": live, "fe-back": back} {
		m, err := sub.NextMsg(time.Second)
		if err != nil {
			t.Fatalf("%s heard no probe: %v", name, err)
		}
		if o, err := messages.DecodeOutput(m.Data); err != nil || o.ReqID != messages.FrontendProbeReqID {
			t.Errorf("%s: probe %+v (%v)", name, o, err)
		}
	}
}
