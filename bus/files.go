package bus

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/nats-io/nkeys"
)

// checkCredsFile reads --nats-creds before Connect tries a server: a file
// that holds no nkey seed (a wrong file given) failed each attempt at
// signing the server's nonce, was retried for the whole ConnectTimeout as
// a server down, and the role then advised starting one.
func checkCredsFile(cfg Config) error {
	if cfg.CredsFile == "" {
		return nil
	}
	b, err := os.ReadFile(cfg.CredsFile)
	if err != nil {
		return fmt.Errorf("%w: --nats-creds %s: %v (give the user's .creds file, its JWT and nkey seed, as nsc writes it)", ErrConnect, cfg.CredsFile, err)
	}
	kp, err := nkeys.ParseDecoratedNKey(b)
	if err != nil {
		return fmt.Errorf("%w: --nats-creds %s: %v: it is no credentials file; give the user's .creds file, its JWT and nkey seed, as nsc writes it (for a bare seed, such as kvbus auth init writes, use --nats-nkey)",
			ErrConnect, cfg.CredsFile, err)
	}
	kp.Wipe()
	return nil
}

// checkTLSFiles loads and parses the TLS files of cfg before Connect tries
// a server: a CA file that holds no certificate, a certificate that is no
// PEM, or a key that is not the certificate's fails at once naming the
// flag (nats.go's error was retried for the whole ConnectTimeout and then
// advised to start a server). A client certificate out of its validity
// period is only warned about: the server decides (and then refuses it,
// which connectAdvice explains).
func checkTLSFiles(cfg Config, log *slog.Logger) error {
	if cfg.TLSCA != "" {
		pem, err := os.ReadFile(cfg.TLSCA)
		if err != nil {
			return fmt.Errorf("%w: --nats-tls-ca: %v", ErrConnect, err)
		}
		if !x509.NewCertPool().AppendCertsFromPEM(pem) {
			return fmt.Errorf("%w: --nats-tls-ca %s holds no PEM certificate: give the CA certificate that signed the server's", ErrConnect, cfg.TLSCA)
		}
	}
	if cfg.TLSCert == "" {
		return nil
	}
	pair, err := tls.LoadX509KeyPair(cfg.TLSCert, cfg.TLSKey)
	if err != nil {
		return fmt.Errorf("%w: --nats-tls-cert %s / --nats-tls-key %s: %v (give the client's PEM certificate and the key it was made for)",
			ErrConnect, cfg.TLSCert, cfg.TLSKey, err)
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return fmt.Errorf("%w: --nats-tls-cert %s: %v", ErrConnect, cfg.TLSCert, err)
	}
	now := time.Now()
	switch {
	case now.After(leaf.NotAfter):
		log.Warn("the client certificate has expired: a server that checks client certificates (mutual TLS) will refuse it; renew it",
			"conn", cfg.Name, "file", cfg.TLSCert, "not_after", leaf.NotAfter.UTC().Format(time.RFC3339))
	case now.Before(leaf.NotBefore):
		log.Warn("the client certificate is not valid yet (check this host's clock): a server that checks client certificates (mutual TLS) will refuse it",
			"conn", cfg.Name, "file", cfg.TLSCert, "not_before", leaf.NotBefore.UTC().Format(time.RFC3339))
	}
	return nil
}

// warnSecretFileModes warns, once per Connect, about a seed or credentials
// file that users other than its owner may read.
func warnSecretFileModes(cfg Config, log *slog.Logger) {
	for _, f := range []struct{ path, flag string }{{cfg.NKeySeedFile, "--nats-nkey"}, {cfg.CredsFile, "--nats-creds"}} {
		if f.path == "" {
			continue
		}
		fi, err := os.Stat(f.path)
		if err != nil || fi.Mode().Perm()&0o077 == 0 {
			continue // a missing file is Connect's error
		}
		log.Warn(fmt.Sprintf("%s %s is readable by other users (mode %04o): anyone who can read it can act as this role; chmod 600 %s",
			f.flag, f.path, fi.Mode().Perm(), f.path), "conn", cfg.Name)
	}
}
