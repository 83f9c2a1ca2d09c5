package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	tea "charm.land/bubbletea/v2"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/top"
)

// topConnectTimeout bounds top's wait for NATS.
const topConnectTimeout = 10 * time.Second

// topCmd shows the cluster live, from the bus alone.
type topCmd struct {
	natsFlags `embed:""`
	Prefix    string        `name:"subject-prefix" default:"kvbus" help:"First token of every kvbus subject."`
	Once      bool          `name:"once" help:"Watch for --watch, print one snapshot and exit (for scripts and tests)."`
	JSON      bool          `name:"json" help:"With --once: print the snapshot as JSON."`
	Watch     time.Duration `name:"watch" default:"3s" help:"With --once: how long to listen before the snapshot (heartbeats come every second)."`
	Refresh   time.Duration `name:"refresh" default:"500ms" help:"Redraw interval (positive; at most 1s)."`
	Window    time.Duration `name:"window" default:"1m" help:"Span of the rates, TTFT percentiles and hit ratios (positive)."`
	Sessions  int           `name:"sessions" default:"10" help:"Busiest sessions listed (0: none)."`

	// errOut receives what top says while it connects; nil means standard
	// error (tests set it).
	errOut io.Writer
	// connectTimeout bounds the wait for NATS (0: topConnectTimeout).
	connectTimeout time.Duration
}

// Validate refuses flag values top cannot honour; kong calls it after
// parsing, Run before it connects.
func (c *topCmd) Validate() error {
	switch {
	case c.Sessions < 0:
		return fmt.Errorf("--sessions must be 0 or more (got %d): how many of the busiest sessions are listed, 0 for none", c.Sessions)
	case c.Window <= 0:
		return fmt.Errorf("--window must be positive (got %s): the span of the rates, percentiles and hit ratios, e.g. 1m", c.Window)
	case c.Refresh <= 0:
		return fmt.Errorf("--refresh must be positive (got %s): the redraw interval, e.g. 500ms (at most 1s)", c.Refresh)
	case c.Watch < 0:
		return fmt.Errorf("--watch must be 0 or more (got %s): how long --once listens before its snapshot, e.g. 3s", c.Watch)
	}
	return nil
}

func (c *topCmd) Run(ctx context.Context) error {
	if err := c.Validate(); err != nil {
		return err
	}
	nc, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer nc.Close()
	w, err := top.New(top.Config{Conn: nc, Subjects: busFlags{Prefix: c.Prefix}.subjects(), Window: c.Window, Sessions: c.Sessions})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- w.Run(ctx) }()
	if c.Once {
		select {
		case err := <-errc:
			return err
		case <-w.Subscribed():
		}
		select {
		case err := <-errc:
			return err
		case <-time.After(c.Watch):
		}
		snap := w.Snapshot(time.Now())
		if len(snap.Sessions) > c.Sessions {
			snap.Sessions = snap.Sessions[:c.Sessions]
		}
		if c.JSON {
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			return enc.Encode(snap)
		}
		_, err := os.Stdout.WriteString(top.NewModel(w, c.Refresh, c.Sessions).Render())
		return err
	}
	p := tea.NewProgram(top.NewModel(w, c.Refresh, c.Sessions), tea.WithContext(ctx))
	if _, err := p.Run(); err != nil && ctx.Err() == nil {
		return err
	}
	cancel()
	return <-errc
}

// connect reaches NATS, saying at once where it connects and why it waits;
// once connected, only errors are logged (the screen is the terminal's).
func (c *topCmd) connect(ctx context.Context) (*nats.Conn, error) {
	out := c.errOut
	if out == nil {
		out = os.Stderr
	}
	level := &slog.LevelVar{} // info while connecting
	log := slog.New(logsink.NewTextHandler(out, &slog.HandlerOptions{Level: level}))
	timeout := c.connectTimeout
	if timeout <= 0 {
		timeout = topConnectTimeout
	}
	shown := bus.RedactURLs(c.NATSURL)
	log.Info("kvbus top: connecting to NATS", "url", shown, "gives_up_after", timeout.String())
	cfg := c.natsFlags.config("kvbus-top", log)
	cfg.ConnectTimeout = timeout
	start := time.Now()
	nc, err := bus.Connect(ctx, cfg)
	if err != nil {
		if ctx.Err() == nil && time.Since(start) >= timeout {
			return nil, fmt.Errorf("top: %w; gave up after %s: check that this NATS server is up and reachable from here "+
				"(its address and port, a firewall, a container's network)", err, timeout)
		}
		return nil, fmt.Errorf("top: %w", err)
	}
	level.Set(slog.LevelError)
	return nc, nil
}
