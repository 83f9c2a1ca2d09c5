package main

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/workers"
)

type frontendCmd struct {
	busFlags        `embed:""`
	modelFlags      `embed:""`
	frontendFlags   `embed:""`
	tokenizerFlags  `embed:""`
	Engine          string `name:"engine" enum:"sim,openai" default:"sim" help:"What the workers run: sim, or openai (model servers): then each client's body goes to the engine as sent, fields the sim cannot honour (tools, response_format, logprobs, n) included, and the client gets the engine's answer as written."`
	EngineAPIKey    string `name:"engine-api-key" help:"--tokenizer engine: sent to the --tokenizer-url engines as Authorization: Bearer <key> (vLLM's --api-key, which guards the /v1/models the frontend reads); never logged."`
	engineTLSFlags  `embed:""`
	requestLogFlags `embed:""`
	timeoutFlags    `embed:""`
	ID              string `name:"id" help:"Frontend id in subjects (default: a random fe-…)."`
}

func (c *frontendCmd) Run(ctx context.Context) (err error) {
	defer func() { err = c.replicasAdvice(err) }()
	if err := c.checkReplicas(); err != nil {
		return err
	}
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
	if err := c.tokenizerOnly(c.EngineAPIKey, c.engineTLSFlags); err != nil {
		return err
	}
	tok, err := c.tokenizer(c.EngineAPIKey, c.engineTLSFlags)
	if err != nil {
		return err
	}
	// Every purely local check before connecting: with NATS not up yet, a
	// bad --http-addr, --id or --session-header was reported only after
	// 10 s of "cannot connect".
	if err := c.checkValues(c.requestLogFlags, c.timeoutFlags); err != nil {
		return err
	}
	cfg := c.frontendConfig(log)
	cfg.Tokenizer = tok
	cfg.Passthrough = c.Engine == workers.EngineOpenAI
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := distinctListeners(listener{"--http-addr", c.HTTPAddr}, listener{"--pprof-addr", c.PprofAddr}); err != nil {
		return err
	}
	if err := portFree(ctx, c.HTTPAddr, c.ReusePort); err != nil {
		return err
	}
	ctx, nc, err := connect(ctx, c.natsFlags, "kvbus-frontend", bus.InboxPrefix(auth.RoleFrontend, ""), log)
	if err != nil {
		return err
	}
	defer drain(nc)
	reg := newRegistry()
	cfg.Conn, cfg.Registry = nc, reg
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
		doing:    fmt.Sprintf("finishing %s in flight (%s), then draining NATS", requests(n), c.newOnes()),
		inFlight: n, upTo: upTo + drainTimeout, bound: bound + " + 5s NATS drain",
	}
}

// frontendConfig is the frontend's configuration from the flags, without
// its connection and registry.
func (c *frontendCmd) frontendConfig(log *slog.Logger) frontend.Config {
	cfg := c.baseConfig(c.requestLogFlags)
	cfg.Subjects, cfg.ID, cfg.StreamReplicas = c.subjects(), c.ID, c.Replicas
	cfg.Models, _ = c.models() // checked in Run
	cfg.RequestTimeout, cfg.Logger = c.RequestTimeout, log
	return cfg
}
