// Package fakeengine is an in-process fake of a vLLM OpenAI-compatible
// server, faithful to vLLM's wire formats, for tests that have neither a
// GPU nor vLLM: kvbus's `--engine openai` worker forwards requests to it
// and indexes its cache from its KV events.
//
// An Engine serves, on 127.0.0.1 at an ephemeral port (Engine.URL):
//
//   - POST /v1/chat/completions and POST /v1/completions, streamed (SSE:
//     "data: {json}\n\n" chunks, then "data: [DONE]\n\n") or not. The reply
//     is deterministic: Config.ReplyTokens words chosen by a hash of the
//     prompt, then the end-of-sequence token TokenEOT (finish_reason
//     "stop"), unless max_tokens (max_completion_tokens for chat) cuts it
//     first (finish_reason "length"). usage has prompt_tokens,
//     completion_tokens (TokenEOT included, as vLLM counts the EOS token),
//     total_tokens and prompt_tokens_details.cached_tokens; a stream
//     carries usage only in a last chunk with no choices, and only when
//     stream_options.include_usage is true (or stream_options is given
//     without it: vLLM's default is true), as vLLM does. /v1/completions
//     takes a text prompt or a list of token ids.
//   - POST /tokenize, with {"prompt"} or {"messages",
//     "add_generation_prompt"}: {"count", "max_model_len", "tokens",
//     "token_strs"}, the very tokens the completion endpoints prefill.
//   - GET /health (200, or 503 after SetHealthy(false)), GET /v1/models,
//     POST /reset_prefix_cache.
//
// Errors have vLLM's body, {"error": {"message", "type", "param",
// "code"}}: an unknown model is a 404 NotFoundError, a prompt too long for
// Config.MaxModelLen a 400 BadRequestError, a body that is not JSON (or not
// sent as application/json) a 400 "Bad Request". With Config.APIKey, paths
// under /v1 need "Authorization: Bearer <key>" and answer 401
// {"error": "Unauthorized"} otherwise, as vLLM's middleware does.
//
// # Tokens
//
// The fake tokenizer (Tokenize) maps each word or punctuation character
// to an id in [16, VocabSize) derived from its hash; about a quarter of
// the ids exceed 200,000. The chat template (ChatTemplate) is TokenBOS,
// then per message a role marker, the content's tokens and TokenEOT, then
// the generation prompt TokenAssistant. A reply's words tokenize to the
// reply's token ids, so a conversation that sends the replies back hits
// the cache as it would with a real model.
//
// # Prefix cache
//
// The cache holds Config.CacheBlocks blocks of Config.BlockSize tokens,
// keyed by chained hashes (sha256 over the parent's hash and the block's
// tokens), evicted least recently used first, a request's tail blocks
// before its head. A request's cached_tokens is its prompt's longest
// cached prefix of full blocks, but never the whole prompt: as vLLM, the
// last prompt token is always computed. Then every full block of the
// prompt and of the output tokens whose KV was computed (all but the last
// one) is stored.
//
// # KV events
//
// With Config.KVEvents the Engine publishes, as vLLM's ZmqEventPublisher,
// a batch per request that changed the cache (and one per Reset): one
// BlockRemoved per evicted block, then one BlockStored of the request's new
// blocks (block_hashes, parent_block_hash, token_ids, block_size, lora_id
// None, medium "GPU", lora_name None); Reset publishes AllBlocksCleared.
// Each ZeroMQ message has three frames: the topic, the sequence number as
// 8 big-endian bytes (from 0) and the msgpack batch
// [ts, [event, ...], data_parallel_rank], events in the array or tagged-map
// form of Config.KVEvents.EventForm. workers/vllmevents documents those
// shapes as verified in vLLM's source, and decodes what this package
// publishes (the package's tests prove it). The PUB socket binds (vLLM) or
// connects to a binding subscriber (llm-d's simulator); an optional ROUTER
// serves vLLM's replay protocol from a buffer of recent batches. SkipSeq and
// DropNext make subscribers see gaps, without and with replayable batches.
//
// # Departures from vLLM
//
// Only n=1 and one prompt per request are served; logprobs, echo, stop
// strings, tools and multimodal parts are ignored (the whole body is
// recorded, see Engine.Requests). Real vLLM reports
// usage.prompt_tokens_details only when started with
// --enable-prompt-tokens-details; the fake does by default
// (Config.OmitPromptTokensDetails turns it off). vLLM publishes a
// request's prompt blocks after its prefill step and each output block
// when it fills; the fake publishes them in one batch when the request
// arrives. Block hashes are the fake's own (vLLM's hash a serialization of
// (parent, tokens, extra keys) with a per-process seed), in vLLM's two
// external forms.
//
// # Concurrency
//
// An Engine's methods are safe for concurrent use; requests are served
// concurrently, their cache admissions and KV event batches serialized
// under one lock. The package has no mutable package-level state.
package fakeengine
