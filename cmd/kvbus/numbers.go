package main

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/alecthomas/kong"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers"
)

// Numbers on the command line. A library Config takes 0 (and, for many
// fields, a negative value) as "the default"; on the command line the
// defaults are written out, so a 0 or a negative value is the operator's,
// and quietly serving the default instead (--request-timeout=0 as 60 s,
// --heartbeat-timeout=-1s as 3 s, the scheduler's --block-size 0 as 16)
// hid a mistake. So every number and duration flag refuses a negative
// value unless its tag says `negative:"allowed"` (and its help what it
// means), and refuses 0 where its tag says `positive:""`; a 0 that means
// something ("0: no bound") is said in its help.

// Validate checks the number flags of the command given (kong calls it
// after parsing, flags from the environment included).
func (c *cli) Validate(kctx *kong.Context) error {
	for _, f := range kctx.Flags() {
		if err := checkNumber(f); err != nil {
			return err
		}
		if err := checkSubjectPrefix(f); err != nil {
			return err
		}
	}
	return nil
}

// checkSubjectPrefix refuses a --subject-prefix that cannot be the first
// token of a subject (a dot, a wildcard, a space), before anything starts:
// serve retried the request log's invalid stream name for 30 s, tap
// listened on a subject nothing publishes, auth init wrote permissions for
// it. Empty is the default's (kvbus, or for auth show DIR's own).
func checkSubjectPrefix(f *kong.Flag) error {
	if f.Name != "subject-prefix" || !f.Target.IsValid() || f.Target.Kind() != reflect.String || f.Target.String() == "" {
		return nil
	}
	if err := messages.ValidateToken("subject prefix", f.Target.String()); err != nil {
		return fmt.Errorf("--subject-prefix %q: the first token of every kvbus subject takes letters, digits, _ and - only, 1 to 64 of them (e.g. kvbus, team-a)",
			f.Target.String())
	}
	return nil
}

// checkNumber refuses f's value when it is negative or, for a positive
// flag, zero.
func checkNumber(f *kong.Flag) error {
	v := f.Target
	if !v.IsValid() {
		return nil
	}
	var neg, zero bool
	var shown any
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		neg, zero, shown = v.Int() < 0, v.Int() == 0, v.Int()
		if v.Type() == reflect.TypeFor[time.Duration]() {
			shown = time.Duration(v.Int())
		}
	case reflect.Float32, reflect.Float64:
		neg, zero, shown = v.Float() < 0, v.Float() == 0, v.Float()
	default:
		return nil
	}
	switch {
	case neg && !f.Tag.Has("negative"):
		return fmt.Errorf("--%s is %v: it may not be negative (see --help)", f.Name, shown)
	case zero && f.Tag.Has("positive"):
		return fmt.Errorf("--%s is 0: it must be positive (0 does not mean none or the default here; see --help)", f.Name)
	}
	return checkMin(f)
}

// checkMin refuses a duration flag below its tag's min:"…" when it is
// positive (a 0 that means something passes): a rank sent heartbeats with
// --heartbeat-interval 1ns as fast as it could, a role with
// --nats-ping-interval 1ms left its server as stale every few seconds (1ns:
// "nats: connection closed" at once), and --slot-ttl 50ms was refused by
// JetStream after connecting, naming no flag.
func checkMin(f *kong.Flag) error {
	if !f.Tag.Has("min") || f.Target.Type() != reflect.TypeFor[time.Duration]() {
		return nil
	}
	least, err := time.ParseDuration(f.Tag.Get("min"))
	if err != nil {
		return fmt.Errorf("--%s: bad min tag %q: %w", f.Name, f.Tag.Get("min"), err)
	}
	if d := time.Duration(f.Target.Int()); d > 0 && d < least {
		return fmt.Errorf("--%s is %s: give at least %s (see --help)", f.Name, d, least)
	}
	return nil
}

// byteSize is a flag in bytes that also takes a size with a unit (64MiB,
// 1GiB, 512MB), as --kv-capacity and --stream-replay do: a scheduler
// restarted with --request-log-history-bytes 64MiB exited, refusing "64MiB"
// as no integer, and its requests got 503s until it was started again.
type byteSize int64

// Decode implements kong.MapperValue.
func (b *byteSize) Decode(ctx *kong.DecodeContext) error {
	var s string
	if err := ctx.Scan.PopValueInto("size", &s); err != nil {
		return err
	}
	s = strings.TrimSpace(s)
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		*b = byteSize(n) // checkNumber judges its sign
		return nil
	}
	n, err := workers.ParseCapacity(s, 0)
	if err != nil || strings.HasSuffix(s, "tok") {
		return fmt.Errorf("bad size %q: want bytes, or a size such as 64MiB, 1GiB or 512MB", s)
	}
	*b = byteSize(n)
	return nil
}
