package scheduler

import (
	"context"
	"maps"
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
	// tombs, while the plan stream is read (journal.go), are the requests
	// peers ended meanwhile: a dispatch read after its end is not running.
	tombs map[string]struct{}
	keep  time.Duration // a dispatch is worth adopting this long (the request timeout)
	// since is when this replica last (re)connected: a peer's silence
	// before then says nothing about it.
	since time.Time
}

type peer struct {
	seen      time.Time // its last announcement
	announced bool      // only a replica heard to announce is judged by its silence
	started   int64     // its process's start, as announced (0: not said)
	// dispatches are its requests not known to have ended, by id;
	// trimAt is the size at which the old ones are dropped next.
	dispatches map[string]peerDispatch
	trimAt     int
	trimmed    time.Time // the last trim
	// orphans are the dispatches of an earlier process under its id,
	// which died: to adopt.
	orphans []peerDispatch
	// replayed: some dispatches were read from the plan stream, not heard
	// live, so they may be an earlier process's (see heard).
	replayed bool
}

// peerDispatch is a request a peer dispatched: its id and sequence in the
// request log.
type peerDispatch struct {
	reqID string
	seq   uint64
	// at is when this replica heard the plan, on its clock; one read from
	// the plan stream (replayed) has the NATS server's time it was stored.
	at       time.Time
	replayed bool
	// peerMs is when the peer made the plan, on the peer's clock (0: not
	// known, a plan of an older kvbus); it orders the dispatch against
	// the peer's start, also on its clock.
	peerMs int64
}

func newPeerTable(keep time.Duration, now time.Time) *peerTable {
	return &peerTable{peers: map[string]*peer{}, keep: keep, since: now}
}

func (pt *peerTable) getLocked(id string) *peer {
	p := pt.peers[id]
	if p == nil {
		p = &peer{dispatches: map[string]peerDispatch{}, trimAt: 1024}
		pt.peers[id] = p
	}
	return p
}

// heard records a peer's announcement; a Stopped one forgets the peer
// with its dispatches. Another start than the one heard before is a new
// process under the same id: the old one's dispatches become orphans.
func (pt *peerTable) heard(id string, started int64, stopped bool, now time.Time) {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	if stopped {
		delete(pt.peers, id)
		return
	}
	p := pt.getLocked(id)
	switch {
	case p.started != 0 && started != 0 && started != p.started:
		for _, d := range p.dispatches {
			p.orphans = append(p.orphans, d)
		}
		clear(p.dispatches)
	case p.replayed && started != 0:
		// Dispatches from the plan stream made before this process
		// started are an earlier process's under the same id.
		for r, d := range p.dispatches {
			// The plan's time and the start, both on the peer's clock;
			// the server's time against the peer's clock made a peer's
			// dispatches orphans (adopted, while it runs them) when its
			// clock ran ahead, and an earlier process's its own when it
			// ran behind.
			at := d.at.UnixMilli()
			if d.peerMs != 0 {
				at = d.peerMs
			}
			if at < started {
				p.orphans = append(p.orphans, d)
				delete(p.dispatches, r)
			}
		}
	}
	p.replayed = p.replayed && started == 0
	p.seen, p.announced = now, true
	if started != 0 {
		p.started = started
	}
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
	p.dispatches[reqID] = peerDispatch{reqID: reqID, seq: seq, at: now}
	if len(p.dispatches) >= p.trimAt {
		p.trim(now, pt.keep)
	}
}

// ended forgets the requests a peer ended.
func (pt *peerTable) ended(id string, reqIDs []string) {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	if pt.tombs != nil {
		for _, r := range reqIDs {
			pt.tombs[r] = struct{}{}
		}
	}
	if p := pt.peers[id]; p != nil {
		for _, r := range reqIDs {
			delete(p.dispatches, r)
		}
	}
}

// replay begins a read of the plan stream: the ends heard live meanwhile
// are kept until replayed.
func (pt *peerTable) replay() {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	pt.tombs = map[string]struct{}{}
}

// replayed records what the plan stream says replicas dispatched and had
// not ended, by replica id, and ends the read. Those replicas are judged
// by their silence from then on, like ones heard to announce: one that
// died before this replica started is never heard again, and its requests
// are adopted once the heartbeat timeout passed since this replica started
// (dead). An entry under this replica's own id is its earlier process's;
// replicas without a dispatch are left out.
func (pt *peerTable) replayed(ds map[string]map[string]peerDispatch) {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	for id, list := range ds {
		if len(list) == 0 {
			continue
		}
		p := pt.getLocked(id)
		for _, d := range list {
			if _, ended := pt.tombs[d.reqID]; ended {
				continue
			}
			if _, known := p.dispatches[d.reqID]; !known {
				p.dispatches[d.reqID] = d
				p.replayed = true
			}
		}
		p.announced = true
	}
	pt.tombs = nil
}

// trim drops the dispatches older than keep, and all but the newest
// maxPeerDispatches.
func (p *peer) trim(now time.Time, keep time.Duration) {
	for r, d := range p.dispatches {
		if now.Sub(d.at) > keep {
			delete(p.dispatches, r)
		}
	}
	if len(p.dispatches) > maxPeerDispatches {
		ds := slices.SortedFunc(maps.Values(p.dispatches), func(a, b peerDispatch) int { return a.at.Compare(b.at) })
		for _, d := range ds[:len(ds)-maxPeerDispatches] {
			delete(p.dispatches, d.reqID)
		}
	}
	p.trimAt, p.trimmed = max(2*len(p.dispatches), 1024), now
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
// timeout), the dispatches to adopt of each dead peer and of each earlier
// process of a live one, oldest first; otherwise nil (the adopter is
// another replica). Peers that never announced are not judged (their
// silence says nothing): they are forgotten once their last dispatch is
// older than the request timeout.
func (pt *peerTable) dead(self string, now time.Time, timeout time.Duration) map[string][]peerDispatch {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	var gone []string
	adopter := true
	for id, p := range pt.peers {
		if now.Sub(p.trimmed) > pt.keep/4 { // a peer that dispatches nothing more is trimmed too
			p.trim(now, pt.keep)
		}
		if !p.announced {
			// Known from its plans only: kept while they are recent.
			if len(p.dispatches) == 0 {
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
	out := map[string][]peerDispatch{}
	keep := func(id string, ds []peerDispatch) {
		ds = slices.DeleteFunc(ds, func(d peerDispatch) bool { return now.Sub(d.at) > pt.keep })
		if adopter && len(ds) > 0 {
			slices.SortFunc(ds, func(a, b peerDispatch) int { return a.at.Compare(b.at) })
			out[id] = append(out[id], ds...)
		}
	}
	for id, p := range pt.peers {
		if len(p.orphans) > 0 {
			keep(id, p.orphans)
			p.orphans = nil
		}
	}
	for _, id := range gone {
		p := pt.peers[id]
		delete(pt.peers, id)
		keep(id, slices.Collect(maps.Values(p.dispatches)))
	}
	if len(out) == 0 {
		return nil
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
	s.peers.heard(a.ID, a.StartedUnixMs, a.Stopped, time.Now())
	return nil
}
