package bus

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/messages"
)

// SchedulerConsumer is the durable consumer all scheduler replicas share.
const SchedulerConsumer = "kvbus-scheduler"

// DefaultAckWait is the schedulers' consumer's ack wait.
const DefaultAckWait = 5 * time.Second

// ErrLogFull is wrapped by a publish the request log refused because it is
// full: it holds MaxBytes of requests and never drops one a client was told
// was accepted, so new requests are refused until schedulers catch up and
// TrimHistory frees space.
var ErrLogFull = errors.New("bus: request log is full")

// ErrRequestLog is wrapped when the stream named as this deployment's
// request log exists but logs other subjects.
var ErrRequestLog = errors.New("bus: not this deployment's request log")

// jsErrStreamStoreFailed is nats-server's JSStreamStoreFailedF error code: a
// publish the stream did not store. With DiscardNew its description names
// the limit that refused it ("maximum bytes exceeded", "maximum messages
// exceeded", "maximum messages per subject exceeded").
const jsErrStreamStoreFailed jetstream.ErrorCode = 10077

// jsErrStreamInvalidConfig is nats-server's JSStreamInvalidConfigF error
// code: the server refuses a stream's configuration.
const jsErrStreamInvalidConfig jetstream.ErrorCode = 10052

// jsErrStorageResources and jsErrMemoryResources are nats-server's
// JSStorageResourcesExceededErr and JSMemoryResourcesExceededErr codes: a
// stream (or bucket) whose MaxBytes the server cannot reserve, its
// JetStream storage (by default from the free space of its store
// directory at start) or memory being smaller. No retry changes that.
const (
	jsErrStorageResources jetstream.ErrorCode = 10047
	jsErrMemoryResources  jetstream.ErrorCode = 10028
)

// ErrStreamConfig is wrapped when a request log's limits are invalid.
var ErrStreamConfig = errors.New("bus: invalid request log configuration")

// IsLogFull reports whether err is a publish refused because the stream is
// at its size or message limit (or wraps ErrLogFull). A message too large
// for the stream is not "full" and gives false.
func IsLogFull(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrLogFull) {
		return true
	}
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || apiErr.ErrorCode != jsErrStreamStoreFailed {
		return false
	}
	return strings.Contains(apiErr.Description, "maximum bytes exceeded") ||
		strings.Contains(apiErr.Description, "maximum messages exceeded") ||
		strings.Contains(apiErr.Description, "maximum messages per subject exceeded")
}

// StreamConfig configures the request log.
type StreamConfig struct {
	Subjects messages.Subjects
	// MaxAge bounds how long requests are kept (default 24 h).
	MaxAge time.Duration
	// MaxBytes bounds the log's size (default 1 GiB). A full log refuses new
	// requests (IsLogFull) instead of dropping accepted ones.
	MaxBytes int64
	// HistoryBytes bounds the requests kept after a scheduler acknowledged
	// them, for capture (default MaxBytes/2, see HistoryBound); a scheduler
	// enforces it with TrimHistory.
	HistoryBytes int64
	// Replicas is the JetStream replication factor (default 1).
	Replicas int
	// DuplicateWindow is how long Nats-Msg-Id dedupes (default 2 min).
	DuplicateWindow time.Duration
}

// Validate refuses negative limits (zero takes the default).
func (c StreamConfig) Validate() error {
	if c.MaxAge < 0 || c.MaxBytes < 0 || c.HistoryBytes < 0 || c.Replicas < 0 || c.DuplicateWindow < 0 {
		return fmt.Errorf("%w: --request-log-max-bytes, --request-log-max-age, --request-log-history-bytes and --stream-replicas must be >= 0 (0: the default)", ErrStreamConfig)
	}
	return nil
}

// HistoryBound is the bound to pass TrimHistory: HistoryBytes, or half of
// MaxBytes (default 1 GiB) when it is zero.
func (c StreamConfig) HistoryBound() int64 {
	if c.HistoryBytes > 0 {
		return c.HistoryBytes
	}
	if c.MaxBytes > 0 {
		return c.MaxBytes / 2
	}
	return 1 << 29
}

// EnsureRequestStream creates the request log (cfg.Subjects.RequestStream,
// KVBUS_REQUESTS under the default prefix) unless it exists.
// Any process may call it; whichever starts first creates the stream, and an
// existing stream is used as it is, except that one created with DiscardOld
// (by an older kvbus) is switched to DiscardNew.
func EnsureRequestStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.MaxAge == 0 {
		cfg.MaxAge = 24 * time.Hour
	}
	if cfg.MaxBytes == 0 {
		cfg.MaxBytes = 1 << 30
	}
	if cfg.Replicas == 0 {
		cfg.Replicas = 1
	}
	if cfg.DuplicateWindow == 0 {
		cfg.DuplicateWindow = 2 * time.Minute
	}
	st, err := Retry(ctx, func(ctx context.Context) (jetstream.Stream, error) { return ensureStream(ctx, js, cfg) })
	if err == nil {
		warnOneReplicaOnACluster(ctx, js.Conn(), st.CachedInfo())
	}
	return st, err
}

// warnOneReplicaOnACluster says so when the request log has one replica
// while the server is clustered: the log lives on one server of the
// cluster, and while that server is down no request is logged (each fails
// with a 503), whatever the other servers do.
func warnOneReplicaOnACluster(ctx context.Context, nc *nats.Conn, info *jetstream.StreamInfo) {
	if info == nil || info.Config.Replicas > 1 || nc.ConnectedClusterName() == "" {
		return
	}
	holder := ""
	if info.Cluster != nil {
		holder = info.Cluster.Leader
	}
	Logger(ctx).WarnContext(ctx, "the request log has one replica on a NATS cluster: while the server holding it is down, every request fails; "+
		"give every role --stream-replicas 3 (KVBUS_STREAM_REPLICAS) on a 3-server cluster before the first starts, "+
		"or raise the replicas of the log and of its consumer "+SchedulerConsumer+" in place (nats stream edit "+info.Config.Name+" --replicas 3, "+
		"nats consumer edit "+info.Config.Name+" "+SchedulerConsumer+", replicas 3): "+
		"a role started later with more uses them as they are",
		"stream", info.Config.Name, "server", holder, "cluster", nc.ConnectedClusterName())
}

// warnConsumerOnOneServer says so when the schedulers' consumer has one
// replica on a clustered server (a scheduler with --stream-replicas 1 on a
// log of more): while the server holding it is down, no request is
// dispatched.
func warnConsumerOnOneServer(ctx context.Context, info *jetstream.ConsumerInfo) {
	if info == nil || info.Cluster == nil || len(info.Cluster.Replicas) > 0 || info.Cluster.Name == "" {
		return
	}
	Logger(ctx).WarnContext(ctx, "the schedulers' consumer of the request log has one replica on a NATS cluster: while the server holding it is down, "+
		"no request is dispatched; give the schedulers --stream-replicas 3 (KVBUS_STREAM_REPLICAS) on a 3-server cluster, or raise the consumer's "+
		"replicas in place (nats consumer edit "+info.Stream+" "+info.Name+", replicas 3): a scheduler started later with more uses it as it is",
		"stream", info.Stream, "consumer", info.Name, "server", info.Cluster.Leader, "cluster", info.Cluster.Name)
}

// Retry runs a JetStream setup call with attempts of at most 3 s until it
// succeeds or ctx ends: an API request whose answer is lost (a server that
// is starting, a leader election) must not fail a role.
func Retry[T any](ctx context.Context, f func(ctx context.Context) (T, error)) (T, error) {
	for {
		actx, cancel := context.WithTimeout(ctx, 3*time.Second)
		v, err := f(actx)
		cancel()
		// No retry makes another deployment's log ours, or gives a key
		// the permissions it lacks.
		if err == nil || ctx.Err() != nil || errors.Is(err, ErrRequestLog) || errors.Is(err, ErrPermission) || permanent(err) {
			return v, err
		}
		select {
		case <-ctx.Done():
			return v, err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// jsErrReplicasNotSupported is nats-server's
// JSStreamReplicasNotSupportedErr code: replicas above 1 asked of a server
// that is not clustered (a stream's or a consumer's).
const jsErrReplicasNotSupported jetstream.ErrorCode = 10074

// permanent reports a JetStream API error that no retry changes: a
// configuration the server refuses (a negative limit, say), or replicas a
// server without a cluster cannot hold (--stream-replicas 3 against one
// server).
func permanent(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == jsErrStreamInvalidConfig || apiErr.ErrorCode == jsErrReplicasNotSupported ||
		apiErr.ErrorCode == jsErrStorageResources || apiErr.ErrorCode == jsErrMemoryResources)
}

// JetStreamNames are the names of a deployment's request log and buckets.
type JetStreamNames struct {
	RequestStream, SessionBucket, SlotBucket string
}

// ResolveNames returns the names s gives (messages.Subjects.RequestStream,
// SessionBucket, SlotBucket), unless the deployment predates them: under a
// prefix other than the default whose requests the stream KVBUS_REQUESTS
// logs (kvbus named it so under every prefix before), it keeps the old
// names, KVBUS_REQUESTS, KVBUS_SESSIONS and KVBUS_RANKS, so that an upgrade
// finds its waiting requests, session bindings and worker slots where the
// processes before it left them.
func ResolveNames(ctx context.Context, js jetstream.JetStream, s messages.Subjects) (JetStreamNames, error) {
	names := JetStreamNames{s.RequestStream(), s.SessionBucket(), s.SlotBucket()}
	if names.RequestStream == messages.RequestStream {
		return names, nil // the default prefix: the names never changed
	}
	_, err := js.Stream(ctx, names.RequestStream)
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return names, err // this prefix's own log (nil), or JetStream cannot say
	}
	// A key written for this prefix may not look at the old name: the
	// server then does not answer, so the look is bounded.
	lctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if st, err := js.Stream(lctx, messages.RequestStream); err == nil && slices.Contains(st.CachedInfo().Config.Subjects, s.RequestAll()) {
		return JetStreamNames{RequestStream: messages.RequestStream, SessionBucket: messages.SessionBucket, SlotBucket: messages.SlotBucket}, nil
	}
	return names, nil
}

func ensureStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
	// An existing stream is used as it is: updating its configuration while
	// another process creates a consumer on it races inside nats-server.
	// The one exception is DiscardOld, which would drop accepted requests; a
	// failed update is only logged, and the next process to start retries it.
	names, err := ResolveNames(ctx, js, cfg.Subjects)
	if err != nil {
		if subject, ok := jetStreamRefused(js.Conn(), names.RequestStream, "STREAM.INFO"); ok {
			return nil, fmt.Errorf("%w: request log %s: %w: the server refused %s; %s", ErrPermission, names.RequestStream, err, subject, jetStreamAdvice)
		}
		return nil, fmt.Errorf("bus: request log %s: %w", names.RequestStream, err)
	}
	name := names.RequestStream
	if st, err := js.Stream(ctx, name); err == nil {
		if subjects := st.CachedInfo().Config.Subjects; !slices.Contains(subjects, cfg.Subjects.RequestAll()) {
			return nil, fmt.Errorf("%w: stream %s logs %v, not %s: it is another deployment's; give this one its own --subject-prefix, or delete the stream",
				ErrRequestLog, name, subjects, cfg.Subjects.RequestAll())
		}
		if sc := st.CachedInfo().Config; sc.Discard != jetstream.DiscardNew {
			sc.Discard = jetstream.DiscardNew
			if updated, err := js.UpdateStream(ctx, sc); err != nil {
				Logger(ctx).WarnContext(ctx, "cannot switch the request log to discard new; a full log drops accepted requests until it is: "+
					"with kvbus auth keys only admin may (nats --nkey DIR/admin.nk stream edit "+name+" --discard new)",
					"stream", name, "err", err)
			} else {
				Logger(ctx).InfoContext(ctx, "request log switched to discard new", "stream", name)
				st = updated
			}
		}
		return st, nil
	}
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:        name,
		Description: "kvbus request log: every Request accepted by a frontend",
		Subjects:    []string{cfg.Subjects.RequestAll()},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      cfg.MaxAge,
		MaxBytes:    cfg.MaxBytes,
		MaxMsgSize:  messages.MaxMessageBytes,
		Replicas:    cfg.Replicas,
		Duplicates:  cfg.DuplicateWindow,
		// A full log refuses new requests: it never drops one that a
		// client was told was accepted. TrimHistory bounds what is kept
		// after dispatch.
		Discard: jetstream.DiscardNew,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		st, err = js.Stream(ctx, name) // another process won the race
	}
	if err != nil {
		// A refused API request is not answered: it fails as a timeout,
		// like a server without JetStream.
		if subject, ok := jetStreamRefused(js.Conn(), name, "STREAM.INFO", "STREAM.CREATE"); ok {
			return nil, fmt.Errorf("%w: create stream %s: %w: the server refused %s; %s", ErrPermission, name, err, subject, jetStreamAdvice)
		}
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrStorageResources {
			return nil, fmt.Errorf("bus: create stream %s of %d bytes (--request-log-max-bytes): %w: the NATS server's JetStream "+
				"storage is smaller (by default what its store directory had free when it started); give `kvbus nats` a --data-dir "+
				"with more free space and restart it, or lower --request-log-max-bytes on the role that creates the log", name, cfg.MaxBytes, err)
		}
		if errors.As(err, &apiErr) {
			return nil, fmt.Errorf("bus: create stream %s: %w", name, err) // the server answered: it says why
		}
		if errors.Is(err, context.Canceled) {
			return nil, fmt.Errorf("bus: create stream %s: %w", name, err) // the caller stopped: no server to blame
		}
		return nil, fmt.Errorf("bus: create stream %s: %w (is JetStream enabled on the server?)", name, err)
	}
	return st, nil
}

// TrimHistory purges the oldest requests of the log while it holds more
// than historyBytes, but only requests cons (the schedulers' consumer) has
// acknowledged: it never purges beyond the consumer's ack floor, so a
// request not yet dispatched is never lost. It estimates how many messages
// to purge from the byte excess assuming messages of roughly uniform size,
// and returns how many it purged. Schedulers call it periodically.
//
// A bound at or above the log's own limit (a scheduler run with another
// --request-log-max-bytes than the role that created the log, or the log
// of an earlier deployment) is half that limit: history kept up to the
// limit leaves no room, and every new request was refused as
// request_log_full with nothing waiting, until the history aged out.
func TrimHistory(ctx context.Context, st jetstream.Stream, cons jetstream.Consumer, historyBytes int64) (purged uint64, err error) {
	if st == nil || cons == nil {
		return 0, errors.New("bus: trim history: nil stream or consumer")
	}
	if historyBytes < 0 {
		historyBytes = 0
	}
	before, err := st.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("bus: trim history: stream info: %w", err)
	}
	if limit := before.Config.MaxBytes; limit > 0 && historyBytes >= limit {
		historyBytes = limit / 2
	}
	state := before.State
	if state.Msgs == 0 || state.Bytes <= uint64(historyBytes) {
		return 0, nil
	}
	ci, err := cons.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("bus: trim history: consumer info: %w", err)
	}
	avg := max(state.Bytes/state.Msgs, 1)
	excess := state.Bytes - uint64(historyBytes)
	// Purge sequences below upTo: FirstSeq .. FirstSeq+n-1.
	upTo := state.FirstSeq + (excess+avg-1)/avg
	upTo = min(upTo, ci.AckFloor.Stream+1)
	if upTo <= state.FirstSeq {
		return 0, nil // nothing acknowledged to purge
	}
	if err := st.Purge(ctx, jetstream.WithPurgeSequence(upTo)); err != nil {
		return 0, fmt.Errorf("bus: trim history: purge below sequence %d: %w", upTo, err)
	}
	after, err := st.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("bus: trim history: stream info after purge: %w", err)
	}
	// Messages published meanwhile are added back; ages expiring meanwhile
	// count as purged.
	added := after.State.LastSeq - state.LastSeq
	if total := state.Msgs + added; total > after.State.Msgs {
		purged = total - after.State.Msgs
	}
	return purged, nil
}

// EnsureSchedulerConsumer creates or updates the schedulers' durable pull
// consumer on the request stream. Only schedulers call it (a frontend key
// may not touch it); requests published before the first scheduler starts
// are not missed (DeliverAll), and a scheduler answers requests whose
// deadline has passed with an error instead of running them.
func EnsureSchedulerConsumer(ctx context.Context, st jetstream.Stream, ackWait time.Duration, replicas int) (jetstream.Consumer, error) {
	if ackWait <= 0 {
		// A scheduler acks right after dispatch; if it dies, the requests it
		// had fetched but not acked go to another replica after this.
		ackWait = DefaultAckWait
	}
	cfg := jetstream.ConsumerConfig{
		Durable:       SchedulerConsumer,
		Description:   "kvbus schedulers: each request is dispatched by one replica",
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxDeliver:    -1,
		MaxAckPending: 10000,
		Replicas:      replicas,
	}
	c, err := Retry(ctx, func(ctx context.Context) (jetstream.Consumer, error) {
		c, err := st.Consumer(ctx, SchedulerConsumer)
		if err == nil {
			return c, nil
		}
		return createConsumer(ctx, st, cfg)
	})
	if err == nil {
		warnConsumerOnOneServer(ctx, c.CachedInfo())
	}
	return c, err
}

func createConsumer(ctx context.Context, st jetstream.Stream, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	c, err := st.CreateConsumer(ctx, cfg)
	if errors.Is(err, jetstream.ErrConsumerExists) {
		c, err = st.Consumer(ctx, SchedulerConsumer)
	}
	if err != nil {
		return nil, fmt.Errorf("bus: create consumer %s: %w", SchedulerConsumer, err)
	}
	return c, nil
}

// PlanStreamBytes bounds the plan stream (see EnsurePlanStream).
const PlanStreamBytes = 256 << 20

// EnsurePlanStream creates the stream that keeps the schedulers' save plans
// (s.PlanStream, KVBUS_PLANS under the default prefix, on s.PlanAll) unless
// it exists, and returns it. It is kept in memory — it is for a scheduler
// that dies, and the requests it names are in the request log on disk —
// for maxAge, at most PlanStreamBytes, the oldest plans dropped first. An
// existing stream is used as it is (see ensureStream).
func EnsurePlanStream(ctx context.Context, js jetstream.JetStream, s messages.Subjects, replicas int, maxAge time.Duration) (jetstream.Stream, error) {
	name := s.PlanStream()
	return Retry(ctx, func(ctx context.Context) (jetstream.Stream, error) {
		if st, err := js.Stream(ctx, name); err == nil {
			return st, nil
		}
		st, err := js.CreateStream(ctx, jetstream.StreamConfig{
			Name:        name,
			Description: "kvbus save plans: what each scheduler replica dispatched and ended, for one that starts after it died",
			Subjects:    []string{s.PlanAll()},
			Storage:     jetstream.MemoryStorage,
			Retention:   jetstream.LimitsPolicy,
			MaxAge:      maxAge,
			MaxBytes:    PlanStreamBytes,
			MaxMsgSize:  messages.MaxMessageBytes,
			Replicas:    max(replicas, 1),
			Discard:     jetstream.DiscardOld,
		})
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			st, err = js.Stream(ctx, name) // another replica won the race
		}
		if err != nil {
			if subject, ok := jetStreamRefused(js.Conn(), name, "STREAM.INFO", "STREAM.CREATE"); ok {
				return nil, fmt.Errorf("%w: plan stream %s: %w: the server refused %s; %s", ErrPermission, name, err, subject, jetStreamAdvice)
			}
			return nil, fmt.Errorf("bus: plan stream %s: %w", name, err)
		}
		return st, nil
	})
}
