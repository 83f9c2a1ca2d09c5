package bus

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// ErrPermission is wrapped when the NATS server refused a role one of its
// own subjects (CheckPermissions; its error also wraps
// nats.ErrPermissionViolation) or the JetStream API of its request log
// (EnsureRequestStream): the role was given another role's key, or a key
// written for another --subject-prefix, and would otherwise run without
// ever receiving what it is there for, or wait for JetStream in vain.
var ErrPermission = errors.New("bus: this role's NATS key may not use its subjects")

// RoleCheck names a role for CheckPermissions.
type RoleCheck struct {
	// Role is "frontend", "scheduler" or "worker": the role whose key the
	// connection should hold (`kvbus auth init` writes DIR/<Role>.nk).
	Role string
	// Group is a worker's group: worker-<Group>.nk is the key for that
	// group only, worker.nk the one for any group.
	Group string
	// Subscribe are the subjects the role subscribes to, spelled as it
	// subscribes them, the one that tells most first: when several are
	// refused, the error names the first. Its reply inbox (nc.NewInbox) is
	// checked too.
	Subscribe []string
	// Newer are subjects of Subscribe that the nats-auth.conf of an
	// earlier `kvbus auth init` does not allow (a worker's
	// kvbus.drain.<g>, since 2026-12-06, and kvbus.ctl.abort.<g>, since
	// 2026-12-07), listed last in Subscribe: one of
	// them refused while the others passed means the key is the role's
	// and the server's configuration is older than the role (a rolling
	// upgrade that started this role before rewriting it), not that the
	// key is another role's.
	Newer []string
}

// permissionCheckTimeout bounds CheckPermissions' flush.
const permissionCheckTimeout = 5 * time.Second

// CheckPermissions tells at once a role whose key the server refuses its
// own subjects. It subscribes to each of c.Subscribe and to a reply inbox
// (the connection's own prefix, Config.InboxPrefix),
// flushes once (the server's -ERR for a refused subscription arrives before
// the PONG), unsubscribes, and returns an error wrapping ErrPermission
// (and nats.ErrPermissionViolation) that names the refused subject, the
// role, and the key `kvbus auth init` wrote for it. The subscriptions are
// its own, so it can be called before or after the role makes its real
// ones; a message they receive in between is dropped.
//
// Only a violation naming one of these subscriptions counts: nc.LastError
// is connection-wide, and the server reports only the last violation, so a
// violation of another subject (an earlier JetStream call, say) is not this
// check's business and, if it arrives last, hides the role's own (the role
// then runs and logs the violation, as without the check). A bus without
// authorization never refuses a subject, so there the check always passes.
//
// Publishes are not checked: the only way to learn that a publish is
// refused is to publish, and every subject a role publishes to has
// consumers (a heartbeat, a KV event, a ReqMeta, an output, a request in
// the log) that would act on a probe. A key that may subscribe to all of
// a role's subjects is that role's key (or admin) among those `kvbus auth
// init` writes, so with its keys the subscriptions decide.
//
// A flush that fails (the connection is reconnecting, or ctx ended first)
// skips the check: it returns nil.
func CheckPermissions(ctx context.Context, nc *nats.Conn, c RoleCheck) error {
	// The connection keeps only the last violation: subscribed in reverse,
	// the first subject refused is the one named.
	inbox := nc.NewInbox()
	subjects := append([]string{inbox}, c.Subscribe...)
	slices.Reverse(subjects[1:])
	var subs []*nats.Subscription
	defer func() {
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
	}()
	for _, s := range subjects {
		sub, err := nc.SubscribeSync(s)
		if err != nil {
			return fmt.Errorf("bus: check the %s's permissions: subscribe %s: %w", roleName(c), s, err)
		}
		subs = append(subs, sub)
	}
	fctx, cancel := context.WithTimeout(ctx, permissionCheckTimeout)
	defer cancel()
	if err := nc.FlushWithContext(fctx); err != nil {
		return nil // not known: the role goes on, as without the check
	}
	kind, subject, ok := violation(nc.LastError())
	if !ok || kind != "Subscription" || !slices.Contains(subjects, subject) {
		return nil
	}
	if subject == inbox && !readsAnInbox(ctx, nc) {
		// Every subject of the role passed and no reply inbox at all: a
		// key that only watches (the observer's reads kvbus.>).
		return fmt.Errorf("%w: the server refused to let the %s subscribe to its reply inbox %s, or to any (%w): its NATS key only "+
			"watches the bus, as the observer key of kvbus top and tap does, and may make no request. Give it the key `kvbus auth init DIR` "+
			"wrote for it: %s; `kvbus auth show DIR` lists what each key may use",
			ErrPermission, roleName(c), subject, nats.ErrPermissionViolation, keyAdvice(c.Role, c.Group))
	}
	if subject == inbox {
		// Every subject of the role passed: its key is right, but the
		// server's allow-list has no inbox of its own.
		prefix := inbox[:strings.LastIndex(inbox, ".")] // the connection's prefix
		return fmt.Errorf("%w: the server refused to let the %s subscribe to its reply inbox %s (%w): the server's nats-auth.conf "+
			"was written by an older `kvbus auth init`, which let every role read _INBOX.>; each role now has its own inbox "+
			"(%s.>). Run `kvbus auth init DIR` again (it keeps the keys and rewrites nats-auth.conf), then reload NATS "+
			"(kill -HUP the kvbus nats process, make reload-nats in compose, or nats-server --signal reload); with your own NATS users, allow this one to subscribe to %s.>",
			ErrPermission, roleName(c), subject, nats.ErrPermissionViolation, prefix, prefix)
	}
	if slices.Contains(c.Newer, subject) {
		return fmt.Errorf("%w: the server refused to let the %s subscribe to %s (%w), and allowed its other subjects: its key is "+
			"right, but the server's nats-auth.conf was written by an earlier `kvbus auth init`, before kvbus used %s. Run `kvbus auth "+
			"init DIR` again (it keeps the keys and rewrites nats-auth.conf), then reload NATS (kill -HUP the kvbus nats process, make "+
			"reload-nats in compose, or nats-server --signal reload), and start this role again; upgrading, do that once the frontends "+
			"run this kvbus, before the schedulers and workers do. With your own NATS users, allow this one to subscribe to %s",
			ErrPermission, roleName(c), subject, nats.ErrPermissionViolation, subject, subject)
	}
	what := subject
	return fmt.Errorf("%w: the server refused to let the %s subscribe to %s (%w): its NATS key is another role's (or "+
		"another group's), or was written for another --subject-prefix. Give it the key `kvbus auth init DIR` wrote for it: %s; "+
		"`kvbus auth show DIR` lists what each key may use, and with your own NATS users give this one the %s's allow-list",
		ErrPermission, roleName(c), what, nats.ErrPermissionViolation, keyAdvice(c.Role, c.Group), c.Role)
}

// readsAnInbox reports whether nc may subscribe to a reply inbox of
// nats.go's own prefix, _INBOX, as every role's key could in the
// nats-auth.conf of an older kvbus auth init (and admin's can): a key
// refused its role's inbox is then that role's, under an older
// configuration, and otherwise a key that may read no inbox at all. A
// flush that fails says nothing: true, the older configuration.
func readsAnInbox(ctx context.Context, nc *nats.Conn) bool {
	probe := nats.NewInbox()
	sub, err := nc.SubscribeSync(probe)
	if err != nil {
		return true
	}
	defer func() { _ = sub.Unsubscribe() }()
	fctx, cancel := context.WithTimeout(ctx, permissionCheckTimeout)
	defer cancel()
	if err := nc.FlushWithContext(fctx); err != nil {
		return true
	}
	kind, subject, ok := violation(nc.LastError())
	return !ok || kind != "Subscription" || subject != probe
}

// keyAdvice names the key `kvbus auth init DIR` wrote for a role (group:
// a worker's group, or ""), as the flag that gives it.
func keyAdvice(role, group string) string {
	if role == "worker" && group != "" {
		return fmt.Sprintf("--nats-nkey DIR/worker-%s.nk (group %s only; `kvbus auth init DIR --groups %s` adds it) "+
			"or DIR/worker.nk (any group)", group, group, group)
	}
	return fmt.Sprintf("--nats-nkey DIR/%s.nk", role)
}

// roleName is "frontend", "scheduler", or "worker of group g2".
func roleName(c RoleCheck) string {
	if c.Group != "" {
		return c.Role + " of group " + c.Group
	}
	return c.Role
}

// violationRe reads the subject out of the server's permissions violation.
var violationRe = regexp.MustCompile(`for (Subscription|Publish) to "([^"]+)"`)

// violation returns what err, a connection's last error, says was refused:
// kind "Subscription" or "Publish", and the subject. ok is false when err
// is no permissions violation.
func violation(err error) (kind, subject string, ok bool) {
	if !errors.Is(err, nats.ErrPermissionViolation) {
		return "", "", false
	}
	m := violationRe.FindStringSubmatch(err.Error())
	if m == nil {
		return "", "", false
	}
	return m[1], m[2], true
}

// jetStreamRefused returns the JetStream API subject that the server last
// refused nc to publish to, if that is nc's last error and names one of
// ops ("STREAM.INFO", "STREAM.CREATE") on the stream name: a key without
// the stream's JetStream permissions, whose API requests go unanswered
// until they time out. Only the ops just tried count: an earlier refusal
// stays the connection's last error (a refused STREAM.UPDATE of an older
// DiscardOld log, which the role goes on without), and a later timeout
// must not be reported as a permission error.
func jetStreamRefused(nc *nats.Conn, name string, ops ...string) (string, bool) {
	if nc == nil {
		return "", false
	}
	kind, subject, ok := violation(nc.LastError())
	if !ok || kind != "Publish" {
		return "", false
	}
	for _, op := range ops {
		if subject == "$JS.API."+op+"."+name {
			return subject, true
		}
	}
	return "", false
}

// jetStreamAdvice is what to do about a key refused the JetStream API.
const jetStreamAdvice = "this role's key has no JetStream permission for it: give each role its own key from " +
	"`kvbus auth init DIR` (--nats-nkey DIR/frontend.nk, scheduler.nk, …; `kvbus auth show DIR` lists what each may use)"
