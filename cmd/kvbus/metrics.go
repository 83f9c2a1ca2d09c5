package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Every role's --metrics-addr listener: /metrics, /livez and /healthz.

// newRegistry returns a registry with the Go and process collectors.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// listenMetrics binds --metrics-addr (nothing when it is empty) for a
// metricsServer, which the caller closes. A role binds it before it
// connects: a port in use stops the process before it acts as a scheduler
// or joins a rank (a second worker given a running rank's identity took its
// group out until it exited).
func listenMetrics(log *slog.Logger, addr string) (*metricsServer, error) {
	if addr == "" {
		return newMetricsServer(log, nil), nil
	}
	// A malformed address is not a port in use: say what to give.
	if _, port, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("--metrics-addr %q: %w: give HOST:PORT, e.g. :9090, or empty to disable", addr, err)
	} else if _, err := net.LookupPort("tcp", port); err != nil {
		return nil, fmt.Errorf("--metrics-addr %q: port %q: %w: give HOST:PORT with a port up to 65535, e.g. :9090, or empty to disable", addr, port, err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics listen on %s: %w (is this role already running? stop it, or choose another --metrics-addr, or empty to disable)", addr, err)
	}
	return newMetricsServer(log, ln), nil
}

// metricsServer serves /metrics, /livez (the process is up and its NATS
// connection not closed for good: a NATS restart is not a reason to kill
// the process, and its store with it) and /healthz (readiness: connected
// to NATS, and ready() if given) on
// --metrics-addr. It outlives the role it reports on: the role closes it
// last, once it has stopped and drained its connection, so that while it
// stops probes get /healthz 503 "draining" and /livez 200 rather than
// "connection refused", and the drain's and the hand-off's counters can
// still be scraped. (It closed with the role's context before: the moment
// SIGTERM came.)
type metricsServer struct {
	log *slog.Logger
	ln  net.Listener // nil: --metrics-addr is empty, nothing is served

	mu     sync.Mutex
	srv    *http.Server
	served chan struct{} // closed when Serve returned
}

// metricsProbe is what the endpoints report on.
type metricsProbe struct {
	nc    *nats.Conn
	ready func() (bool, string) // nil: ready while live
	// stopping is closed when the role begins to stop: /healthz answers
	// 503 draining, with drainReason, and /livez 200 whatever NATS does
	// (a liveness failure would get the process killed mid-drain).
	stopping    <-chan struct{}
	drainReason string
}

func newMetricsServer(log *slog.Logger, ln net.Listener) *metricsServer {
	return &metricsServer{log: log, ln: ln}
}

// serve starts serving on the listener; fail gets an error that ends the
// serving before close.
func (m *metricsServer) serve(reg *prometheus.Registry, p metricsProbe, fail func(error)) {
	if m.ln == nil {
		return
	}
	srv := &http.Server{Handler: metricsHandler(reg, p), ReadHeaderTimeout: 5 * time.Second}
	served := make(chan struct{})
	m.mu.Lock()
	m.srv, m.served = srv, served
	m.mu.Unlock()
	m.log.Info("metrics listening", "addr", m.ln.Addr().String())
	go func() {
		defer close(served)
		if err := srv.Serve(m.ln); !errors.Is(err, http.ErrServerClosed) {
			fail(err)
		}
	}()
}

// close stops serving, waits for Serve to return and closes the listener.
func (m *metricsServer) close() {
	m.mu.Lock()
	srv, served := m.srv, m.served
	m.mu.Unlock()
	if srv != nil {
		_ = srv.Close()
		<-served
	}
	if m.ln != nil {
		_ = m.ln.Close()
	}
}

func metricsHandler(reg *prometheus.Registry, p metricsProbe) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	status := func(w http.ResponseWriter, code int, v map[string]string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(v)
	}
	stopping := func() bool {
		select {
		case <-p.stopping:
			return true
		default:
			return false
		}
	}
	connected := func(w http.ResponseWriter) bool {
		if p.nc != nil && !p.nc.IsConnected() {
			status(w, http.StatusServiceUnavailable, map[string]string{"status": "nats disconnected"})
			return false
		}
		return true
	}
	mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) {
		switch {
		case stopping():
			status(w, http.StatusOK, map[string]string{"status": "alive", "detail": "stopping"})
		case p.nc != nil && p.nc.IsClosed():
			// Closed for good (the server refused its credentials twice,
			// or answered an error nats.go does not reconnect after):
			// only a restart helps.
			status(w, http.StatusServiceUnavailable, map[string]string{"status": "nats connection closed"})
		case p.nc != nil && !p.nc.IsConnected():
			// A NATS restart: the connection comes back by itself, and a
			// liveness probe that failed now would restart the process and
			// empty its KV store.
			status(w, http.StatusOK, map[string]string{"status": "alive", "detail": "nats reconnecting"})
		default:
			status(w, http.StatusOK, map[string]string{"status": "alive"})
		}
	})
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if stopping() {
			status(w, http.StatusServiceUnavailable, map[string]string{"status": "draining", "reason": p.drainReason})
			return
		}
		if !connected(w) {
			return
		}
		if p.ready != nil {
			if ok, why := p.ready(); !ok {
				status(w, http.StatusServiceUnavailable, map[string]string{"status": "not ready", "reason": why})
				return
			}
		}
		status(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	return mux
}
