package workers

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// ErrConfig is wrapped by configuration errors.
var ErrConfig = errors.New("workers: bad configuration")

// RankConfig configures one rank of a worker group.
type RankConfig struct {
	// Conn is the rank's NATS connection; the caller owns it (Run does not
	// close it).
	Conn     *nats.Conn
	Subjects messages.Subjects
	// Group is the worker group (one engine instance, a DP replica).
	Group string
	// TPRank/TPSize and EPRank/EPSize are the rank's tensor- and
	// expert-parallel coordinates; EP ranks may coincide with TP ranks.
	TPRank, TPSize int
	EPRank, EPSize int
	// Model is the served model name, used in store keys.
	Model string
	// Profile sizes block payloads.
	Profile ModelProfile
	// CapacityBytes is the rank's block store capacity (default 1 GiB).
	CapacityBytes int64
	// Payload is PayloadBytes (default) or PayloadAccounting.
	Payload string
	// Evict is the MemStore's eviction policy: EvictLRU (default) or
	// EvictSession.
	Evict string
	// Engine runs requests on the driver rank (tp_rank 0); required there,
	// ignored elsewhere.
	Engine Engine
	// EngineCache: the driver's engine is a model server with its own KV
	// cache (--engine openai), whose cache is the truth: the rank loads and
	// saves nothing, and the group's blocks are those the engine's KV
	// events (KVEvents) announce. The group is one rank (TPSize 1): the
	// engine does its own tensor parallelism.
	EngineCache bool
	// KVEvents, with EngineCache, subscribes to the engine's KV events
	// (vLLM's ZeroMQ publisher); nil means none, and placement then cannot
	// see the engine's cache. Its Logger and OnGap are the rank's.
	KVEvents *vllmevents.Config
	// KVEventsSilence, with KVEvents: a rank that has heard no batch of the
	// engine's KV events this long after the engine answered a prompt that
	// stored new blocks warns, once, that placement cannot see the
	// engine's cache (a wrong endpoint or topic, events off). Zero means
	// DefaultKVEventsSilence.
	KVEventsSilence time.Duration
	// BlockSize is the tokens per block used to express capacity in blocks
	// in heartbeats (default 16), and the engine's block size with
	// KVEvents; requests carry their own block_size.
	BlockSize int
	// HeartbeatInterval defaults to 1 s.
	HeartbeatInterval time.Duration
	// IdentityWait is how long Run first listens for another process
	// heartbeating with this rank's identity, and refuses to start if one
	// does (0: 1.5 heartbeat intervals, at most 10 s; negative: not at
	// all). A wait shorter than the other process's heartbeat interval may
	// miss it.
	IdentityWait time.Duration
	// QueueSize bounds the load and store queues (default 1024).
	QueueSize int
	// SaveWait bounds how long a load waits for a block that this rank is
	// still saving for an earlier request (the previous turn of a
	// conversation, placed a moment ago); past it the block counts in
	// failed_blocks and is prefilled (default 2 s).
	SaveWait time.Duration
	// ReceiptAfter: a rank whose result for a ReqMeta is not sent within
	// it sends a receipt, so the scheduler knows it has the ReqMeta
	// (default 100 ms).
	ReceiptAfter time.Duration
	// SeenIDs and SeenAge bound the memory of (req_id, attempt) pairs that
	// drops duplicate ReqMetas (defaults 100,000 and 10 min).
	SeenIDs int
	SeenAge time.Duration
	// ReplayBytes and ReplayAge bound what a driver rank keeps of its
	// requests' outputs, to publish them again when they were lost on the
	// bus (replay.go): a stream's while it runs and ReplayAge after, for a
	// frontend that asks (messages.Resend); every answer's until the
	// driver's server confirmed it, for the driver's own reconnect
	// (defaults 64 MiB and 10 s). A negative ReplayBytes keeps nothing: a
	// stream that lost outputs after its first chunk ends with output_lost,
	// and an answer lost with the driver's connection waits for its
	// deadline.
	ReplayBytes int64
	ReplayAge   time.Duration
	// DrainHandoff is the byte budget per rank of the drain hand-off: a
	// stopping group gives up to this many bytes of its most recently used
	// blocks (whole sessions) to the other groups before it exits, so the
	// conversations it served keep their cache. 0 turns it off.
	DrainHandoff int64
	// StoreDelay is a fault-injection knob: the store thread sleeps this
	// long before each request's save (a slow rank). Zero in production.
	StoreDelay time.Duration
	// DropReqMetas is a fault-injection knob: the rank ignores its first
	// DropReqMetas ReqMetas, as if those core NATS messages were lost.
	DropReqMetas int
	// DelayFirstReqMeta is a fault-injection knob: the rank handles its
	// first ReqMeta this late (a rank whose intake is behind its group's).
	DelayFirstReqMeta time.Duration
	// ShutdownTimeout bounds how long Run lets in-flight requests finish
	// after its context ends (default 10 s).
	ShutdownTimeout time.Duration
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// Metrics and HandlerMetrics; nil means unregistered metrics.
	Metrics        *Metrics
	HandlerMetrics *bus.HandlerMetrics
}

// Validate checks the configuration.
func (c *RankConfig) Validate() error {
	switch {
	case c.Conn == nil:
		return fmt.Errorf("%w: no NATS connection", ErrConfig)
	case messages.ValidateGroup(c.Group) != nil:
		return fmt.Errorf("%w: %w", ErrConfig, messages.ValidateGroup(c.Group))
	case c.TPSize < 1 || c.TPRank < 0 || c.TPRank >= c.TPSize:
		return fmt.Errorf("%w: --tp-rank %d must be in [0, --tp-size %d)", ErrConfig, c.TPRank, c.TPSize)
	case c.EPSize < 1 || c.EPRank < 0 || c.EPRank >= c.EPSize:
		return fmt.Errorf("%w: --ep-rank %d must be in [0, --ep-size %d)", ErrConfig, c.EPRank, c.EPSize)
	case c.Model == "":
		return fmt.Errorf("%w: no --model", ErrConfig)
	case c.Profile.Validate() != nil:
		return fmt.Errorf("%w: %w", ErrConfig, c.Profile.Validate())
	case c.TPRank == 0 && c.Engine == nil:
		return fmt.Errorf("%w: the driver rank (tp_rank 0) needs an engine", ErrConfig)
	case c.CapacityBytes < 0:
		return fmt.Errorf("%w: negative KV capacity", ErrConfig)
	case c.EngineCache && c.TPSize != 1:
		return fmt.Errorf("%w: a group that fronts a model server is --tp-size 1 (the engine does its own tensor parallelism), not %d", ErrConfig, c.TPSize)
	case c.KVEvents != nil && !c.EngineCache:
		return fmt.Errorf("%w: --kv-events needs --engine openai: the sim's ranks publish their own KV events", ErrConfig)
	case c.KVEventsSilence < 0:
		return fmt.Errorf("%w: negative KVEventsSilence", ErrConfig)
	case c.DrainHandoff < 0:
		return fmt.Errorf("%w: negative --drain-handoff (0 turns it off)", ErrConfig)
	case c.Payload != PayloadBytes && c.Payload != PayloadAccounting:
		return fmt.Errorf("%w: --kv-payload %q must be %s or %s", ErrConfig, c.Payload, PayloadBytes, PayloadAccounting)
	}
	return c.Subjects.Validate()
}
