package fakeengine

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvbus/kvbus/workers/vllmevents"
)

// Defaults of Config and KVEventsConfig.
const (
	DefaultModelName   = "fake/model"
	DefaultMaxModelLen = 4096
	// DefaultBlockSize is vLLM's default block size on GPUs.
	DefaultBlockSize = 16
	// DefaultCacheBlocks is the default cache capacity, 16,384 tokens at
	// the default block size (raised to hold MaxModelLen if needed).
	DefaultCacheBlocks = 1024
	// DefaultMaxRecorded is how many requests an Engine keeps by default.
	DefaultMaxRecorded = 10_000
	// DefaultReplyTokens is the length of the fake model's replies.
	DefaultReplyTokens = 8
	// DefaultBufferSteps is vLLM's KVEventsConfig.buffer_steps: the number
	// of batches kept for replay.
	DefaultBufferSteps = 10_000
)

// ErrConfig is wrapped by configuration errors.
var ErrConfig = errors.New("fakeengine: invalid configuration")

// Config configures an Engine. The zero Config is valid: an engine serving
// DefaultModelName without KV events.
type Config struct {
	// ModelName is the served model name (vLLM's --served-model-name):
	// a request naming another model gets vLLM's 404; one naming none is
	// served. Empty means DefaultModelName.
	ModelName string
	// Addr is the HTTP listen address; empty means 127.0.0.1:0 (an
	// ephemeral loopback port, see Engine.URL).
	Addr string
	// MaxModelLen is the context length (vLLM's --max-model-len): a
	// prompt must be shorter, and prompt plus max_tokens no longer.
	// Zero means DefaultMaxModelLen.
	MaxModelLen int
	// BlockSize is the cache's block size (vLLM's --block-size); zero
	// means DefaultBlockSize.
	BlockSize int
	// CacheBlocks is the cache's capacity in blocks (vLLM's GPU blocks);
	// zero means DefaultCacheBlocks, or enough for MaxModelLen if that is
	// more. It must hold one request of MaxModelLen tokens, as vLLM checks
	// at startup.
	CacheBlocks int
	// MaxRecorded bounds the requests kept for Requests (zero:
	// DefaultMaxRecorded): past it the oldest are forgotten, so that a
	// long-lived engine polled for health does not grow without end.
	MaxRecorded int
	// HashBytes makes KV events carry block hashes as 32-byte sha256
	// digests (vLLM's default) instead of unsigned 64-bit integers (vLLM
	// with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the digests' low 64 bits).
	HashBytes bool
	// ReplyTokens is the length in words of the fake model's reply, which
	// then ends with TokenEOT (finish_reason "stop") unless max_tokens cuts
	// it (finish_reason "length"). Zero means DefaultReplyTokens.
	ReplyTokens int
	// APIKey, when set, is required as "Authorization: Bearer <key>" on
	// every path under /v1, as vLLM's --api-key; /health and /tokenize stay
	// open, as in vLLM.
	APIKey string
	// TimeToFirstToken delays the first token of every reply, and
	// InterTokenLatency every later one (streamed or not). Zero: none.
	TimeToFirstToken  time.Duration
	InterTokenLatency time.Duration
	// OmitPromptTokensDetails leaves usage.prompt_tokens_details out (null),
	// as vLLM does unless started with --enable-prompt-tokens-details; by
	// default the fake reports cached_tokens there, as vLLM with the flag.
	OmitPromptTokensDetails bool
	// KVEvents, when set, publishes the cache's KV events as vLLM's
	// ZmqEventPublisher does.
	KVEvents *KVEventsConfig
	// LoRAModules are the names of LoRA adapters served next to the model
	// (vLLM's --lora-modules name=path): GET /v1/models lists each with the
	// model as its parent, a request may name one, and its blocks are
	// keyed with the adapter (their KV events carry lora_id and lora_name),
	// so they match only prompts of the same adapter, as in vLLM.
	LoRAModules []string
}

// KVEventsConfig configures the KV event publisher, after vLLM's
// --kv-events-config (KVEventsConfig in vllm/config/kv_events.py).
type KVEventsConfig struct {
	// Endpoint is where the PUB socket binds, "tcp://host:port" (port 0
	// binds an ephemeral port, see Engine.KVEventsAddr; "*" every
	// interface, vLLM's default "tcp://*:5557") or "ipc:///path"; with
	// Connect, where it connects to a subscriber that binds (as llm-d's
	// inference simulator does).
	Endpoint string
	// Connect makes the PUB socket connect to Endpoint instead of binding
	// it. It connects in the background and reconnects, as ZeroMQ does.
	// (vLLM's ZmqEventPublisher binds an endpoint with a wildcard, "*" or
	// "::", or an ipc:// or inproc:// one, and connects otherwise; the
	// fake is told, so that a test can bind 127.0.0.1:0.)
	Connect bool
	// Topic is the first frame of every message; vLLM's default is "".
	Topic string
	// EventForm is how events are encoded; empty means EventFormMap.
	EventForm EventForm
	// ReplayEndpoint, when set, binds a ROUTER socket answering vLLM's
	// replay requests from the last BufferSteps batches (see
	// Engine.ReplayAddr).
	ReplayEndpoint string
	// BufferSteps is the number of batches kept for replay; zero means
	// DefaultBufferSteps.
	BufferSteps int
	// DataParallelRank is the batches' data_parallel_rank.
	DataParallelRank int
	// ZeroRootParent sends parent_block_hash 0 where vLLM sends None (the
	// first blocks of a prompt), as llm-d's inference simulator does.
	ZeroRootParent bool
	// FirstSeq is the first batch's sequence number: vLLM counts from 0,
	// llm-d's inference simulator from 1.
	FirstSeq uint64
}

// Validate checks c.
func (c *Config) Validate() error {
	switch {
	case c.MaxModelLen < 0:
		return fmt.Errorf("%w: negative MaxModelLen %d", ErrConfig, c.MaxModelLen)
	case c.BlockSize < 0:
		return fmt.Errorf("%w: negative BlockSize %d", ErrConfig, c.BlockSize)
	case c.CacheBlocks < 0:
		return fmt.Errorf("%w: negative CacheBlocks %d", ErrConfig, c.CacheBlocks)
	case c.ReplyTokens < 0:
		return fmt.Errorf("%w: negative ReplyTokens %d", ErrConfig, c.ReplyTokens)
	case c.TimeToFirstToken < 0 || c.InterTokenLatency < 0:
		return fmt.Errorf("%w: negative latency", ErrConfig)
	}
	d := c.withDefaults()
	for i, name := range c.LoRAModules {
		if name == "" || name == d.ModelName || slices.Contains(c.LoRAModules[:i], name) {
			return fmt.Errorf("%w: LoRA module %q: empty, the model's name or a repeat", ErrConfig, name)
		}
	}
	if d.CacheBlocks*d.BlockSize < d.MaxModelLen {
		return fmt.Errorf("%w: %d blocks of %d tokens cannot hold one request of MaxModelLen %d tokens",
			ErrConfig, d.CacheBlocks, d.BlockSize, d.MaxModelLen)
	}
	if c.KVEvents != nil {
		if err := c.KVEvents.validate(); err != nil {
			return err
		}
	}
	return nil
}

func (k *KVEventsConfig) validate() error {
	if err := vllmevents.CheckEndpoint(k.Endpoint, !k.Connect); err != nil {
		return fmt.Errorf("%w: KV events endpoint: %w", ErrConfig, err)
	}
	if k.ReplayEndpoint != "" {
		if err := vllmevents.CheckEndpoint(k.ReplayEndpoint, true); err != nil {
			return fmt.Errorf("%w: KV events replay endpoint: %w", ErrConfig, err)
		}
	}
	switch k.EventForm {
	case "", EventFormMap, EventFormArray:
	default:
		return fmt.Errorf("%w: event form %q, want %q or %q", ErrConfig, k.EventForm, EventFormMap, EventFormArray)
	}
	if k.BufferSteps < 0 {
		return fmt.Errorf("%w: negative BufferSteps %d", ErrConfig, k.BufferSteps)
	}
	return nil
}

// withDefaults returns c with its defaults filled in.
func (c Config) withDefaults() Config {
	if c.ModelName == "" {
		c.ModelName = DefaultModelName
	}
	if c.MaxModelLen == 0 {
		c.MaxModelLen = DefaultMaxModelLen
	}
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.CacheBlocks == 0 {
		c.CacheBlocks = max(DefaultCacheBlocks, (c.MaxModelLen+c.BlockSize-1)/c.BlockSize)
	}
	if c.ReplyTokens == 0 {
		c.ReplyTokens = DefaultReplyTokens
	}
	if c.MaxRecorded <= 0 {
		c.MaxRecorded = DefaultMaxRecorded
	}
	if c.KVEvents != nil {
		k := *c.KVEvents
		if k.EventForm == "" {
			k.EventForm = EventFormMap
		}
		if k.BufferSteps == 0 {
			k.BufferSteps = DefaultBufferSteps
		}
		c.KVEvents = &k
	}
	return c
}
