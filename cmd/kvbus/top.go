package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	tea "charm.land/bubbletea/v2"

	"github.com/nats-io/nats.go"
	"golang.org/x/term"

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
	Refresh   time.Duration `name:"refresh" default:"500ms" help:"Redraw interval (positive)."`
	Window    time.Duration `name:"window" default:"1m" help:"Span of the rates, TTFT percentiles and hit ratios (positive)."`
	Sessions  int           `name:"sessions" default:"10" help:"Busiest sessions listed (0: none)."`
	// HeartbeatTimeout is the schedulers' --heartbeat-timeout: give the
	// same when groups beat slower than every second.
	HeartbeatTimeout time.Duration `name:"heartbeat-timeout" default:"3s" help:"A rank not heard for longer is gone (positive; the schedulers' default, 3s)."`
	MaxSessions      int           `name:"max-sessions" default:"10000" help:"Sessions followed at most; past it the least recently active are forgotten (positive)."`

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
		return fmt.Errorf("--refresh must be positive (got %s): the redraw interval, e.g. 500ms", c.Refresh)
	case c.HeartbeatTimeout <= 0:
		return fmt.Errorf("--heartbeat-timeout must be positive (got %s): how long a silent rank counts as live, e.g. 3s", c.HeartbeatTimeout)
	case c.MaxSessions <= 0:
		return fmt.Errorf("--max-sessions must be positive (got %d): how many sessions top follows at most, e.g. 10000", c.MaxSessions)
	case c.JSON && !c.Once:
		return errors.New("--json needs --once: the live view is for a terminal; kvbus top --once --json prints one snapshot")
	case c.Watch < 0:
		return fmt.Errorf("--watch must be 0 or more (got %s): how long --once listens before its snapshot, e.g. 3s", c.Watch)
	}
	return nil
}

func (c *topCmd) Run(ctx context.Context) error {
	if err := c.Validate(); err != nil {
		return err
	}
	// The live view draws on the terminal of its output: into a pipe or a
	// file it drew nothing (a few escape sequences) and ran until killed.
	if !c.Once && !term.IsTerminal(int(os.Stdout.Fd())) {
		return errors.New("top: the live view needs a terminal, and standard output is not one (a pipe or a file): " +
			"for scripts use --once (one plain snapshot after --watch) or --once --json")
	}
	nc, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer nc.Close()
	w, err := top.New(top.Config{Conn: nc, Subjects: busFlags{Prefix: c.Prefix}.subjects(), Window: c.Window, Sessions: c.Sessions,
		HeartbeatTimeout: c.HeartbeatTimeout, MaxSessions: c.MaxSessions, URL: bus.RedactURLs(c.NATSURL)})
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
		// Said once it follows the bus: what is published from now on is
		// in the snapshot (a script can start its traffic on this line).
		c.stderrLog(slog.LevelInfo).Info("kvbus top: following the bus", "snapshot_in", c.Watch.String())
		select {
		case err := <-errc:
			return err
		case <-time.After(c.Watch):
		}
		if c.JSON {
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			return enc.Encode(w.SnapshotWith(time.Now(), top.SnapshotOptions{Sessions: c.Sessions}))
		}
		_, err := os.Stdout.WriteString(top.NewModel(w, c.Refresh, c.Sessions).Report(plainOutput(os.Stdout)))
		return err
	}
	p := tea.NewProgram(top.NewModel(w, c.Refresh, c.Sessions), tea.WithContext(ctx))
	if _, err := p.Run(); err != nil && ctx.Err() == nil {
		return err
	}
	cancel()
	return <-errc
}

// plainOutput reports whether f takes no styling: not a terminal (a pipe,
// a file), or NO_COLOR or TERM=dumb set.
func plainOutput(f *os.File) bool {
	return !term.IsTerminal(int(f.Fd())) || os.Getenv("NO_COLOR") != "" || os.Getenv("TERM") == "dumb"
}

// stderrLog logs to standard error (errOut in tests) at level.
func (c *topCmd) stderrLog(level slog.Leveler) *slog.Logger {
	out := c.errOut
	if out == nil {
		out = os.Stderr
	}
	return slog.New(logsink.NewTextHandler(out, &slog.HandlerOptions{Level: level}))
}

// connect reaches NATS, saying at once where it connects and why it waits;
// once connected, only errors are logged (the screen is the terminal's).
func (c *topCmd) connect(ctx context.Context) (*nats.Conn, error) {
	level := &slog.LevelVar{} // info while connecting
	log := c.stderrLog(level)
	timeout := c.connectTimeout
	if timeout <= 0 {
		timeout = topConnectTimeout
	}
	shown := bus.RedactURLs(c.NATSURL)
	log.Info("kvbus top: connecting to NATS", "url", shown, "gives_up_after", timeout.String())
	cfg := c.natsFlags.config("kvbus-top", "", log)
	cfg.ConnectTimeout = timeout
	start := time.Now()
	nc, err := bus.Connect(ctx, cfg)
	if err != nil {
		if errors.Is(err, context.Canceled) {
			// A signal while waiting: a stop, as for tap and the roles.
			return nil, fmt.Errorf("%w: %w", errStoppedConnecting, err)
		}
		if ctx.Err() == nil && time.Since(start) >= timeout {
			return nil, fmt.Errorf("top: %w; gave up after %s: check that this NATS server is up and reachable from here "+
				"(its address and port, a firewall, a container's network)", err, timeout)
		}
		return nil, fmt.Errorf("top: %w", err)
	}
	level.Set(slog.LevelError)
	return nc, nil
}
