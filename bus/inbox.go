package bus

// Reply inboxes per role. Every request a role makes (a JetStream API call,
// a pull of the request log, a KV put, a dump, a pool read, a hand-off) is
// answered on the connection's inbox, so the inbox prefix is what the
// server's permissions must keep a role from reading of another's: each
// role's connection uses its own prefix (Config.InboxPrefix), and the keys
// `kvbus auth init` writes allow each role only its own (auth.For).
//
//	frontend                      _INBOX_frontend.>
//	scheduler                     _INBOX_scheduler.>
//	worker of group g (--group g, also with --rank auto) _INBOX_worker_g.g.>
//	worker of any group (--rank auto without --group)  _INBOX_worker.>
//	admin and the tools (capture, replay, auth probe): nats.go's _INBOX.>
//	top and tap (the observer key) make no request: no inbox
//
// The worker.nk key (any group) may use both worker prefixes; worker-g.nk
// only _INBOX_worker_g.g.>, which no other group's inbox starts with (the
// group is a whole subject token).
const (
	// inboxRoot starts every role's inbox prefix and nats.go's own.
	inboxRoot        = "_INBOX"
	inboxFrontend    = "_INBOX_frontend"
	inboxScheduler   = "_INBOX_scheduler"
	inboxWorkerAny   = "_INBOX_worker"
	inboxWorkerGroup = "_INBOX_worker_g"
)

// InboxPrefix is the reply inbox prefix of a role's connection (for
// Config.InboxPrefix): role is "frontend", "scheduler" or "worker"; group
// is a worker's group, or "" for a worker that may serve any group
// (--rank auto). Any other role (admin, a tool) gets "", nats.go's
// default _INBOX.
func InboxPrefix(role, group string) string {
	switch role {
	case "frontend":
		return inboxFrontend
	case "scheduler":
		return inboxScheduler
	case "worker":
		if group != "" {
			return inboxWorkerGroup + "." + group
		}
		return inboxWorkerAny
	}
	return ""
}

// InboxSubscriptions are the inbox subjects a key of role (and group, for
// a worker key limited to one group) must be allowed to subscribe to: the
// prefixes of every connection that key may serve. Admin and unknown roles
// get none (admin is allowed ">").
func InboxSubscriptions(role, group string) []string {
	switch role {
	case "frontend", "scheduler":
		return []string{InboxPrefix(role, "") + ".>"}
	case "worker":
		if group != "" {
			return []string{InboxPrefix(role, group) + ".>"}
		}
		return []string{inboxWorkerAny + ".>", inboxWorkerGroup + ".>"}
	}
	return nil
}
