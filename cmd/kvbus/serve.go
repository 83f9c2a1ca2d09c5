package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/cluster"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
	"github.com/kvbus/kvbus/workers"
)

type serveCmd struct {
	logFlags           `embed:""`
	pprofFlags         `embed:""`
	modelFlags         `embed:""`
	frontendFlags      `embed:""`
	requestLogFlags    `embed:""`
	timeoutFlags       `embed:""`
	schedulerFlags     `embed:""`
	engineFlags        `embed:""`
	engineAdapterFlags `embed:""`
	tokenizerFlags     `embed:""`
	Prefix             string `name:"subject-prefix" default:"kvbus" help:"First token of every kvbus subject."`
	NATSAddr           string `name:"nats-addr" default:"127.0.0.1:4222" help:"Listen address of the embedded NATS server (point the nats CLI at it to watch the bus)."`
	DataDir            string `name:"data-dir" help:"JetStream storage directory (default: a temporary directory, removed at exit)."`
	Groups             int    `name:"groups" positive:"" default:"1" help:"Worker groups (engine instances); with --engine openai, one per --engine-url."`
	Ranks              int    `name:"ranks" positive:"" default:"4" help:"Ranks per group (TP size; EP ranks equal TP ranks)."`
}

func (c *serveCmd) Run(ctx context.Context) error {
	log := c.logger()
	if err := distinctListeners(listener{"--nats-addr", c.NATSAddr}, listener{"--http-addr", c.HTTPAddr},
		listener{"--pprof-addr", c.PprofAddr}); err != nil {
		return err
	}
	onStop(ctx, log, nil)
	stopPprof, err := c.startPprof(ctx, log)
	if err != nil {
		return err
	}
	defer stopPprof()
	if c.HeartbeatTimeout <= c.HeartbeatEvery {
		// Every rank would be silent longer than the timeout between two
		// heartbeats: no group would stay ready, and nothing said why.
		return fmt.Errorf("--heartbeat-timeout %s must be above --heartbeat-interval %s (a rank is gone once silent that long; give at least twice the interval, the defaults are 3s and 1s)",
			c.HeartbeatTimeout, c.HeartbeatEvery)
	}
	if err := c.checkValues(c.requestLogFlags, c.timeoutFlags); err != nil {
		return err
	}
	if err := portFree(ctx, c.HTTPAddr, c.ReusePort); err != nil {
		return err
	}
	cfg, err := c.clusterConfig()
	if err != nil {
		return err
	}
	cfg.NATSAddr, cfg.DataDir, cfg.Logger, cfg.Registry = c.NATSAddr, c.DataDir, log, newRegistry()
	// The frontend's /metrics serves the whole process's registry.
	fc := c.baseConfig(c.requestLogFlags)
	if fc.Tokenizer, err = c.tokenizer(c.EngineAPIKey, c.engineTLSFlags); err != nil {
		return err
	}
	cfg.Frontend = &fc
	cl, err := cluster.Start(ctx, cfg)
	if err != nil {
		return err
	}
	reg := cfg.Registry
	onStop(ctx, log, func() stopPlan { return c.stopPlan(reg) })
	log.Info("kvbus serving", "nats_url", cl.NATSURL, "http_addr", c.HTTPAddr, "groups", cl.Groups(), "ranks", cl.Ranks(), "policy", c.Policy)
	select {
	case <-ctx.Done():
	case <-cl.Done(): // a role failed (a port in use): stop, and say why
	}
	return cl.Wait()
}

// clusterConfig maps the flags shared by serve and bench onto a cluster.
func (c *serveCmd) clusterConfig() (cluster.Config, error) {
	profile, err := workers.LookupModelProfile(c.ModelProfile)
	if err != nil {
		return cluster.Config{}, err
	}
	if c.Groups < 1 || c.Ranks < 1 || c.BlockSize < 1 {
		return cluster.Config{}, fmt.Errorf("--groups (%d), --ranks (%d) and --block-size (%d) must be at least 1", c.Groups, c.Ranks, c.BlockSize)
	}
	capacity, err := kvCapacity(c.KVCapacity, profile.BytesPerTokenPerRank(c.Ranks), c.BlockSize)
	if err != nil {
		return cluster.Config{}, err
	}
	if c.Engine != workers.EngineOpenAI { // a model server keeps its own cache
		if err := fitStores(c.KVPayload, c.KVCapacity, c.Groups*c.Ranks, capacity, rolesCluster); err != nil {
			return cluster.Config{}, err
		}
	}
	handoff, err := c.drainHandoff(profile.BytesPerTokenPerRank(c.Ranks))
	if err != nil {
		return cluster.Config{}, err
	}
	replay, err := c.streamReplay()
	if err != nil {
		return cluster.Config{}, err
	}
	var engines []cluster.EngineBackend
	switch {
	case c.Engine == workers.EngineOpenAI && len(c.EngineURL) == 0:
		return cluster.Config{}, errors.New("--engine openai needs --engine-url http://HOST:PORT, one per group, comma-separated")
	case c.Engine == workers.EngineOpenAI:
		for i := range c.EngineURL {
			oc, ev, err := c.openAI(i)
			if err != nil {
				return cluster.Config{}, err
			}
			engines = append(engines, cluster.EngineBackend{OpenAI: oc, KVEvents: ev})
		}
	}
	if err := c.openAIOnly(c.Tokenizer == "engine"); err != nil {
		return cluster.Config{}, err
	}
	model, err := c.one()
	if err != nil {
		return cluster.Config{}, err
	}
	return cluster.Config{
		Engines:  engines,
		Subjects: messages.Subjects{Prefix: c.Prefix}, Groups: c.Groups, Ranks: c.Ranks,
		Model: model, ModelProfile: c.ModelProfile, KVCapacity: capacity, Payload: c.KVPayload, Evict: c.Evict,
		Sim: workers.SimConfig{
			Profile: workers.SimProfile{PrefillPerToken: c.PrefillPerToken, LoadPerToken: c.LoadPerToken, RemoteLoadPerToken: c.RemoteLoad,
				DecodePerToken: c.DecodePerToken},
			TimeScale: c.TimeScale, DefaultMaxTokens: c.DefaultMaxTokens,
		},
		HeartbeatInterval: c.HeartbeatEvery, ShutdownTimeout: c.ShutdownTimeout,
		Policy: c.Policy, SessionEpsilon: &c.SessionEpsilon, BlockSize: c.BlockSize,
		HeartbeatTimeout: c.HeartbeatTimeout, RequestTimeout: c.RequestTimeout, SessionTTL: c.SessionTTL, MaxSessions: c.MaxSessions,
		NoGroupWait: c.NoGroupWait, FrontendGoneAfter: c.FrontendGone, ResendAfter: c.ResendAfter, SaveWait: c.SaveWait, DrainHandoff: handoff, StreamReplay: replay, Pool: c.Pool,
	}, nil
}

// stopPlan: serve stops its roles in order (cluster.Cluster.stopInOrder):
// the frontend finishes what it accepted, then the schedulers stop (5 s
// request-log consumer drain, then up to 20 s watching what they placed),
// then the ranks finish theirs within --shutdown-timeout (a hand-off finds
// no other group to take blocks: they all stop; up to 3 heartbeat
// intervals to see it), then the connections drain and the embedded NATS
// server stops.
func (c *serveCmd) stopPlan(reg *prometheus.Registry) stopPlan {
	n := gaugeSum(reg, "kvbus_frontend_inflight_requests")
	fe, bound := frontendStopBound(c.RequestTimeout, c.StopGrace, c.StopTimeout)
	return stopPlan{
		doing:    fmt.Sprintf("finishing %s in flight (%s), then stopping the schedulers and the ranks", requests(n), c.newOnes()),
		inFlight: n,
		upTo:     fe + drainTimeout + scheduler.DefaultShutdownTimeout + c.ShutdownTimeout + 3*c.HeartbeatEvery + drainTimeout,
		bound:    bound + " + 25s (schedulers) + --shutdown-timeout + 3 × --heartbeat-interval + 5s NATS drain",
	}
}
