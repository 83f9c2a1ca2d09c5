// Package vllmevents receives vLLM's KV cache events over ZeroMQ, decodes
// them and translates them into kvbus KV events, so that a kvbus rank
// fronting a real vLLM engine can index the engine's real cache.
//
// # Wire format (verified in vLLM's source)
//
// vllm/distributed/kv_events.py defines the events as msgspec Structs
// (read in vllm-project/vllm at commits b4e69e0af33f and 0181ea3173e5, and
// in a later copy, from a repository the search index did not name, with
// EventBatch still array_like, map events and a msgpack replay request):
//
//	class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
//	    ts: float
//	    events: list[Any]
//	    data_parallel_rank: int | None = None
//	class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True)
//	class BlockStored(KVCacheEvent):
//	    block_hashes: list[ExternalBlockHash]
//	    parent_block_hash: ExternalBlockHash | None
//	    token_ids: list[int]
//	    block_size: int
//	    lora_id: int | None
//	    medium: str | None
//	    lora_name: str | None
//	    extra_keys: list[tuple[Any, ...] | None] | None = None
//	    group_idx: int | None = None
//	    kv_cache_spec_kind: str | None = None   (and more in newer versions)
//	class BlockRemoved(KVCacheEvent):
//	    block_hashes: list[ExternalBlockHash]
//	    medium: str | None
//	    group_idx: int | None = None
//	class AllBlocksCleared(KVCacheEvent): pass
//
// Three shapes exist in the wild, and Decode accepts all of them, in any
// mix:
//
//   - Until vLLM PR #42892 (merged 2026-06-09, per llm-d-kv-cache PR #661
//     which adapted to it), KVCacheEvent also had
//     array_like=True: a batch is the msgpack array [ts, [event, ...],
//     data_parallel_rank] and each event an array whose first element is
//     the tag, e.g. ["BlockStored", block_hashes, parent_block_hash,
//     token_ids, block_size, lora_id, medium, lora_name, extra_keys,
//     group_idx, ...] (older versions stop after lora_id or medium;
//     omit_defaults drops trailing fields left at their default, so an
//     array may be shorter; newer fields are appended at the end).
//   - Since then each event is a msgspec tagged map, {"type": "BlockStored",
//     "block_hashes": ..., ...}, inside the still positional batch (a dump
//     from vLLM 0.26 in volcano-sh/kthena issue #1535 shows
//     [ts, [{'type': 'BlockStored', ...}], 0]).
//   - One snapshot of vllm-project/vllm (0181ea3173e5) also drops
//     array_like from EventBatch, making the batch a map {"ts", "events",
//     "data_parallel_rank"}. llm-d's inference simulator emits either
//     event form (its --use-vllm-map-event-format, llm-d-inference-sim PR
//     #570); in its array form a prompt's first blocks have
//     parent_block_hash 0, not None, which the Translator reads as None
//     unless 0 is a block it heard of.
//
// ExternalBlockHash is `bytes | int` (vllm/v1/core/kv_cache_utils.py):
// sha256 bytes by default, or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES,
// int.from_bytes(hash, "big") & (1<<64 - 1), an unsigned 64-bit integer;
// older versions used Python's hash(), a signed one. Hash keeps all three
// apart.
//
// ZmqEventPublisher (same file) sends each batch as a three-frame message
// (topic, seq.to_bytes(8, "big"), msgspec payload) on a PUB socket that
// binds when its endpoint has a wildcard ("tcp://*:5557") and connects
// otherwise; seq counts from 0 per publisher process. Its optional ROUTER
// replay socket answers a request [identity, "", start_seq as 8 big-endian
// bytes] with one [identity, "", seq, payload] per buffered batch with seq >=
// start_seq, then the end marker [identity, "", (-1).to_bytes(8, "big",
// signed=True), ""] (examples/online_serving/kv_events_subscriber.py reads
// it that way). Newer variants also accept a msgpack replay request but
// keep serving this one. Subscriber implements that client (replay.go).
//
// # Concurrency
//
// Decode is a pure function. A Translator is owned by one goroutine. A
// Subscriber's Run calls its handler and OnGap on its own goroutine, one
// call at a time, so a handler may use a Translator without locking.
package vllmevents

import "errors"

// Sentinel errors. Every error of the package wraps one of them.
var (
	// ErrMalformed is wrapped when a payload or an event is not a valid
	// vLLM KV event batch, or a ZeroMQ message does not have vLLM's frames.
	ErrMalformed = errors.New("vllmevents: malformed")
	// ErrTooLarge is wrapped when a payload exceeds messages.MaxMessageBytes
	// or holds more than MaxHashesPerBatch block hashes.
	ErrTooLarge = errors.New("vllmevents: too large")
	// ErrBlockSize is wrapped when the engine's block size is not kvbus's:
	// kvbus cannot hash the engine's blocks. Set kvbus's --block-size to the
	// engine's.
	ErrBlockSize = errors.New("vllmevents: block size mismatch")
	// ErrUnknownParent is wrapped when a BlockStored event chains from a
	// block the Translator does not know (stored before it started, lost in
	// a gap, or skipped): its blocks are not indexed.
	ErrUnknownParent = errors.New("vllmevents: unknown parent block")
	// ErrConfig is wrapped by configuration errors.
	ErrConfig = errors.New("vllmevents: invalid configuration")
	// ErrReplay is wrapped when a replay request fails.
	ErrReplay = errors.New("vllmevents: replay failed")
)
