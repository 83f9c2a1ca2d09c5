package bus

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode"

	"github.com/nats-io/nats-server/v2/server"
)

// ErrServer is wrapped when the embedded NATS server cannot start.
var ErrServer = errors.New("bus: embedded NATS server")

// ServerConfig configures the embedded nats-server.
type ServerConfig struct {
	// Addr is HOST:PORT to listen on; port 0 picks a free port, an empty Addr
	// means 127.0.0.1:4222.
	Addr string
	// DataDir holds JetStream's file storage. Empty means a new temporary
	// directory, removed by Server.Shutdown.
	DataDir string
	// ServerName names the server (required by clustering; default
	// "kvbus-<port>").
	ServerName string
	// MaxPayload is the largest message the server accepts (default 8 MiB).
	MaxPayload int32
	// Cluster is an optional route listen address (HOST:PORT) and Routes the
	// other nodes' route URLs, for a clustered JetStream: each needs the
	// other, and a clustered server should have its own ServerName.
	Cluster     string
	ClusterName string
	Routes      []string
	// ClusterUser and ClusterPassword, if the password is set, are required
	// from every server that routes in, and sent on the routes this server
	// makes (a route URL's own user info wins). The user defaults to
	// "kvbus". With Token or AuthConfig, a Cluster needs them: otherwise any
	// server that reaches the route port joins and bypasses every key.
	ClusterUser, ClusterPassword string
	// ClusterPasswordFile, if set, holds ClusterPassword (not with it; `kvbus
	// auth init` writes one): read at start and again by every Reload, so a
	// rotated password takes effect without a restart.
	ClusterPasswordFile string
	// Token, if set, is required from every client.
	Token string
	// AuthConfig, if set, is a nats-server configuration file whose
	// authorization block (users, nkeys and their permissions; `kvbus auth
	// init` writes one) applies to every client. Not with Token.
	AuthConfig string
	// TLSCert and TLSKey (PEM files), if set, make clients connect with TLS;
	// TLSCA, if also set, requires and verifies client certificates. With a
	// Cluster, the routes use TLS too, both ways verified against
	// ClusterTLSCA, else TLSCA (the system's roots without either), so with
	// a Cluster TLSCert must verify against it. An expired certificate, or
	// one not yet valid, is refused; one that expires within 14 days is
	// warned about.
	TLSCert, TLSKey, TLSCA string
	// ClusterTLSCA, if set, is the CA (PEM) the routes verify each other's
	// certificates against, so that servers with certificates of a private
	// CA can route over TLS while clients connect without certificates of
	// their own (TLSCA empty). Needs TLSCert and a Cluster.
	ClusterTLSCA string
	// MonitorAddr, if set, serves nats-server's monitoring endpoints there
	// (HOST:PORT), /healthz among them.
	MonitorAddr string
	// Logger receives the server's notices (at info), warnings and errors
	// (refused credentials, failed TLS handshakes, route trouble), a
	// connection's repeats collapsed to one line per host and message per
	// 10 s; nil means slog.Default().
	Logger *slog.Logger
	// Debug adds the server's debug output, at debug level.
	Debug bool
	// LameDuckDuration and LameDuckGracePeriod shape LameDuck: the whole
	// of it, and the wait before the first client is closed (defaults
	// nats-server's: 2 min and 10 s; the grace period must be shorter).
	LameDuckDuration, LameDuckGracePeriod time.Duration
}

// Server is a running embedded nats-server.
type Server struct {
	*server.Server
	tempDir string
	log     *serverLogger
	// cfg and base are what the server was started with (Reload).
	cfg    ServerConfig
	base   server.Options
	logger *slog.Logger
	// storeDir is the JetStream store's directory (--data-dir), watched
	// for write errors (watchStore) until stopStore is closed, once
	// (stopWatch): a lame duck stop and a Shutdown that cuts it short
	// run at once.
	storeDir  string
	stopStore chan struct{}
	storeDone chan struct{}
	stopWatch sync.Once
}

// Validate checks what needs no file and no network, and says which flag
// to fix: the client (--addr), monitoring and route listen addresses are
// HOST:PORT with a numeric port; flags that go together are given together
// and exclusive ones are not (--cluster-password and
// --cluster-password-file, --token and --auth-config, --tls-cert and
// --tls-key, --tls-ca and --cluster-tls-ca without a certificate, route
// flags without --cluster-addr and the reverse); a cluster whose clients
// need credentials has route authentication; every route is a URL; and
// MaxPayload and the lame duck durations are not negative, the grace
// period shorter than the duration (nats-server's defaults for zeros).
// The zero ServerConfig is valid: every field has a default. Errors wrap
// ErrServer. StartServer calls it before it reads a file or listens; the
// files themselves (TLS, --auth-config, --cluster-password-file) and the
// ports are checked by StartServer.
func (c ServerConfig) Validate() error {
	if _, _, _, err := c.listenAddr(); err != nil {
		return err
	}
	for _, a := range []struct{ what, flag, addr string }{
		{"monitor", "--monitor-addr", c.MonitorAddr},
		{"cluster", "--cluster-addr", c.Cluster},
	} {
		if a.addr == "" {
			continue
		}
		_, p, err := net.SplitHostPort(a.addr)
		if err == nil {
			_, err = strconv.Atoi(p)
		}
		if err != nil {
			return fmt.Errorf("%w: %s address %q: %v (want HOST:PORT with a numeric port, 0 for any free one: check %s)", ErrServer, a.what, a.addr, err, a.flag)
		}
	}
	if strings.ContainsFunc(c.ServerName, unicode.IsSpace) {
		// nats-server says only "server name cannot contain spaces".
		return fmt.Errorf("%w: --server-name %q contains spaces: give the server a name without any, its own in the cluster", ErrServer, c.ServerName)
	}
	if c.ClusterPassword != "" && c.ClusterPasswordFile != "" {
		return fmt.Errorf("%w: --cluster-password and --cluster-password-file exclude each other", ErrServer)
	}
	if c.Token != "" && c.AuthConfig != "" {
		return fmt.Errorf("%w: --token and --auth-config exclude each other", ErrServer)
	}
	if err := checkRouteAuth(c); err != nil {
		return err
	}
	if err := checkClusterFlags(c); err != nil {
		return err
	}
	if c.Cluster != "" {
		if _, err := routeURLs(c); err != nil {
			return err
		}
	}
	if err := checkTLSFlags(c); err != nil {
		return err
	}
	if c.MaxPayload < 0 {
		return fmt.Errorf("%w: MaxPayload %d: must be >= 0 (0: 8 MiB)", ErrServer, c.MaxPayload)
	}
	if c.LameDuckDuration < 0 || c.LameDuckGracePeriod < 0 {
		return fmt.Errorf("%w: --lame-duck-duration (%s) and --lame-duck-grace-period (%s) must be >= 0 (0: nats-server's default)",
			ErrServer, c.LameDuckDuration, c.LameDuckGracePeriod)
	}
	dur := cmp.Or(c.LameDuckDuration, server.DEFAULT_LAME_DUCK_DURATION)
	if grace := cmp.Or(c.LameDuckGracePeriod, server.DEFAULT_LAME_DUCK_GRACE_PERIOD); grace >= dur {
		return fmt.Errorf("%w: --lame-duck-grace-period (%s) must be shorter than --lame-duck-duration (%s) (0: nats-server's defaults, 10s and 2m)",
			ErrServer, grace, dur)
	}
	return nil
}

// clientAddrFlag names the flags that set ServerConfig.Addr.
const clientAddrFlag = "--addr (kvbus nats) or --nats-addr (kvbus serve)"

// listenAddr is the client listen address (Addr, default 127.0.0.1:4222),
// its host and its port as nats-server takes it (0 asks for a free one).
func (c ServerConfig) listenAddr() (addr, host string, port int, err error) {
	addr = cmp.Or(c.Addr, "127.0.0.1:4222")
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return "", "", 0, fmt.Errorf("%w: address %q: %v (want HOST:PORT: check %s)", ErrServer, addr, err, clientAddrFlag)
	}
	if port, err = strconv.Atoi(portStr); err != nil {
		return "", "", 0, fmt.Errorf("%w: port %q: %v (want a numeric port, 0 for any free one: check %s)", ErrServer, portStr, err, clientAddrFlag)
	}
	if port == 0 {
		port = server.RANDOM_PORT
	}
	return addr, host, port, nil
}

// StartServer starts an embedded nats-server with JetStream and waits until
// it accepts connections. It calls cfg.Validate first.
func StartServer(cfg ServerConfig) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	addr, host, port, err := cfg.listenAddr()
	if err != nil {
		return nil, err
	}
	_, portStr, _ := net.SplitHostPort(addr)
	for _, l := range []struct{ what, flag, addr string }{
		{"client", clientAddrFlag, addr},
		{"monitoring", "--monitor-addr", cfg.MonitorAddr},
		{"cluster", "--cluster-addr", cfg.Cluster},
	} {
		if err := portFree(l.what, l.flag, l.addr); err != nil {
			return nil, err
		}
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.Default()
	}
	if cfg.ClusterPassword, err = readClusterPassword(cfg); err != nil {
		return nil, err
	}
	warnClusterFlags(cfg, logger)
	if err := checkServerTLS(cfg, logger, time.Now()); err != nil {
		return nil, err
	}
	s := &Server{}
	dir := cfg.DataDir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "kvbus-nats-*"); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrServer, err)
		}
		s.tempDir = dir
	} else if err := os.MkdirAll(filepath.Join(dir, "jetstream"), 0o755); err != nil {
		// nats-server says why only in its own log, then never becomes
		// ready: say it here.
		return nil, fmt.Errorf("%w: JetStream storage directory %s: %v (give --data-dir a writable directory)", ErrServer, dir, err)
	}
	maxPayload := cfg.MaxPayload
	if maxPayload == 0 {
		maxPayload = 8 << 20
	}
	name := cfg.ServerName
	if name == "" {
		name = "kvbus-" + portStr
	}
	s.cfg, s.logger = cfg, logger
	s.base = server.Options{
		ServerName:    name,
		Host:          host,
		Port:          port,
		JetStream:     true,
		StoreDir:      dir,
		MaxPayload:    maxPayload,
		NoSigs:        true,
		Authorization: cfg.Token,
		Debug:         cfg.Debug,
		// nats-server's defaults when zero.
		LameDuckDuration:    cfg.LameDuckDuration,
		LameDuckGracePeriod: cfg.LameDuckGracePeriod,
	}
	opts, err := serverOptions(cfg, s.base)
	if err != nil {
		s.cleanup()
		return nil, err
	}
	ns, err := server.NewServer(opts)
	if err != nil {
		s.cleanup()
		return nil, fmt.Errorf("%w: %w", ErrServer, err)
	}
	s.log = newServerLogger(logger, cfg.ClusterPassword, cfg.Token)
	ns.SetLoggerV2(s.log, cfg.Debug, false, false)
	go ns.Start()
	if !ns.ReadyForConnections(30 * time.Second) {
		ns.Shutdown()
		s.log.close()
		s.cleanup()
		return nil, fmt.Errorf("%w: not ready to accept connections on %s within 30s (is the port in use? --debug shows the server's own log)", ErrServer, addr)
	}
	// The start-up banner went to debug; from here on notices (routes
	// joining, JetStream leaders, slow consumers) are logged at info.
	s.log.quiet.Store(false)
	s.Server = ns
	s.storeDir, s.stopStore, s.storeDone = dir, make(chan struct{}), make(chan struct{})
	go func() {
		defer close(s.storeDone)
		s.watchStore(s.stopStore)
	}()
	return s, nil
}

// Reload reads the authorization file (--auth-config) and the TLS files
// again and applies them to the running server, as nats-server does on
// SIGHUP: keys that `kvbus auth init` added, rotated or rewrote, renewed
// certificates and a rotated cluster password (ClusterPasswordFile) take
// effect without a restart; routes already up stay, new ones need the new
// password. Clients stay connected but
// for those whose key is gone. The files are checked as at start (a
// certificate out of its validity period, a key that is not the
// certificate's, a file without users); on an error nothing changes.
func (s *Server) Reload() error {
	cfg := s.cfg
	var err error
	if cfg.ClusterPassword, err = readClusterPassword(cfg); err != nil {
		return err
	}
	if err := checkServerTLS(cfg, s.logger, time.Now()); err != nil {
		return err
	}
	opts, err := serverOptions(cfg, s.base)
	if err != nil {
		return err
	}
	s.log.redact(cfg.ClusterPassword)
	if err := s.Server.ReloadOptions(opts); err != nil {
		return fmt.Errorf("%w: reload: %v", ErrServer, err)
	}
	s.cfg = cfg
	return nil
}

// readClusterPassword returns cfg's cluster password: the content of
// ClusterPasswordFile if set, else ClusterPassword.
func readClusterPassword(cfg ServerConfig) (string, error) {
	if cfg.ClusterPasswordFile == "" {
		return cfg.ClusterPassword, nil
	}
	data, err := os.ReadFile(cfg.ClusterPasswordFile)
	if err != nil {
		return "", fmt.Errorf("%w: --cluster-password-file: %v (kvbus auth init DIR writes DIR/cluster-password)", ErrServer, err)
	}
	pw := strings.TrimSpace(string(data))
	if pw == "" {
		return "", fmt.Errorf("%w: --cluster-password-file %s is empty", ErrServer, cfg.ClusterPasswordFile)
	}
	return pw, nil
}

// serverOptions are base with what cfg's files and flags add: the keys of
// the authorization file, TLS for clients and routes, monitoring and the
// cluster. StartServer and Reload build them alike, so a reload changes
// only what the files now say.
func serverOptions(cfg ServerConfig, base server.Options) (*server.Options, error) {
	opts := &base
	if cfg.AuthConfig != "" {
		ac, err := server.ProcessConfigFile(cfg.AuthConfig)
		if err != nil {
			return nil, fmt.Errorf("%w: --auth-config %s: %v", ErrServer, cfg.AuthConfig, err)
		}
		if len(ac.Nkeys) == 0 && len(ac.Users) == 0 {
			return nil, fmt.Errorf("%w: --auth-config %s has no users: write one with `kvbus auth init DIR`", ErrServer, cfg.AuthConfig)
		}
		opts.Nkeys, opts.Users = ac.Nkeys, ac.Users
	}
	if cfg.TLSCert != "" || cfg.TLSKey != "" {
		tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: cfg.TLSCert, KeyFile: cfg.TLSKey, CaFile: cfg.TLSCA, Verify: cfg.TLSCA != ""})
		if err != nil {
			return nil, fmt.Errorf("%w: TLS: %v", ErrServer, err)
		}
		opts.TLS, opts.TLSConfig, opts.TLSVerify, opts.TLSTimeout = true, tc, cfg.TLSCA != "", 2
	}
	if cfg.MonitorAddr != "" {
		mh, mp, err := net.SplitHostPort(cfg.MonitorAddr)
		if err != nil {
			return nil, fmt.Errorf("%w: monitor address %q: %v", ErrServer, cfg.MonitorAddr, err)
		}
		opts.HTTPHost = mh
		opts.HTTPPort = serverPort(mp)
	}
	if cfg.Cluster != "" {
		ch, cp, err := net.SplitHostPort(cfg.Cluster)
		if err != nil {
			return nil, fmt.Errorf("%w: cluster address %q: %v", ErrServer, cfg.Cluster, err)
		}
		opts.Cluster.Host = ch
		opts.Cluster.Port = serverPort(cp)
		opts.Cluster.Name = cfg.ClusterName
		if opts.Routes, err = routeURLs(cfg); err != nil {
			return nil, err
		}
		if cfg.ClusterPassword != "" {
			opts.Cluster.Username, opts.Cluster.Password = clusterUser(cfg), cfg.ClusterPassword
		}
		if opts.TLSConfig != nil {
			// Routes are TLS both ways: each server is the other's client,
			// and both verify the peer's certificate against the CA.
			rc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: cfg.TLSCert, KeyFile: cfg.TLSKey, CaFile: cmp.Or(cfg.ClusterTLSCA, cfg.TLSCA), Verify: true})
			if err != nil {
				return nil, fmt.Errorf("%w: route TLS: %v", ErrServer, err)
			}
			rc.RootCAs = rc.ClientCAs
			opts.Cluster.TLSConfig, opts.Cluster.TLSTimeout = rc, 2
		}
	}
	return opts, nil
}

// serverPort is a listener's port as nats-server takes it: port 0 asks for
// a free one (RANDOM_PORT), as it does for the client address; nats-server
// reads a 0 as "no listener".
func serverPort(p string) int {
	n, _ := strconv.Atoi(p)
	if n == 0 {
		return server.RANDOM_PORT
	}
	return n
}

// portFree fails at once, and says what to do, when addr (the server's
// what address; "" or port 0: none to check) cannot be listened on:
// nats-server would log the error and leave ReadyForConnections to time out
// 30 s later, naming nothing.
func portFree(what, flag, addr string) error {
	if _, p, err := net.SplitHostPort(addr); addr == "" || err != nil || p == "0" {
		return nil // nothing to check, or an address the server will refuse itself
	}
	l, err := net.Listen("tcp", addr)
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("%w: cannot listen on %s, the %s address: %v (is another kvbus or NATS server running there? stop it, or give this one another address with %s)",
			ErrServer, addr, what, err, flag)
	}
	if err != nil {
		return fmt.Errorf("%w: cannot listen on %s, the %s address: %v (check %s)", ErrServer, addr, what, err, flag)
	}
	return l.Close()
}

// LameDuck stops the server the way a planned stop of one server of a
// cluster should go (nats-server's lame duck mode): it stops accepting
// clients, hands the leadership of its JetStream streams and consumers to
// the other servers and stops its JetStream, tells its clients to go
// elsewhere, waits the grace period, then closes them one by one over the
// rest of LameDuckDuration, so they reconnect to the other servers spread
// out rather than all at once. It returns once the server is down, and
// removes a temporary data directory as Shutdown does. A second signal's
// Shutdown (or process exit) cuts it short.
func (s *Server) LameDuck() { s.stop(false) }

// Shutdown stops the server, waits for it, and removes a temporary data
// directory.
func (s *Server) Shutdown() { s.stop(true) }

// stop stops the server at once or in lame duck mode (whose steps are
// logged), waits for it, and removes a temporary data directory.
func (s *Server) stop(now bool) {
	if s.log != nil && now {
		s.log.quiet.Store(true) // the shutdown's steps
	}
	if s.stopStore != nil { // set before StartServer returns
		s.stopWatch.Do(func() { close(s.stopStore) })
		<-s.storeDone
	}
	if s.Server != nil {
		if now {
			s.Server.Shutdown()
		} else {
			s.Server.LameDuckShutdown()
		}
		s.Server.WaitForShutdown()
	}
	if s.log != nil {
		s.log.close()
	}
	s.cleanup()
}

func (s *Server) cleanup() {
	if s.tempDir != "" {
		_ = os.RemoveAll(s.tempDir)
	}
}

// checkClusterFlags refuses route settings that nats-server would ignore or
// wait on for ever: --routes without --cluster-addr (the server ran alone,
// saying nothing), and --cluster-addr without --routes (a clustered
// JetStream needs its routes at start: nats-server never became ready, and
// the error came 30 s later asking whether the port was in use).
func checkClusterFlags(cfg ServerConfig) error {
	routes := strings.Trim(strings.Join(cfg.Routes, ","), ", ") != "" // an empty KVBUS_ROUTES= is none
	if cfg.Cluster == "" {
		if routes {
			return fmt.Errorf("%w: --routes %s without --cluster-addr: the server would run alone and ignore them; "+
				"give this server's own route listen address too (--cluster-addr 0.0.0.0:6222), the same way on every server of the cluster",
				ErrServer, RedactURLs(strings.Join(cfg.Routes, ",")))
		}
		return nil
	}
	if !routes {
		return fmt.Errorf("%w: --cluster-addr %s without --routes: a clustered JetStream server needs the other servers' route URLs to start; "+
			"give every server of the cluster the others' (--routes nats://n2:6222,nats://n3:6222), or drop --cluster-addr to run one server alone",
			ErrServer, cfg.Cluster)
	}
	return nil
}

// warnClusterFlags warns about route settings that are allowed but likely
// not meant: a cluster password without --cluster-addr, and a clustered
// server without --server-name (every kvbus nats on the same port has the
// same default name, and servers with the same name refuse each other's
// routes).
func warnClusterFlags(cfg ServerConfig, log *slog.Logger) {
	if cfg.Cluster == "" {
		if cfg.ClusterPassword != "" || cfg.ClusterUser != "" {
			log.Warn("a cluster password (--cluster-password-file, --cluster-password or --cluster-user) without --cluster-addr: "+
				"this server runs alone and has no routes; give --cluster-addr and --routes to cluster it", "component", "nats-server")
		}
		return
	}
	if cfg.ServerName == "" {
		log.Warn("no --server-name on a clustered server: it is named kvbus-<port of --addr>, as is every other kvbus nats with that port, "+
			"and servers with the same name refuse each other's routes; give each server of the cluster its own --server-name", "component", "nats-server")
	}
}

// clusterUser is the user name routes authenticate with.
func clusterUser(cfg ServerConfig) string {
	if cfg.ClusterUser != "" {
		return cfg.ClusterUser
	}
	return "kvbus"
}

// checkRouteAuth refuses a route port without authentication on a server
// whose clients need credentials: any server reaching it could join the
// cluster and give its own anonymous clients every subject.
// A ClusterPasswordFile counts as a password: StartServer refuses one that
// cannot be read or is empty.
func checkRouteAuth(cfg ServerConfig) error {
	password := cfg.ClusterPassword != "" || cfg.ClusterPasswordFile != ""
	if cfg.ClusterUser != "" && !password {
		return fmt.Errorf("%w: --cluster-user needs a --cluster-password (or --cluster-password-file)", ErrServer)
	}
	if cfg.Cluster == "" || password {
		return nil
	}
	locked := ""
	switch {
	case cfg.AuthConfig != "":
		locked = "--auth-config"
	case cfg.Token != "":
		locked = "--token"
	default:
		return nil
	}
	return fmt.Errorf("%w: %s with --cluster-addr but no route authentication: any server that reaches the route port %s could join the cluster, "+
		"and its clients read and publish every subject without a key; add --cluster-password-file FILE (kvbus auth init writes DIR/cluster-password) "+
		"or --cluster-password (KVBUS_CLUSTER_PASSWORD), the same on every server of the cluster", ErrServer, locked, cfg.Cluster)
}

// routeURLs parses cfg.Routes (comma-separated within an element too),
// with the cluster's credentials on each URL that carries none of its own.
func routeURLs(cfg ServerConfig) ([]*url.URL, error) {
	var out []*url.URL
	for _, r := range cfg.Routes {
		for _, r := range strings.Split(r, ",") {
			if r = strings.TrimSpace(r); r == "" {
				continue
			}
			u, err := url.Parse(r)
			if err != nil || u.Host == "" {
				return nil, fmt.Errorf("%w: route %q: want nats://HOST:PORT (--routes)", ErrServer, redactURL(r))
			}
			if u.User == nil && cfg.ClusterPassword != "" {
				u.User = url.UserPassword(clusterUser(cfg), cfg.ClusterPassword)
			}
			out = append(out, u)
		}
	}
	return out, nil
}

// redactURL hides a password in a URL that failed to parse.
func redactURL(s string) string {
	if at := strings.LastIndex(s, "@"); at >= 0 {
		if i := strings.Index(s, "://"); i >= 0 && i < at {
			return s[:i+3] + "xxxxx" + s[at:]
		}
		return "xxxxx" + s[at:]
	}
	return s
}
