package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/alecthomas/kong"

	"github.com/kvbus/kvbus/internal/logsink"
)

// TestNumberFlags: a negative number or duration, or a 0 where 0 does not
// mean anything, is refused naming the flag, for every role alike; each of
// these started and served the default before (the scheduler's
// --block-size 0 as 16, serve's --request-timeout=0 as 60 s, a negative
// --heartbeat-timeout as 3 s). Values whose help gives them a meaning
// still pass.
func TestNumberFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		flag string // "" when the command line is valid
	}{
		{[]string{"serve", "--request-timeout=0"}, "--request-timeout"},
		{[]string{"serve", "--request-timeout=-1s"}, "--request-timeout"},
		{[]string{"scheduler", "--block-size=0"}, "--block-size"},
		{[]string{"scheduler", "--heartbeat-timeout=-1s"}, "--heartbeat-timeout"},
		{[]string{"scheduler", "--session-epsilon=-1"}, "--session-epsilon"},
		{[]string{"scheduler", "--no-group-wait=-1s"}, "--no-group-wait"},
		{[]string{"serve", "--default-max-tokens=-1"}, "--default-max-tokens"},
		{[]string{"serve", "--save-wait=-1s"}, "--save-wait"},
		{[]string{"frontend", "--max-body-bytes=0"}, "--max-body-bytes"},
		{[]string{"frontend", "--max-inflight=-1"}, "--max-inflight"},
		{[]string{"frontend", "--request-log-max-age=-1s"}, "--request-log-max-age"},
		{[]string{"frontend", "--request-log-max-bytes=0"}, "--request-log-max-bytes"}, // served 1 GiB
		{[]string{"scheduler", "--request-log-max-age=0"}, "--request-log-max-age"},    // served 24h
		{[]string{"bench", "--trace=numbers_test.go", "--groups=0"}, "--groups"},
		{[]string{"replay", "--target=http://127.0.0.1:1", "numbers_test.go", "--limit=-5"}, "--limit"},
		{[]string{"worker", "--group=g0", "--slot-ttl=0"}, "--slot-ttl"},
		{[]string{"worker", "--group=g0", "--tp-size=0"}, "--tp-size"},
		{[]string{"worker", "--group=g0", "--heartbeat-interval=-1s"}, "--heartbeat-interval"},
		{[]string{"scheduler", "--shutdown-timeout=0"}, "--shutdown-timeout"},
		{[]string{"serve", "--groups=0"}, "--groups"},
		{[]string{"frontend", "--stop-timeout=-1s"}, "--stop-timeout"},
		{[]string{"worker", "--group=g0", "--nats-ping-interval=0"}, "--nats-ping-interval"},
		// Below a duration flag's least (it flooded NATS, or churned).
		{[]string{"worker", "--group=g0", "--nats-ping-interval=1ms"}, "--nats-ping-interval"},
		{[]string{"worker", "--group=g0", "--heartbeat-interval=1ns"}, "--heartbeat-interval"},
		{[]string{"serve", "--heartbeat-interval=1ms"}, "--heartbeat-interval"},
		{[]string{"worker", "--rank=auto", "--slot-ttl=50ms"}, "--slot-ttl"},
		{[]string{"worker", "--engine=openai", "--engine-health-interval=1ns"}, "--engine-health-interval"},
		{[]string{"worker", "--group=g0", "--heartbeat-interval=100ms", "--slot-ttl=100ms", "--nats-ping-interval=1s"}, ""},
		// Meaningful values pass.
		{[]string{"worker", "--group=g0"}, ""},         // --ep-rank -1: the TP rank
		{[]string{"frontend", "--max-inflight=0"}, ""}, // no bound
		{[]string{"frontend", "--stop-grace=-1s"}, ""}, // none
		{[]string{"serve", "--time-scale=0"}, ""},      // instant
		{[]string{"scheduler", "--session-epsilon=0"}, ""},
		{[]string{"serve"}, ""},
		{[]string{"scheduler"}, ""},
		{[]string{"frontend"}, ""},
	} {
		err := parseArgs(t, tc.args...)
		switch {
		case tc.flag == "" && err != nil:
			t.Errorf("%v: %v; want it accepted", tc.args, err)
		case tc.flag != "" && (err == nil || !strings.Contains(err.Error(), tc.flag)):
			t.Errorf("%v: %v; want an error naming %s", tc.args, err, tc.flag)
		}
	}
}

// TestSubjectPrefixFlag: a --subject-prefix that cannot be a subject token
// is refused when the command line is parsed, naming the flag, by every
// command that takes one. Before, each found out (or not) in its own way:
// serve retried the request log's invalid stream name for 30 s in silence,
// tap listened for ever on a subject nothing publishes, auth init wrote
// keys and a nats-auth.conf for it, and frontend, scheduler and worker
// refused it only after connecting, without naming the flag (behind a
// "cannot connect" after 10 s when NATS was not up yet).
func TestSubjectPrefixFlag(t *testing.T) {
	dir := t.TempDir()
	for _, cmd := range [][]string{
		{"serve"}, {"frontend"}, {"scheduler"}, {"worker", "--group=g0"}, {"tap"}, {"top"},
		{"capture", "record", "--out=" + dir + "/c"}, {"replay", "--target=http://127.0.0.1:1", "numbers_test.go"},
		{"auth", "init", dir}, {"auth", "show", dir},
	} {
		for _, bad := range []string{"a.b", "*", ">", "a b", strings.Repeat("p", 65)} {
			err := parseArgs(t, append(slices.Clone(cmd), "--subject-prefix="+bad)...)
			if err == nil || !strings.Contains(err.Error(), "--subject-prefix") {
				t.Errorf("%v --subject-prefix=%q: %v; want an error naming --subject-prefix", cmd, bad, err)
			}
		}
		if err := parseArgs(t, append(slices.Clone(cmd), "--subject-prefix=team-a_2")...); err != nil {
			t.Errorf("%v --subject-prefix=team-a_2: %v; want it accepted", cmd, err)
		}
	}
	t.Setenv("KVBUS_SUBJECT_PREFIX", "a.b")
	if err := parseArgs(t, "scheduler"); err == nil || !strings.Contains(err.Error(), "--subject-prefix") {
		t.Errorf("scheduler with KVBUS_SUBJECT_PREFIX=a.b: %v; want an error naming --subject-prefix", err)
	}
}

// parseArgs parses a command line as kvbus does and returns its error.
func parseArgs(t *testing.T, args ...string) error {
	t.Helper()
	var c cli
	p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"), kong.Exit(func(int) {}))
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.Parse(args)
	return err
}

// TestByteSizeFlags: the flags in bytes take a size with a unit, as
// --kv-capacity does. A scheduler restarted with
// --request-log-history-bytes 64MiB exited ("expected a valid 64 bit int")
// and its requests got 503s until it was started again.
func TestByteSizeFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		get  func(*cli) byteSize
		want byteSize
	}{
		{[]string{"scheduler", "--request-log-history-bytes", "64MiB"}, func(c *cli) byteSize { return c.Scheduler.RequestLogHistoryBytes }, 64 << 20},
		{[]string{"scheduler", "--request-log-max-bytes", "2GiB"}, func(c *cli) byteSize { return c.Scheduler.RequestLogMaxBytes }, 2 << 30},
		{[]string{"frontend", "--max-body-bytes", "8MB"}, func(c *cli) byteSize { return c.Frontend.MaxBodyBytes }, 8e6},
		{[]string{"frontend", "--max-body-bytes", "4194304"}, func(c *cli) byteSize { return c.Frontend.MaxBodyBytes }, 4 << 20},
		{[]string{"frontend"}, func(c *cli) byteSize { return c.Frontend.MaxBodyBytes }, 4 << 20}, // the default
		{[]string{"serve", "--request-log-history-bytes", "0"}, func(c *cli) byteSize { return c.Serve.RequestLogHistoryBytes }, 0},
	} {
		if got := tc.get(parseCLI(t, tc.args...)); got != tc.want {
			t.Errorf("%v: %d, want %d", tc.args, got, tc.want)
		}
	}
	for _, tc := range []struct{ arg, want string }{
		{"5tok", "bad size"}, {"lots", "bad size"}, {"-1", "may not be negative"}, {"-1MiB", "bad size"},
	} {
		err := parseArgs(t, "scheduler", "--request-log-history-bytes="+tc.arg)
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "request-log-history-bytes") {
			t.Errorf("--request-log-history-bytes %s: %v; want an error naming the flag and %q", tc.arg, err, tc.want)
		}
	}
}
