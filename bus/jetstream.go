package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/messages"
)

// SchedulerConsumer is the durable consumer all scheduler replicas share.
const SchedulerConsumer = "kvbus-scheduler"

// DefaultAckWait is the schedulers' consumer's ack wait.
const DefaultAckWait = 5 * time.Second

// StreamConfig configures the request log.
type StreamConfig struct {
	Subjects messages.Subjects
	// MaxAge bounds how long requests are kept (default 24 h).
	MaxAge time.Duration
	// MaxBytes bounds the log's size (default 1 GiB).
	MaxBytes int64
	// Replicas is the JetStream replication factor (default 1).
	Replicas int
	// DuplicateWindow is how long Nats-Msg-Id dedupes (default 2 min).
	DuplicateWindow time.Duration
}

// EnsureRequestStream creates the KVBUS_REQUESTS stream unless it exists.
// Any process may call it; whichever starts first creates the stream, and an
// existing stream is used as it is.
func EnsureRequestStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
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
	return Retry(ctx, func(ctx context.Context) (jetstream.Stream, error) { return ensureStream(ctx, js, cfg) })
}

// Retry runs a JetStream setup call with attempts of at most 3 s until it
// succeeds or ctx ends: an API request whose answer is lost (a server that
// is starting, a leader election) must not fail a role.
func Retry[T any](ctx context.Context, f func(ctx context.Context) (T, error)) (T, error) {
	for {
		actx, cancel := context.WithTimeout(ctx, 3*time.Second)
		v, err := f(actx)
		cancel()
		if err == nil || ctx.Err() != nil {
			return v, err
		}
		select {
		case <-ctx.Done():
			return v, err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func ensureStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
	// An existing stream is used as it is: updating its configuration while
	// another process creates a consumer on it races inside nats-server.
	if st, err := js.Stream(ctx, messages.RequestStream); err == nil {
		return st, nil
	}
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:        messages.RequestStream,
		Description: "kvbus request log: every Request accepted by a frontend",
		Subjects:    []string{cfg.Subjects.RequestAll()},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      cfg.MaxAge,
		MaxBytes:    cfg.MaxBytes,
		MaxMsgSize:  messages.MaxMessageBytes,
		Replicas:    cfg.Replicas,
		Duplicates:  cfg.DuplicateWindow,
		Discard:     jetstream.DiscardOld,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		st, err = js.Stream(ctx, messages.RequestStream) // another process won the race
	}
	if err != nil {
		return nil, fmt.Errorf("bus: create stream %s: %w (is JetStream enabled on the server?)", messages.RequestStream, err)
	}
	return st, nil
}

// EnsureSchedulerConsumer creates or updates the schedulers' durable pull
// consumer on the request stream. Frontends call it too, so requests
// published before the first scheduler starts are not missed (DeliverAll);
// a scheduler answers requests whose deadline has passed with an error
// instead of running them.
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
	return Retry(ctx, func(ctx context.Context) (jetstream.Consumer, error) {
		c, err := st.Consumer(ctx, SchedulerConsumer)
		if err == nil {
			return c, nil
		}
		return createConsumer(ctx, st, cfg)
	})
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
