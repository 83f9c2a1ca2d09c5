package fakeengine

import (
	"bytes"

	"github.com/vmihailenco/msgpack/v5"
)

// EventForm is how KV events are encoded inside vLLM's positional batch
// [ts, events, data_parallel_rank] (see workers/vllmevents' package
// documentation for the wire shapes and where they were seen).
type EventForm string

const (
	// EventFormMap encodes each event as a msgspec tagged map,
	// {"type": "BlockStored", "block_hashes": ..., ...}: current vLLM
	// (since PR #42892). The default.
	EventFormMap EventForm = "map"
	// EventFormArray encodes each event as an array_like struct,
	// ["BlockStored", block_hashes, parent_block_hash, token_ids,
	// block_size, lora_id, medium, lora_name]: vLLM before PR #42892.
	EventFormArray EventForm = "array"
)

// Event tags, as vLLM's msgspec structs are named.
const (
	tagBlockStored      = "BlockStored"
	tagBlockRemoved     = "BlockRemoved"
	tagAllBlocksCleared = "AllBlocksCleared"
)

// mediumGPU is vLLM's MEDIUM_GPU (vllm/distributed/kv_events.py).
const mediumGPU = "GPU"

// kvEvent is one event to encode.
type kvEvent struct {
	tag       string
	hashes    []blockHash
	parent    *blockHash // BlockStored
	tokens    []uint32   // BlockStored
	blockSize int        // BlockStored
	// loraName and loraID: the LoRA adapter of a BlockStored's blocks;
	// empty and 0 for the model's own.
	loraName string
	loraID   int
	// salt: the cache_salt of a BlockStored that starts at the prompt's
	// first block, whose extra keys hold it (vLLM's extra_keys).
	salt string
}

// eventsOf turns one request's admission into vLLM's events, in the order
// vLLM queues them: one BlockRemoved per evicted block (vLLM's
// _maybe_evict_cached_block), then one BlockStored for the blocks the
// request filled (vLLM's cache_full_blocks). A LoRA adapter's blocks
// carry its name and id (vLLM's lora_name and lora_int_id); a salted
// prompt's first block, its salt as an extra key.
func eventsOf(a admission, blockSize int, loraName string, loraID int, salt string) []kvEvent {
	var evs []kvEvent
	for _, h := range a.removed {
		evs = append(evs, kvEvent{tag: tagBlockRemoved, hashes: []blockHash{h}})
	}
	if len(a.stored) > 0 {
		ev := kvEvent{tag: tagBlockStored, hashes: a.stored, parent: a.parent,
			tokens: a.tokens, blockSize: blockSize, loraName: loraName, loraID: loraID}
		if a.parent == nil {
			ev.salt = salt
		}
		evs = append(evs, ev)
	}
	return evs
}

// batchEncoder encodes KV event batches as msgspec encodes vLLM's
// KVEventBatch: an array [ts, events, data_parallel_rank] (EventBatch is
// array_like; data_parallel_rank is sent, vLLM's scheduler sets it), floats
// as float64, integers in their shortest form, bytes as bin, None as nil.
// Fields without a default (lora_id, medium, lora_name) are always
// encoded, even when None; defaulted ones left at None (extra_keys,
// group_idx, ...) are omitted, as omit_defaults does.
type batchEncoder struct {
	form      EventForm
	hashBytes bool
	dpRank    int
	zeroRoot  bool // parent_block_hash 0 for None (KVEventsConfig.ZeroRootParent)
}

func (b batchEncoder) encode(ts float64, evs []kvEvent) ([]byte, error) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	w := &encWriter{enc: enc}
	w.arrayLen(3)
	w.do(enc.EncodeFloat64(ts))
	w.arrayLen(len(evs))
	for _, ev := range evs {
		b.event(w, ev)
	}
	w.do(enc.EncodeInt(int64(b.dpRank)))
	if w.err != nil {
		return nil, w.err
	}
	return buf.Bytes(), nil
}

// encWriter keeps the first encoding error.
type encWriter struct {
	enc *msgpack.Encoder
	err error
}

func (w *encWriter) do(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *encWriter) arrayLen(n int) { w.do(w.enc.EncodeArrayLen(n)) }

func (b batchEncoder) hash(w *encWriter, h blockHash) {
	if b.hashBytes {
		w.do(w.enc.EncodeBytes(h[:]))
		return
	}
	w.do(w.enc.EncodeUint(intHash(h)))
}

func (b batchEncoder) hashes(w *encWriter, hs []blockHash) {
	w.arrayLen(len(hs))
	for _, h := range hs {
		b.hash(w, h)
	}
}

// field writes a map key in the map form; nothing in the array form.
func (b batchEncoder) field(w *encWriter, name string) {
	if b.form == EventFormMap {
		w.do(w.enc.EncodeString(name))
	}
}

func (b batchEncoder) event(w *encWriter, ev kvEvent) {
	n := 1 // the tag
	switch ev.tag {
	case tagBlockStored:
		n += 7
		if ev.salt != "" {
			n++ // extra_keys
		}
	case tagBlockRemoved:
		n += 2
	}
	if b.form == EventFormMap {
		w.do(w.enc.EncodeMapLen(n))
		w.do(w.enc.EncodeString("type"))
	} else {
		w.arrayLen(n)
	}
	w.do(w.enc.EncodeString(ev.tag))
	switch ev.tag {
	case tagBlockStored:
		b.field(w, "block_hashes")
		b.hashes(w, ev.hashes)
		b.field(w, "parent_block_hash")
		switch {
		case ev.parent != nil:
			b.hash(w, *ev.parent)
		case b.zeroRoot:
			w.do(w.enc.EncodeUint(0))
		default:
			w.do(w.enc.EncodeNil())
		}
		b.field(w, "token_ids")
		w.arrayLen(len(ev.tokens))
		for _, t := range ev.tokens {
			w.do(w.enc.EncodeUint(uint64(t)))
		}
		b.field(w, "block_size")
		w.do(w.enc.EncodeInt(int64(ev.blockSize)))
		b.field(w, "lora_id")
		if ev.loraID == 0 {
			w.do(w.enc.EncodeNil())
		} else {
			w.do(w.enc.EncodeInt(int64(ev.loraID)))
		}
		b.field(w, "medium")
		w.do(w.enc.EncodeString(mediumGPU))
		b.field(w, "lora_name")
		if ev.loraName == "" {
			w.do(w.enc.EncodeNil())
		} else {
			w.do(w.enc.EncodeString(ev.loraName))
		}
		if ev.salt != "" {
			// Per block: the first one's extra keys (the salt), None
			// for the rest.
			b.field(w, "extra_keys")
			w.arrayLen(len(ev.hashes))
			for i := range ev.hashes {
				if i == 0 {
					w.arrayLen(1)
					w.do(w.enc.EncodeString(ev.salt))
				} else {
					w.do(w.enc.EncodeNil())
				}
			}
		}
	case tagBlockRemoved:
		b.field(w, "block_hashes")
		b.hashes(w, ev.hashes)
		b.field(w, "medium")
		w.do(w.enc.EncodeString(mediumGPU))
	}
}
