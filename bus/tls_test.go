package bus_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvbus/kvbus/bus"
)

// writeCert writes a certificate and its key signed by parent (self-signed
// when parent is nil) and returns the certificate, key and file paths.
func writeCert(t *testing.T, dir, name string, isCA bool, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey, string, string) {
	t.Helper()
	return writeCertValid(t, dir, name, isCA, parent, parentKey, time.Now().Add(-time.Hour), time.Now().Add(time.Hour))
}

// writeCertValid is writeCert for a certificate valid from notBefore to
// notAfter.
func writeCertValid(t *testing.T, dir, name string, isCA bool, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, notBefore, notAfter time.Time) (*x509.Certificate, *ecdsa.PrivateKey, string, string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: notBefore, NotAfter: notAfter,
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		IsCA: isCA, BasicConstraintsValid: true,
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	kder, _ := x509.MarshalECPrivateKey(key)
	certPath, keyPath := filepath.Join(dir, name+".pem"), filepath.Join(dir, name+"-key.pem")
	if err := os.WriteFile(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	return cert, key, certPath, keyPath
}

func TestConnectMutualTLS(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, caPath, _ := writeCert(t, dir, "ca", true, nil, nil)
	_, _, srvCert, srvKey := writeCert(t, dir, "server", false, ca, caKey)
	_, _, cliCert, cliKey := writeCert(t, dir, "client", false, ca, caKey)
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), TLSCert: srvCert, TLSKey: srvKey, TLSCA: caPath})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	url := "tls://" + srv.Addr().String()

	nc, err := bus.Connect(t.Context(), bus.Config{URL: url, TLSCA: caPath, TLSCert: cliCert, TLSKey: cliKey})
	if err != nil {
		t.Fatalf("mutual TLS: %v", err)
	}
	if !nc.TLSRequired() {
		t.Error("the connection is not TLS")
	}
	if err := nc.Publish("x", []byte("y")); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	// Without a client certificate the server refuses.
	if _, err := bus.Connect(t.Context(), bus.Config{URL: url, TLSCA: caPath, ConnectTimeout: 300 * time.Millisecond}); !errors.Is(err, bus.ErrConnect) {
		t.Fatalf("no client certificate: %v, want ErrConnect", err)
	}
}
