package main

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/workers"
)

type serveCmd struct {
	logFlags       `embed:""`
	modelFlags     `embed:""`
	frontendFlags  `embed:""`
	timeoutFlags   `embed:""`
	schedulerFlags `embed:""`
	engineFlags    `embed:""`
	Prefix         string `name:"subject-prefix" default:"kvbus" help:"First token of every kvbus subject."`
	NATSAddr       string `name:"nats-addr" default:"127.0.0.1:4222" help:"Listen address of the embedded NATS server (point the nats CLI at it to watch the bus)."`
	DataDir        string `name:"data-dir" help:"JetStream storage directory (default: a temporary directory, removed at exit)."`
	Groups         int    `name:"groups" default:"1" help:"Worker groups (engine instances)."`
	Ranks          int    `name:"ranks" default:"4" help:"Ranks per group (TP size; EP ranks equal TP ranks)."`
}

func (c *serveCmd) Run(ctx context.Context) error {
	log := c.logger()
	if c.Groups < 1 || c.Ranks < 1 {
		return fmt.Errorf("--groups and --ranks must be at least 1")
	}
	srv, err := bus.StartServer(bus.ServerConfig{Addr: c.NATSAddr, DataDir: c.DataDir})
	if err != nil {
		return err
	}
	defer srv.Shutdown()
	log.Info("embedded nats server ready", "url", srv.ClientURL())
	b := busFlags{natsFlags: natsFlags{NATSURL: srv.ClientURL()}, logFlags: c.logFlags, Prefix: c.Prefix}
	var conns []*nats.Conn
	defer func() { drain(conns...) }()
	conn := func(name string) (*nats.Conn, error) {
		nc, err := connect(ctx, b.natsFlags, name, log)
		if err == nil {
			conns = append(conns, nc)
		}
		return nc, err
	}

	reg := newRegistry()
	wm, hm := workers.NewMetrics(reg), bus.NewHandlerMetrics(reg)
	r := newRoles(ctx)
	for g := range c.Groups {
		group := fmt.Sprintf("g%d", g)
		engine, err := c.engine()
		if err != nil {
			return err
		}
		for tp := range c.Ranks {
			nc, err := conn(fmt.Sprintf("kvbus-worker-%s-%d", group, tp))
			if err != nil {
				return err
			}
			rank, err := newRank(nc, b, c.modelFlags, c.engineFlags, engine, group, tp, c.Ranks, tp, c.Ranks, log, wm, hm)
			if err != nil {
				return err
			}
			r.run(fmt.Sprintf("worker %s/%d", group, tp), rank.Run)
		}
	}
	nc, err := conn("kvbus-scheduler")
	if err != nil {
		return err
	}
	s, err := newScheduler(nc, b, c.schedulerFlags, c.timeoutFlags, "", log, reg)
	if err != nil {
		return err
	}
	r.run("scheduler", s.Run)
	if nc, err = conn("kvbus-frontend"); err != nil {
		return err
	}
	// The frontend's /metrics serves the whole process's registry.
	fe, err := frontend.New(newFrontendConfig(nc, b.subjects(), log, reg, "", c.modelFlags, c.frontendFlags, c.timeoutFlags))
	if err != nil {
		return err
	}
	r.run("frontend", fe.Run)
	return r.wait()
}
