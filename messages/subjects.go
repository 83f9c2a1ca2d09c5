package messages

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/zeebo/xxh3"
)

// DefaultPrefix is the first token of every kvbus subject.
const DefaultPrefix = "kvbus"

// The JetStream stream that logs every Request, the KV bucket of session
// bindings, the one of worker slots and the stream that keeps the
// schedulers' save plans, under the default prefix; Subjects.RequestStream,
// SessionBucket, SlotBucket and PlanStream name them for any.
const (
	RequestStream = "KVBUS_REQUESTS"
	SessionBucket = "KVBUS_SESSIONS"
	SlotBucket    = "KVBUS_RANKS"
	PlanStream    = "KVBUS_PLANS"
)

// MaxGroups is how many worker groups a deployment is built for: a
// scheduler's KV index tracks this many at once, and workers given their
// rank by slot (kvbus worker --rank auto) claim slots in this many.
const MaxGroups = 1024

// NoSession is the session key of a request without a session id.
const NoSession = "none"

// Kinds: the token after the prefix that tells what a subject carries
// (kvbus.<kind>.…). Subjects spells every subject with them; a role that
// routes what it hears on kvbus.> reads them back with Subjects.Kind.
const (
	KindRequest   = "req"
	KindMeta      = "meta"
	KindDone      = "done"
	KindOut       = "out"
	KindKV        = "kv"
	KindHeartbeat = "hb"
	KindControl   = "ctl"
	KindAnnounce  = "ann"
	KindScheduler = "sched"
	KindPool      = "pool"
	KindDrain     = "drain"
)

// ErrBadName is wrapped when a group name, prefix or id cannot be a subject
// token.
var ErrBadName = errors.New("messages: bad name")

// SessionKey returns the subject token of a session id: the 16-hex-digit
// xxh3-64 of its UTF-8 bytes, or "none" for the empty id. The raw id never
// appears in a subject.
func SessionKey(sessionID string) string {
	if sessionID == "" {
		return NoSession
	}
	var b [16]byte
	const hexdigits = "0123456789abcdef"
	h := xxh3.HashString(sessionID)
	for i := 15; i >= 0; i-- {
		b[i] = hexdigits[h&0xf]
		h >>= 4
	}
	return string(b[:])
}

// MaxModelBytes is the longest model name kvbus serves, in bytes. The name's
// token stands in the request subject, and a NATS server closes, for good,
// the connection of a client that sends a protocol line over its
// max_control_line (4096 bytes by default): subject, reply subject and sizes.
const MaxModelBytes = 1024

// ModelToken returns model with every byte outside [A-Za-z0-9_-] replaced by
// '_', so that it can stand as one subject token.
func ModelToken(model string) string {
	b := []byte(model)
	for i, c := range b {
		if !isTokenByte(c) {
			b[i] = '_'
		}
	}
	if len(b) == 0 {
		return "_"
	}
	return string(b)
}

// ValidateGroup reports whether name is a valid worker group name:
// [A-Za-z0-9_-]{1,32}.
func ValidateGroup(name string) error {
	if len(name) < 1 || len(name) > 32 || !isToken(name) {
		return fmt.Errorf("%w: group %q must match [A-Za-z0-9_-]{1,32}", ErrBadName, name)
	}
	return nil
}

// ValidateToken reports whether s can be used as one subject token by kvbus
// (a prefix, a frontend id or a scheduler id): [A-Za-z0-9_-]{1,64}.
func ValidateToken(what, s string) error {
	if len(s) < 1 || len(s) > 64 || !isToken(s) {
		return fmt.Errorf("%w: %s %q must match [A-Za-z0-9_-]{1,64}", ErrBadName, what, s)
	}
	return nil
}

func isTokenByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-'
}

func isToken(s string) bool {
	for i := 0; i < len(s); i++ {
		if !isTokenByte(s[i]) {
			return false
		}
	}
	return true
}

// Subjects spells every kvbus subject under one prefix. The zero value uses
// DefaultPrefix. Subjects is a value type, safe for concurrent use.
type Subjects struct {
	Prefix string
}

func (s Subjects) p() string {
	if s.Prefix == "" {
		return DefaultPrefix
	}
	return s.Prefix
}

// RequestStream is the JetStream stream that logs this deployment's
// Requests: KVBUS_REQUESTS under the default prefix, KVBUS_REQUESTS_<prefix>
// under another, so that deployments with their own prefixes on one NATS
// keep their own request logs (and schedulers, whose durable consumer is
// the stream's).
func (s Subjects) RequestStream() string { return s.jetStreamName(RequestStream) }

// SessionBucket is the JetStream KV bucket of session bindings
// (KVBUS_SESSIONS, with the prefix as for RequestStream).
func (s Subjects) SessionBucket() string { return s.jetStreamName(SessionBucket) }

// SlotBucket is the JetStream KV bucket where `kvbus worker --rank auto`
// claims slots (KVBUS_RANKS, with the prefix as for RequestStream).
func (s Subjects) SlotBucket() string { return s.jetStreamName(SlotBucket) }

// PlanStream is the JetStream stream that keeps the schedulers' SavePlans
// (kvbus.sched.plan.*) for a while (KVBUS_PLANS, with the prefix as for
// RequestStream): what a replica dispatched and ended, for one that starts
// after it died.
func (s Subjects) PlanStream() string { return s.jetStreamName(PlanStream) }

// jetStreamName is base under the default prefix and base_<prefix> under
// another: a prefix is [A-Za-z0-9_-], which stream and bucket names take.
func (s Subjects) jetStreamName(base string) string {
	if s.p() == DefaultPrefix {
		return base
	}
	return base + "_" + s.p()
}

// Validate checks the prefix.
func (s Subjects) Validate() error { return ValidateToken("subject prefix", s.p()) }

// Request is kvbus.req.<model-token>, where the frontend publishes.
func (s Subjects) Request(model string) string {
	return s.p() + "." + KindRequest + "." + ModelToken(model)
}

// RequestAll is kvbus.req.>, the subjects of the request stream.
func (s Subjects) RequestAll() string { return s.p() + "." + KindRequest + ".>" }

// Meta is kvbus.meta.<group>.<session-key>, where the scheduler publishes a
// ReqMeta for a group.
func (s Subjects) Meta(group, sessionID string) string {
	return s.p() + "." + KindMeta + "." + group + "." + SessionKey(sessionID)
}

// MetaGroup is kvbus.meta.<group>.>, what every rank of a group subscribes.
func (s Subjects) MetaGroup(group string) string { return s.p() + "." + KindMeta + "." + group + ".>" }

// MetaSession is kvbus.meta.*.<session-key>: one conversation across groups.
func (s Subjects) MetaSession(sessionID string) string {
	return s.p() + "." + KindMeta + ".*." + SessionKey(sessionID)
}

// Done is kvbus.done.<scheduler-id>, where ranks report RankResults.
func (s Subjects) Done(schedulerID string) string { return s.p() + "." + KindDone + "." + schedulerID }

// Out is kvbus.out.<frontend-id>, where the driver rank streams Outputs.
func (s Subjects) Out(frontendID string) string { return s.p() + "." + KindOut + "." + frontendID }

// KV is kvbus.kv.<group>.<rank>, a rank's KV events.
func (s Subjects) KV(group string, rank int) string {
	return s.p() + "." + KindKV + "." + group + "." + strconv.Itoa(rank)
}

// KVAll is kvbus.kv.>, every rank's KV events.
func (s Subjects) KVAll() string { return s.p() + "." + KindKV + ".>" }

// Heartbeat is kvbus.hb.<group>.<rank>.
func (s Subjects) Heartbeat(group string, rank int) string {
	return s.p() + "." + KindHeartbeat + "." + group + "." + strconv.Itoa(rank)
}

// HeartbeatAll is kvbus.hb.>, every rank's heartbeats.
func (s Subjects) HeartbeatAll() string { return s.p() + "." + KindHeartbeat + ".>" }

// Abort is kvbus.ctl.abort, where frontends publish the Aborts of their
// clients and the schedulers read them.
func (s Subjects) Abort() string { return s.p() + "." + KindControl + ".abort" }

// AbortGroup is kvbus.ctl.abort.<group>, where a scheduler sends one
// group's ranks the Aborts of its requests: a client's, relayed from
// kvbus.ctl.abort, and its own withdrawals. group may be "*" (every group).
func (s Subjects) AbortGroup(group string) string { return s.Abort() + "." + group }

// Resend is kvbus.ctl.resend, where a frontend asks the schedulers which
// group holds a request whose outputs it lost on the bus (see Resend); a
// driver rank before 2026-12-07 read it itself.
func (s Subjects) Resend() string { return s.p() + "." + KindControl + ".resend" }

// ResendGroup is kvbus.ctl.resend.<group>, where a frontend asks the
// group's driver rank for the outputs of a request again (see Resend).
// group may be "*" (every group).
func (s Subjects) ResendGroup(group string) string { return s.Resend() + "." + group }

// Dump is kvbus.ctl.dump.<group>.<rank>, a request/reply for a full
// KVEventBatch of what a rank holds.
func (s Subjects) Dump(group string, rank int) string {
	return s.p() + "." + KindControl + ".dump." + group + "." + strconv.Itoa(rank)
}

// Announce is kvbus.ann.<role>.<id>, where a process announces itself.
func (s Subjects) Announce(role, id string) string {
	return s.p() + "." + KindAnnounce + "." + role + "." + id
}

// AnnounceRole is kvbus.ann.<role>.*, every announcement of one role.
func (s Subjects) AnnounceRole(role string) string {
	return s.p() + "." + KindAnnounce + "." + role + ".*"
}

// Plan is kvbus.sched.plan.<scheduler-id>, where a scheduler replica
// publishes its SavePlans.
func (s Subjects) Plan(schedulerID string) string {
	return s.p() + "." + KindScheduler + ".plan." + schedulerID
}

// PlanAll is kvbus.sched.plan.*, every replica's SavePlans.
func (s Subjects) PlanAll() string { return s.p() + "." + KindScheduler + ".plan.*" }

// Pool is kvbus.pool.<group>.<rank>, where a rank answers PoolReads for
// its segment of the KV pool.
func (s Subjects) Pool(group string, rank int) string {
	return s.p() + "." + KindPool + "." + group + "." + strconv.Itoa(rank)
}

// Handoff is kvbus.pool.<group>.<rank>.handoff, where a rank takes blocks
// a draining group hands to it (Handoff → HandoffResult).
func (s Subjects) Handoff(group string, rank int) string {
	return s.Pool(group, rank) + ".handoff"
}

// Drain is kvbus.drain.<group>, where a draining group's driver rank
// publishes its DrainPlan to the group's ranks. It is outside kvbus.pool.>
// because a worker key may publish PoolReads to any group's
// kvbus.pool.<group>.<rank>, a pattern (pool.*.*) that would match every
// group's plan there too.
func (s Subjects) Drain(group string) string { return s.p() + "." + KindDrain + "." + group }

// Wildcard patterns, for subscriptions and for the permissions kvbus auth
// gives each role. A group argument may be "*" (every group).

// MetaAll is kvbus.meta.>, every group's ReqMetas.
func (s Subjects) MetaAll() string { return s.p() + "." + KindMeta + ".>" }

// DoneAll is kvbus.done.*, every scheduler's RankResults.
func (s Subjects) DoneAll() string { return s.Done("*") }

// OutAll is kvbus.out.*, every frontend's Outputs.
func (s Subjects) OutAll() string { return s.Out("*") }

// KVGroup is kvbus.kv.<group>.*, the KV events of a group's ranks.
func (s Subjects) KVGroup(group string) string { return s.p() + "." + KindKV + "." + group + ".*" }

// HeartbeatGroup is kvbus.hb.<group>.*, the heartbeats of a group's ranks.
func (s Subjects) HeartbeatGroup(group string) string {
	return s.p() + "." + KindHeartbeat + "." + group + ".*"
}

// DumpGroup is kvbus.ctl.dump.<group>.*, the dump requests to a group's
// ranks.
func (s Subjects) DumpGroup(group string) string {
	return s.p() + "." + KindControl + ".dump." + group + ".*"
}

// DumpAll is kvbus.ctl.dump.>, the dump requests to every rank.
func (s Subjects) DumpAll() string { return s.p() + "." + KindControl + ".dump.>" }

// PoolAny is kvbus.pool.*.*, the pool reads to any rank of any group.
func (s Subjects) PoolAny() string { return s.p() + "." + KindPool + ".*.*" }

// HandoffAny is kvbus.pool.*.*.handoff, the hand-offs to any rank.
func (s Subjects) HandoffAny() string { return s.PoolAny() + ".handoff" }

// PoolGroup is kvbus.pool.<group>.>, a group's pool reads and hand-offs.
func (s Subjects) PoolGroup(group string) string { return s.p() + "." + KindPool + "." + group + ".>" }

// Kind returns the kind token of a subject under this prefix (KindMeta for
// kvbus.meta.g0.<key>), and the rest after it ("g0.<key>"), or "" when
// the subject is not under the prefix.
func (s Subjects) Kind(subject string) (kind, rest string) {
	p := s.p() + "."
	if !strings.HasPrefix(subject, p) {
		return "", ""
	}
	kind, rest, _ = strings.Cut(subject[len(p):], ".")
	return kind, rest
}

// All is kvbus.>, every kvbus subject.
func (s Subjects) All() string { return s.p() + ".>" }
