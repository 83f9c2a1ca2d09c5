package main

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers"
)

type frontendCmd struct {
	busFlags        `embed:""`
	modelFlags      `embed:""`
	frontendFlags   `embed:""`
	tokenizerFlags  `embed:""`
	Engine          string `name:"engine" enum:"sim,openai" default:"sim" help:"What the workers run: sim, or openai (model servers): then each client's body goes to the engine as sent, fields the sim cannot honour (tools, response_format, logprobs, n) included, and the client gets the engine's answer as written."`
	requestLogFlags `embed:""`
	timeoutFlags    `embed:""`
	ID              string `name:"id" help:"Frontend id in subjects (default: a random fe-…)."`
}

func (c *frontendCmd) Run(ctx context.Context) error {
	log := c.logger()
	onStop(ctx, log, nil)
	stopPprof, err := c.startPprof(ctx, log)
	if err != nil {
		return err
	}
	defer stopPprof()
	if _, err := c.models(); err != nil {
		return err
	}
	tok, err := c.tokenizer()
	if err != nil {
		return err
	}
	// Every purely local check before connecting: with NATS not up yet, a
	// bad --http-addr, --id or --session-header was reported only after
	// 10 s of "cannot connect".
	if err := c.checkValues(c.requestLogFlags, c.timeoutFlags); err != nil {
		return err
	}
	pre := c.frontendConfig(nil, log, nil, c.ID)
	if err := pre.Validate(); err != nil {
		return err
	}
	ctx, nc, err := connect(ctx, c.natsFlags, "kvbus-frontend", bus.InboxPrefix(auth.RoleFrontend, ""), log)
	if err != nil {
		return err
	}
	defer drain(nc)
	reg := newRegistry()
	cfg := c.frontendConfig(nc, log, reg, c.ID)
	cfg.Tokenizer = tok
	cfg.Passthrough = c.Engine == workers.EngineOpenAI
	fe, err := frontend.New(cfg)
	if err != nil {
		return err
	}
	onStop(ctx, log, func() stopPlan { return c.stopPlan(reg) })
	return roleErr(ctx, fe.Run(ctx))
}

// stopPlan: the frontend answers new requests with 503 shutting_down and
// finishes those in flight, then drains NATS.
func (c *frontendCmd) stopPlan(reg *prometheus.Registry) stopPlan {
	n := gaugeSum(reg, "kvbus_frontend_inflight_requests")
	upTo, bound := frontendStopBound(c.RequestTimeout, c.StopGrace, c.StopTimeout)
	return stopPlan{
		doing:    fmt.Sprintf("finishing %s in flight (new ones get 503 shutting_down), then draining NATS", requests(n)),
		inFlight: n, upTo: upTo + drainTimeout, bound: bound + " + 5s NATS drain",
	}
}

func (c *frontendCmd) frontendConfig(nc *nats.Conn, log *slog.Logger, reg *prometheus.Registry, id string) frontend.Config {
	return newFrontendConfig(nc, c.subjects(), c.Replicas, log, reg, id, c.modelFlags, c.frontendFlags, c.requestLogFlags, c.timeoutFlags)
}

func newFrontendConfig(nc *nats.Conn, subj messages.Subjects, replicas int, log *slog.Logger, reg *prometheus.Registry, id string, m modelFlags, f frontendFlags, rl requestLogFlags, t timeoutFlags) frontend.Config {
	cfg := f.baseConfig(rl)
	cfg.Conn, cfg.Subjects, cfg.ID, cfg.StreamReplicas = nc, subj, id, replicas
	cfg.Models, _ = m.models() // checked in Run
	cfg.RequestTimeout, cfg.Logger, cfg.Registry = t.RequestTimeout, log, reg
	return cfg
}
