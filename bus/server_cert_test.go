package bus_test

import (
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/bus"
)

// TestServerCertValidity: an expired server certificate, or one not yet
// valid, is refused at start with an error naming the file and the date;
// one that expires within 14 days starts with a warning. Before, the server
// started with either and every client's handshake failed.
func TestServerCertValidity(t *testing.T) {
	dir := t.TempDir()
	now := time.Now()
	ca, caKey, _, _ := writeCertValid(t, dir, "ca", true, nil, nil, now.Add(-365*24*time.Hour), now.Add(365*24*time.Hour))
	expired, _, expiredCert, expiredKey := writeCertValid(t, dir, "expired", false, ca, caKey, now.Add(-48*time.Hour), now.Add(-24*time.Hour))
	_, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), TLSCert: expiredCert, TLSKey: expiredKey})
	if !errors.Is(err, bus.ErrServer) || !strings.Contains(err.Error(), expiredCert) || !strings.Contains(err.Error(), "NotAfter") ||
		!strings.Contains(err.Error(), expired.NotAfter.UTC().Format(time.RFC3339)) {
		t.Errorf("an expired certificate: %v, want a refusal naming %s and its NotAfter", err, expiredCert)
	}
	_, _, futureCert, futureKey := writeCertValid(t, dir, "future", false, ca, caKey, now.Add(24*time.Hour), now.Add(48*time.Hour))
	_, err = bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), TLSCert: futureCert, TLSKey: futureKey})
	if !errors.Is(err, bus.ErrServer) || !strings.Contains(err.Error(), futureCert) || !strings.Contains(err.Error(), "NotBefore") {
		t.Errorf("a certificate not valid yet: %v, want a refusal naming %s and its NotBefore", err, futureCert)
	}
	_, _, soonCert, soonKey := writeCertValid(t, dir, "soon", false, ca, caKey, now.Add(-24*time.Hour), now.Add(3*24*time.Hour))
	log, logs := captureLogger(slog.LevelInfo)
	srv, err := bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), TLSCert: soonCert, TLSKey: soonKey, Logger: log})
	if err != nil {
		t.Fatalf("a certificate valid 3 more days: %v", err)
	}
	srv.Shutdown()
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "expires soon") || !strings.Contains(logs.String(), soonCert) {
		t.Errorf("no warning about a certificate expiring in 3 days:\n%s", logs)
	}
	_, _, goodCert, goodKey := writeCertValid(t, dir, "good", false, ca, caKey, now.Add(-24*time.Hour), now.Add(90*24*time.Hour))
	log, logs = captureLogger(slog.LevelInfo)
	srv, err = bus.StartServer(bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: t.TempDir(), TLSCert: goodCert, TLSKey: goodKey, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	if strings.Contains(logs.String(), "expires soon") {
		t.Errorf("a warning about a certificate valid 90 more days:\n%s", logs)
	}
	// While it runs: the periodic check warns once the certificate is
	// within 14 days of its end, and says it expired after.
	if err := srv.CheckCertificate(now.Add(30 * 24 * time.Hour)); err != nil || strings.Contains(logs.String(), "expires soon") {
		t.Errorf("check 60 days before the end: %v, log:\n%s", err, logs)
	}
	if err := srv.CheckCertificate(now.Add(80 * 24 * time.Hour)); err != nil || !strings.Contains(logs.String(), "expires soon") || !strings.Contains(logs.String(), goodCert) {
		t.Errorf("check 10 days before the end: %v, want a warning naming %s; log:\n%s", err, goodCert, logs)
	}
	if err := srv.CheckCertificate(now.Add(91 * 24 * time.Hour)); !errors.Is(err, bus.ErrServer) || !strings.Contains(err.Error(), "expired") {
		t.Errorf("check a day after the end: %v, want an error saying it expired", err)
	}
}
