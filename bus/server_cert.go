package bus

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"time"
)

// certExpiryWarning is how long before its NotAfter a server certificate
// makes StartServer warn.
const certExpiryWarning = 14 * 24 * time.Hour

// CheckCertificate checks the server's certificate (--tls-cert) as of now,
// as StartServer did: it warns through the server's logger when it expires
// within 14 days, and returns an error once it has expired (or is not valid
// yet). kvbus nats calls it periodically, so that a certificate nearing its
// end while the server runs is said before clients are refused. Without
// TLS it does nothing. Safe for concurrent use.
func (s *Server) CheckCertificate(now time.Time) error {
	if s.cfg.TLSCert == "" {
		return nil
	}
	return checkServerCert(s.cfg.TLSCert, s.cfg.Cluster != "", s.logger, now)
}

// checkServerTLS checks the server's TLS files before anything starts, and
// says what is wrong naming the flag: --tls-ca without the server's own
// certificate, --tls-cert without --tls-key (or the reverse), files that
// cannot be read or hold no PEM certificate or key, a key that is not the
// certificate's (nats-server's errors named its own options, "key_file",
// or no file at all), a certificate out of its validity period
// (checkServerCert). With a cluster, the routes verify each other's
// certificates against --tls-ca (the system's roots without it): a
// certificate that does not verify there is refused, since no other
// server of the cluster could accept this one's routes.
func checkServerTLS(cfg ServerConfig, log *slog.Logger, now time.Time) error {
	if err := checkTLSFlags(cfg); err != nil || cfg.TLSCert == "" {
		return err
	}
	if err := checkServerCert(cfg.TLSCert, cfg.Cluster != "", log, now); err != nil {
		return err
	}
	pair, err := tls.LoadX509KeyPair(cfg.TLSCert, cfg.TLSKey)
	if err != nil {
		return fmt.Errorf("%w: --tls-cert %s / --tls-key %s: %v (give the server's PEM certificate and the key it was made for)",
			ErrServer, cfg.TLSCert, cfg.TLSKey, err)
	}
	clientRoots, err := readCA("--tls-ca", cfg.TLSCA, "the clients' certificates")
	if err != nil {
		return err
	}
	routeRoots, err := readCA("--cluster-tls-ca", cfg.ClusterTLSCA, "every server's certificate")
	if err != nil {
		return err
	}
	if cfg.Cluster == "" {
		return nil
	}
	roots, rootsFlag, rootsFile := routeRoots, "--cluster-tls-ca", cfg.ClusterTLSCA // nil: the system's
	if cfg.ClusterTLSCA == "" {
		roots, rootsFlag, rootsFile = clientRoots, "--tls-ca", cfg.TLSCA
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return fmt.Errorf("%w: --tls-cert %s: %v", ErrServer, cfg.TLSCert, err)
	}
	inter := x509.NewCertPool()
	for _, der := range pair.Certificate[1:] {
		if c, err := x509.ParseCertificate(der); err == nil {
			inter.AddCert(c)
		}
	}
	_, err = leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	switch {
	case err == nil:
		return nil
	case rootsFile == "":
		return fmt.Errorf("%w: --tls-cert %s does not verify against the system's roots (%v): with --cluster-addr the servers "+
			"verify each other's route certificates against --cluster-tls-ca (else --tls-ca, else the system's roots), so no server of the "+
			"cluster would accept this one's routes; give --cluster-tls-ca FILE with the CA that signed every server's certificate, "+
			"or use certificates from a CA this system trusts", ErrServer, cfg.TLSCert, err)
	default:
		return fmt.Errorf("%w: --tls-cert %s does not verify against %s %s (%v): with --cluster-addr the servers verify each other's "+
			"route certificates against it, so no server of the cluster would accept this one's routes; issue every server's certificate "+
			"from a CA in that file, or give --cluster-tls-ca FILE with the servers' CA (--tls-ca then verifies only the clients')",
			ErrServer, cfg.TLSCert, rootsFlag, rootsFile, err)
	}
}

// readCA reads the CA certificates of flag's file path (nil for none: the
// system's roots); what names what they verify, for the error.
func readCA(flag, path, what string) (*x509.CertPool, error) {
	if path == "" {
		return nil, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrServer, flag, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return nil, fmt.Errorf("%w: %s %s holds no PEM certificate: give the CA certificate that signed %s", ErrServer, flag, path, what)
	}
	return pool, nil
}

// checkServerCert refuses a server certificate (the first CERTIFICATE
// block of the PEM file path) that has expired or is not valid yet, and
// warns through log when it expires within certExpiryWarning. With routes
// (cluster), the certificate is presented as a client certificate too, so
// it must allow client authentication.
func checkServerCert(path string, cluster bool, log *slog.Logger, now time.Time) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("%w: --tls-cert: %v", ErrServer, err)
	}
	var cert *x509.Certificate
	for rest := data; cert == nil; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			return fmt.Errorf("%w: --tls-cert %s: no PEM CERTIFICATE block", ErrServer, path)
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		if cert, err = x509.ParseCertificate(b.Bytes); err != nil {
			return fmt.Errorf("%w: --tls-cert %s: %v", ErrServer, path, err)
		}
	}
	const layout = time.RFC3339
	switch {
	case now.After(cert.NotAfter):
		return fmt.Errorf("%w: --tls-cert %s (%s) expired at %s (NotAfter), %s ago: clients would refuse every connection; renew it",
			ErrServer, path, cert.Subject, cert.NotAfter.UTC().Format(layout), now.Sub(cert.NotAfter).Round(time.Minute))
	case now.Before(cert.NotBefore):
		return fmt.Errorf("%w: --tls-cert %s (%s) is not valid before %s (NotBefore), %s from now: clients would refuse every connection; check the clock or the certificate",
			ErrServer, path, cert.Subject, cert.NotBefore.UTC().Format(layout), cert.NotBefore.Sub(now).Round(time.Minute))
	case cert.NotAfter.Sub(now) < certExpiryWarning:
		log.Warn("the NATS server's TLS certificate expires soon: renew it, then send the server SIGHUP (make reload-nats) to load it",
			"cert", path, "subject", cert.Subject.String(), "not_after", cert.NotAfter.UTC().Format(layout),
			"expires_in", cert.NotAfter.Sub(now).Round(time.Minute).String())
	}
	if cluster && len(cert.ExtKeyUsage) > 0 && !slices.Contains(cert.ExtKeyUsage, x509.ExtKeyUsageClientAuth) &&
		!slices.Contains(cert.ExtKeyUsage, x509.ExtKeyUsageAny) {
		return fmt.Errorf("%w: --tls-cert %s is only for servers (its extended key usage lacks clientAuth); with --cluster-addr the routes present it to each other as a client certificate too: issue it for serverAuth and clientAuth", ErrServer, path)
	}
	return nil
}

// checkTLSFlags refuses TLS flags that do not go together, before any file
// is read: --tls-ca or --cluster-tls-ca without the server's own
// certificate, --cluster-tls-ca without --cluster-addr, --tls-cert without
// --tls-key or the reverse.
func checkTLSFlags(cfg ServerConfig) error {
	switch {
	case cfg.TLSCert == "" && cfg.TLSKey == "":
		if cfg.TLSCA != "" {
			return fmt.Errorf("%w: --tls-ca verifies client certificates on a TLS listener: give the server's own --tls-cert and --tls-key too", ErrServer)
		}
		if cfg.ClusterTLSCA != "" {
			return fmt.Errorf("%w: --cluster-tls-ca verifies the routes' certificates: give the server's own --tls-cert and --tls-key too", ErrServer)
		}
		return nil
	case cfg.ClusterTLSCA != "" && cfg.Cluster == "":
		return fmt.Errorf("%w: --cluster-tls-ca verifies the routes' certificates, and there are no routes: give --cluster-addr (and --routes), or leave it out", ErrServer)
	case cfg.TLSKey == "":
		return fmt.Errorf("%w: --tls-cert needs --tls-key, the PEM private key of the server's certificate", ErrServer)
	case cfg.TLSCert == "":
		return fmt.Errorf("%w: --tls-key needs --tls-cert, the server's PEM certificate", ErrServer)
	}
	return nil
}
