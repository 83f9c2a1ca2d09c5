package workers

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// ErrRankServed is returned by Run when another process already serves
// the rank's (group, tp_rank).
var ErrRankServed = errors.New("workers: another process serves this rank")

// A second process with a rank's identity — a worker started twice by
// mistake, compose's --scale on a fixed-rank service — gets every ReqMeta
// of its group too and runs each request a second time (in front of an
// engine: twice the GPU work), while the schedulers follow only the newer
// one's heartbeats and nothing else shows it. So a starting rank listens
// to its identity's heartbeats for 1.5 heartbeat intervals first,
// and refuses to start while another process serves it. One that is
// draining (being replaced) does not count.

// maxIdentityWait bounds that wait by default (RankConfig.IdentityWait).
const maxIdentityWait = 10 * time.Second

// awaitIdentityFree returns nil once no other process has sent a
// heartbeat for this rank within RankConfig.IdentityWait.
func (r *Rank) awaitIdentityFree(ctx context.Context) error {
	if r.cfg.IdentityWait < 0 {
		return nil
	}
	subject := r.cfg.Subjects.Heartbeat(r.cfg.Group, r.cfg.TPRank)
	heard := make(chan *messages.Heartbeat, 1)
	sub, err := r.cfg.Conn.Subscribe(subject, func(m *nats.Msg) {
		hb, err := messages.DecodeHeartbeat(m.Data)
		if err != nil || hb.Draining || hb.StartedUnixMs == r.events.started {
			return
		}
		select {
		case heard <- hb:
		default:
		}
	})
	if err != nil {
		return fmt.Errorf("workers: subscribe %s: %w", subject, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	t := time.NewTimer(r.cfg.IdentityWait)
	defer t.Stop()
	select {
	case hb := <-heard:
		return fmt.Errorf("%w: group %s rank %d is served by a worker process started at %s (its heartbeat came just now): both would run every request of the group; stop that process first, or give this one another --group/--tp-rank (or --rank auto)",
			ErrRankServed, r.cfg.Group, r.cfg.TPRank, time.UnixMilli(hb.StartedUnixMs).UTC().Format(time.RFC3339))
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
