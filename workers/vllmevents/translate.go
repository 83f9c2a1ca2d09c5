package vllmevents

import (
	"errors"
	"fmt"

	"github.com/kvbus/kvbus/messages"
)

// HashFunc returns kvbus's hash of one block of tokens chained from its
// parent's kvbus hash, parent being nil for the first block of a prompt.
// For kvbus's scheme (scheduler.HashBlocks) it is
//
//	func(parent *uint64, tokens []uint32) uint64 {
//		prev := scheduler.HashSeed(model)
//		if parent != nil {
//			prev = *parent
//		}
//		return scheduler.HashBlocks(nil, prev, tokens, len(tokens))[0]
//	}
//
// since HashBlocks' hash of block i depends only on hash i-1 and the
// block's tokens. It must not retain tokens.
type HashFunc func(parent *uint64, tokens []uint32) uint64

// DefaultMaxBlocks is TranslatorConfig.MaxBlocks' default: a million
// blocks, 16M tokens at a block size of 16, more than any single GPU's
// cache holds; at most about 150 MB (see TranslatorConfig.MaxBlocks).
const DefaultMaxBlocks = 1 << 20

// MediumGPU is vLLM's medium of its GPU cache (MEDIUM_GPU in
// vllm/distributed/kv_events.py).
const MediumGPU = "GPU"

// TranslatorConfig configures a Translator.
type TranslatorConfig struct {
	// BlockSize is kvbus's block size (its --block-size); the engine's
	// must be the same.
	BlockSize int
	// Hash is kvbus's chained block hash of the model served.
	Hash HashFunc
	// MaxBlocks bounds the engine-to-kvbus hash map, which mirrors the
	// engine's cache: a 32-byte Hash key and a 16-byte entry per map slot,
	// plus the 32 bytes of a sha256 hash, measured at 112 bytes per block
	// with integer hashes and 144 with sha256 ones (a million blocks, Go
	// 1.26). Past it, the Translator forgets an arbitrary block and emits
	// its removal, so that the kvbus index never holds a block the
	// Translator cannot remove. Zero means DefaultMaxBlocks.
	MaxBlocks int
	// Medium is the medium whose blocks are translated; events of other
	// media (an offloading connector's "CPU") are ignored, since removing a
	// block from one medium would otherwise remove it from kvbus while the
	// GPU still holds it. Events without a medium count as MediumGPU.
	// Empty means MediumGPU.
	Medium string
	// Group is the KV cache group whose events are translated (vLLM's
	// group_idx, absent meaning 0); others are ignored.
	Group int
}

// Validate checks c: a positive block size, a hash function, a max
// blocks not negative.
func (c TranslatorConfig) Validate() error {
	switch {
	case c.BlockSize <= 0:
		return fmt.Errorf("%w: block size %d", ErrConfig, c.BlockSize)
	case c.Hash == nil:
		return fmt.Errorf("%w: no hash function", ErrConfig)
	case c.MaxBlocks < 0:
		return fmt.Errorf("%w: max blocks %d", ErrConfig, c.MaxBlocks)
	}
	return nil
}

// TranslatorStats are a Translator's counters since it was made.
type TranslatorStats struct {
	Stored  int // kvbus blocks emitted as stored
	Removed int // kvbus blocks emitted as removed (evictions included)
	Cleared int // AllBlocksCleared events and resets
	// UnknownParent counts BlockStored events skipped because their parent
	// is not mapped.
	UnknownParent int
	// Keyed counts blocks skipped because vLLM hashed them with more than
	// their tokens (LoRA, multimodal inputs, cache salt), which kvbus's
	// hash cannot express, and the blocks after them in their event.
	Keyed int
	// Ignored counts events of another medium or KV cache group.
	Ignored int
	// BadBlockSize counts BlockStored events skipped for a block size
	// other than kvbus's; Malformed those whose tokens do not fill their
	// blocks.
	BadBlockSize int
	Malformed    int
	// UnknownRemoved counts removed engine hashes that were not mapped
	// (blocks this Translator skipped or never saw).
	UnknownRemoved int
	// Evicted counts blocks forgotten to stay within MaxBlocks.
	Evicted int
	// Conflicts counts engine hashes stored again with another kvbus hash
	// (the first is kept).
	Conflicts int
}

// Translator turns vLLM KV events into kvbus KV events. kvbus hashes blocks
// itself, from their tokens, so the Translator computes each stored
// block's kvbus hash chained from its parent's, which it finds in a map
// from engine hashes to kvbus hashes kept from earlier events (as llm-d's
// KV indexer does). A Translator is not safe for concurrent use: one
// goroutine (a Subscriber's handler) owns it.
type Translator struct {
	cfg    TranslatorConfig
	blocks map[Hash]entry
	stats  TranslatorStats
}

// entry is a mapped engine block. vLLM does not deduplicate blocks: two
// physical blocks may hold the same hash, each stored and removed with its
// own event (vllm/v1/core/block_pool.py), so refs counts them and the kvbus
// block is removed with the last.
type entry struct {
	kv   uint64
	refs uint32
}

// NewTranslator returns a Translator with an empty map.
func NewTranslator(cfg TranslatorConfig) (*Translator, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.MaxBlocks == 0 {
		cfg.MaxBlocks = DefaultMaxBlocks
	}
	if cfg.Medium == "" {
		cfg.Medium = MediumGPU
	}
	return &Translator{cfg: cfg, blocks: map[Hash]entry{}}, nil
}

// Len returns the number of engine blocks mapped.
func (t *Translator) Len() int { return len(t.blocks) }

// Stats returns the Translator's counters.
func (t *Translator) Stats() TranslatorStats { return t.stats }

// Reset forgets every mapped block and returns the kvbus events that say
// so: call it when the engine's state is unknown (a gap in the event
// stream, an engine restart) and publish what it returns.
func (t *Translator) Reset() []messages.KVEvent {
	clear(t.blocks)
	t.stats.Cleared++
	return []messages.KVEvent{{Type: messages.EventAllBlocksCleared}}
}

// Translate returns the kvbus events for b's events, in order. What it
// cannot translate it skips, and reports in the returned error, which
// joins at most one error per kind (wrapping ErrBlockSize,
// ErrUnknownParent or ErrMalformed, with counts); the events returned are
// valid to publish either way. The returned events own their slices.
//
//   - BlockStored: each block gets kvbus hash Hash(parent, its tokens),
//     chained from the kvbus hash of the event's parent. A parent the map
//     lacks cannot be chained from, and treating the block as the start of
//     a prompt would claim a prefix the engine does not hold, so the event
//     is skipped (ErrUnknownParent) and its blocks, unmapped, make their
//     descendants unknown too: the Translator only indexes chains it saw
//     from their root. So do blocks that vLLM hashed with a LoRA adapter or
//     extra keys, which a token hash cannot tell apart.
//   - BlockRemoved: each mapped block loses a reference; the kvbus hashes
//     of those that lose their last are removed.
//   - AllBlocksCleared: the map is cleared and the event passed on.
func (t *Translator) Translate(b *Batch) ([]messages.KVEvent, error) {
	var (
		out     []messages.KVEvent
		errs    translateErrors
		evicted []uint64
	)
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Type {
		case messages.EventBlockStored:
			if !t.tracked(ev) {
				t.stats.Ignored++
				continue
			}
			stored, err := t.stored(ev, &evicted)
			errs.add(err)
			if stored != nil {
				out = append(out, *stored)
			}
			// After the store: a block of this very event may have been
			// forgotten, and must not stay in the index.
			if len(evicted) > 0 {
				out = append(out, messages.KVEvent{Type: messages.EventBlockRemoved, BlockHashes: evicted, Medium: t.cfg.Medium})
				evicted = nil
			}
		case messages.EventBlockRemoved:
			if !t.tracked(ev) {
				t.stats.Ignored++
				continue
			}
			if removed := t.removed(ev); len(removed) > 0 {
				out = append(out, messages.KVEvent{Type: messages.EventBlockRemoved, BlockHashes: removed, Medium: t.cfg.Medium})
			}
		case messages.EventAllBlocksCleared:
			out = append(out, t.Reset()...)
		}
	}
	return out, errs.join()
}

// tracked reports whether ev is of the configured medium and group.
func (t *Translator) tracked(ev *Event) bool {
	medium := ev.Medium
	if medium == "" {
		medium = MediumGPU
	}
	group := 0
	if ev.GroupIdx != nil {
		group = *ev.GroupIdx
	}
	return medium == t.cfg.Medium && group == t.cfg.Group
}

// stored maps a BlockStored event's blocks and returns its kvbus event, or
// nil if no block could be mapped; blocks forgotten to make room are
// appended to evicted.
func (t *Translator) stored(ev *Event, evicted *[]uint64) (*messages.KVEvent, error) {
	n := len(ev.BlockHashes)
	bs := ev.BlockSize
	if bs == 0 && n > 0 && len(ev.TokenIDs)%n == 0 {
		bs = len(ev.TokenIDs) / n // an event without block_size
	}
	if bs != t.cfg.BlockSize {
		t.stats.BadBlockSize++
		return nil, &blockSizeError{engine: bs, kvbus: t.cfg.BlockSize}
	}
	if len(ev.TokenIDs) != n*bs {
		t.stats.Malformed++
		return nil, fmt.Errorf("%w: BlockStored of %d blocks of %d tokens has %d tokens", ErrMalformed, n, bs, len(ev.TokenIDs))
	}
	if ev.LoRAID != nil || ev.LoRAName != nil {
		t.stats.Keyed += n
		return nil, nil
	}
	var parent *uint64
	if ev.Parent != nil {
		e, ok := t.blocks[*ev.Parent]
		switch {
		case ok:
			parent = &e.kv
		case *ev.Parent == HashFromUint64(0):
			// llm-d's simulator sends parent_block_hash 0, not None, for
			// a chain that starts a prompt (llm-d's indexer reads None as
			// 0): a root, unless 0 is a block this rank heard of.
		default:
			t.stats.UnknownParent++
			return nil, fmt.Errorf("%w %v", ErrUnknownParent, *ev.Parent)
		}
	}
	for i := range ev.ExtraKeys {
		if ev.ExtraKeys[i] {
			// The block and its descendants in this event are keyed.
			t.stats.Keyed += n - i
			n = i
			break
		}
	}
	if n == 0 {
		return nil, nil
	}
	out := &messages.KVEvent{
		Type:        messages.EventBlockStored,
		BlockHashes: make(messages.BlockHashes, 0, n),
		TokenIDs:    append(messages.TokenIDs(nil), ev.TokenIDs[:n*bs]...),
		BlockSize:   bs,
		Medium:      t.cfg.Medium,
	}
	if parent != nil {
		p := *parent
		out.ParentBlockHash = &p
	}
	prev := parent
	for i, h := range ev.BlockHashes[:n] {
		kv := t.cfg.Hash(prev, ev.TokenIDs[i*bs:(i+1)*bs])
		if e, ok := t.blocks[h]; ok {
			if e.kv != kv {
				t.stats.Conflicts++
				kv = e.kv
			}
			e.refs++
			t.blocks[h] = e
		} else {
			t.makeRoom(evicted)
			t.blocks[h] = entry{kv: kv, refs: 1}
		}
		out.BlockHashes = append(out.BlockHashes, kv)
		prev = &kv
	}
	t.stats.Stored += n
	return out, nil
}

// makeRoom forgets an arbitrary mapped block while the map is full,
// appending its kvbus hash to evicted.
func (t *Translator) makeRoom(evicted *[]uint64) {
	for len(t.blocks) >= t.cfg.MaxBlocks {
		for h, e := range t.blocks {
			delete(t.blocks, h)
			*evicted = append(*evicted, e.kv)
			t.stats.Evicted++
			t.stats.Removed++
			break
		}
	}
}

// removed unmaps a BlockRemoved event's blocks and returns the kvbus hashes
// of those that lost their last reference.
func (t *Translator) removed(ev *Event) []uint64 {
	var out []uint64
	for _, h := range ev.BlockHashes {
		e, ok := t.blocks[h]
		if !ok {
			t.stats.UnknownRemoved++
			continue
		}
		if e.refs > 1 {
			e.refs--
			t.blocks[h] = e
			continue
		}
		delete(t.blocks, h)
		out = append(out, e.kv)
	}
	t.stats.Removed += len(out)
	return out
}

type blockSizeError struct{ engine, kvbus int }

func (e *blockSizeError) Error() string {
	return fmt.Sprintf("%v: the engine's block size is %d, kvbus's is %d: set kvbus's --block-size to %d",
		ErrBlockSize, e.engine, e.kvbus, e.engine)
}

func (e *blockSizeError) Unwrap() error { return ErrBlockSize }

// translateErrors keeps the first error of each kind and counts them.
type translateErrors struct {
	first []error
	count []int
}

func (te *translateErrors) add(err error) {
	if err == nil {
		return
	}
	for i, f := range te.first {
		if sameKind(f, err) {
			te.count[i]++
			return
		}
	}
	te.first = append(te.first, err)
	te.count = append(te.count, 1)
}

func sameKind(a, b error) bool {
	for _, s := range []error{ErrBlockSize, ErrUnknownParent, ErrMalformed} {
		if errors.Is(a, s) {
			return errors.Is(b, s)
		}
	}
	return false
}

func (te *translateErrors) join() error {
	errs := make([]error, len(te.first))
	for i, err := range te.first {
		if te.count[i] > 1 {
			err = fmt.Errorf("%w (%d events)", err, te.count[i])
		} else {
			err = fmt.Errorf("%w (1 event)", err)
		}
		errs[i] = err
	}
	return errors.Join(errs...)
}
