package vllmevents

import (
	"errors"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/kvbus/kvbus/messages"
)

// MaxHashesPerBatch bounds the number of block hashes one batch may hold,
// so that a small payload of one-byte integers cannot make the decoder
// allocate many times its size. vLLM sends one BlockStored per request and
// scheduling step, far below this.
const MaxHashesPerBatch = 1 << 20

// maxUnknownTags bounds Batch.UnknownTags.
const maxUnknownTags = 8

// Batch is a decoded vLLM KVEventBatch. It is owned by the caller.
type Batch struct {
	// TS is the engine's wall-clock time of the batch, in seconds since the
	// epoch.
	TS float64
	// Events are the batch's known events, in order.
	Events []Event
	// DPRank is the engine's data-parallel rank (0 when absent).
	DPRank int
	// First is set by a Subscriber on the first batch the engine
	// published: numbered 0, or the first it delivered after the engine's
	// replay endpoint answered that it held none before it (llm-d's
	// inference simulator numbers its batches from 1). Decode leaves it
	// false.
	First bool
	// Skipped counts events with a tag this package does not know; they
	// are not in Events. UnknownTags lists their distinct tags (at most 8),
	// for the caller to log.
	Skipped     int
	UnknownTags []string
}

// Event is one vLLM KV cache event, told apart by Type: BlockStored,
// BlockRemoved or AllBlocksCleared (the messages.Event* constants). Fields
// an event type does not have are zero.
type Event struct {
	Type string
	// BlockHashes are the engine's hashes of the blocks stored or removed,
	// in chain order for BlockStored.
	BlockHashes []Hash
	// Parent is the engine hash of the block the first stored block chains
	// from; nil when it starts a prompt.
	Parent *Hash
	// TokenIDs are the tokens of the stored blocks, BlockSize per block.
	TokenIDs  []uint32
	BlockSize int
	// LoRAID and LoRAName identify the LoRA adapter the blocks were
	// computed with, if any: vLLM mixes the adapter into the block hashes.
	LoRAID   *int
	LoRAName *string
	// Medium is where the blocks live ("GPU", "CPU", ...); empty when the
	// event does not say (vLLM before it had the field: GPU).
	Medium string
	// GroupIdx is the KV cache group of the blocks, when the event says.
	GroupIdx *int
	// ExtraKeys tells, per block of BlockHashes, whether vLLM mixed extra
	// keys (multimodal inputs, LoRA name, cache salt, prompt embeddings)
	// into the block's hash; nil when the event has none.
	ExtraKeys []bool
}

// Decode decodes one vLLM KV event batch payload, in any of the shapes the
// package documentation lists. Events with unknown tags are skipped and
// counted, not an error. Any other deviation fails the whole batch with an
// error wrapping ErrMalformed (or ErrTooLarge above messages.MaxMessageBytes
// or MaxHashesPerBatch): Decode never panics. The payload is not retained.
func Decode(payload []byte) (*Batch, error) {
	w := wireBatch{size: len(payload)}
	// messages.Unmarshal bounds the size and the nesting depth (the
	// decoder's Skip recurses) and recovers from panics before and while
	// it calls w.DecodeMsgpack.
	err := messages.Unmarshal(payload, &w)
	switch {
	case w.err != nil && errors.Is(w.err, errTooManyHashes):
		return nil, fmt.Errorf("%w: %v", ErrTooLarge, w.err)
	case w.err != nil:
		return nil, fmt.Errorf("%w: %v", ErrMalformed, w.err)
	case errors.Is(err, messages.ErrTooLarge):
		return nil, fmt.Errorf("%w: %v", ErrTooLarge, err)
	case err != nil:
		return nil, fmt.Errorf("%w: %v", ErrMalformed, err)
	case !w.called:
		// msgpack decodes nil into the zero value without asking w.
		return nil, fmt.Errorf("%w: nil is not a batch", ErrMalformed)
	}
	return &w.b, nil
}

// errTooManyHashes is returned past MaxHashesPerBatch.
var errTooManyHashes = fmt.Errorf("more than %d block hashes in a batch", MaxHashesPerBatch)

// wireBatch decodes a batch from the msgpack stream; err keeps the
// package's own error, which messages.Unmarshal would flatten.
type wireBatch struct {
	b      Batch
	size   int // payload bytes: a bound for preallocations
	hashes int // hashes decoded so far
	called bool
	err    error // without the package's sentinel, which Decode adds
}

var _ msgpack.CustomDecoder = (*wireBatch)(nil)

func (w *wireBatch) DecodeMsgpack(dec *msgpack.Decoder) error {
	w.called = true
	w.err = w.decode(dec)
	return w.err
}

// malformed returns a decoding error; Decode wraps it in ErrMalformed.
func malformed(format string, args ...any) error { return fmt.Errorf(format, args...) }

func (w *wireBatch) decode(dec *msgpack.Decoder) error {
	c, err := dec.PeekCode()
	if err != nil {
		return malformed("batch: %v", err)
	}
	switch {
	case isArray(c):
		n, err := dec.DecodeArrayLen()
		if err != nil {
			return malformed("batch: %v", err)
		}
		if n < 2 {
			return malformed("batch: array of %d elements, want [ts, events, ...]", n)
		}
		if w.b.TS, err = decodeFloat(dec); err != nil {
			return fmt.Errorf("batch ts: %w", err)
		}
		if err := w.decodeEvents(dec); err != nil {
			return err
		}
		if n > 2 {
			if w.b.DPRank, err = decodeOptInt(dec); err != nil {
				return fmt.Errorf("batch data_parallel_rank: %w", err)
			}
		}
		return skipN(dec, n-3)
	case isMap(c):
		n, err := dec.DecodeMapLen()
		if err != nil {
			return malformed("batch: %v", err)
		}
		sawEvents := false
		for range n {
			key, err := decodeKey(dec)
			if err != nil {
				return fmt.Errorf("batch: %w", err)
			}
			switch key {
			case "ts":
				if w.b.TS, err = decodeFloat(dec); err != nil {
					return fmt.Errorf("batch ts: %w", err)
				}
			case "events":
				if sawEvents {
					return malformed("batch: events twice")
				}
				sawEvents = true
				if err := w.decodeEvents(dec); err != nil {
					return err
				}
			case "data_parallel_rank":
				if w.b.DPRank, err = decodeOptInt(dec); err != nil {
					return fmt.Errorf("batch data_parallel_rank: %w", err)
				}
			default:
				if err := dec.Skip(); err != nil {
					return malformed("batch: %v", err)
				}
			}
		}
		if !sawEvents {
			return malformed("batch: map without events")
		}
		return nil
	}
	return malformed("batch: msgpack code %#x is neither an array nor a map", c)
}

func (w *wireBatch) decodeEvents(dec *msgpack.Decoder) error {
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return malformed("events: %v", err)
	}
	w.b.Events = make([]Event, 0, min(max(n, 0), w.size, 1024))
	for i := range n {
		ev, known, err := w.decodeEvent(dec)
		if err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
		if known {
			w.b.Events = append(w.b.Events, ev)
		}
	}
	return nil
}

// decodeEvent decodes one event in array or map form; known is false for
// an unknown tag, which it records.
func (w *wireBatch) decodeEvent(dec *msgpack.Decoder) (ev Event, known bool, err error) {
	c, err := dec.PeekCode()
	if err != nil {
		return ev, false, malformed("%v", err)
	}
	switch {
	case isArray(c):
		return w.decodeArrayEvent(dec)
	case isMap(c):
		return w.decodeMapEvent(dec)
	}
	return ev, false, malformed("msgpack code %#x is neither an array nor a map", c)
}

func (w *wireBatch) unknown(tag string) {
	w.b.Skipped++
	for _, t := range w.b.UnknownTags {
		if t == tag {
			return
		}
	}
	if len(w.b.UnknownTags) < maxUnknownTags {
		w.b.UnknownTags = append(w.b.UnknownTags, tag)
	}
}

func knownTag(tag string) bool {
	switch tag {
	case messages.EventBlockStored, messages.EventBlockRemoved, messages.EventAllBlocksCleared:
		return true
	}
	return false
}

// storedFields and removedFields name BlockStored's and BlockRemoved's
// fields by position in the array form (0 is the tag), in the declaration
// order of vLLM's classes; later positions are skipped.
var (
	storedFields = []string{"", "block_hashes", "parent_block_hash", "token_ids", "block_size",
		"lora_id", "medium", "lora_name", "extra_keys", "group_idx"}
	removedFields = []string{"", "block_hashes", "medium", "group_idx"}
)

// minArrayLen is the number of required elements of an event array: the
// tag and the fields without a default up to block_size for BlockStored,
// up to block_hashes for BlockRemoved (older vLLM had no medium).
var minArrayLen = map[string]int{
	messages.EventBlockStored:      5,
	messages.EventBlockRemoved:     2,
	messages.EventAllBlocksCleared: 1,
}

func (w *wireBatch) decodeArrayEvent(dec *msgpack.Decoder) (ev Event, known bool, err error) {
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return ev, false, malformed("%v", err)
	}
	if n < 1 {
		return ev, false, malformed("empty event array")
	}
	tag, err := decodeStr(dec)
	if err != nil {
		return ev, false, fmt.Errorf("tag: %w", err)
	}
	if !knownTag(tag) {
		w.unknown(tag)
		return ev, false, skipN(dec, n-1)
	}
	ev.Type = tag
	if want := minArrayLen[tag]; n < want {
		return ev, false, malformed("%s: array of %d elements, want at least %d", tag, n, want)
	}
	var names []string
	switch tag {
	case messages.EventBlockStored:
		names = storedFields
	case messages.EventBlockRemoved:
		names = removedFields
	}
	for pos := 1; pos < n; pos++ {
		name := ""
		if pos < len(names) {
			name = names[pos]
		}
		if err := w.decodeField(dec, &ev, name); err != nil {
			return ev, false, fmt.Errorf("%s: %w", tag, err)
		}
	}
	w.finish(&ev)
	return ev, true, nil
}

// mapFields are the event map keys decodeMapEvent tracks, for duplicate
// and required-field checks.
var mapFields = map[string]uint{"block_hashes": 0, "parent_block_hash": 1, "token_ids": 2,
	"block_size": 3, "lora_id": 4, "medium": 5, "lora_name": 6, "extra_keys": 7, "group_idx": 8,
	"type": 9, "tag": 9}

func (w *wireBatch) decodeMapEvent(dec *msgpack.Decoder) (ev Event, known bool, err error) {
	n, err := dec.DecodeMapLen()
	if err != nil {
		return ev, false, malformed("%v", err)
	}
	var seen uint
	for i := range n {
		key, err := decodeKey(dec)
		if err != nil {
			return ev, false, err
		}
		if bit, ok := mapFields[key]; ok {
			if seen&(1<<bit) != 0 {
				return ev, false, malformed("key %q twice", key)
			}
			seen |= 1 << bit
		}
		if key == "type" || key == "tag" {
			tag, err := decodeStr(dec)
			if err != nil {
				return ev, false, fmt.Errorf("%s: %w", key, err)
			}
			if !knownTag(tag) {
				// The rest of this event's fields may mean anything.
				w.unknown(tag)
				return ev, false, skipN(dec, 2*(n-i-1))
			}
			ev.Type = tag
			continue
		}
		if err := w.decodeField(dec, &ev, key); err != nil {
			return ev, false, err
		}
	}
	if ev.Type == "" {
		return ev, false, malformed("event map without type")
	}
	var required []string
	switch ev.Type {
	case messages.EventBlockStored:
		required = []string{"block_hashes", "token_ids"}
	case messages.EventBlockRemoved:
		required = []string{"block_hashes"}
	}
	for _, k := range required {
		if seen&(1<<mapFields[k]) == 0 {
			return ev, false, malformed("%s without %s", ev.Type, k)
		}
	}
	w.finish(&ev)
	return ev, true, nil
}

// decodeField decodes the value of the named field into ev; unknown names
// (an empty one included) are skipped.
func (w *wireBatch) decodeField(dec *msgpack.Decoder, ev *Event, name string) error {
	var err error
	switch name {
	case "block_hashes":
		ev.BlockHashes, err = w.decodeHashes(dec)
	case "parent_block_hash":
		ev.Parent, err = decodeOpt(dec, decodeHash)
	case "token_ids":
		ev.TokenIDs, err = w.decodeTokens(dec)
	case "block_size":
		ev.BlockSize, err = decodeOptInt(dec)
		if err == nil && ev.BlockSize < 0 {
			err = malformed("negative %d", ev.BlockSize)
		}
	case "lora_id":
		ev.LoRAID, err = decodeOpt(dec, decodeOptInt)
	case "lora_name":
		ev.LoRAName, err = decodeOpt(dec, decodeStr)
	case "medium":
		var m *string
		if m, err = decodeOpt(dec, decodeStr); m != nil {
			ev.Medium = *m
		}
	case "group_idx":
		ev.GroupIdx, err = decodeOpt(dec, decodeOptInt)
	case "extra_keys":
		ev.ExtraKeys, err = w.decodeExtraKeys(dec)
	default:
		if err := dec.Skip(); err != nil {
			return malformed("%s: %v", name, err)
		}
	}
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// decodeOpt decodes nil as a nil pointer and anything else with decode.
func decodeOpt[T any](dec *msgpack.Decoder, decode func(*msgpack.Decoder) (T, error)) (*T, error) {
	if isNil(dec) {
		return nil, dec.DecodeNil()
	}
	v, err := decode(dec)
	if err != nil {
		return nil, err
	}
	return &v, nil
}

// finish checks what only the whole event tells.
func (w *wireBatch) finish(ev *Event) {
	if ev.ExtraKeys != nil && len(ev.ExtraKeys) != len(ev.BlockHashes) {
		// One entry per block, says vLLM; if not, no block can be trusted
		// to have been hashed from its tokens alone.
		for i := range ev.ExtraKeys {
			ev.ExtraKeys[i] = true
		}
		for len(ev.ExtraKeys) < len(ev.BlockHashes) {
			ev.ExtraKeys = append(ev.ExtraKeys, true)
		}
		ev.ExtraKeys = ev.ExtraKeys[:len(ev.BlockHashes)]
	}
}

func (w *wireBatch) decodeHashes(dec *msgpack.Decoder) ([]Hash, error) {
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return nil, malformed("%v", err)
	}
	if n < 0 {
		return nil, nil
	}
	if w.hashes += n; w.hashes > MaxHashesPerBatch {
		return nil, errTooManyHashes
	}
	out := make([]Hash, 0, min(n, w.size))
	for range n {
		h, err := decodeHash(dec)
		if err != nil {
			return nil, err
		}
		out = append(out, h)
	}
	return out, nil
}

func (w *wireBatch) decodeTokens(dec *msgpack.Decoder) ([]uint32, error) {
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return nil, malformed("%v", err)
	}
	if n < 0 {
		return nil, nil
	}
	out := make([]uint32, 0, min(n, w.size))
	for range n {
		neg, v, err := decodeInt(dec)
		if err != nil {
			return nil, err
		}
		if neg || v > math.MaxUint32 {
			return nil, malformed("token id out of range")
		}
		out = append(out, uint32(v))
	}
	return out, nil
}

// decodeExtraKeys returns, per block, whether its entry is set: vLLM sends
// None for a block hashed from its tokens alone and a tuple otherwise.
func (w *wireBatch) decodeExtraKeys(dec *msgpack.Decoder) ([]bool, error) {
	if isNil(dec) {
		return nil, dec.DecodeNil()
	}
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return nil, malformed("%v", err)
	}
	out := make([]bool, 0, min(n, w.size))
	for range n {
		set := !isNil(dec)
		if err := dec.Skip(); err != nil {
			return nil, malformed("%v", err)
		}
		out = append(out, set)
	}
	return out, nil
}

// decodeHash decodes an ExternalBlockHash: an integer or bytes.
func decodeHash(dec *msgpack.Decoder) (Hash, error) {
	c, err := dec.PeekCode()
	if err != nil {
		return Hash{}, malformed("%v", err)
	}
	if msgpcode.IsBin(c) || msgpcode.IsString(c) {
		b, err := dec.DecodeBytes()
		if err != nil {
			return Hash{}, malformed("%v", err)
		}
		if len(b) == 0 || len(b) > MaxHashBytes {
			return Hash{}, malformed("bytes hash of %d bytes", len(b))
		}
		return HashFromBytes(b), nil
	}
	neg, v, err := decodeInt(dec)
	if err != nil {
		return Hash{}, err
	}
	if neg {
		return Hash{kind: hashNeg, n: v}, nil
	}
	return HashFromUint64(v), nil
}

// decodeInt decodes a msgpack integer of any width: neg tells a negative
// value, v holds its two's complement bits.
func decodeInt(dec *msgpack.Decoder) (neg bool, v uint64, err error) {
	c, err := dec.PeekCode()
	if err != nil {
		return false, 0, malformed("%v", err)
	}
	switch {
	case c <= msgpcode.PosFixedNumHigh, c == msgpcode.Uint8, c == msgpcode.Uint16,
		c == msgpcode.Uint32, c == msgpcode.Uint64:
		v, err = dec.DecodeUint64()
	case c >= msgpcode.NegFixedNumLow, c == msgpcode.Int8, c == msgpcode.Int16,
		c == msgpcode.Int32, c == msgpcode.Int64:
		var s int64
		s, err = dec.DecodeInt64()
		neg, v = s < 0, uint64(s)
	default:
		return false, 0, malformed("msgpack code %#x is not an integer", c)
	}
	if err != nil {
		return false, 0, malformed("%v", err)
	}
	return neg, v, nil
}

// decodeOptInt decodes an integer that fits an int, nil being 0.
func decodeOptInt(dec *msgpack.Decoder) (int, error) {
	if isNil(dec) {
		return 0, dec.DecodeNil()
	}
	neg, v, err := decodeInt(dec)
	if err != nil {
		return 0, err
	}
	if s := int64(v); neg != (s < 0) || s < math.MinInt32 || s > math.MaxInt32 {
		return 0, malformed("integer out of range")
	}
	return int(int64(v)), nil
}

func decodeFloat(dec *msgpack.Decoder) (float64, error) {
	c, err := dec.PeekCode()
	if err != nil {
		return 0, malformed("%v", err)
	}
	if c == msgpcode.Float || c == msgpcode.Double {
		f, err := dec.DecodeFloat64()
		if err != nil {
			return 0, malformed("%v", err)
		}
		return f, nil
	}
	neg, v, err := decodeInt(dec)
	if err != nil {
		return 0, err
	}
	if neg {
		return float64(int64(v)), nil
	}
	return float64(v), nil
}

func decodeStr(dec *msgpack.Decoder) (string, error) {
	c, err := dec.PeekCode()
	if err != nil {
		return "", malformed("%v", err)
	}
	if !msgpcode.IsString(c) && !msgpcode.IsBin(c) {
		return "", malformed("msgpack code %#x is not a string", c)
	}
	s, err := dec.DecodeString()
	if err != nil {
		return "", malformed("%v", err)
	}
	return s, nil
}

func decodeKey(dec *msgpack.Decoder) (string, error) {
	k, err := decodeStr(dec)
	if err != nil {
		return "", fmt.Errorf("map key: %w", err)
	}
	return k, nil
}

func skipN(dec *msgpack.Decoder, n int) error {
	for range n {
		if err := dec.Skip(); err != nil {
			return malformed("%v", err)
		}
	}
	return nil
}

func isNil(dec *msgpack.Decoder) bool {
	c, err := dec.PeekCode()
	return err == nil && c == msgpcode.Nil
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}
