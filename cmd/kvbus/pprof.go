package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/kvbus/kvbus/bus"
)

// pprofFlags expose Go's profiler on a role (issue 14: profile what users
// run). Off by default: the endpoints reveal the process's internals.
type pprofFlags struct {
	PprofAddr string `name:"pprof-addr" help:"Serve Go's profiler (/debug/pprof/: CPU, heap, allocs, goroutines, mutex, block) on HOST:PORT; empty: off. Bind it to loopback."`
}

// startPprof serves the profiler until ctx ends; the returned stop waits for
// it. Without --pprof-addr it does nothing.
func (f pprofFlags) startPprof(ctx context.Context, log *slog.Logger) (stop func(), err error) {
	if f.PprofAddr == "" {
		return func() {}, nil
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	ln, err := net.Listen("tcp", f.PprofAddr)
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("--pprof-addr %s: %w (another process, another kvbus's profiler perhaps, has it: choose another port, or leave --pprof-addr empty)", f.PprofAddr, err)
	}
	if err != nil {
		return nil, fmt.Errorf("--pprof-addr %s: %w (give HOST:PORT on loopback, e.g. 127.0.0.1:6060, or leave it empty)", f.PprofAddr, err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			log.Error("pprof server stopped", "err", err)
		}
	}()
	ctx, cancel := context.WithCancel(ctx)
	go func() { <-ctx.Done(); _ = srv.Close() }()
	log.Info("pprof listening", "addr", ln.Addr().String())
	return func() { cancel(); <-done }, nil
}

// cmdline is pprof's /debug/pprof/cmdline with the values of secret flags
// (--api-key, --nats-password, --nats-token, …) and URL passwords shown as
// "xxxxx": pprof's own served them to anyone reaching --pprof-addr.
func cmdline(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = fmt.Fprint(w, strings.Join(redactArgs(os.Args), "\x00"))
}

// redactArgs returns args with every secret flag's value and every URL's
// password replaced.
func redactArgs(args []string) []string {
	out := make([]string, len(args))
	secret := func(flag string) bool {
		name := strings.ToLower(strings.TrimLeft(flag, "-"))
		for _, s := range []string{"key", "password", "token", "secret"} {
			if strings.Contains(name, s) {
				return true
			}
		}
		return false
	}
	next := false // the previous arg was a secret flag without "="
	for i, a := range args {
		switch {
		case next:
			out[i], next = "xxxxx", false
		case strings.HasPrefix(a, "-") && secret(strings.SplitN(a, "=", 2)[0]):
			if name, _, ok := strings.Cut(a, "="); ok {
				out[i] = name + "=xxxxx"
			} else {
				out[i], next = a, true
			}
		case strings.Contains(a, "://"):
			out[i] = bus.RedactURLs(a)
		default:
			out[i] = a
		}
	}
	return out
}
