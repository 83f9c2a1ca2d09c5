package messages

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/zeebo/xxh3"
)

func TestSessionKey(t *testing.T) {
	if got := SessionKey(""); got != "none" || NoSession != "none" {
		t.Errorf(`SessionKey("") = %q, want "none"`, got)
	}
	inputs := []string{
		"a",
		"sess-alpha",
		"conversation 42",
		"ünïcödé 会话",
		"none", // a session literally named "none" still hashes
		strings.Repeat("x", 256),
		"\x00",
	}
	// Find an input whose hash has a leading zero nibble, so that the
	// zero padding is exercised (1 in 16 strings qualify).
	for i := 0; ; i++ {
		s := fmt.Sprintf("session-%d", i)
		if xxh3.HashString(s)>>60 == 0 {
			inputs = append(inputs, s)
			break
		}
	}
	for _, s := range inputs {
		got := SessionKey(s)
		want := fmt.Sprintf("%016x", xxh3.HashString(s))
		if got != want {
			t.Errorf("SessionKey(%q) = %q, want %q", s, got, want)
		}
		if len(got) != 16 {
			t.Errorf("SessionKey(%q) = %q: length %d, want 16", s, got, len(got))
		}
		if got != SessionKey(s) {
			t.Errorf("SessionKey(%q) is not deterministic", s)
		}
	}
	last := inputs[len(inputs)-1]
	if k := SessionKey(last); k[0] != '0' {
		t.Errorf("SessionKey(%q) = %q, want a leading 0", last, k)
	}
	if SessionKey("a") == SessionKey("b") {
		t.Error(`SessionKey("a") == SessionKey("b")`)
	}
}

func TestModelToken(t *testing.T) {
	tests := []struct{ in, want string }{
		{"meta-llama/Llama-3.1-8B-Instruct", "meta-llama_Llama-3_1-8B-Instruct"},
		{"", "_"},
		{"gpt2", "gpt2"},
		{"A_b-9", "A_b-9"},
		{"Qwen/Qwen2.5-7B", "Qwen_Qwen2_5-7B"},
		{"a.b*c>d e\tf", "a_b_c_d_e_f"},
		{"é", "__"},      // two UTF-8 bytes
		{"模型", "______"}, // two characters of three bytes each
		{"m😀", "m____"},  // one four-byte character
		{"\xff", "_"},    // invalid UTF-8 is one byte
		{"..", "__"},
	}
	for _, tc := range tests {
		got := ModelToken(tc.in)
		if got != tc.want {
			t.Errorf("ModelToken(%q) = %q, want %q", tc.in, got, tc.want)
		}
		if len(tc.in) > 0 && len(got) != len(tc.in) {
			t.Errorf("ModelToken(%q) changed the length: %d bytes, want %d", tc.in, len(got), len(tc.in))
		}
		if !isToken(got) {
			t.Errorf("ModelToken(%q) = %q is not a subject token", tc.in, got)
		}
	}
}

func TestValidateGroup(t *testing.T) {
	tests := []struct {
		name string
		ok   bool
	}{
		{"g0", true},
		{"A_b-9", true},
		{"_", true},
		{"-", true},
		{strings.Repeat("g", 32), true},
		{"", false},
		{strings.Repeat("g", 33), false},
		{"g.0", false},
		{"g*", false},
		{"g>", false},
		{"g 0", false},
		{"g\t0", false},
		{"gé", false},
		{"g/0", false},
	}
	for _, tc := range tests {
		err := ValidateGroup(tc.name)
		if tc.ok && err != nil {
			t.Errorf("ValidateGroup(%q) = %v, want nil", tc.name, err)
		}
		if !tc.ok && !errors.Is(err, ErrBadName) {
			t.Errorf("ValidateGroup(%q) = %v, want ErrBadName", tc.name, err)
		}
	}
}

func TestValidateToken(t *testing.T) {
	for _, s := range []string{"kvbus", "fe-0", "sched_1", strings.Repeat("x", 64)} {
		if err := ValidateToken("id", s); err != nil {
			t.Errorf("ValidateToken(%q) = %v", s, err)
		}
	}
	for _, s := range []string{"", strings.Repeat("x", 65), "a.b", "a b", "a*", "a>"} {
		if err := ValidateToken("id", s); !errors.Is(err, ErrBadName) {
			t.Errorf("ValidateToken(%q) = %v, want ErrBadName", s, err)
		}
	}
	if err := (Subjects{}).Validate(); err != nil {
		t.Errorf("default prefix: %v", err)
	}
	if err := (Subjects{Prefix: "xy"}).Validate(); err != nil {
		t.Errorf("prefix xy: %v", err)
	}
	if err := (Subjects{Prefix: "a.b"}).Validate(); !errors.Is(err, ErrBadName) {
		t.Errorf("prefix a.b: %v, want ErrBadName", err)
	}
}

func TestSubjects(t *testing.T) {
	const (
		model   = "meta-llama/Llama-3.1-8B-Instruct"
		session = "sess-alpha"
	)
	key := SessionKey(session)
	type spelled struct{ name, got, want string }
	spell := func(s Subjects, p string) []spelled {
		return []spelled{
			{"Request", s.Request(model), p + ".req.meta-llama_Llama-3_1-8B-Instruct"},
			{"Request/empty model", s.Request(""), p + ".req._"},
			{"RequestAll", s.RequestAll(), p + ".req.>"},
			{"Meta", s.Meta("g0", session), p + ".meta.g0." + key},
			{"Meta/no session", s.Meta("g0", ""), p + ".meta.g0.none"},
			{"MetaGroup", s.MetaGroup("g0"), p + ".meta.g0.>"},
			{"MetaSession", s.MetaSession(session), p + ".meta.*." + key},
			{"MetaSession/no session", s.MetaSession(""), p + ".meta.*.none"},
			{"Done", s.Done("sched-0"), p + ".done.sched-0"},
			{"Out", s.Out("fe-0"), p + ".out.fe-0"},
			{"KV", s.KV("g0", 3), p + ".kv.g0.3"},
			{"KVAll", s.KVAll(), p + ".kv.>"},
			{"Heartbeat", s.Heartbeat("g1", 0), p + ".hb.g1.0"},
			{"HeartbeatAll", s.HeartbeatAll(), p + ".hb.>"},
			{"Abort", s.Abort(), p + ".ctl.abort"},
			{"AbortGroup", s.AbortGroup("g0"), p + ".ctl.abort.g0"},
			{"AbortGroup/every group", s.AbortGroup("*"), p + ".ctl.abort.*"},
			{"Dump", s.Dump("g0", 12), p + ".ctl.dump.g0.12"},
			{"All", s.All(), p + ".>"},
			{"Resend", s.Resend(), p + ".ctl.resend"},
			{"ResendGroup", s.ResendGroup("g0"), p + ".ctl.resend.g0"},
			{"ResendGroup/every group", s.ResendGroup("*"), p + ".ctl.resend.*"},
			{"Announce", s.Announce("scheduler", "s1"), p + ".ann.scheduler.s1"},
			{"AnnounceRole", s.AnnounceRole("scheduler"), p + ".ann.scheduler.*"},
			{"Plan", s.Plan("s1"), p + ".sched.plan.s1"},
			{"PlanAll", s.PlanAll(), p + ".sched.plan.*"},
			{"Pool", s.Pool("g0", 2), p + ".pool.g0.2"},
			{"Handoff", s.Handoff("g0", 2), p + ".pool.g0.2.handoff"},
			{"Drain", s.Drain("g0"), p + ".drain.g0"},
			{"MetaAll", s.MetaAll(), p + ".meta.>"},
			{"DoneAll", s.DoneAll(), p + ".done.*"},
			{"OutAll", s.OutAll(), p + ".out.*"},
			{"KVGroup", s.KVGroup("g0"), p + ".kv.g0.*"},
			{"HeartbeatGroup", s.HeartbeatGroup("*"), p + ".hb.*.*"},
			{"DumpGroup", s.DumpGroup("g0"), p + ".ctl.dump.g0.*"},
			{"DumpAll", s.DumpAll(), p + ".ctl.dump.>"},
			{"PoolAny", s.PoolAny(), p + ".pool.*.*"},
			{"HandoffAny", s.HandoffAny(), p + ".pool.*.*.handoff"},
			{"PoolGroup", s.PoolGroup("g0"), p + ".pool.g0.>"},
		}
	}
	for _, prefix := range []struct {
		s Subjects
		p string
	}{
		{Subjects{}, "kvbus"},
		{Subjects{Prefix: DefaultPrefix}, "kvbus"},
		{Subjects{Prefix: "xy"}, "xy"},
	} {
		for _, sp := range spell(prefix.s, prefix.p) {
			if sp.got != sp.want {
				t.Errorf("prefix %q: %s = %q, want %q", prefix.s.Prefix, sp.name, sp.got, sp.want)
			}
		}
	}
	for _, tt := range []struct{ subject, kind, rest string }{
		{Subjects{}.Meta("g0", session), KindMeta, "g0." + key},
		{Subjects{}.Abort(), KindControl, "abort"},
		{Subjects{}.Out("fe-0"), KindOut, "fe-0"},
		{"kvbus", "", ""},
		{"kvbusx.req.m", "", ""},
		{"xy.req.m", "", ""},
	} {
		if kind, rest := (Subjects{}).Kind(tt.subject); kind != tt.kind || rest != tt.rest {
			t.Errorf("Kind(%q) = %q, %q; want %q, %q", tt.subject, kind, rest, tt.kind, tt.rest)
		}
	}
	if kind, rest := (Subjects{Prefix: "xy"}).Kind("xy.req.m"); kind != KindRequest || rest != "m" {
		t.Errorf(`Kind("xy.req.m") under prefix xy = %q, %q; want "req", "m"`, kind, rest)
	}
	if key == "" || !strings.HasSuffix(Subjects{}.Meta("g0", session), "."+key) {
		t.Errorf("Meta does not end in the session key %q", key)
	}
}

func TestSubjectsNeverSpellRawSession(t *testing.T) {
	sessions := []string{
		"sess-alpha",
		"user@example.com",
		"a.b.c",
		"conv*>",
		"0123456789abcdef", // looks like a key itself
		"g0",               // same as the group
	}
	for _, s := range sessions {
		key := SessionKey(s)
		for _, subj := range []string{
			Subjects{}.Meta("g0", s),
			Subjects{Prefix: "xy"}.Meta("grp", s),
			Subjects{}.MetaSession(s),
		} {
			tokens := strings.Split(subj, ".")
			last := tokens[len(tokens)-1]
			if last != key {
				t.Errorf("%q: last token %q, want the key %q", subj, last, key)
			}
			if s != key && strings.Contains(last, s) {
				t.Errorf("%q: session token holds the raw session id %q", subj, s)
			}
			if !strings.Contains(s, ".") && s != "g0" && strings.Contains(subj, s) {
				t.Errorf("%q holds the raw session id %q", subj, s)
			}
			if strings.Count(subj, ".") != 3 {
				t.Errorf("%q: want exactly 4 tokens", subj)
			}
		}
	}
}

// TestJetStreamNamesPerPrefix: the default prefix keeps DESIGN.md's
// names; another prefix gets its own stream and buckets.
func TestJetStreamNamesPerPrefix(t *testing.T) {
	def, b := Subjects{}, Subjects{Prefix: "team-b"}
	for _, c := range []struct{ got, want string }{
		{def.RequestStream(), "KVBUS_REQUESTS"}, {def.SessionBucket(), "KVBUS_SESSIONS"}, {def.SlotBucket(), "KVBUS_RANKS"},
		{Subjects{Prefix: DefaultPrefix}.RequestStream(), "KVBUS_REQUESTS"},
		{b.RequestStream(), "KVBUS_REQUESTS_team-b"}, {b.SessionBucket(), "KVBUS_SESSIONS_team-b"}, {b.SlotBucket(), "KVBUS_RANKS_team-b"},
	} {
		if c.got != c.want {
			t.Errorf("got %s, want %s", c.got, c.want)
		}
	}
}
