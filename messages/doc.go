// Package messages defines kvbus's wire contract: the msgpack message types
// exchanged over NATS, the codec that packs token ids and block hashes as
// msgpack bin, and the subject helpers. It is the only place a subject is
// spelled.
//
// Every message is a msgpack map with snake_case keys (vLLM's field names
// where vLLM has the field) and a version key "v". Decoders ignore unknown
// keys, so a newer producer can add fields without breaking older consumers.
// Decode functions never panic on malformed input; they return an error
// wrapping ErrMalformed.
package messages
