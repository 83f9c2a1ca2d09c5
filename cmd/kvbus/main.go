// Command kvbus runs the roles of kvbus, an LLM-serving request pipeline over
// NATS: serve (everything in one process), nats, frontend, scheduler and
// worker. Every flag has a KVBUS_* environment twin.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/alecthomas/kong"
	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/internal/logsink"
)

type cli struct {
	Serve     serveCmd         `cmd:"" help:"Run everything in one process: embedded NATS, frontend, one scheduler, --groups groups of --ranks ranks."`
	NATS      natsCmd          `cmd:"" name:"nats" help:"Run the embedded nats-server alone, with JetStream."`
	Frontend  frontendCmd      `cmd:"" help:"Run the OpenAI-compatible HTTP frontend."`
	Scheduler schedulerCmd     `cmd:"" help:"Run a scheduler replica."`
	Worker    workerCmd        `cmd:"" help:"Run one rank of a worker group."`
	Capture   captureCmd       `cmd:"" help:"Copy requests from the bus into a capture file, or summarise one."`
	Replay    replayCmd        `cmd:"" help:"Replay a capture file or a trace (Mooncake, TraceLab, Azure) onto the bus or a frontend and report."`
	Tap       tapCmd           `cmd:"" help:"Print bus messages live, decoded to JSON, one per line (with kvbus auth keys: the observer key)."`
	Bench     benchCmd         `cmd:"" help:"Replay one trace on an embedded cluster per placement policy and compare them side by side."`
	Health    healthcheckCmd   `cmd:"" name:"healthcheck" help:"Exit 0 when a role's /healthz answers 200 (for container health checks)."`
	Auth      authCmd          `cmd:"" help:"Give every role its own NATS key and only the subjects it needs (init, show, probe)."`
	Report    reportCmd        `cmd:"" help:"Redraw the HTML plots of a JSON report (kvbus report --html out.html report.json)."`
	Loadgen   loadgenCmd       `cmd:"" help:"Drive an OpenAI-compatible server over HTTP with concurrent clients and print req/s and latency percentiles."`
	Top       topCmd           `cmd:"" help:"Watch the cluster live from the bus: groups, queues, cache hits, TTFT, busiest sessions (with kvbus auth keys: the observer key)."`
	Version   kong.VersionFlag `env:"-" help:"Print kvbus's version and exit."`
}

func main() {
	// The first SIGINT/SIGTERM stops the command gracefully, the second at
	// once (see watchSignals).
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	// Every role logs through one sink: a line costs its formatting, and
	// one goroutine writes them out in batches.
	sink, err := logsink.New(logsink.Config{Out: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvbus:", err)
		os.Exit(1)
	}
	notice := &stopNotice{out: sink}
	ctx, cancel := context.WithCancel(withStopNotice(context.Background(), notice))
	defer cancel()
	go watchSignals(sigs, notice, cancel, func(code int) {
		// What is logged is written out first, within a second.
		flushed := make(chan struct{})
		go func() { _ = sink.Close(); close(flushed) }()
		select {
		case <-flushed:
		case <-time.After(time.Second):
		}
		os.Exit(code)
	})
	var c cli
	kctx := kong.Parse(&c,
		kong.Bind(sink),
		kong.BindTo(ctx, (*context.Context)(nil)),
		kong.Name("kvbus"),
		kong.Description("kvbus: an LLM-serving request pipeline over NATS that carries a conversation's session id from the OpenAI API to every KV store rank."),
		kong.DefaultEnvars("KVBUS"),
		kong.Vars{"version": buildVersion()},
		kong.ShortUsageOnError(), // the full usage buried a one-line error under 80 lines
	)
	// SIGHUP (the terminal closed) stops a role as SIGTERM does, where
	// Go's default killed it on the spot; kvbus nats reloads on it
	// instead, and under nohup it stays ignored.
	if (kctx.Selected() == nil || kctx.Selected().Name != "nats") && !signal.Ignored(syscall.SIGHUP) {
		signal.Notify(sigs, syscall.SIGHUP)
	}
	err = kctx.Run()
	_ = sink.Close()
	if err != nil && !errors.Is(err, errStoppedConnecting) {
		fmt.Fprintln(os.Stderr, "kvbus:", err)
		os.Exit(1)
	}
}

// roles runs functions concurrently until all return; the first error
// cancels the others.
type roles struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex // guards err: fail may be called from outside run
	err    error
}

func newRoles(ctx context.Context) *roles {
	r := &roles{}
	r.ctx, r.cancel = context.WithCancel(ctx)
	return r
}

func (r *roles) run(name string, f func(context.Context) error) {
	r.wg.Go(func() { r.fail(name, f(r.ctx)) })
}

// fail records a role's error, the first one only, and cancels the
// others; a nil error or a cancellation is not a failure.
func (r *roles) fail(name string, err error) {
	if err != nil && !errors.Is(err, context.Canceled) {
		r.mu.Lock()
		if r.err == nil {
			r.err = fmt.Errorf("%s: %w", name, err)
		}
		r.mu.Unlock()
		r.cancel()
	}
}

func (r *roles) wait() error {
	r.wg.Wait()
	r.cancel()
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// connect opens a role's NATS connection; inbox is its reply inbox prefix
// (bus.InboxPrefix: with the keys of `kvbus auth init` each role may read
// only its own). See connectRole for the context it returns.
func connect(ctx context.Context, f natsFlags, name, inbox string, log *slog.Logger) (context.Context, *nats.Conn, error) {
	return connectRole(ctx, f.config(name, inbox, log))
}

// connectRole connects with cfg and returns, with the connection, the
// context the role runs in: ctx, ended when the server closes the
// connection for good (it refused the role's credentials at a reconnect:
// a rotated key after a NATS restart; or it answered an error nats.go does
// not reconnect after), with that error as its cause. The
// role then stops as at a signal, and roleErr makes Run return the error,
// so that the process exits non-zero instead of running on a closed
// connection. A close by the role itself (its drain) is no such error.
func connectRole(ctx context.Context, cfg bus.Config) (context.Context, *nats.Conn, error) {
	ctx, lost := context.WithCancelCause(ctx)
	cfg.OnClosed = lost
	nc, err := bus.Connect(ctx, cfg)
	if err != nil {
		if errors.Is(err, context.Canceled) {
			err = fmt.Errorf("%w: %w", errStoppedConnecting, err)
		}
		lost(nil)
		return ctx, nil, err
	}
	return ctx, nc, nil
}

// errStoppedConnecting is a role's error when it was stopped (a signal)
// while it still waited for NATS: a stop, as at any other time, that exits
// 0 and says nothing more, not a failure to connect advising to start a
// NATS server.
var errStoppedConnecting = errors.New("stopped while waiting for NATS")

// closeConn closes nc at once, as the role's own close (not reported as
// the server's, see connectRole).
func closeConn(nc *nats.Conn) {
	nc.SetClosedHandler(nil)
	nc.Close()
}

// roleErr is what a role's Run returns: err, unless its connection was
// closed for good (connectRole), which is the error then.
func roleErr(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); errors.Is(cause, bus.ErrClosed) {
		return cause
	}
	return err
}

// drainTimeout bounds a role's drain of its NATS connections.
const drainTimeout = 5 * time.Second

// drain drains connections with a deadline.
func drain(conns ...*nats.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), drainTimeout)
	defer cancel()
	for _, nc := range conns {
		bus.Drain(ctx, nc)
	}
}
