package main

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestEngineFlagsWithoutTheirEngineAreRefused: a flag of --engine openai
// given to the sim engine (worker, serve), or a frontend's flag of
// --tokenizer engine given with the embedded tokenizer, is refused at
// once, naming it. They were ignored without a word: --engine-tls-ca of a
// file that does not exist, --engine-model, --kv-events-topic.
func TestEngineFlagsWithoutTheirEngineAreRefused(t *testing.T) {
	serve := []string{"--nats-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--kv-capacity", "64MiB", "--ranks", "1"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"worker", "--engine-tls-ca", "/nonexistent/ca.pem"}, "--engine-tls-ca"},
		{[]string{"worker", "--engine-model", "m"}, "--engine-model"},
		{[]string{"worker", "--kv-events-topic", "kv"}, "--kv-events-topic"},
		{[]string{"worker", "--engine-api-key", "k"}, "--engine-api-key"},
		{[]string{"worker", "--engine-url", "http://127.0.0.1:1"}, "--engine-url"},
		{append([]string{"serve", "--engine-tls-insecure-skip-verify"}, serve...), "--engine-tls-insecure-skip-verify"},
		{append([]string{"serve", "--engine-model", "m"}, serve...), "--engine-model"},
		{[]string{"frontend", "--engine-tls-ca", "/nonexistent/ca.pem"}, "--engine-tls-ca"},
		{[]string{"frontend", "--engine-api-key", "k"}, "--engine-api-key"},
	} {
		args := tc.args
		if args[0] != "serve" {
			args = append(args, "--nats-url", "nats://127.0.0.1:1", "--metrics-addr=")
			if args[0] == "frontend" {
				args = append(args[:len(args)-1], "--http-addr", "127.0.0.1:0")
			}
		}
		c := parseCLI(t, args...)
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		start := time.Now()
		err := runParsed(ctx, c, args[0])
		cancel()
		if err == nil || !strings.Contains(err.Error(), tc.want) || time.Since(start) > 2*time.Second {
			t.Errorf("%v: %v after %v; want an error at once naming %s", tc.args, err, time.Since(start).Round(time.Millisecond), tc.want)
		}
	}
	// With their engine they are taken: serve's --tokenizer engine uses
	// --engine-api-key without --engine openai.
	c := parseCLI(t, append([]string{"serve", "--tokenizer", "engine", "--tokenizer-url", "http://127.0.0.1:1", "--engine-api-key", "k"}, serve...)...)
	if _, err := c.Serve.clusterConfig(); err != nil {
		t.Errorf("serve --tokenizer engine --engine-api-key: %v", err)
	}
}
