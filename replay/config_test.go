package replay_test

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/internal/validatetest"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
)

// TestConfigValidate: a Config with only a target (every other field
// zero: its default) passes; each bad field is refused wrapping ErrConfig
// and naming its flag, and New refuses it with Validate's error.
func TestConfigValidate(t *testing.T) {
	conn := &nats.Conn{} // Validate only asks that there is one
	for _, tc := range []struct {
		name string
		cfg  replay.Config
		want string // "" for valid
	}{
		{"http defaults", replay.Config{Target: "http://127.0.0.1:19000"}, ""},
		{"https", replay.Config{Target: "https://frontend.example:443/"}, ""},
		{"nats defaults", replay.Config{Target: "nats://127.0.0.1:19001", Conn: conn}, ""},
		{"tls", replay.Config{Target: "tls://u:p@127.0.0.1:19001", Conn: conn}, ""},
		{"every field", replay.Config{Target: "http://h:1", Subjects: messages.Subjects{Prefix: "other"}, Speed: 100, Mode: replay.ModeSession,
			Timeout: time.Second, MaxInflight: 1, APIKey: "k"}, ""},

		{"zero", replay.Config{}, "--target"},
		{"no scheme", replay.Config{Target: "127.0.0.1:8000"}, "--target"},
		{"ftp", replay.Config{Target: "ftp://h:1"}, "--target"},
		{"not a URL", replay.Config{Target: "http://u:secret@[::1"}, "--target"},
		{"http without host", replay.Config{Target: "http://"}, "--target"},
		{"nats without a connection", replay.Config{Target: "nats://127.0.0.1:4222"}, "--target"},
		{"negative speed", replay.Config{Target: "http://h:1", Speed: -1}, "--speed"},
		{"NaN speed", replay.Config{Target: "http://h:1", Speed: math.NaN()}, "--speed"},
		{"infinite speed", replay.Config{Target: "http://h:1", Speed: math.Inf(1)}, "--speed"},
		{"mode", replay.Config{Target: "http://h:1", Mode: "closed"}, "--mode"},
		{"negative timeout", replay.Config{Target: "http://h:1", Timeout: -time.Second}, "--timeout"},
		{"negative max inflight", replay.Config{Target: "http://h:1", MaxInflight: -1}, "MaxInflight"},
		{"subject prefix", replay.Config{Target: "http://h:1", Subjects: messages.Subjects{Prefix: "a.b"}}, "--subject-prefix"},
	} {
		err := tc.cfg.Validate()
		if !validatetest.Refused(t, tc.name, err, replay.ErrConfig, tc.want) {
			continue
		}
		if strings.Contains(err.Error(), "secret") {
			t.Errorf("%s: Validate: %v shows the target's password", tc.name, err)
		}
		_, nerr := replay.New(tc.cfg)
		validatetest.SameError(t, tc.name, "New", nerr, err)
	}
}

// TestTapConfigValidate: a TapConfig with a connection passes, with or
// without a session and a subject; no connection, a bad subject prefix or
// a --subject that is not a NATS subject is refused wrapping ErrConfig and
// naming it, and Tap refuses it with Validate's error before subscribing.
func TestTapConfigValidate(t *testing.T) {
	conn := &nats.Conn{}
	for _, tc := range []struct {
		name string
		cfg  replay.TapConfig
		want string // "" for valid
	}{
		{"defaults", replay.TapConfig{Conn: conn}, ""},
		{"every field", replay.TapConfig{Conn: conn, Subjects: messages.Subjects{Prefix: "other"}, SessionID: " s 1 ", Subject: "other.meta.*.>"}, ""},

		{"zero", replay.TapConfig{}, "Conn"},
		{"subject prefix", replay.TapConfig{Conn: conn, Subjects: messages.Subjects{Prefix: "a b"}}, "--subject-prefix"},
		{"empty token", replay.TapConfig{Conn: conn, Subject: "kvbus..req"}, "--subject"},
		{"space", replay.TapConfig{Conn: conn, Subject: "kvbus req"}, "--subject"},
		{"> not last", replay.TapConfig{Conn: conn, Subject: "kvbus.>.req"}, "--subject"},
	} {
		err := tc.cfg.Validate()
		if !validatetest.Refused(t, tc.name, err, replay.ErrConfig, tc.want) {
			continue
		}
		validatetest.SameError(t, tc.name, "Tap", replay.Tap(t.Context(), tc.cfg, &strings.Builder{}), err)
	}
}
