package main

import (
	"context"
	"encoding/json"
	"os"
	"time"

	tea "charm.land/bubbletea/v2"

	"github.com/kvbus/kvbus/top"
)

// topCmd shows the cluster live, from the bus alone.
type topCmd struct {
	natsFlags `embed:""`
	Prefix    string        `name:"subject-prefix" default:"kvbus" help:"First token of every kvbus subject."`
	Once      bool          `name:"once" help:"Watch for --watch, print one snapshot and exit (for scripts and tests)."`
	JSON      bool          `name:"json" help:"With --once: print the snapshot as JSON."`
	Watch     time.Duration `name:"watch" default:"3s" help:"With --once: how long to listen before the snapshot (heartbeats come every second)."`
	Refresh   time.Duration `name:"refresh" default:"500ms" help:"Redraw interval (at most 1s)."`
	Window    time.Duration `name:"window" default:"1m" help:"Span of the rates, TTFT percentiles and hit ratios."`
	Sessions  int           `name:"sessions" default:"10" help:"Busiest sessions listed."`
}

func (c *topCmd) Run(ctx context.Context) error {
	// The screen is the terminal's: only errors are logged.
	nc, err := connect(ctx, c.natsFlags, "kvbus-top", logFlags{LogLevel: "error"}.logger())
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
