package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/scheduler"
)

type schedulerCmd struct {
	busFlags        `embed:""`
	schedulerFlags  `embed:""`
	requestLogFlags `embed:""`
	timeoutFlags    `embed:""`
	ID              string        `name:"id" help:"Scheduler id in subjects (default: a random sched-…)."`
	MetricsAddr     string        `name:"metrics-addr" default:":9090" help:"Address of /metrics and /healthz (empty: off)."`
	ShutdownTimeout time.Duration `name:"shutdown-timeout" positive:"" default:"20s" help:"On SIGTERM, how long the scheduler watches the requests it placed (their results, and moving them if their group fails) until they end."`
}

func (c *schedulerCmd) Run(ctx context.Context) (err error) {
	defer func() { err = c.replicasAdvice(err) }()
	if err := c.checkReplicas(); err != nil {
		return err
	}
	log := c.logger()
	onStop(ctx, log, nil)
	if err := distinctListeners(listener{"--metrics-addr", c.MetricsAddr}, listener{"--pprof-addr", c.PprofAddr}); err != nil {
		return err
	}
	stopPprof, err := c.startPprof(ctx, log)
	if err != nil {
		return err
	}
	defer stopPprof()
	// Every purely local check before connecting: with NATS not up yet, a
	// bad --id was reported only after 10 s of "cannot connect".
	if err := c.checkAge(c.timeoutFlags); err != nil {
		return err
	}
	cfg, err := schedulerConfig(c, log)
	if err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	if c.HeartbeatTimeout < 2*time.Second {
		// The scheduler cannot know the workers' interval (they may beat
		// faster), so this is a warning, not a refusal.
		log.Warn("--heartbeat-timeout is below twice the workers' default --heartbeat-interval (1s): a group whose ranks beat at that interval goes unready between two heartbeats; give at least twice the workers' interval",
			"heartbeat_timeout", c.HeartbeatTimeout)
	}
	metrics, err := listenMetrics(log, c.MetricsAddr)
	if err != nil {
		return err
	}
	// Closed last, after the NATS drain below.
	defer metrics.close()
	ncfg := c.natsFlags.config("kvbus-scheduler", bus.InboxPrefix(auth.RoleScheduler, ""), log)
	ncfg.NoEcho = true // a scheduler does not receive its own save plans
	ctx, nc, err := connectRole(ctx, ncfg)
	if err != nil {
		return err
	}
	defer drain(nc)
	reg := newRegistry()
	cfg.Conn, cfg.Registerer = nc, reg
	s, err := scheduler.New(cfg)
	if err != nil {
		return err
	}
	onStop(ctx, log, func() stopPlan {
		n := s.Trackers()
		return stopPlan{
			doing:    fmt.Sprintf("taking no new requests, watching the %s in flight it placed until they end, then draining NATS", requests(n)),
			inFlight: n, upTo: drainTimeout + c.ShutdownTimeout + drainTimeout,
			bound: fmt.Sprintf("5s request-log consumer drain + %s for its requests (--shutdown-timeout) + 5s NATS drain", c.ShutdownTimeout),
		}
	})
	r := newRoles(ctx)
	metrics.serve(reg, metricsProbe{nc: nc, ready: s.Ready, stopping: r.ctx.Done(),
		drainReason: "scheduler stopping: it takes no new requests"}, func(err error) { r.fail("metrics", err) })
	r.run("scheduler", s.Run)
	return roleErr(ctx, r.wait())
}

// schedulerConfig is the scheduler's configuration from the flags, without
// its connection and registry.
func schedulerConfig(c *schedulerCmd, log *slog.Logger) (scheduler.Config, error) {
	b, f, rl, t := c.busFlags, c.schedulerFlags, c.requestLogFlags, c.timeoutFlags
	policy, err := scheduler.NewPolicy(f.Policy, f.SessionEpsilon)
	if err != nil {
		return scheduler.Config{}, err
	}
	return scheduler.Config{
		Subjects: b.subjects(), ID: c.ID, Policy: policy, BlockSize: f.BlockSize, StreamReplicas: b.Replicas,
		HeartbeatTimeout: f.HeartbeatTimeout, RequestTimeout: t.RequestTimeout, SessionTTL: f.SessionTTL, MaxSessions: f.MaxSessions, ShutdownTimeout: c.ShutdownTimeout,
		Logger:      log,
		NoGroupWait: f.NoGroupWait, ResendAfter: f.ResendAfter, RequestLog: rl.streamConfig(), Pool: f.Pool,
		FrontendGoneAfter: f.FrontendGone,
	}, nil
}
