package scheduler

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// Peer replicas. A replica acknowledges a request in the log once it has
// dispatched it, so from then on only that replica watches it: its
// results, a failure of its group. When a replica dies (SIGKILL, a lost
// host), the others would leave its requests to hang until their deadline
// if their group then failed. So every replica follows the others'
// announcements (kvbus.ann.scheduler.<id>, each second) and their save
// plans (one per dispatch, with the request's sequence in the log). A
// replica not heard for the heartbeat timeout died; the live replica with
// the lowest id adopts the requests it dispatched within the request
// timeout (adopt.go). A clean stop ends with a Stopped announcement once
// the replica's requests ended: nothing is adopted then.

// maxPeerDispatches bounds what is remembered of one peer's dispatches
// (its last request timeout's worth, at most this many).
const maxPeerDispatches = 200_000

// peerTable follows the other replicas. It is safe for concurrent use.
type peerTable struct {
	mu    sync.Mutex
	peers map[string]*peer
	keep  time.Duration // a dispatch is worth adopting this long (the request timeout)
	// since is when this replica last (re)connected: a peer's silence
	// before then says nothing about it.
	since time.Time
}

type peer struct {
	seen      time.Time // its last announcement
	announced bool      // only a replica heard to announce is judged by its silence
	// dispatches are oldest first.
	dispatches []peerDispatch
}

// peerDispatch is a request a peer dispatched: its id and sequence in the
// request log.
type peerDispatch struct {
	reqID string
	seq   uint64
	at    time.Time
}

func newPeerTable(keep time.Duration, now time.Time) *peerTable {
	return &peerTable{peers: map[string]*peer{}, keep: keep, since: now}
}

func (pt *peerTable) getLocked(id string) *peer {
	p := pt.peers[id]
	if p == nil {
		p = &peer{}
		pt.peers[id] = p
	}
	return p
}

// heard records a peer's announcement; a Stopped one forgets the peer
// with its dispatches.
func (pt *peerTable) heard(id string, stopped bool, now time.Time) {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	if stopped {
		delete(pt.peers, id)
		return
	}
	p := pt.getLocked(id)
	p.seen, p.announced = now, true
}

// dispatched records a request a peer dispatched (a save plan). A plan
// without a log sequence (a replica of an older kvbus) cannot be adopted.
func (pt *peerTable) dispatched(id, reqID string, seq uint64, now time.Time) {
	if seq == 0 {
		return
	}
	pt.mu.Lock()
	defer pt.mu.Unlock()
	p := pt.getLocked(id)
	p.dispatches = append(p.dispatches, peerDispatch{reqID: reqID, seq: seq, at: now})
	p.trim(now, pt.keep)
}

// trim drops the dispatches older than keep, and the oldest past
// maxPeerDispatches.
func (p *peer) trim(now time.Time, keep time.Duration) {
	i := 0
	for i < len(p.dispatches) && (now.Sub(p.dispatches[i].at) > keep || len(p.dispatches)-i > maxPeerDispatches) {
		i++
	}
	if i > 0 {
		// Copy once half is dead, so the slice does not keep growing.
		if i >= len(p.dispatches)/2 {
			p.dispatches = append(p.dispatches[:0:0], p.dispatches[i:]...)
		} else {
			p.dispatches = p.dispatches[i:]
		}
	}
}

// reconnected says this replica was cut off from NATS until now.
func (pt *peerTable) reconnected(now time.Time) {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	pt.since = now
}

// dead removes the announced peers not heard within timeout (counting from
// the last reconnect) and returns, when self has the lowest id among the
// replicas still alive (itself and the announced peers heard within
// timeout), the dispatches of each dead peer to adopt; otherwise nil (the
// adopter is another replica). Peers that never announced are not judged
// (their silence says nothing): they are forgotten once their last
// dispatch is older than the request timeout.
func (pt *peerTable) dead(self string, now time.Time, timeout time.Duration) map[string][]peerDispatch {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	var gone []string
	adopter := true
	for id, p := range pt.peers {
		if !p.announced {
			// Known from its plans only: kept while they are recent.
			if p.trim(now, pt.keep); len(p.dispatches) == 0 {
				delete(pt.peers, id)
			}
			continue
		}
		last := p.seen
		if last.Before(pt.since) {
			last = pt.since
		}
		if now.Sub(last) > timeout {
			gone = append(gone, id)
		} else if id < self {
			adopter = false
		}
	}
	if len(gone) == 0 {
		return nil
	}
	slices.Sort(gone)
	out := map[string][]peerDispatch{}
	for _, id := range gone {
		p := pt.peers[id]
		delete(pt.peers, id)
		p.trim(now, pt.keep)
		if adopter && len(p.dispatches) > 0 {
			out[id] = p.dispatches
		}
	}
	return out
}

// onPeer follows the other replicas' announcements.
func (s *Scheduler) onPeer(_ context.Context, m *nats.Msg) error {
	a, err := messages.DecodeAnnouncement(m.Data)
	if err != nil {
		return err
	}
	if a.ID == s.cfg.ID || a.Role != messages.RoleScheduler {
		return nil
	}
	s.peers.heard(a.ID, a.Stopped, time.Now())
	return nil
}
