package bus_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/internal/validatetest"
)

// TestServerConfigValidate: the zero ServerConfig and the configurations
// kvbus nats, kvbus serve and the tests start with pass; each bad field is
// refused wrapping ErrServer and naming its flag (or field), without a file
// read or a port tried.
func TestServerConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  bus.ServerConfig
		want string // "" for valid
	}{
		{"zero", bus.ServerConfig{}, ""},
		{"free port", bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: "/nonexistent", MonitorAddr: "127.0.0.1:0"}, ""},
		{"kvbus nats defaults", bus.ServerConfig{Addr: "127.0.0.1:4222", ClusterName: "kvbus", LameDuckDuration: 30 * time.Second, LameDuckGracePeriod: 5 * time.Second}, ""},
		{"cluster", bus.ServerConfig{Cluster: "0.0.0.0:6222", Routes: []string{"nats://n2:6222,nats://n3:6222"}, AuthConfig: "/a/auth.conf", ClusterPasswordFile: "/a/pw"}, ""},
		{"token", bus.ServerConfig{Token: "tok"}, ""},
		{"tls", bus.ServerConfig{TLSCert: "c.pem", TLSKey: "k.pem", TLSCA: "ca.pem"}, ""},
		{"empty KVBUS_ROUTES", bus.ServerConfig{Routes: []string{""}}, ""},

		{"addr without port", bus.ServerConfig{Addr: "127.0.0.1"}, "--addr"},
		{"addr with a named port", bus.ServerConfig{Addr: "127.0.0.1:nats"}, "--nats-addr"},
		{"monitor addr", bus.ServerConfig{MonitorAddr: "localhost"}, "--monitor-addr"},
		{"monitor named port", bus.ServerConfig{MonitorAddr: "localhost:http"}, "--monitor-addr"},
		{"cluster addr", bus.ServerConfig{Cluster: "6222", Routes: []string{"nats://n2:6222"}}, "--cluster-addr"},
		{"server name with a space", bus.ServerConfig{ServerName: "a b"}, "--server-name"}, // in nats-server's words before, naming no flag
		{"both cluster passwords", bus.ServerConfig{ClusterPassword: "p", ClusterPasswordFile: "/pw"}, "--cluster-password-file"},
		{"token and auth config", bus.ServerConfig{Token: "t", AuthConfig: "/a"}, "--auth-config"},
		{"cluster user alone", bus.ServerConfig{ClusterUser: "u"}, "--cluster-password"},
		{"auth config cluster without route auth", bus.ServerConfig{AuthConfig: "/a", Cluster: "127.0.0.1:0", Routes: []string{"nats://n2:6222"}}, "--cluster-password"},
		{"token cluster without route auth", bus.ServerConfig{Token: "t", Cluster: "127.0.0.1:0", Routes: []string{"nats://n2:6222"}}, "--cluster-password"},
		{"routes without cluster addr", bus.ServerConfig{Routes: []string{"nats://n2:6222"}}, "--cluster-addr"},
		{"cluster addr without routes", bus.ServerConfig{Cluster: "127.0.0.1:0"}, "--routes"},
		{"bad route", bus.ServerConfig{Cluster: "127.0.0.1:0", Routes: []string{"n2"}}, "--routes"},
		{"tls cert without key", bus.ServerConfig{TLSCert: "c.pem"}, "--tls-key"},
		{"tls key without cert", bus.ServerConfig{TLSKey: "k.pem"}, "--tls-cert"},
		{"tls ca without cert", bus.ServerConfig{TLSCA: "ca.pem"}, "--tls-ca"},
		{"cluster tls ca without cert", bus.ServerConfig{ClusterTLSCA: "ca.pem"}, "--cluster-tls-ca"},
		{"cluster tls ca without cluster", bus.ServerConfig{TLSCert: "c.pem", TLSKey: "k.pem", ClusterTLSCA: "ca.pem"}, "--cluster-tls-ca"},
		{"negative max payload", bus.ServerConfig{MaxPayload: -1}, "MaxPayload"},
		{"negative lame duck duration", bus.ServerConfig{LameDuckDuration: -time.Second}, "--lame-duck-duration"},
		{"negative grace period", bus.ServerConfig{LameDuckGracePeriod: -time.Second}, "--lame-duck-grace-period"},
		{"grace period as long as the duration", bus.ServerConfig{LameDuckDuration: 5 * time.Second, LameDuckGracePeriod: 5 * time.Second}, "--lame-duck-grace-period"},
		{"default grace period above a short duration", bus.ServerConfig{LameDuckDuration: 5 * time.Second}, "--lame-duck-duration"},
	} {
		validatetest.Refused(t, tc.name, tc.cfg.Validate(), bus.ErrServer, tc.want)
	}
}

// TestStartServerValidates: StartServer refuses what Validate refuses, with
// its error, before it makes a data directory or listens.
func TestStartServerValidates(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "never")
	cfg := bus.ServerConfig{Addr: "127.0.0.1:0", DataDir: dir, MaxPayload: -1}
	srv, err := bus.StartServer(cfg)
	if err == nil {
		srv.Shutdown()
		t.Fatal("a server started with a negative MaxPayload")
	}
	if want := cfg.Validate(); want == nil || err.Error() != want.Error() {
		t.Fatalf("StartServer: %v, want Validate's %v", err, want)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("StartServer made the data directory %s of a configuration it refused (stat: %v)", dir, err)
	}
}
