package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"
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
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	ln, err := net.Listen("tcp", f.PprofAddr)
	if err != nil {
		return nil, fmt.Errorf("--pprof-addr %s: %w", f.PprofAddr, err)
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
