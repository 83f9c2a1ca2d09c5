package bus

import (
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
		log.Warn("the NATS server's TLS certificate expires soon: renew it and restart the server",
			"cert", path, "subject", cert.Subject.String(), "not_after", cert.NotAfter.UTC().Format(layout),
			"expires_in", cert.NotAfter.Sub(now).Round(time.Minute).String())
	}
	if cluster && len(cert.ExtKeyUsage) > 0 && !slices.Contains(cert.ExtKeyUsage, x509.ExtKeyUsageClientAuth) &&
		!slices.Contains(cert.ExtKeyUsage, x509.ExtKeyUsageAny) {
		return fmt.Errorf("%w: --tls-cert %s is only for servers (its extended key usage lacks clientAuth); with --cluster-addr the routes present it to each other as a client certificate too: issue it for serverAuth and clientAuth", ErrServer, path)
	}
	return nil
}
