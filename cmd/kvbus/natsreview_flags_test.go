package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestNATSRefusesRouteAndTLSFlagsItWouldIgnore: `kvbus nats` given
// --routes without --cluster-addr, --cluster-addr without --routes, or
// --tls-cert without --tls-key stops at start naming the flag to add.
// Before, the first ran a server alone that ignored its routes, the second
// waited 30 s and asked whether the port was in use, and the third said
// "missing 'key_file' in TLS configuration".
func TestNATSRefusesRouteAndTLSFlagsItWouldIgnore(t *testing.T) {
	cert := filepath.Join(t.TempDir(), "server.pem")
	if err := os.WriteFile(cert, []byte("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--routes", "nats://" + freeAddr(t)}, "--cluster-addr"},
		{[]string{"--cluster-addr", freeAddr(t), "--server-name", "n1"}, "--routes"},
		{[]string{"--tls-cert", cert}, "--tls-key"},
	} {
		c := parseCLI(t, append([]string{"nats", "--addr", "127.0.0.1:0", "--data-dir", t.TempDir()}, tc.args...)...)
		c.NATS.out = &bytes.Buffer{}
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second) // a server that started runs until then
		err := c.NATS.Run(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("kvbus nats %s: %v, want a refusal naming %s", strings.Join(tc.args, " "), err, tc.want)
		}
	}
}
