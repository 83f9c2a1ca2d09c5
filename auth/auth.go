// Package auth gives every kvbus role its own NATS identity and exactly the
// bus subjects it needs. Init writes one nkey seed per role (frontend,
// scheduler, worker, observer, admin; optionally one worker key per group) and an
// authorization block for nats-server that lists each role's public key
// with publish and subscribe allow-lists derived from the subject table
// (DESIGN §4) plus the JetStream API, KV-bucket and inbox subjects the role
// uses; everything else is denied. `kvbus nats --auth-config` loads it; the
// roles connect with `--nats-nkey <role>.nk`.
//
// The functions are pure but for Init and Load, which touch the files they
// name; nothing here keeps state.
package auth

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// Role names, and the seed file of each: DIR/<role>.nk (worker keys of one
// group: DIR/worker-<group>.nk).
const (
	RoleFrontend  = "frontend"
	RoleScheduler = "scheduler"
	RoleWorker    = "worker"
	// RoleObserver reads every kvbus subject and publishes nothing: the
	// key of `kvbus top` and `kvbus tap`, which watch the bus and must not
	// be able to forge a message on it.
	RoleObserver = "observer"
	RoleAdmin    = "admin"
)

// Roles are the roles in the order the matrix prints them.
func Roles() []string {
	return []string{RoleFrontend, RoleScheduler, RoleWorker, RoleObserver, RoleAdmin}
}

// Sentinel errors.
var (
	// ErrExists is wrapped when Init would overwrite keys (use force).
	ErrExists = errors.New("auth: keys exist")
	// ErrConfig is wrapped by bad arguments.
	ErrConfig = errors.New("auth: bad configuration")
)

// schedulerConsumer is the schedulers' durable consumer of the request log
// (only they may make it); the stream and buckets are named by the subject
// prefix.
const schedulerConsumer = bus.SchedulerConsumer

// Permissions are a role's allow-lists; what is not listed is denied.
// Responses, when set, lets the role answer requests it received (on their
// reply subjects) up to that many messages per request.
type Permissions struct {
	Publish   []string
	Subscribe []string
	Responses int
}

// Identity is a key of one role: Group is set for a worker key limited to
// one group.
type Identity struct {
	Role  string
	Group string
}

// Name is the identity's seed file name without .nk.
func (id Identity) Name() string {
	if id.Group != "" {
		return id.Role + "-" + id.Group
	}
	return id.Role
}

// maxResponses bounds the replies of one request a role may send: a dump or
// a pool read is answered in as many chunks as the max payload needs.
const maxResponses = 1 << 20

// jsAPI is the JetStream API subject prefix.
const jsAPI = "$JS.API."

// streamAPI are the subjects that manage and read the stream `name`.
func streamAPI(name string, ops ...string) []string {
	var out []string
	for _, op := range ops {
		out = append(out, jsAPI+"STREAM."+op+"."+name)
	}
	return out
}

// kvBucket is what a client of the KV bucket needs: its stream's info and
// creation, direct gets, watches (ordered consumers, with their answers to
// the server's flow control, $JS.FC.<stream>.…: unanswered, the server stops
// a watch's deliveries once ~2 MiB are pending) and puts of the keys
// matching keys (">" for all).
func kvBucket(bucket, keys string) []string {
	st := "KV_" + bucket
	return append(streamAPI(st, "INFO", "CREATE", "MSG.GET"),
		jsAPI+"DIRECT.GET."+st+".>", jsAPI+"DIRECT.GET."+st,
		jsAPI+"CONSUMER.CREATE."+st+".>", jsAPI+"CONSUMER.DELETE."+st+".>", jsAPI+"CONSUMER.INFO."+st+".>",
		"$JS.FC."+st+".>", "$KV."+bucket+"."+keys)
}

// For returns the permissions of an identity for subjects s. A worker
// identity with a group is limited to that group's ReqMetas, dumps, pool,
// KV events and heartbeats.
func For(s messages.Subjects, id Identity) (Permissions, error) {
	requestStream := s.RequestStream()
	// Each role reads only its own reply inbox (bus.InboxPrefix): with
	// _INBOX.> for all, any key could read the request log's deliveries to
	// the schedulers, the JetStream API's and the buckets' answers, dumps
	// and pool reads.
	inbox := bus.InboxSubscriptions(id.Role, id.Group)
	switch id.Role {
	case RoleFrontend:
		return Permissions{
			// No UPDATE of the request log (nor for a scheduler): a
			// frontend key could add kvbus.meta.> to its subjects with a
			// republish onto kvbus.out.<g> and read every ReqMeta. Only
			// admin switches an older log to discard new
			// (bus.EnsureRequestStream says how).
			// Nor the schedulers' consumer: its create is also its update
			// (the action is in the body), and a frontend key could point
			// it at no subject, or have it drop requests (MaxDeliver 1).
			// Resends go to the schedulers (kvbus.ctl.resend), then to
			// the group's driver they name (kvbus.ctl.resend.<g>).
			Publish: slices.Concat([]string{s.RequestAll(), s.Abort(), s.Resend(), s.ResendGroup("*"), jsAPI + "INFO"},
				streamAPI(requestStream, "INFO", "CREATE")),
			Subscribe: append([]string{s.OutAll(), s.AnnounceRole(messages.RoleScheduler)}, inbox...),
		}, nil
	case RoleScheduler:
		return Permissions{
			// Aborts go to one group's ranks (kvbus.ctl.abort.<g>);
			// kvbus.ctl.abort too, where a scheduler before 2026-12-07
			// sent its withdrawals, for the time of an upgrade.
			//
			// The frontends' reply inboxes: its answer to a Resend. Not
			// allow_responses: the server would then remember, for its
			// 10 minutes, the reply subject of every message delivered to
			// the key that it may not publish to (each session binding
			// its bucket watch delivers, with its JetStream ack subject).
			Publish: slices.Concat([]string{s.MetaAll(), s.OutAll(), s.Abort(), s.AbortGroup("*"), s.DumpAll(), s.PlanAll(),
				s.AnnounceRole(messages.RoleScheduler), jsAPI + "INFO"}, bus.InboxSubscriptions(RoleFrontend, ""),
				// MSG.GET: a dead replica's requests, adopted (scheduler/peers.go).
				// No UPDATE: a scheduler key could add kvbus.out.> to the
				// log's subjects with a republish onto kvbus.sched.plan.*
				// and read every answer.
				streamAPI(requestStream, "INFO", "CREATE", "PURGE", "MSG.GET"),
				[]string{jsAPI + "CONSUMER.INFO." + requestStream + "." + schedulerConsumer,
					jsAPI + "CONSUMER.CREATE." + requestStream + "." + schedulerConsumer,
					jsAPI + "CONSUMER.CREATE." + requestStream + "." + schedulerConsumer + ".>",
					jsAPI + "CONSUMER.DURABLE.CREATE." + requestStream + "." + schedulerConsumer,
					jsAPI + "CONSUMER.MSG.NEXT." + requestStream + "." + schedulerConsumer,
					"$JS.ACK." + requestStream + "." + schedulerConsumer + ".>"},
				kvBucket(s.SessionBucket(), ">"),
				// The plan stream: made, and read once at start
				// (scheduler/journal.go).
				streamAPI(s.PlanStream(), "INFO", "CREATE"),
				[]string{jsAPI + "CONSUMER.CREATE." + s.PlanStream() + ".>", jsAPI + "CONSUMER.MSG.NEXT." + s.PlanStream() + ".>",
					jsAPI + "CONSUMER.DELETE." + s.PlanStream() + ".>", jsAPI + "CONSUMER.INFO." + s.PlanStream() + ".>"}),
			// A frontend's Resend is answered with the request's group.
			Subscribe: append([]string{s.DoneAll(), s.KVAll(), s.HeartbeatAll(), s.PlanAll(), s.Abort(), s.Resend(),
				s.AnnounceRole(messages.RoleScheduler)}, inbox...),
		}, nil
	case RoleWorker:
		g := "*"
		slots := ">"
		if id.Group != "" {
			if err := messages.ValidateGroup(id.Group); err != nil {
				return Permissions{}, fmt.Errorf("%w: %w", ErrConfig, err)
			}
			g = id.Group
			slots = g + ".*" // its group's slots (--rank auto --group g): <group>.<rank>
		}
		return Permissions{
			Publish: slices.Concat([]string{s.KVGroup(g), s.HeartbeatGroup(g), s.DoneAll(), s.OutAll(),
				// Pool reads and hand-offs go to any group; the drain plan
				// only to its own (outside pool.>, which pool.*.* covers).
				s.PoolAny(), s.HandoffAny(), s.Drain(g), jsAPI + "INFO"},
				kvBucket(s.SlotBucket(), slots)),
			// A worker reads its group's aborts (kvbus.ctl.abort.<g>) and
			// resends (kvbus.ctl.resend.<g>); kvbus.ctl.abort and
			// kvbus.ctl.resend, where a worker before 2026-12-07 read every
			// group's, stay allowed for the time of an upgrade.
			Subscribe: append([]string{s.MetaGroup(g), s.AbortGroup(g), s.Abort(), s.ResendGroup(g), s.Resend(), s.DumpGroup(g), s.PoolGroup(g),
				s.Drain(g), s.HeartbeatAll()}, inbox...),
			Responses: maxResponses,
		}, nil
	case RoleObserver:
		// Core subscriptions only: no JetStream API (a consumer it created
		// could deliver the request log onto any subject), no inbox (it
		// makes no request), no publish at all.
		return Permissions{Subscribe: []string{s.All()}}, nil
	case RoleAdmin:
		return Permissions{Publish: []string{">"}, Subscribe: []string{">"}, Responses: maxResponses}, nil
	}
	return Permissions{}, fmt.Errorf("%w: unknown role %q (want frontend, scheduler, worker, observer or admin)", ErrConfig, id.Role)
}

// RewriteConfig rewrites dir's ConfigFile with the permissions this kvbus
// gives the keys there, keeping every seed: the upgrade of a directory
// written by an older `kvbus auth init` (whose roles all read _INBOX.>).
// It reports whether the file changed; NATS must then load it again.
func RewriteConfig(dir string, s messages.Subjects) (bool, error) {
	conf, current, err := configOf(dir, s)
	if err != nil || current {
		return false, err
	}
	return true, commit([]file{conf})
}

// ConfigIsCurrent reports whether dir's ConfigFile, what NATS enforces,
// gives the keys there the permissions this kvbus gives them (what Matrix
// lists): not when an older kvbus wrote it, it was edited, or a key was
// added, removed or replaced since, nor when there is none.
func ConfigIsCurrent(dir string, s messages.Subjects) (bool, error) {
	_, current, err := configOf(dir, s)
	return current, err
}

// configOf returns the ConfigFile this kvbus writes for the keys of dir,
// and whether dir's is that one.
func configOf(dir string, s messages.Subjects) (file, bool, error) {
	ids, _, err := Keys(dir)
	if err != nil {
		return file{}, false, err
	}
	if s, err = dirSubjects(dir, s); err != nil {
		return file{}, false, err
	}
	files, err := keyFiles(dir, s, ids, func(Identity) bool { return false })
	if err != nil {
		return file{}, false, err
	}
	conf := files[len(files)-1]
	old, err := os.ReadFile(filepath.Join(dir, ConfigFile))
	if err != nil {
		return conf, false, nil
	}
	oldHead, oldUsers, ok := usersOf(old)
	head, users, _ := usersOf(conf.data)
	return conf, ok && oldHead == head && slices.Equal(oldUsers, users), nil
}

// usersOf returns what a ConfigFile's text has before its first user (the
// comments, the authorization block's opening: compared too, or a user
// inserted at the top of the list, which NATS lets in, went unseen), and
// its users, each as written, sorted: their order gives no permission
// (Init writes them in the roles' order, a rewrite in the order of the
// seed files' names). ok is false for a text not of that form.
func usersOf(text []byte) (head string, users []string, ok bool) {
	body, ok := bytes.CutSuffix(text, []byte("  ]\n}\n"))
	if !ok {
		return "", nil, false
	}
	parts := strings.Split(string(body), "\n    # ")
	head, users = parts[0], parts[1:]
	for i, u := range users {
		users[i] = strings.TrimSuffix(u, "\n") // the last one's
	}
	slices.Sort(users)
	return head, users, true
}
