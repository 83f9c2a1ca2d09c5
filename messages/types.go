package messages

import (
	"strings"
	"time"
)

//go:generate go run github.com/tinylib/msgp@v1.6.5 -file types.go -o types_gen.go -io=false -tests=false
//msgp:tag msgpack

// A decoder allocates by the lengths a message declares: no array may
// declare more than 262,144 elements (a PoolPart of 8-byte digests in an
// 8 MiB payload has ~120k pieces), no map more than 65,536 entries. Without
// them an 8 MiB KVEventBatch declaring 8M one-byte events made its decoder
// allocate 768 MiB. The array limit bounds byte strings too: each []byte
// field says limit=8388608 (MaxMessageBytes), or a 512 KiB block in one
// PoolPiece (or an engine body over 256 KiB) would be refused.
//msgp:limit arrays:262144 maps:65536

// Version is the value of the "v" key this package writes.
const Version = 1

// Endpoint names the OpenAI endpoint a request came through.
const (
	EndpointChat        = "chat"
	EndpointCompletions = "completions"
)

// ExtraArgSessionID is the key of the session id in
// sampling_params.extra_args, as read by vLLM's _session_id_from_request.
const ExtraArgSessionID = "session_id"

// Request is one inference request as the frontend publishes it on
// kvbus.req.<model-token> (JetStream, Nats-Msg-Id = RequestID).
type Request struct {
	V              int    `msgpack:"v" json:"v"`
	RequestID      string `msgpack:"request_id" json:"request_id"`
	SessionID      string `msgpack:"session_id,omitempty" json:"session_id,omitempty"`
	Model          string `msgpack:"model" json:"model"`
	FrontendID     string `msgpack:"frontend_id" json:"frontend_id"`
	ArrivalUnixMs  int64  `msgpack:"arrival_unix_ms" json:"arrival_unix_ms"`
	DeadlineUnixMs int64  `msgpack:"deadline_unix_ms,omitempty" json:"deadline_unix_ms,omitempty"`
	// TimeoutMs is the time the request had left, by its frontend's clock,
	// when it was published (with DeadlineUnixMs; 0 from a frontend of an
	// earlier kvbus): the scheduler learns from it how far the frontend's
	// clock is from its own (see ReqMeta.TimeoutMs).
	TimeoutMs      int64          `msgpack:"timeout_ms,omitempty" json:"timeout_ms,omitempty"`
	PromptTokenIDs TokenIDs       `msgpack:"prompt_token_ids" json:"prompt_token_ids"`
	SamplingParams SamplingParams `msgpack:"sampling_params" json:"sampling_params"`
	Stream         bool           `msgpack:"stream" json:"stream"`
	// KVTransferParams is vLLM's kv_transfer_params, passed through.
	KVTransferParams Args   `msgpack:"kv_transfer_params,omitempty,omitzero" json:"kv_transfer_params,omitempty"`
	Endpoint         string `msgpack:"endpoint" json:"endpoint"`
	// Body is the client's JSON body, exactly as sent, when the frontend
	// forwards requests to real engines (--engine openai): the driver rank
	// passes it to the engine so that every field the engine supports
	// keeps working. Empty with the sim engine and for replayed traces.
	Body []byte `msgpack:"body,omitempty,allownil,limit=8388608" json:"body,omitempty"`
	// AgainOf is the request id this request asks again for: the frontend
	// publishes a request again, under a new id, when its answer was lost
	// on the bus. It is the same turn of its session, not the next. Empty
	// for every other request.
	AgainOf string `msgpack:"again_of,omitempty" json:"again_of,omitempty"`
	// CacheSalt is vLLM's cache_salt: a prompt with a salt shares cached
	// blocks only with prompts of the same model and the same salt (its
	// block hash chain is seeded with both). Empty: no salt.
	CacheSalt string `msgpack:"cache_salt,omitempty" json:"cache_salt,omitempty"`
	// LoRAName is the LoRA adapter the client asked for by its model name
	// (an engine's GET /v1/models lists it with a parent), while Model is
	// the base model the groups serve. vLLM keys an adapter's blocks with
	// its name, so a prompt's block hash chain is seeded with it too: an
	// adapter's blocks match only those of prompts of the same adapter.
	// Empty: the base model.
	LoRAName string `msgpack:"lora_name,omitempty" json:"lora_name,omitempty"`
}

// SamplingParams is the subset of vLLM's SamplingParams that kvbus carries.
// Zero values mean "not set" except where noted.
type SamplingParams struct {
	MaxTokens   int      `msgpack:"max_tokens" json:"max_tokens"`
	MinTokens   int      `msgpack:"min_tokens,omitempty" json:"min_tokens,omitempty"`
	Temperature float64  `msgpack:"temperature" json:"temperature"`
	TopP        float64  `msgpack:"top_p" json:"top_p"`
	Seed        *int64   `msgpack:"seed,omitempty" json:"seed,omitempty"`
	Stop        []string `msgpack:"stop,omitempty,allownil" json:"stop,omitempty"`
	IgnoreEOS   bool     `msgpack:"ignore_eos,omitempty" json:"ignore_eos,omitempty"`
	// StopTokenIDs is vLLM's stop_token_ids: a generated token among them
	// (once min_tokens are out) ends the answer, its text left out unless
	// IncludeStopStr.
	StopTokenIDs TokenIDs `msgpack:"stop_token_ids,omitempty,omitzero" json:"stop_token_ids,omitempty"`
	// IncludeStopStr is vLLM's include_stop_str_in_output: the stop string
	// that ended the answer is part of its text.
	IncludeStopStr bool `msgpack:"include_stop_str_in_output,omitempty" json:"include_stop_str_in_output,omitempty"`
	// ExtraArgs is vLLM's sampling_params.extra_args; the frontend puts the
	// session id under "session_id" when there is one, and only then.
	ExtraArgs Args `msgpack:"extra_args,omitempty,omitzero" json:"extra_args,omitempty"`
}

// SessionFromExtraArgs reads the session id back from extra_args the way
// vLLM's _session_id_from_request does: a string value, or nothing.
func (p SamplingParams) SessionFromExtraArgs() string {
	s, _ := p.ExtraArgs.String(ExtraArgSessionID)
	return s
}

// PutSetFields puts into body, an OpenAI /v1/completions request as vLLM
// takes it, the fields of p that are set and that a token-id prompt sent
// on carries (min_tokens, seed, stop, stop_token_ids,
// include_stop_str_in_output, ignore_eos), each under vLLM's name; the
// caller puts the rest (max_tokens, temperature, extra_args as vllm_xargs).
func (p SamplingParams) PutSetFields(body map[string]any) {
	if p.MinTokens > 0 {
		body["min_tokens"] = p.MinTokens
	}
	if p.Seed != nil {
		body["seed"] = *p.Seed
	}
	if len(p.Stop) > 0 {
		body["stop"] = p.Stop
	}
	if len(p.StopTokenIDs) > 0 {
		body["stop_token_ids"] = p.StopTokenIDs
	}
	if p.IncludeStopStr {
		body["include_stop_str_in_output"] = true
	}
	if p.IgnoreEOS {
		body["ignore_eos"] = true
	}
}

// LoadSpec says how much of a request's prompt is already cached: vLLM's
// computed tokens and the tokens to load from the KV pool (Mooncake store).
type LoadSpec struct {
	VLLMCachedTokens   int  `msgpack:"vllm_cached_tokens" json:"vllm_cached_tokens"`
	KVPoolCachedTokens int  `msgpack:"kvpool_cached_tokens" json:"kvpool_cached_tokens"`
	CanLoad            bool `msgpack:"can_load" json:"can_load"`
	// Remote says where parts of the prefix are read from when they are not
	// in the group's own segments of the KV pool: each run of blocks from a
	// named source group whose ranks all hold it (same tp_rank). Blocks of
	// the prefix (KVPoolCachedTokens) outside every run are read locally.
	// Empty with --pool local.
	Remote []RemoteRun `msgpack:"remote,omitempty,allownil" json:"remote,omitempty"`
}

// RemoteRun is Blocks blocks of a prefix, from block index FromBlock, read
// from the same tp_rank of group Group. Alternates are other groups whose
// ranks all held the longest start of the run when it was planned (the
// whole run first; at most MaxRunAlternates, in the order to try them): a
// rank whose read from Group fails (the source stopped, or evicted part of
// the run) reads what it can of the rest of the run from them, in turn,
// and recomputes what none gave. Empty when no other group held its first
// block; older schedulers send none. Saving says Group's ranks were still
// to save part of the run when it was planned (the previous turn just ran
// there): the read from Group asks it to wait for that save's ReqMeta
// (PoolRead.Saving).
type RemoteRun struct {
	Group      string   `msgpack:"group" json:"group"`
	FromBlock  int      `msgpack:"from_block" json:"from_block"`
	Blocks     int      `msgpack:"blocks" json:"blocks"`
	Alternates []string `msgpack:"alternates,omitempty,allownil" json:"alternates,omitempty"`
	Saving     bool     `msgpack:"saving,omitempty" json:"saving,omitempty"`
}

// MaxRunAlternates is how many alternates a RemoteRun may name.
const MaxRunAlternates = 2

// ReqMeta is the per-request KV-connector metadata the scheduler publishes
// once on kvbus.meta.<group>.<session-key>; NATS fans it out to every rank
// of the group. Field names follow vLLM's mooncake store connector.
type ReqMeta struct {
	V               int         `msgpack:"v" json:"v"`
	ReqID           string      `msgpack:"req_id" json:"req_id"`
	SessionID       string      `msgpack:"session_id,omitempty" json:"session_id,omitempty"`
	Model           string      `msgpack:"model" json:"model"`
	Group           string      `msgpack:"group" json:"group"`
	TokenLen        int         `msgpack:"token_len" json:"token_len"`
	TokenIDs        TokenIDs    `msgpack:"token_ids" json:"token_ids"`
	BlockSize       int         `msgpack:"block_size" json:"block_size"`
	BlockHashes     BlockHashes `msgpack:"block_hashes" json:"block_hashes"`
	LoadSpec        *LoadSpec   `msgpack:"load_spec" json:"load_spec"`
	CanSave         bool        `msgpack:"can_save" json:"can_save"`
	SaveFromBlock   int         `msgpack:"save_from_block" json:"save_from_block"`
	IsLastChunk     bool        `msgpack:"is_last_chunk" json:"is_last_chunk"`
	NumPromptTokens int         `msgpack:"num_prompt_tokens" json:"num_prompt_tokens"`
	// What the driver rank needs to run the request.
	SamplingParams SamplingParams `msgpack:"sampling_params" json:"sampling_params"`
	FrontendID     string         `msgpack:"frontend_id" json:"frontend_id"`
	ResultSubject  string         `msgpack:"result_subject" json:"result_subject"`
	Attempt        int            `msgpack:"attempt" json:"attempt"`
	DeadlineUnixMs int64          `msgpack:"deadline_unix_ms,omitempty" json:"deadline_unix_ms,omitempty"`
	// TimeoutMs is the time the request had left, by the scheduler's
	// clock, when it was published (with DeadlineUnixMs; 0 from a
	// scheduler of an earlier kvbus): a rank counts it from the ReqMeta's
	// receipt, so that its deadline does not depend on the two hosts'
	// clocks agreeing (see LocalDeadline).
	TimeoutMs int64 `msgpack:"timeout_ms,omitempty" json:"timeout_ms,omitempty"`
	// For an engine behind the driver rank (--engine openai): the
	// request's endpoint, whether the client streams, its original body
	// (Request.Body) and kv_transfer_params.
	Endpoint         string `msgpack:"endpoint,omitempty" json:"endpoint,omitempty"`
	Stream           bool   `msgpack:"stream,omitempty" json:"stream,omitempty"`
	Body             []byte `msgpack:"body,omitempty,allownil,limit=8388608" json:"body,omitempty"`
	KVTransferParams Args   `msgpack:"kv_transfer_params,omitempty,omitzero" json:"kv_transfer_params,omitempty"`
	// CacheSalt is the request's cache_salt (Request.CacheSalt), for an
	// engine that gets no client body (a replayed capture or trace).
	CacheSalt string `msgpack:"cache_salt,omitempty" json:"cache_salt,omitempty"`
}

// RankResult is what one rank reports to the scheduler on
// kvbus.done.<scheduler-id> after its load and store work for a request. The
// driver rank reports after generation, with CompletionTokens set, and also
// once when the prompt is prefilled (Prefilled set), so that the scheduler
// knows what is still queued for prefill.
type RankResult struct {
	V            int    `msgpack:"v" json:"v"`
	ReqID        string `msgpack:"req_id" json:"req_id"`
	Group        string `msgpack:"group" json:"group"`
	TPRank       int    `msgpack:"tp_rank" json:"tp_rank"`
	EPRank       int    `msgpack:"ep_rank" json:"ep_rank"`
	Attempt      int    `msgpack:"attempt" json:"attempt"`
	LoadedTokens int    `msgpack:"loaded_tokens" json:"loaded_tokens"`
	// RemoteTokens are those of LoadedTokens copied from another group's
	// segment of the KV pool.
	RemoteTokens     int   `msgpack:"remote_tokens,omitempty" json:"remote_tokens,omitempty"`
	StoredBlocks     int   `msgpack:"stored_blocks" json:"stored_blocks"`
	SkippedBlocks    int   `msgpack:"skipped_blocks" json:"skipped_blocks"`
	FailedBlocks     int   `msgpack:"failed_blocks" json:"failed_blocks"`
	LoadUs           int64 `msgpack:"load_us" json:"load_us"`
	StoreUs          int64 `msgpack:"store_us" json:"store_us"`
	CompletionTokens int   `msgpack:"completion_tokens,omitempty" json:"completion_tokens,omitempty"`
	// Prefilled marks the driver's early report that the prompt is
	// prefilled (the first output follows); it is not the rank's result.
	Prefilled bool `msgpack:"prefilled,omitempty" json:"prefilled,omitempty"`
	// Received marks a receipt: the rank has the ReqMeta and works on it.
	// A rank sends one when its result is not ready soon after the ReqMeta
	// arrived, and again when the same ReqMeta arrives twice, so that a
	// scheduler can tell a rank that missed the ReqMeta from a busy one.
	Received bool   `msgpack:"received,omitempty" json:"received,omitempty"`
	Error    string `msgpack:"error,omitempty" json:"error,omitempty"`
	// ErrorCode says what Error is, in the codes of OutputError and
	// RankErr*: the request's deadline passed (timeout), its client went
	// away (aborted), or it failed (any other code). Empty with an Error
	// from a rank of an older kvbus: a failure.
	ErrorCode string `msgpack:"error_code,omitempty" json:"error_code,omitempty"`
	// PrefillUs, on a Prefilled report, is the engine time of the prefill
	// (loads included): from when the engine could start it (the request
	// reached it, or the prefill before it ended) to its end. Schedulers
	// learn from it how fast a group works off its queue.
	PrefillUs int64 `msgpack:"prefill_us,omitempty" json:"prefill_us,omitempty"`
	// StartedUnixMs is when the answering rank's process started, as in its
	// heartbeats: a scheduler that hears a rank restart tells the requests
	// the new process has (it answered them) from those the old one took
	// with it. 0: not said (an older worker).
	StartedUnixMs int64 `msgpack:"started_unix_ms,omitempty" json:"started_unix_ms,omitempty"`
}

// Usage counts tokens like OpenAI's usage object.
type Usage struct {
	PromptTokens     int `msgpack:"prompt_tokens" json:"prompt_tokens"`
	CompletionTokens int `msgpack:"completion_tokens" json:"completion_tokens"`
	CachedTokens     int `msgpack:"cached_tokens" json:"cached_tokens"`
	// RemoteCachedTokens are those of CachedTokens read from another
	// group's segment of the KV pool (not part of OpenAI's usage).
	RemoteCachedTokens int `msgpack:"remote_cached_tokens,omitempty" json:"remote_cached_tokens,omitempty"`
}

// Codes of RankResult.ErrorCode that are not a failure of the group: a
// scheduler counts such a request under its own outcome, not as failed.
const (
	// RankErrTimeout: the request's deadline passed before the rank was done.
	RankErrTimeout = "timeout"
	// RankErrAborted: the request's client went away (an Abort).
	RankErrAborted = "aborted"
	// RankErrStoreSkipped: the answer was produced, but the rank's store
	// queue was full and the prompt's new blocks were not saved.
	RankErrStoreSkipped = "store_skipped"
)

// OutputError is an error that ends a request, with an OpenAI error code
// (for example "timeout", "no_ready_group") and a message for the client.
type OutputError struct {
	Code    string `msgpack:"code" json:"code"`
	Message string `msgpack:"message" json:"message"`
	// Status is the HTTP status an engine answered (a 400 for a field it
	// refused); zero means the frontend picks one from Code.
	Status int `msgpack:"status,omitempty" json:"status,omitempty"`
	// Raw is the engine's error body, relayed to the client as it is.
	Raw []byte `msgpack:"raw,omitempty,allownil,limit=8388608" json:"raw,omitempty"`
}

// Output is one chunk of a request's answer on kvbus.out.<frontend-id>.
// Index numbers the chunks of a request from 0 so the frontend can drop
// duplicates; the last chunk has FinishReason or Error set and carries
// Usage.
type Output struct {
	V     int    `msgpack:"v" json:"v"`
	ReqID string `msgpack:"req_id" json:"req_id"`
	Index int    `msgpack:"index" json:"index"`
	// Attempt is the dispatch attempt that produced the chunk (ReqMeta's
	// attempt): a request moved to another group starts again at index 0
	// with a higher attempt, and the frontend never mixes two attempts.
	Attempt      int      `msgpack:"attempt,omitempty" json:"attempt,omitempty"`
	Text         string   `msgpack:"text" json:"text"`
	TokenIDs     TokenIDs `msgpack:"token_ids,omitempty,omitzero" json:"token_ids,omitempty"`
	FinishReason string   `msgpack:"finish_reason,omitempty" json:"finish_reason,omitempty"`
	// StopReason is the stop string that ended the request (vLLM's
	// stop_reason), with FinishReason "stop"; empty when it ended at the
	// end of sequence or by length.
	StopReason string `msgpack:"stop_reason,omitempty" json:"stop_reason,omitempty"`
	// StopToken is the stop token id that ended the request (vLLM's
	// stop_reason as a number: one of stop_token_ids), nil when none did.
	StopToken *uint32      `msgpack:"stop_token,omitempty" json:"stop_token,omitempty"`
	Usage     *Usage       `msgpack:"usage,omitempty" json:"usage,omitempty"`
	Error     *OutputError `msgpack:"error,omitempty" json:"error,omitempty"`
	// Raw is an engine's own JSON (--engine openai), which the frontend
	// relays as it is: one streamed chunk's data, or the whole response of
	// a request that does not stream (on the last Output).
	Raw []byte `msgpack:"raw,omitempty,allownil,limit=8388608" json:"raw,omitempty"`
}

// Final reports whether o is the last chunk of its request.
func (o *Output) Final() bool { return o.FinishReason != "" || o.Error != nil }

// KV event kinds, vLLM's names.
const (
	EventBlockStored      = "BlockStored"
	EventBlockRemoved     = "BlockRemoved"
	EventAllBlocksCleared = "AllBlocksCleared"
)

// KVEvent is one of vLLM's KV cache events, told apart by Type:
// BlockStored{block_hashes, parent_block_hash, token_ids, block_size,
// medium}, BlockRemoved{block_hashes, medium} or AllBlocksCleared{}.
type KVEvent struct {
	Type            string      `msgpack:"type" json:"type"`
	BlockHashes     BlockHashes `msgpack:"block_hashes,omitempty,omitzero" json:"block_hashes,omitempty"`
	ParentBlockHash *uint64     `msgpack:"parent_block_hash,omitempty" json:"parent_block_hash,omitempty"`
	TokenIDs        TokenIDs    `msgpack:"token_ids,omitempty,omitzero" json:"token_ids,omitempty"`
	BlockSize       int         `msgpack:"block_size,omitempty" json:"block_size,omitempty"`
	Medium          string      `msgpack:"medium,omitempty" json:"medium,omitempty"`
}

// KVEventBatch is a rank's batch of KV events on kvbus.kv.<group>.<rank>.
// Seq increases by one per batch of a rank's process; a gap means a batch
// was lost.
type KVEventBatch struct {
	V      int       `msgpack:"v" json:"v"`
	TS     float64   `msgpack:"ts" json:"ts"`
	Seq    uint64    `msgpack:"seq" json:"seq"`
	Group  string    `msgpack:"group" json:"group"`
	Rank   int       `msgpack:"rank" json:"rank"`
	Events []KVEvent `msgpack:"events,allownil" json:"events"`
	// DumpChunk and DumpChunks number the chunks of a dump (a reply on
	// kvbus.ctl.dump.<group>.<rank>): a rank's held set is sent in as many
	// batches as fit the connection's max payload, all at the same seq, the
	// first starting with AllBlocksCleared. Zero outside dumps; at most
	// MaxDumpChunks.
	DumpChunk  int `msgpack:"dump_chunk,omitempty" json:"dump_chunk,omitempty"`
	DumpChunks int `msgpack:"dump_chunks,omitempty" json:"dump_chunks,omitempty"`
	// StartedUnixMs names the publishing process, as in its heartbeats, so
	// that a scheduler can drop the events of a second process given the
	// same rank. Zero from workers that predate it.
	StartedUnixMs int64 `msgpack:"started_unix_ms,omitempty" json:"started_unix_ms,omitempty"`
}

// MaxDumpChunks bounds a dump's chunk count: 65,536 chunks of a 1 MiB
// payload hold ~8 billion block hashes, more than any rank has. A receiver
// allocates by the count, so a larger one is malformed.
const MaxDumpChunks = 1 << 16

// Heartbeat announces a live rank on kvbus.hb.<group>.<rank>.
type Heartbeat struct {
	V              int    `msgpack:"v" json:"v"`
	Group          string `msgpack:"group" json:"group"`
	TPRank         int    `msgpack:"tp_rank" json:"tp_rank"`
	EPRank         int    `msgpack:"ep_rank" json:"ep_rank"`
	WorldSize      int    `msgpack:"world_size" json:"world_size"`
	Model          string `msgpack:"model" json:"model"`
	CapacityBlocks int64  `msgpack:"capacity_blocks" json:"capacity_blocks"`
	UsedBlocks     int64  `msgpack:"used_blocks" json:"used_blocks"`
	// UsedBytes is what the rank's block store holds (0 with an engine).
	UsedBytes     int64 `msgpack:"used_bytes,omitempty" json:"used_bytes,omitempty"`
	QueueDepth    int   `msgpack:"queue_depth" json:"queue_depth"`
	StartedUnixMs int64 `msgpack:"started_unix_ms" json:"started_unix_ms"`
	// Draining is set by a rank that is stopping: it finishes what it has
	// but takes nothing new, so its group gets no new requests.
	Draining bool `msgpack:"draining,omitempty" json:"draining,omitempty"`
	// HandedOff is set by a draining rank whose drain hand-off is over
	// (done, failed, or nothing to hand off): a rank that handed blocks
	// off waits for its group's other ranks to say it before it exits and
	// clears its blocks, so that its sessions' prefixes stay whole on some
	// group throughout.
	HandedOff bool `msgpack:"handed_off,omitempty" json:"handed_off,omitempty"`
	// NotReady is set by a rank whose engine does not take requests (a
	// model server failing its /health, or not up yet), with the reason:
	// its group gets no new requests and its queued ones move, as for a
	// dead rank.
	NotReady       bool   `msgpack:"not_ready,omitempty" json:"not_ready,omitempty"`
	NotReadyReason string `msgpack:"not_ready_reason,omitempty" json:"not_ready_reason,omitempty"`
	// The driver rank's view of its group's load, which every scheduler
	// replica uses so that replicas place as one would: requests received
	// and not finished, and prompt tokens of those not yet prefilled.
	InflightRequests    int   `msgpack:"inflight_requests,omitempty" json:"inflight_requests,omitempty"`
	QueuedPrefillTokens int64 `msgpack:"queued_prefill_tokens,omitempty" json:"queued_prefill_tokens,omitempty"`
	// Cached tokens those requests will still load before their prefill,
	// from the group's own segments and from other groups' (the global
	// pool): loading holds the engine too.
	QueuedLoadTokens       int64 `msgpack:"queued_load_tokens,omitempty" json:"queued_load_tokens,omitempty"`
	QueuedRemoteLoadTokens int64 `msgpack:"queued_remote_load_tokens,omitempty" json:"queued_remote_load_tokens,omitempty"`
	// The prefill at the head of the engine's queue (counted in the
	// queued tokens above): how long the engine has been on it, and its
	// tokens to prefill (not those it loads, which a scheduler weighs
	// differently). A scheduler takes the work done on it off the queue, up
	// to those tokens, rather than count it whole until it ends.
	PrefillingUs     int64 `msgpack:"prefilling_us,omitempty" json:"prefilling_us,omitempty"`
	PrefillingTokens int64 `msgpack:"prefilling_tokens,omitempty" json:"prefilling_tokens,omitempty"`
	// ResendByGroup is set by a driver rank that answers Resends on
	// kvbus.ctl.resend.<group>: the schedulers send frontends there. A
	// driver before 2026-12-07 read kvbus.ctl.resend and answered itself.
	ResendByGroup bool `msgpack:"resend_by_group,omitempty" json:"resend_by_group,omitempty"`
}

// Announcement tells the cluster that a role's process is alive and whether
// it is ready, on kvbus.ann.<role>.<id>, every second and on change. The
// frontends' health checks follow the schedulers' announcements.
type Announcement struct {
	V      int    `msgpack:"v" json:"v"`
	Role   string `msgpack:"role" json:"role"`
	ID     string `msgpack:"id" json:"id"`
	Ready  bool   `msgpack:"ready" json:"ready"`
	Reason string `msgpack:"reason,omitempty" json:"reason,omitempty"`
	// ReadyGroups is, for a scheduler, how many groups it can place on.
	ReadyGroups int   `msgpack:"ready_groups,omitempty" json:"ready_groups,omitempty"`
	UnixMs      int64 `msgpack:"unix_ms" json:"unix_ms"`
	// Stopped is a scheduler's last announcement after a clean stop, once
	// every request it dispatched has ended: the other replicas have none
	// of its requests to adopt. A replica that falls silent without it
	// died, and its requests are adopted (see SavePlan.LogSeq).
	Stopped bool `msgpack:"stopped,omitempty" json:"stopped,omitempty"`
	// StartedUnixMs is when the announcing process started: a scheduler
	// heard again under its id with another start died in between (a
	// fixed --id restarted at once), and its requests are adopted.
	StartedUnixMs int64 `msgpack:"started_unix_ms,omitempty" json:"started_unix_ms,omitempty"`
	// ReadyModels are, for a ready scheduler, the models of the groups it
	// can place on, sorted ("" for groups whose ranks name no model: any).
	// Absent from a scheduler of a kvbus before models were told apart.
	ReadyModels []string `msgpack:"ready_models,omitempty" json:"ready_models,omitempty"`
	// NoGroupWaitMs is, for a scheduler whose request consumer runs, how
	// long it holds a request for a ready worker group (--no-group-wait):
	// a frontend that saw a scheduler ready holds its requests as long
	// while none is (a group briefly away: a rank replaced). 0: it holds
	// none (its consumer is not running, or a kvbus before the field).
	NoGroupWaitMs int64 `msgpack:"no_group_wait_ms,omitempty" json:"no_group_wait_ms,omitempty"`
}

// RoleScheduler is the role name of schedulers in announcements.
const RoleScheduler = "scheduler"

// SavePlan tells the other scheduler replicas where a request was just
// dispatched (kvbus.sched.plan.<scheduler-id>), one per dispatch: a replica
// that gets the request redelivered after this one died sends it to the
// same group and attempt, and the group is about to store the request's
// prefix (BlockHashes). Until the ranks' KV events confirm them, or the plan
// expires, every replica treats the blocks as the group's, so the next turn
// of a conversation loads them whichever replica places it. LogSeq is the
// request's sequence in the request log: if the replica dies (is no longer
// announced) while the request runs, the replica that adopts its requests
// reads it from there, and a failure of its group afterwards is handled.
type SavePlan struct {
	V             int         `msgpack:"v" json:"v"`
	SchedulerID   string      `msgpack:"scheduler_id" json:"scheduler_id"`
	ReqID         string      `msgpack:"req_id" json:"req_id"`
	Group         string      `msgpack:"group" json:"group"`
	Attempt       int         `msgpack:"attempt,omitempty" json:"attempt,omitempty"`
	BlockHashes   BlockHashes `msgpack:"block_hashes" json:"block_hashes"`
	ExpiresUnixMs int64       `msgpack:"expires_unix_ms" json:"expires_unix_ms"`
	// ExpiresInMs is how long the plan had left when it was sent (0 from a
	// replica of an earlier kvbus): a replica counts it from receipt,
	// whatever its clock and the sender's say.
	ExpiresInMs int64  `msgpack:"expires_in_ms,omitempty" json:"expires_in_ms,omitempty"`
	LogSeq      uint64 `msgpack:"log_seq,omitempty" json:"log_seq,omitempty"`
	// Ended, in a plan without a req_id, lists requests the replica
	// ended since its last such plan (sent every 250 ms while it has
	// peers): they are not to be adopted if it dies.
	Ended []string `msgpack:"ended,omitempty" json:"ended,omitempty"`
	// SessionKey (messages.SessionKey of the request's session id; empty
	// without one or from an earlier kvbus), with Model, PromptBlocks,
	// LastHash and Turn, is the session binding the dispatching replica
	// recorded: where the session's latest turn ran, its full blocks and
	// the last one's hash, its turn number. The bucket's watcher tells the
	// other replicas later, after the answer may have come and the next
	// turn been sent; the plan reaches them before that answer does, so
	// the replica that places the next turn knows where the previous one
	// is being saved.
	SessionKey   string `msgpack:"session_key,omitempty" json:"session_key,omitempty"`
	Model        string `msgpack:"model,omitempty" json:"model,omitempty"`
	PromptBlocks int    `msgpack:"prompt_blocks,omitempty" json:"prompt_blocks,omitempty"`
	LastHash     uint64 `msgpack:"last_hash,omitempty" json:"last_hash,omitempty"`
	Turn         int    `msgpack:"turn,omitempty" json:"turn,omitempty"`
}

// FrontendProbeReqID is the request id of the Outputs a scheduler sends to
// find whether a frontend still listens on its output subject (a request
// with a reply inbox: the server answers "no responders" once nobody
// does). No request has it; every reader of outputs ignores it.
const FrontendProbeReqID = "kvbus-frontend-probe"

// AbortReasonTimeout begins the Reason of an Abort sent because the
// request's deadline passed (a frontend's --request-timeout, a replay's
// --timeout), not because its client went away.
const AbortReasonTimeout = "timeout"

// Timeout reports whether the Abort is for a request whose deadline passed.
func (a *Abort) Timeout() bool { return strings.HasPrefix(a.Reason, AbortReasonTimeout) }

// Reasons of an Abort sent because nobody waits for the answer any more:
// its client went away, or its frontend stopped with it in flight. A
// frontend's other Aborts withdraw a request it gave up for another (a
// copy published again, one whose publish failed).
const (
	AbortReasonClientGone      = "client disconnected"
	AbortReasonFrontendStopped = "frontend stopped"
	// AbortReasonFrontendGone is a scheduler's, for the requests of a
	// frontend that died with them in flight (nobody listens on its output
	// subject any more).
	AbortReasonFrontendGone = "frontend gone"
)

// ByClient reports whether the Abort is for a request nobody waits for:
// its client went away, or its frontend stopped.
func (a *Abort) ByClient() bool {
	return a.Reason == AbortReasonClientGone || a.Reason == AbortReasonFrontendStopped || a.Reason == AbortReasonFrontendGone
}

// Abort cancels a request; published on kvbus.ctl.abort.
type Abort struct {
	V      int    `msgpack:"v" json:"v"`
	ReqID  string `msgpack:"req_id" json:"req_id"`
	Reason string `msgpack:"reason,omitempty" json:"reason,omitempty"`
	// Group, if set, limits the abort to that group's ranks: the scheduler
	// withdrawing a request from a group that failed or lost it (the request
	// goes on elsewhere, or on the same group at a higher attempt). Without
	// it every role drops the request.
	Group string `msgpack:"group,omitempty" json:"group,omitempty"`
	// BeforeAttempt, if above 0, limits the abort to attempts below it: the
	// request goes on at that attempt, which a rank may receive before this
	// Abort (they come on different subjects).
	BeforeAttempt int `msgpack:"before_attempt,omitempty" json:"before_attempt,omitempty"`
}

// Resend asks the driver rank of a request for its outputs again, from
// FromIndex on (a request; only the driver that holds the request's outputs
// answers, with a ResendReply, after publishing them again on the request's
// output subject). A frontend sends it when a stream already under way lost
// outputs on the bus (an index skipped, or nothing heard after a NATS
// reconnect): the client's stream goes on where it was cut instead of
// ending with output_lost. It goes first to kvbus.ctl.resend, where a
// scheduler replica that knows the request's group answers with a
// ResendReply naming it (Group), then, unchanged, to that group's driver on
// kvbus.ctl.resend.<group>. (Before 2026-12-07 every group's driver read
// kvbus.ctl.resend: after a NATS restart of a cluster of 1,000 groups, every
// request a frontend asked about was read 1,000 times.)
type Resend struct {
	V         int    `msgpack:"v" json:"v"`
	ReqID     string `msgpack:"req_id" json:"req_id"`
	Attempt   int    `msgpack:"attempt,omitempty" json:"attempt,omitempty"`
	FromIndex int    `msgpack:"from_index" json:"from_index"`
}

// ResendReply answers a Resend. A driver's: how many outputs were published
// again (zero: none after FromIndex yet, the request is still running), or
// why none could be (the outputs are no longer kept). A scheduler's names
// the Group whose driver to ask, with an Error for a frontend before
// 2026-12-07, which knows no Group.
type ResendReply struct {
	V      int    `msgpack:"v" json:"v"`
	Resent int    `msgpack:"resent" json:"resent"`
	Done   bool   `msgpack:"done,omitempty" json:"done,omitempty"`
	Error  string `msgpack:"error,omitempty" json:"error,omitempty"`
	Group  string `msgpack:"group,omitempty" json:"group,omitempty"`
}

// PoolRead asks a rank for blocks of its segment of the KV pool, on
// kvbus.pool.<group>.<rank> (a request with several replies): the blocks of
// model with these hashes, at the asking rank's tp_rank, which is the
// answering rank's too (rank t reads rank t of another group, as in
// Mooncake, whose keys name no instance). Saving says the scheduler
// planned the read from a save in flight at the answering rank's group
// (RemoteRun.Saving): blocks it neither holds nor saves yet are waited
// for, within a quarter of its SaveWait, since in a NATS cluster the read
// can reach it before the ReqMeta that saves them. Group is the reading
// rank's group (empty from a reader that predates it): a source whose own
// load thread is reading from that group does not wait for a save queued
// behind that read (the two groups would wait on each other).
type PoolRead struct {
	V           int         `msgpack:"v" json:"v"`
	ReqID       string      `msgpack:"req_id,omitempty" json:"req_id,omitempty"`
	Group       string      `msgpack:"group,omitempty" json:"group,omitempty"`
	Model       string      `msgpack:"model" json:"model"`
	TPRank      int         `msgpack:"tp_rank" json:"tp_rank"`
	BlockHashes BlockHashes `msgpack:"block_hashes" json:"block_hashes"`
	Saving      bool        `msgpack:"saving,omitempty" json:"saving,omitempty"`
	// StartedUnixMs, when set, names the process of the rank to read (its
	// heartbeats' started_unix_ms): another process of the same rank (its
	// replacement, started while it drains, which holds none of its
	// blocks) does not answer. A drain hand-off's reads set it.
	StartedUnixMs int64 `msgpack:"started_unix_ms,omitempty" json:"started_unix_ms,omitempty"`
}

// PoolPart is one reply to a PoolRead: part Part of Parts (every reply
// says how many there are), carrying pieces of the blocks found. A block is
// sent in order, in one or more pieces (Offset into a value of Size bytes)
// so that no reply exceeds the connection's max payload; a block the rank
// does not hold is never sent and counts as missing.
type PoolPart struct {
	V      int         `msgpack:"v" json:"v"`
	Part   int         `msgpack:"part" json:"part"`
	Parts  int         `msgpack:"parts" json:"parts"`
	Pieces []PoolPiece `msgpack:"pieces,allownil" json:"pieces"`
}

// PoolPiece is bytes [Offset, Offset+len(Data)) of the value, Size bytes
// long, of the block at Index in the PoolRead's hashes.
type PoolPiece struct {
	Index  int    `msgpack:"index" json:"index"`
	Offset int    `msgpack:"offset" json:"offset"`
	Size   int    `msgpack:"size" json:"size"`
	Data   []byte `msgpack:"data,allownil,limit=8388608" json:"data"`
}

// DrainPlan is what the driver rank of a draining group (scaled down)
// tells its ranks, on kvbus.drain.<group>, once their requests are
// finished: which of the blocks they hold go to which other group. Every
// rank t hands the same blocks to rank t of the same target, so the target
// group holds whole prefixes, as a LoadSpec needs. An empty plan means
// nothing is handed off.
type DrainPlan struct {
	V         int             `msgpack:"v" json:"v"`
	Group     string          `msgpack:"group" json:"group"`
	Model     string          `msgpack:"model" json:"model"`
	BlockSize int             `msgpack:"block_size" json:"block_size"`
	Targets   []HandoffTarget `msgpack:"targets,allownil" json:"targets"`
}

// HandoffTarget is the part of a DrainPlan for one target group.
type HandoffTarget struct {
	Group string       `msgpack:"group" json:"group"`
	Runs  []HandoffRun `msgpack:"runs,allownil" json:"runs"`
}

// HandoffRun is blocks of one session (Session is the store's group tag,
// the session key; empty for untagged blocks), most recently used first.
type HandoffRun struct {
	Session     string      `msgpack:"session,omitempty" json:"session,omitempty"`
	BlockHashes BlockHashes `msgpack:"block_hashes" json:"block_hashes"`
}

// Handoff asks rank TPRank of a group, on
// kvbus.pool.<group>.<rank>.handoff, to read the runs from the same rank of
// the draining Source group (PoolReads) and keep them as its own blocks. The
// reply is a HandoffResult.
type Handoff struct {
	V         int          `msgpack:"v" json:"v"`
	Model     string       `msgpack:"model" json:"model"`
	TPRank    int          `msgpack:"tp_rank" json:"tp_rank"`
	Source    string       `msgpack:"source" json:"source"`
	BlockSize int          `msgpack:"block_size" json:"block_size"`
	Runs      []HandoffRun `msgpack:"runs,allownil" json:"runs"`
	// SourceStartedUnixMs is the draining source process's
	// started_unix_ms: the target's reads name it (PoolRead.StartedUnixMs),
	// so that a replacement of the source rank, started as it drains,
	// does not answer them with blocks missing.
	SourceStartedUnixMs int64 `msgpack:"source_started_unix_ms,omitempty" json:"source_started_unix_ms,omitempty"`
}

// HandoffResult answers a Handoff: how many blocks the target now holds,
// how many it could not read (the source no longer had them, or they failed
// verification), and an error when it refused the whole hand-off.
type HandoffResult struct {
	V      int    `msgpack:"v" json:"v"`
	Stored int    `msgpack:"stored" json:"stored"`
	Failed int    `msgpack:"failed" json:"failed"`
	Bytes  int64  `msgpack:"bytes" json:"bytes"`
	Error  string `msgpack:"error,omitempty" json:"error,omitempty"`
}

// TimeLeftMs is what a sender puts in a message's timeout_ms for deadline
// at now: the milliseconds left, rounded up, at least 1 (0 says "none").
func TimeLeftMs(deadline, now time.Time) int64 {
	left := deadline.Sub(now)
	return max(int64((left+time.Millisecond-1)/time.Millisecond), 1)
}

// LocalDeadline is the deadline a receiver keeps for a message that carries
// one both as its sender's wall-clock time (deadlineUnixMs) and as the time
// it had left when sent (timeoutMs), received at received (time.Now(), with
// its monotonic reading): the time left counted from receipt, which no
// difference or step between the two hosts' clocks moves, late by the
// message's transit only. skew is how far the sender's deadline, read on
// this host's clock, lies after that one: about how far the sender's clock
// is ahead of this host's (behind when negative). Without timeoutMs (a
// sender of an earlier kvbus) the deadline is deadlineUnixMs on this host's
// clock, as before, and skew is 0; without either there is none (zero).
func LocalDeadline(deadlineUnixMs, timeoutMs int64, received time.Time) (deadline time.Time, skew time.Duration) {
	if timeoutMs <= 0 {
		if deadlineUnixMs <= 0 {
			return time.Time{}, 0
		}
		return time.UnixMilli(deadlineUnixMs), 0
	}
	deadline = received.Add(time.Duration(timeoutMs) * time.Millisecond)
	if deadlineUnixMs > 0 {
		skew = time.UnixMilli(deadlineUnixMs).Sub(deadline.Round(0))
	}
	return deadline, skew
}
