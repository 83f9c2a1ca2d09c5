package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/kvbus/kvbus/bus"
)

type natsCmd struct {
	logFlags   `embed:""`
	pprofFlags `embed:""`
	Addr       string   `name:"addr" default:"127.0.0.1:4222" help:"Client listen address HOST:PORT."`
	DataDir    string   `name:"data-dir" help:"JetStream storage directory (default: a temporary directory)."`
	Token      string   `name:"token" help:"Require this token from clients."`
	Auth       string   `name:"auth-config" type:"path" help:"nats-server config file whose authorization block applies (kvbus auth init writes one): each role's key gets only its subjects."`
	TLSCert    string   `name:"tls-cert" type:"path" help:"Server certificate (PEM): clients connect with TLS."`
	TLSKey     string   `name:"tls-key" type:"path" help:"Server key (PEM)."`
	TLSCA      string   `name:"tls-ca" type:"path" help:"CA (PEM) to require and verify client certificates (and, without --cluster-tls-ca, the routes')."`
	ClusterCA  string   `name:"cluster-tls-ca" type:"path" help:"CA (PEM) the routes verify each other's certificates against (with --tls-cert and --cluster-addr): servers of a private CA route over TLS while clients need no certificate."`
	Debug      bool     `name:"debug" help:"Log the server's own debug output."`
	Monitor    string   `name:"monitor-addr" help:"Serve the server's monitoring endpoints (/healthz, /varz, /jsz) on HOST:PORT."`
	Name       string   `name:"server-name" help:"Server name (default kvbus-<port>; must differ in a cluster)."`
	Cluster    string   `name:"cluster-addr" help:"Route listen address HOST:PORT: join a cluster of kvbus nats servers."`
	CName      string   `name:"cluster-name" default:"kvbus" help:"Cluster name."`
	Routes     []string `name:"routes" help:"Route URLs of the other servers (nats://host:6222), comma-separated."`
	// Route authentication: never logged.
	ClusterUser     string        `name:"cluster-user" help:"User name of the route authentication (default kvbus; needs a cluster password)."`
	ClusterPassword string        `name:"cluster-password" help:"Password every server routing in must give, and this one gives on its routes: the same on every server. Required with --cluster-addr and --auth-config or --token. Prefer --cluster-password-file (a flag shows in ps)."`
	ClusterPassFile string        `name:"cluster-password-file" type:"path" help:"File holding the cluster password (kvbus auth init writes DIR/cluster-password)."`
	LameDuck        time.Duration `name:"lame-duck-duration" default:"30s" help:"How long lame duck mode takes (SIGUSR2, as nats-server's: a planned stop of one server of a cluster): the stream leaders move to the other servers at once, then the clients are closed one by one, so they reconnect spread out. SIGTERM stops at once."`
	LameDuckGrace   time.Duration `name:"lame-duck-grace-period" default:"5s" help:"In lame duck mode, how long the clients are told to go elsewhere before the first is closed (shorter than --lame-duck-duration)."`
}

func (c *natsCmd) Run(ctx context.Context) error {
	lf := c.logFlags
	if c.Debug { // the server's debug output is logged at debug level
		lf.LogLevel = "debug"
	}
	log := lf.logger()
	if c.LameDuck <= 0 || c.LameDuckGrace >= c.LameDuck {
		return fmt.Errorf("--lame-duck-grace-period (%s) must be shorter than --lame-duck-duration (%s), which must be above 0", c.LameDuckGrace, c.LameDuck)
	}
	if err := distinctListeners(listener{"--addr", c.Addr}, listener{"--monitor-addr", c.Monitor},
		listener{"--cluster-addr", c.Cluster}, listener{"--pprof-addr", c.PprofAddr}); err != nil {
		return err
	}
	onStop(ctx, log, func() stopPlan { return stopPlan{doing: "shutting the NATS server down", inFlight: -1} })
	stopPprof, err := c.startPprof(ctx, log)
	if err != nil {
		return err
	}
	defer stopPprof()
	// SIGHUP reads --auth-config and the TLS files again, as nats-server
	// does: new or rotated keys and renewed certificates without a restart.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	// SIGUSR2 enters lame duck mode, as nats-server's does. Both are
	// caught from before the server is ready: unhandled, SIGUSR2 would
	// kill the process.
	ldm := make(chan os.Signal, 1)
	signal.Notify(ldm, syscall.SIGUSR2)
	defer signal.Stop(ldm)
	srv, err := bus.StartServer(bus.ServerConfig{Addr: c.Addr, DataDir: c.DataDir, Token: c.Token, AuthConfig: c.Auth, Debug: c.Debug,
		TLSCert: c.TLSCert, TLSKey: c.TLSKey, TLSCA: c.TLSCA, ClusterTLSCA: c.ClusterCA, MonitorAddr: c.Monitor,
		ServerName: c.Name, Cluster: c.Cluster, ClusterName: c.CName, Routes: c.Routes,
		ClusterUser: c.ClusterUser, ClusterPassword: c.ClusterPassword, ClusterPasswordFile: c.ClusterPassFile, Logger: log,
		LameDuckDuration: c.LameDuck, LameDuckGracePeriod: c.LameDuckGrace})
	if err != nil {
		return err
	}
	monitor := "off (--monitor-addr)"
	if a := srv.MonitorAddr(); a != nil {
		monitor = a.String()
	}
	log.Info("nats server ready", "url", srv.ClientURL(), "jetstream", true, "data_dir", srv.StoreDir(), "monitor_addr", monitor)
	// The certificate is checked as at start every few hours: a warning
	// from 14 days before it ends, an error once it has.
	certCheck := time.NewTicker(certCheckEvery)
	defer certCheck.Stop()
	for {
		select {
		case now := <-certCheck.C:
			if err := srv.CheckCertificate(now); err != nil {
				log.Error("the NATS server's TLS certificate is not valid now: clients refuse new connections to it; renew it, then send the server SIGHUP (make reload-nats)", "err", err)
			}
		case <-hup:
			if err := srv.Reload(); err != nil {
				log.Error("SIGHUP: the configuration was not reloaded; the server runs on as it was: fix the files and send SIGHUP again", "err", err)
			} else {
				log.Info("SIGHUP: reloaded the authorization and TLS files and the cluster password file", "auth_config", c.Auth, "tls_cert", c.TLSCert,
					"cluster_password_file", c.ClusterPassFile)
			}
		case <-ldm:
			log.Info("SIGUSR2: entering lame duck mode: the stream leaders move to the other servers, the clients are told to go elsewhere and closed one by one",
				"lame_duck_duration", c.LameDuck, "lame_duck_grace_period", c.LameDuckGrace)
			done := make(chan struct{})
			go func() {
				defer close(done)
				srv.LameDuck()
			}()
			select {
			case <-done:
				log.Info("nats server stopped after lame duck mode")
			case <-ctx.Done(): // SIGTERM or SIGINT cuts it short
				log.Info("nats server stopping before lame duck mode ended")
				srv.Shutdown()
				<-done
			}
			return nil
		case <-ctx.Done():
			log.Info("nats server stopping")
			srv.Shutdown()
			return nil
		}
	}
}

// certCheckEvery is how often kvbus nats checks its TLS certificate's
// validity while it runs.
const certCheckEvery = 6 * time.Hour
