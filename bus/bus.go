// Package bus connects kvbus roles to NATS: connection options for real
// clusters (credentials, nkey, token, user/password, TLS), an embedded
// nats-server with JetStream, and the idempotent JetStream setup (the request
// stream and the schedulers' durable consumer).
package bus

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	neturl "net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
)

// ErrConnect is wrapped when a role cannot reach NATS.
var ErrConnect = errors.New("bus: cannot connect to NATS")

// Config says how a role connects to NATS. The zero value (after defaults)
// connects to nats://127.0.0.1:4222 without authentication.
type Config struct {
	// URL is one or more comma-separated server URLs.
	URL string
	// Name identifies the connection in the server's monitoring.
	Name string
	// CredsFile is a NATS credentials file (JWT + nkey seed).
	CredsFile string
	// NKeySeedFile is a file holding an nkey seed.
	NKeySeedFile string
	// Token is an authentication token.
	Token string
	// User and Password authenticate with a user name.
	User, Password string
	// TLSCA, TLSCert and TLSKey are PEM files; TLSCA alone verifies the
	// server, TLSCert and TLSKey together authenticate the client.
	TLSCA, TLSCert, TLSKey string
	// ConnectTimeout bounds the first connection (default 10 s).
	ConnectTimeout time.Duration
	// PingInterval is how often the connection pings its server (default
	// DefaultPingInterval). A server that answers none of
	// MaxPingsOutstanding+1 pings in a row is taken for dead and the role
	// reconnects, to another server of a cluster: a server whose host
	// stopped or was cut off closes no socket, and only the pings notice.
	PingInterval time.Duration
	// NoEcho: the connection does not receive its own publications. A
	// scheduler sets it: it subscribes to every replica's save plans and
	// must not spend time on its own (JetStream deliveries are unaffected).
	NoEcho bool
	// InboxPrefix is the prefix of the connection's reply inboxes
	// (InboxPrefix(role, group)); "" is nats.go's _INBOX. With the keys of
	// `kvbus auth init` each role may read only its own.
	InboxPrefix string
	// OnClosed, when set, is called once if the server closed the
	// connection for good: it refused the role's credentials at a
	// reconnect (a rotated key after a NATS restart), and nats.go gives
	// up after the second refusal despite reconnecting forever; or it
	// answered an error nats.go never reconnects after (a protocol line
	// over its max_control_line). err wraps ErrClosed and says what to
	// do; the role should stop with it. A close by the role itself (Close,
	// Drain) does not call it.
	OnClosed func(err error)
	// Logger receives connection state changes; nil means slog.Default().
	Logger *slog.Logger
}

// DefaultURL is used when Config.URL is empty.
const DefaultURL = nats.DefaultURL

// DefaultPingInterval is Config.PingInterval's default: a silent server is
// left after about three of them (nats.go's own default, 2 minutes with two
// pings outstanding, took 4 to 6 minutes).
const DefaultPingInterval = 5 * time.Second

// MaxPingsOutstanding is how many pings may go unanswered: the next one
// without an answer marks the connection stale.
const MaxPingsOutstanding = 2

// Validate checks that the options go together.
func (c Config) Validate() error {
	if (c.TLSCert == "") != (c.TLSKey == "") {
		return fmt.Errorf("%w: --nats-tls-cert and --nats-tls-key must be given together", ErrConnect)
	}
	if c.Password != "" && c.User == "" {
		return fmt.Errorf("%w: --nats-password needs --nats-user", ErrConnect)
	}
	var seen []string
	for _, s := range []struct{ value, name string }{
		{c.CredsFile, "--nats-creds (KVBUS_NATS_CREDS)"}, {c.NKeySeedFile, "--nats-nkey (KVBUS_NATS_NKEY)"},
		{c.Token, "--nats-token (KVBUS_NATS_TOKEN)"}, {c.User, "--nats-user (KVBUS_NATS_USER)"},
	} {
		if s.value != "" {
			seen = append(seen, s.name)
		}
	}
	if len(seen) > 1 {
		return fmt.Errorf("%w: give only one of credentials file, nkey seed, token, or user/password; got %s "+
			"(a value may come from a KVBUS_* environment variable: unset the one you do not mean)", ErrConnect, strings.Join(seen, " and "))
	}
	if c.InboxPrefix != "" {
		if err := nats.CustomInboxPrefix(c.InboxPrefix)(&nats.Options{}); err != nil {
			return fmt.Errorf("%w: inbox prefix %q: %v", ErrConnect, c.InboxPrefix, err)
		}
	}
	return nil
}

// Connect opens a NATS connection that reconnects forever, so that a role
// survives a NATS restart. It waits for the first connection at most
// ConnectTimeout and honours ctx.
func Connect(ctx context.Context, cfg Config) (*nats.Conn, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	violations := &onceSet{seen: map[string]struct{}{}}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	// Local files are checked before anything connects: a bad one is no
	// server that may yet come up.
	if err := checkTLSFiles(cfg, log); err != nil {
		return nil, err
	}
	if err := checkCredsFile(cfg); err != nil {
		return nil, err
	}
	warnSecretFileModes(cfg, log)
	url := cfg.URL
	if url == "" {
		url = DefaultURL
	}
	if err := checkURLs(url); err != nil {
		return nil, err
	}
	timeout := cfg.ConnectTimeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	ping := cfg.PingInterval
	if ping <= 0 {
		ping = DefaultPingInterval
	}
	tlsOn := cfg.TLSCA != "" || cfg.TLSCert != "" || strings.Contains(strings.ToLower(url), "tls://")
	var watching atomic.Bool // a reconnectProbe.watch runs
	// What a reconnect that cannot succeed was told: once per outage.
	refusals := &onceSet{seen: map[string]struct{}{}}
	probe := &reconnectProbe{log: log, name: cfg.Name, tlsOn: tlsOn, said: refusals}
	opts := []nats.Option{
		nats.Name(cfg.Name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, time.Second),
		nats.ReconnectBufSize(64 << 20),
		nats.RetryOnFailedConnect(false),
		nats.Timeout(2 * time.Second),
		nats.PingInterval(ping),
		nats.MaxPingsOutstanding(MaxPingsOutstanding),
		nats.DisconnectErrHandler(func(nc *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected: reconnecting (about every ¼ s, for as long as it takes; what is published meanwhile is buffered, up to 64 MiB); "+
					"a 'nats reconnected' line follows, or, while it cannot, lines naming why: check that the NATS server runs and is reachable",
					"conn", cfg.Name, "err", err)
			}
			if nc.IsReconnecting() && watching.CompareAndSwap(false, true) { // not at a Close
				go func() {
					defer watching.Store(false)
					probe.watch(nc)
				}()
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			refusals.reset()
			log.Info("nats reconnected", "conn", cfg.Name, "url", nc.ConnectedUrlRedacted())
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			subject := ""
			if sub != nil {
				subject = sub.Subject
			}
			if isAuthError(err) {
				// At a reconnect: nats.go closes the connection at the
				// second refusal (the ClosedHandler below ends the role).
				log.Error("nats refused this role's credentials at a reconnect: "+refusedAtReconnect, "conn", cfg.Name, "err", err)
				return
			}
			if errors.Is(err, nats.ErrPermissionViolation) {
				// The server refused a subject this role may not use: said
				// once per subject, not on every message.
				if !violations.first(err.Error()) {
					return
				}
				if subject == "" {
					// nats.go passes no subscription with a server's
					// violation: the subject is in its text.
					subject = violatedSubject(err)
				}
				log.Error("nats permissions violation: this role's key may not use the subject (see `kvbus auth show`)",
					"conn", cfg.Name, "subject", subject, "err", err)
				return
			}
			if advice, final := connectAdvice(err, tlsOn); sub == nil && final {
				// A reconnect's TLS handshake refused (nats.go reports
				// some of them here): said as reconnectProbe says them.
				probe.say(advice, err)
				return
			}
			if sub == nil && brokenConnection(err) {
				// A reconnect attempt met the server going away (it is
				// stopping or restarting): nats.go tries again; no error
				// of this role's.
				log.Warn("nats reconnect attempt cut off by the server; trying again", "conn", cfg.Name, "err", err)
				return
			}
			log.Error("nats async error", "conn", cfg.Name, "subject", subject, "err", err)
		}),
		nats.ClosedHandler(func(nc *nats.Conn) {
			// Closed by nats.go (not by Close or Drain, which replaces
			// this handler): it gave up reconnecting (the server refused
			// the credentials twice), or the server answered one of the
			// role's messages with an error that nats.go does not
			// reconnect after (a subject over the server's control line).
			// Either way the connection is gone for good.
			err := nc.LastError()
			advice := refusedAtReconnect
			switch {
			case isAuthError(err):
			case err == nil || isTransientError(err):
				// A Close by code that kept this handler: nats.go closes
				// only after an error that ends the connection.
				return
			default:
				advice = closedByServerError
			}
			lost := fmt.Errorf("%w: %v (%s)", ErrClosed, err, advice)
			log.Error("nats connection closed: "+advice, "conn", cfg.Name, "err", err)
			if cfg.OnClosed != nil {
				cfg.OnClosed(lost)
			}
		}),
	}
	if cfg.InboxPrefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(cfg.InboxPrefix))
	}
	// What a server may refuse: the credentials and TLS, for Connect and
	// for reconnectProbe's probes.
	var secure []nats.Option
	switch {
	case cfg.CredsFile != "":
		secure = append(secure, nats.UserCredentials(cfg.CredsFile))
	case cfg.NKeySeedFile != "":
		o, err := nats.NkeyOptionFromSeed(cfg.NKeySeedFile)
		if err != nil {
			return nil, fmt.Errorf("%w: --nats-nkey %s: %v (give the file of an nkey seed, such as DIR/<role>.nk that `kvbus auth init DIR` writes)", ErrConnect, cfg.NKeySeedFile, err)
		}
		secure = append(secure, o)
	case cfg.Token != "":
		secure = append(secure, nats.Token(cfg.Token))
	case cfg.User != "":
		secure = append(secure, nats.UserInfo(cfg.User, cfg.Password))
	}
	if cfg.TLSCA != "" {
		secure = append(secure, nats.RootCAs(cfg.TLSCA))
	}
	if cfg.TLSCert != "" {
		secure = append(secure, nats.ClientCert(cfg.TLSCert, cfg.TLSKey))
	}
	probe.url, probe.opts = url, append(secure, nats.Name(cfg.Name+"-probe"), nats.NoReconnect(), nats.Timeout(2*time.Second))
	opts = append(opts, secure...)
	if cfg.NoEcho {
		opts = append(opts, nats.NoEcho())
	}

	deadline := time.Now().Add(timeout)
	shown := RedactURLs(url)
	said := false // the first failure is logged, so a wait is not silent
	for {
		nc, err := nats.Connect(url, opts...)
		if err == nil {
			// Which server of a cluster: the one whose stop this role feels.
			log.Info("nats connected", "conn", cfg.Name, "url", nc.ConnectedUrlRedacted())
			return nc, nil
		}
		err = redactError(err, url, shown)
		advice, final := connectAdvice(err, tlsOn)
		if final || time.Now().After(deadline) {
			return nil, fmt.Errorf("%w at %s: %v (%s)", ErrConnect, shown, err, advice)
		}
		if !said {
			said = true
			log.Warn("cannot reach NATS yet; retrying", "conn", cfg.Name, "url", shown, "for", timeout.String(), "err", err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w at %s: %w; the last attempt: %v (%s)", ErrConnect, shown, ctx.Err(), err, advice)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// reconnectCheck is how often a reconnecting connection's last error is
// looked at; reconnectProbeEvery how often its servers are probed.
const (
	reconnectCheck      = 250 * time.Millisecond
	reconnectProbeFirst = 2 * time.Second
	reconnectProbeEvery = 30 * time.Second
)

// reconnectProbe says, once per cause until the connection is back, why a
// reconnecting connection cannot reconnect when a server refuses it in a
// way retrying will not mend: its TLS certificate does not verify against
// --nats-tls-ca, or it refuses this client's certificate (a NATS server
// restarted with new certificates, a client certificate that expired while
// the role ran). nats.go reports most of these to no callback and retries
// for ever, so a role said "nats disconnected" and then nothing. A server
// not up yet is not said (the disconnect was), nor a refused key (the
// ErrorHandler says it).
type reconnectProbe struct {
	log   *slog.Logger
	name  string
	tlsOn bool
	said  *onceSet
	// url and opts connect a probe: the role's URLs, credentials and TLS.
	url  string
	opts []nats.Option
}

// watch looks at nc's last error every reconnectCheck and, since nats.go
// clears it at the next server's attempt, probes each server itself
// (one connection, closed at once) reconnectProbeFirst after the
// disconnect and every reconnectProbeEvery after. It returns once nc is
// connected again or closed.
func (p *reconnectProbe) watch(nc *nats.Conn) {
	t := time.NewTicker(reconnectCheck)
	defer t.Stop()
	next := time.Now().Add(reconnectProbeFirst)
	for range t.C {
		if !nc.IsReconnecting() {
			return
		}
		p.check(nc.LastError())
		if time.Now().Before(next) {
			continue
		}
		next = time.Now().Add(reconnectProbeEvery)
		for _, u := range strings.Split(p.url, ",") {
			if !nc.IsReconnecting() {
				return
			}
			pc, err := nats.Connect(strings.TrimSpace(u), p.opts...)
			if err == nil {
				pc.Close()
				continue
			}
			p.check(redactError(err, u, RedactURLs(u)))
		}
	}
}

// check says err if retrying cannot mend it.
func (p *reconnectProbe) check(err error) {
	if err == nil || isAuthError(err) {
		return
	}
	if advice, final := connectAdvice(err, p.tlsOn); final {
		p.say(advice, err)
	}
}

// say logs a reconnect refused for a reason retrying will not mend, once
// per advice (the errors of one cause vary) until the connection is back.
func (p *reconnectProbe) say(advice string, err error) {
	if p.said.first(advice) {
		p.log.Error("nats cannot reconnect: "+advice+"; retrying", "conn", p.name, "err", err)
	}
}

// RedactURLs is urls (comma-separated) with every password (or token)
// shown as "xxxxx", as nats.go's ConnectedUrlRedacted shows it: for
// errors and logs.
// A URL net/url cannot parse (a password with '/' or '#' unescaped) has
// everything between its scheme and its last '@' replaced.
func RedactURLs(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		u, err := neturl.Parse(strings.TrimSpace(p))
		switch {
		case err == nil && u.User != nil:
			if _, has := u.User.Password(); has {
				u.User = neturl.UserPassword(u.User.Username(), "xxxxx")
			} else {
				u.User = neturl.User("xxxxx") // a token
			}
			parts[i] = u.String()
		case err != nil:
			if at := strings.LastIndex(p, "@"); at >= 0 {
				from := 0
				if s := strings.Index(p, "://"); s >= 0 && s < at {
					from = s + 3
				}
				parts[i] = p[:from] + "xxxxx" + p[at:]
			}
		}
	}
	return strings.Join(parts, ",")
}

// redactError is err with the URLs in its text (nats.go quotes a URL it
// cannot parse) as shown; a parse error is wrapped as ErrBadURL.
func redactError(err error, urls, shown string) error {
	text := err.Error()
	if urls != shown {
		// nats.go quotes a URL without the spaces around its comma.
		for i, p := range strings.Split(urls, ",") {
			if p = strings.TrimSpace(p); p != "" {
				text = strings.ReplaceAll(text, p, strings.TrimSpace(strings.Split(shown, ",")[i]))
			}
		}
	}
	var uerr *neturl.Error
	if errors.As(err, &uerr) {
		if strings.Contains(uerr.URL, "@") {
			// The reason quotes a piece of the URL, of its password too
			// (`invalid port ":hun" after host`, `invalid URL escape "%zz"`).
			return fmt.Errorf("%w: %s %q: the URL cannot be parsed", errBadURL, uerr.Op, RedactURLs(uerr.URL))
		}
		return fmt.Errorf("%w: %s", errBadURL, text)
	}
	if text == err.Error() {
		return err
	}
	return errors.New(text)
}

// checkURLs refuses, before any attempt, a URL of urls (comma-separated)
// that no attempt can reach: a scheme nats.go does not speak (http://, the
// frontend's address by mistake) or a port out of range. nats.go took
// them as servers down, and the role retried them for 10 s before
// advising to start a NATS server. What url.Parse refuses is left to
// nats.go, whose error names it (errBadURL); so is a URL without a scheme
// (host:port, which nats.go takes).
func checkURLs(urls string) error {
	for _, u := range strings.Split(urls, ",") {
		u = strings.TrimSpace(u)
		if !strings.Contains(u, "://") {
			continue
		}
		pu, err := neturl.Parse(u)
		if err != nil {
			continue
		}
		switch strings.ToLower(pu.Scheme) {
		case "nats", "tls", "ws", "wss":
		default:
			return fmt.Errorf("%w: %w: --nats-url %s: %s:// is no NATS scheme; give nats://HOST:PORT (tls:// for TLS, ws:// or wss:// for a websocket listener), comma-separated for several",
				ErrConnect, errBadURL, RedactURLs(u), pu.Scheme)
		}
		if p := pu.Port(); p != "" {
			if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
				return fmt.Errorf("%w: %w: --nats-url %s: port %s is out of range; give a port from 1 to 65535 (NATS's default is 4222)",
					ErrConnect, errBadURL, RedactURLs(u), p)
			}
		}
	}
	return nil
}

// errBadURL marks a --nats-url that cannot be parsed.
var errBadURL = errors.New("bad NATS URL")

// connectAdvice says what to do about a failed connection, and whether
// retrying cannot help: a server that refused this role's credentials or
// its TLS will refuse them again, where a server not yet up may come.
func connectAdvice(err error, tlsOn bool) (advice string, final bool) {
	var (
		unknownCA *x509.UnknownAuthorityError
		verify    *tls.CertificateVerificationError
		hostname  x509.HostnameError
		pathErr   *fs.PathError
	)
	switch {
	case errors.Is(err, nats.ErrAuthorization), errors.Is(err, nats.ErrAuthExpired), errors.Is(err, nats.ErrAuthRevoked),
		errors.Is(err, nats.ErrAccountAuthExpired):
		return "the server refused this role's credentials: check --nats-creds, --nats-nkey, --nats-token or " +
			"--nats-user/--nats-password (with keys made by `kvbus auth init`, `kvbus auth show` says which file each role uses)", true
	case errors.Is(err, nats.ErrSecureConnRequired):
		return "the server requires TLS: give its CA with --nats-tls-ca", true
	case errors.Is(err, nats.ErrSecureConnWanted):
		return "TLS was asked for but the server does not use it: drop the --nats-tls-* flags or start the server with TLS", true
	case errors.As(err, &unknownCA), errors.As(err, &verify), errors.As(err, &hostname):
		return "the server's TLS certificate did not verify: give the CA that signed it with --nats-tls-ca, and connect by a name the certificate holds", true
	case tlsOn && (strings.Contains(err.Error(), "remote error: tls:") ||
		strings.Contains(err.Error(), "connection closed by remote after TLS handshake")):
		return clientCertRefused, true
	case errors.Is(err, errBadURL):
		return "--nats-url must be nats://[user:password@]host:port[,...]; escape '/', '#' and '%' in a password as %2F, %23 and %25", true
	case errors.As(err, &pathErr):
		return "a credentials or TLS file could not be read: check the path given to the --nats-* flag", true
	}
	return "start one with `kvbus nats`, or set --nats-url / KVBUS_NATS_URL", false
}

// ErrClosed is wrapped by the error Config.OnClosed gets: the server closed
// the connection for good.
var ErrClosed = errors.New("bus: the NATS connection was closed")

// closedByServerError is the advice for a connection nats.go closed after
// an error of the server other than a refusal of the credentials.
const closedByServerError = "the server answered with an error after which the NATS client does not reconnect; " +
	"the role stops so that it can be restarted (the error says what the server refused)"

// refusedAtReconnect is the advice for credentials refused at a reconnect.
const refusedAtReconnect = "the server refused this role's credentials after a reconnect " +
	"(rotated key? restart the role with its new seed)"

// clientCertRefused is the advice for a server that refused the client's
// certificate in the TLS handshake.
const clientCertRefused = "the server refused this client's certificate (mutual TLS): give --nats-tls-cert/--nats-tls-key " +
	"signed by the CA of the server's --tls-ca, not expired"

// brokenConnection reports whether err is the connection to the server
// breaking (the server stopping or restarting): nats.go reports a
// reconnect's handshake cut off so as an async error, then tries again.
func brokenConnection(err error) bool {
	return errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF) ||
		errors.Is(err, net.ErrClosed)
}

// violatedSubject is the subject a server's permissions violation names
// ("Permissions Violation for Publish to \"kvbus.req.m\"", "… for
// Subscription to …", "… for Publish with Reply of …"), or "".
func violatedSubject(err error) string {
	if m := violatedSubjectRe.FindStringSubmatch(err.Error()); m != nil {
		return m[1]
	}
	return ""
}

var violatedSubjectRe = regexp.MustCompile(`Permissions Violation for [^"]*? (?:to|of) "([^"]*)"`)

// isAuthError reports whether err is the server refusing the credentials.
func isAuthError(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) || errors.Is(err, nats.ErrAuthRevoked) ||
		errors.Is(err, nats.ErrAccountAuthExpired)
}

// isTransientError reports whether err is one that nats.go records as the
// connection's last error and carries on after (the connection still works).
func isTransientError(err error) bool {
	return errors.Is(err, nats.ErrPermissionViolation) || errors.Is(err, nats.ErrMaxSubscriptionsExceeded) ||
		errors.Is(err, nats.ErrSlowConsumer) || errors.Is(err, nats.ErrDrainTimeout)
}

// Drain drains nc (flushing pending publishes and letting subscription
// handlers finish) and waits until it is closed or ctx ends. A connection
// that is reconnecting (NATS restarting) holds its publishes in the
// reconnect buffer: Drain waits, within ctx, for the server to come back,
// and closes the connection with them unsent only when ctx ends.
func Drain(ctx context.Context, nc *nats.Conn) {
	if nc == nil || nc.IsClosed() {
		return
	}
	nc.SetClosedHandler(nil) // a close from here on is the role's own
	for nc.IsReconnecting() && ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
	if !nc.IsConnected() { // nothing can be flushed to a server that is gone
		nc.Close()
		return
	}
	closed := make(chan struct{})
	nc.SetClosedHandler(func(*nats.Conn) { close(closed) })
	if err := nc.Drain(); err != nil {
		nc.Close()
		return
	}
	select {
	case <-closed:
	case <-ctx.Done():
		nc.Close()
	}
}

// onceSet remembers up to 1,000 strings, to say each once.
type onceSet struct {
	mu   sync.Mutex
	seen map[string]struct{}
}

// reset forgets every string.
func (o *onceSet) reset() {
	o.mu.Lock()
	defer o.mu.Unlock()
	clear(o.seen)
}

// first reports whether k is new (and remembers it while there is room).
func (o *onceSet) first(k string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.seen[k]; ok {
		return false
	}
	if len(o.seen) < 1000 {
		o.seen[k] = struct{}{}
	}
	return true
}
