package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/messages"
)

// TestNATSClusterNeedsRouteAuth: `kvbus nats --auth-config … --cluster-addr`
// without a cluster password is refused, naming the flag to add; with
// --cluster-password-file (the file kvbus auth init writes) it starts, and
// logs neither the password nor nats-server's start-up banner. Before, it
// started with a route port open to any server.
func TestNATSClusterNeedsRouteAuth(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.Init(dir, messages.Subjects{}, nil, false); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, auth.ConfigFile)
	args := []string{"nats", "--addr", "127.0.0.1:0", "--auth-config", conf, "--cluster-addr", freeAddr(t)}
	c := parseCLI(t, args...)
	c.NATS.out = &bytes.Buffer{}
	err := c.NATS.Run(t.Context())
	if err == nil || !strings.Contains(err.Error(), "--cluster-password-file") {
		t.Fatalf("--auth-config with --cluster-addr and no cluster password: %v, want a refusal naming --cluster-password-file", err)
	}

	empty := filepath.Join(t.TempDir(), "empty")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// With a route: a cluster address without routes is refused first
	// (bus.ServerConfig.Validate), before the file is read.
	c = parseCLI(t, append(args, "--cluster-password-file", empty, "--routes", "nats://"+freeAddr(t))...)
	if err := c.NATS.Run(t.Context()); err == nil || !strings.Contains(err.Error(), "empty") {
		t.Errorf("an empty --cluster-password-file: %v", err)
	}

	// A single clustered JetStream server waits for its routes: give it
	// one, to a server that is not there.
	pwFile := filepath.Join(dir, auth.ClusterPasswordFile)
	c = parseCLI(t, append(args, "--cluster-password-file", pwFile, "--routes", "nats://"+freeAddr(t))...)
	out := &syncBuffer{}
	c.NATS.out = out
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	if err := c.NATS.Run(ctx); err != nil {
		t.Fatal(err)
	}
	logs := out.String()
	if !strings.Contains(logs, "nats server ready") {
		t.Errorf("no ready line:\n%s", logs)
	}
	pw, _ := os.ReadFile(pwFile)
	if strings.Contains(logs, strings.TrimSpace(string(pw))) || strings.Contains(logs, "Starting nats-server") {
		t.Errorf("the log shows the cluster password or the start-up banner:\n%s", logs)
	}
}
