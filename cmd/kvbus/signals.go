package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/frontend"
)

// Signals. The first SIGINT or SIGTERM ends the command's context: a role
// stops taking work and finishes what it has, and says so in one log line
// naming the signal, what it finishes and for how long at most. A second
// one ends the process at once, with 128 + the signal's number (130 for
// SIGINT, 143 for SIGTERM), after a line saying that it stops without
// finishing. signal.NotifyContext, used before, went on catching signals
// after the first: a second Ctrl-C or kill was silently ignored while a
// frontend waited up to two minutes for its requests, and nothing said
// why the process was still there.

// stopPlan is what a role does once a signal stops it.
type stopPlan struct {
	// doing follows "stopping: " in the log line, e.g. "finishing 3
	// requests in flight".
	doing string
	// inFlight is the count of requests in flight; -1: not known.
	inFlight int
	// upTo bounds the stop (0: not known); bound says which flags make it.
	upTo  time.Duration
	bound string
}

// stopNotice is what the process says when a signal stops it: a role
// registers its logger and plan with onStop.
type stopNotice struct {
	// out takes the second signal's line when no role registered (nil:
	// standard error).
	out  io.Writer
	mu   sync.Mutex
	log  *slog.Logger
	plan func() stopPlan
}

type stopNoticeKey struct{}

func withStopNotice(ctx context.Context, n *stopNotice) context.Context {
	return context.WithValue(ctx, stopNoticeKey{}, n)
}

// onStop registers the role's logger and, if not nil, its plan with the
// process's signal handling; a role calls it as it starts (plan nil) and
// again once it can tell what it would finish. A context without it
// (tests calling Run) ignores it.
func onStop(ctx context.Context, log *slog.Logger, plan func() stopPlan) {
	n, ok := ctx.Value(stopNoticeKey{}).(*stopNotice)
	if !ok {
		return
	}
	n.mu.Lock()
	n.log, n.plan = log, plan
	n.mu.Unlock()
}

func (n *stopNotice) get() (*slog.Logger, func() stopPlan) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.log, n.plan
}

// stopping logs the first signal, if a role registered.
func (n *stopNotice) stopping(sig os.Signal) {
	log, plan := n.get()
	if log == nil {
		return
	}
	p := stopPlan{inFlight: -1}
	if plan != nil {
		p = plan()
	}
	msg := signalName(sig) + ": stopping"
	if p.doing != "" {
		msg += ": " + p.doing
	}
	attrs := []any{"signal", signalName(sig)}
	if p.inFlight >= 0 {
		attrs = append(attrs, "in_flight", p.inFlight)
	}
	if p.upTo > 0 {
		msg += ", up to " + p.upTo.String()
		if p.bound != "" {
			msg += " (" + p.bound + ")"
		}
		attrs = append(attrs, "up_to", p.upTo)
	}
	log.Info(msg+"; send the signal again to stop at once", attrs...)
}

// stoppingAtOnce logs the second signal.
func (n *stopNotice) stoppingAtOnce(sig os.Signal, code int) {
	msg := fmt.Sprintf("%s again: stopping at once, without finishing (exit code %d)", signalName(sig), code)
	if log, _ := n.get(); log != nil {
		log.Warn(msg, "signal", signalName(sig), "exit_code", code)
		return
	}
	out := n.out
	if out == nil {
		out = os.Stderr
	}
	fmt.Fprintln(out, "kvbus:", msg)
}

// watchSignals ends ctx (cancel) at the first signal on sigs and calls
// exit at the second, with the conventional 128 + the signal's number.
func watchSignals(sigs <-chan os.Signal, n *stopNotice, cancel context.CancelFunc, exit func(code int)) {
	sig, ok := <-sigs
	if !ok {
		return
	}
	n.stopping(sig)
	cancel()
	if sig, ok = <-sigs; !ok {
		return
	}
	code := exitCode(sig)
	n.stoppingAtOnce(sig, code)
	exit(code)
}

// exitCode is 128 + the signal's number, as shells report a process
// killed by it: 130 for SIGINT, 143 for SIGTERM.
func exitCode(sig os.Signal) int {
	if s, ok := sig.(syscall.Signal); ok {
		return 128 + int(s)
	}
	return 1
}

func signalName(sig os.Signal) string {
	switch sig {
	case syscall.SIGINT:
		return "SIGINT"
	case syscall.SIGTERM:
		return "SIGTERM"
	case syscall.SIGHUP:
		return "SIGHUP"
	}
	return sig.String()
}

// requests is "1 request", "3 requests", or "the requests" when n < 0.
func requests(n int) string {
	switch {
	case n < 0:
		return "the requests"
	case n == 1:
		return "1 request"
	}
	return fmt.Sprintf("%d requests", n)
}

// gaugeSum is the sum of a gauge's series in reg, or -1 when reg has
// none. It gathers the registry once: cheap enough for a signal.
func gaugeSum(reg *prometheus.Registry, name string) int {
	if reg == nil {
		return -1
	}
	mfs, err := reg.Gather()
	if err != nil {
		return -1
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		var sum float64
		for _, m := range mf.GetMetric() {
			sum += m.GetGauge().GetValue()
		}
		return int(sum)
	}
	return -1
}

// frontendStopBound bounds, by the frontend's own timers
// (frontend.Server.Run), how long it takes to stop before its NATS
// connection drains: it holds the listener open until the accepted
// requests are answered, up to --request-timeout (not with a negative
// --stop-grace), then gives the HTTP server's shutdown up to
// --request-timeout + 1 s; with --stop-timeout, that bound + 1 s.
func frontendStopBound(requestTimeout, stopGrace, stopTimeout time.Duration) (time.Duration, string) {
	if stopTimeout > 0 {
		return stopTimeout + time.Second, "--stop-timeout + 1s"
	}
	if requestTimeout <= 0 {
		requestTimeout = frontend.DefaultRequestTimeout
	}
	if stopGrace < 0 {
		return requestTimeout + time.Second, "--request-timeout + 1s"
	}
	return 2*requestTimeout + time.Second, "2 × --request-timeout + 1s"
}
