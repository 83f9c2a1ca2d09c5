package cluster

import (
	"errors"
	"fmt"

	"github.com/kvbus/kvbus/bus"
)

// Stopping, killing and restarting a cluster's processes, as an operator
// or a fault would: what the reliability and fault tests drive.

// rankRun returns a running rank.
func (c *Cluster) rankRun(group string, rank int) (*rankRun, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if rr := c.ranks[rankKey{group, rank}]; rr != nil {
		return rr, nil
	}
	return nil, fmt.Errorf("cluster: no rank %s/%d", group, rank)
}

// StopRank stops one rank gracefully, as SIGTERM would: it drains (its
// group takes no new request), finishes what it has, and exits.
func (c *Cluster) StopRank(group string, rank int) error {
	rr, err := c.rankRun(group, rank)
	if err != nil {
		return err
	}
	rr.stop()
	<-rr.done
	return nil
}

// StopGroup stops every rank of a group at once, as scaling the group's
// workers down would, and waits until they exited.
func (c *Cluster) StopGroup(group string) error {
	c.mu.Lock()
	var runs []*rankRun
	for k, rr := range c.ranks {
		if k.group == group {
			runs = append(runs, rr)
		}
	}
	c.mu.Unlock()
	if len(runs) == 0 {
		return fmt.Errorf("cluster: no group %s", group)
	}
	for _, rr := range runs {
		rr.stop()
	}
	for _, rr := range runs {
		<-rr.done
	}
	return nil
}

// ReplaceGroup replaces every rank of a group at once, as a rolling
// upgrade does a whole group: it stops them all, starts a new process of
// each while they drain (and hand their blocks off), and waits until the
// stopped ones exited.
func (c *Cluster) ReplaceGroup(group string) error {
	c.mu.Lock()
	old := map[int]*rankRun{}
	for k, rr := range c.ranks {
		if k.group == group {
			old[k.rank] = rr
		}
	}
	c.mu.Unlock()
	if len(old) == 0 {
		return fmt.Errorf("cluster: no group %s", group)
	}
	for _, rr := range old {
		rr.stop()
	}
	for r := range old {
		if err := c.startRank(group, r); err != nil {
			return err
		}
	}
	for _, rr := range old {
		<-rr.done
	}
	return nil
}

// RestartRank stops one rank and starts a new one with the same identity
// and an empty block store, as a process restart would.
func (c *Cluster) RestartRank(group string, rank int) error {
	if err := c.StopRank(group, rank); err != nil {
		return err
	}
	return c.startRank(group, rank)
}

// KillRank makes one rank vanish as a crashed process would: its NATS
// connection closes at once (no result, output, event or heartbeat gets out
// any more), then it stops.
func (c *Cluster) KillRank(group string, rank int) error {
	rr, err := c.rankRun(group, rank)
	if err != nil {
		return err
	}
	rr.nc.Close()
	return c.StopRank(group, rank)
}

// CrashRestartRank crashes one rank as KillRank does and starts a new
// process of it at once, as a supervisor restarting a crashed worker would
// (well within the heartbeat timeout); the old one finishes stopping in the
// background, unable to publish.
func (c *Cluster) CrashRestartRank(group string, rank int) error {
	rr, err := c.rankRun(group, rank)
	if err != nil {
		return err
	}
	rr.nc.Close()
	rr.stop()
	return c.startRank(group, rank)
}

// KillScheduler makes scheduler replica i vanish as a crashed process
// would: its connection closes at once, then it stops.
func (c *Cluster) KillScheduler(i int) error {
	if i < 0 || i >= len(c.schedRuns) {
		return fmt.Errorf("cluster: no scheduler %d", i)
	}
	sr := c.schedRuns[i]
	sr.nc.Close()
	sr.stop()
	<-sr.done
	return nil
}

// StopScheduler stops scheduler replica i as SIGTERM would (its
// connection stays open while it stops) and waits until it has.
func (c *Cluster) StopScheduler(i int) error {
	if i < 0 || i >= len(c.schedRuns) {
		return fmt.Errorf("cluster: no scheduler %d", i)
	}
	sr := c.schedRuns[i]
	sr.stop()
	<-sr.done
	return nil
}

// RestartNATS stops the embedded server and starts it again on the same
// address and data directory, as an operator restarting NATS would; every
// role reconnects by itself. It needs Config.DataDir (file storage that
// outlives the server).
func (c *Cluster) RestartNATS() error {
	if c.NATS == nil || c.cfg.DataDir == "" {
		return errors.New("cluster: RestartNATS needs an embedded server with a DataDir")
	}
	addr := c.NATS.Addr().String()
	c.NATS.Shutdown()
	srv, err := bus.StartServer(bus.ServerConfig{Addr: addr, DataDir: c.cfg.DataDir, MaxPayload: c.cfg.MaxPayload, AuthConfig: c.authConfig(), Logger: c.log.With("role", "nats")})
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.NATS = srv
	c.mu.Unlock()
	return nil
}
