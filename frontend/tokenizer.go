package frontend

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"unicode"

	"github.com/maypok86/otter/v2"
	"github.com/tiktoken-go/tokenizer"
)

// Tokenizer turns text into token ids. Implementations are safe for
// concurrent use.
type Tokenizer interface {
	// Encode tokenizes text.
	Encode(text string) ([]uint32, error)
	// ApplyChatTemplate renders and tokenizes a conversation, ending with the
	// assistant's turn prompt.
	ApplyChatTemplate(msgs []ChatTurn) ([]uint32, error)
	// VocabSize bounds valid token ids.
	VocabSize() int
	// Name identifies the vocabulary.
	Name() string
}

// ChatRenderer is implemented by a Tokenizer that renders a conversation
// with the chat template's options, as vLLM's /tokenize takes them; the
// frontend finds it by a type assertion on its Tokenizer (without it, a
// chat not ending with the generation prompt is refused). Like the
// Tokenizer, safe for concurrent use.
type ChatRenderer interface {
	// RenderChat tokenizes msgs; generationPrompt ends them with the
	// assistant's turn prompt, continueFinal leaves the last message open
	// for the model to continue (never both).
	RenderChat(msgs []ChatTurn, generationPrompt, continueFinal bool) ([]uint32, error)
}

// Detokenizer is implemented by a Tokenizer that turns token ids back
// into text; the frontend finds it by a type assertion on its Tokenizer
// (without it, /detokenize answers 501 and /tokenize's token strings are
// empty). Like the Tokenizer, safe for concurrent use.
type Detokenizer interface {
	// Decode returns the text of ids; an id outside the vocabulary is an
	// error wrapping ErrUnknownToken.
	Decode(ids []uint32) (string, error)
}

// ErrUnknownToken is wrapped by a Detokenizer's error for an id outside
// its vocabulary.
var ErrUnknownToken = errors.New("frontend: unknown token id")

// ChatTurn is one message of a conversation, reduced to text.
type ChatTurn struct {
	Role    string
	Content string
}

// o200k chat-format token ids (the GPT-4o ChatML markers of tiktoken's
// o200k_base): <|im_start|>, <|im_end|>, <|im_sep|>.
const (
	imStart   = 200264
	imEnd     = 200265
	imSep     = 200266
	o200kSize = 201088
)

// BPETokenizer is the o200k_base byte-level BPE tokenizer (tiktoken's
// vocabulary, embedded in the binary) with GPT-4o's ChatML chat template:
//
//	<|im_start|>{role}<|im_sep|>{content}<|im_end|> … <|im_start|>assistant<|im_sep|>
//
// The template encodes each role and each message on its own, so a
// message's ids do not depend on its neighbours: they are cached (up to
// tokenCacheBytes of text and ids). A conversation sends every earlier
// message again with each turn; only the new one is tokenized.
type BPETokenizer struct {
	codec tokenizer.Codec
	cache *otter.Cache[string, []uint32] // message text -> its ids; the slices are never modified
}

// tokenCacheBytes bounds the memory of the tokenizer's cache: an entry
// weighs its text, 4 bytes per id and tokenCacheEntryBytes.
const tokenCacheBytes = 64 << 20

// tokenCacheEntryBytes is what an entry costs beyond its text and ids: the
// cache's node, its map slot, the string and slice headers, size-class
// rounding. Measured: 246 bytes of heap an entry for 131 of text and ids
// (200k short messages); weighed without it, the cache held twice its
// bound (123 MB in a soak run) and four times with short messages.
const tokenCacheEntryBytes = 128

// NewBPETokenizer loads the embedded o200k_base vocabulary.
func NewBPETokenizer() (*BPETokenizer, error) {
	c, err := tokenizer.Get(tokenizer.O200kBase)
	if err != nil {
		return nil, fmt.Errorf("frontend: load o200k_base tokenizer: %w", err)
	}
	cache, err := otter.New(&otter.Options[string, []uint32]{
		MaximumWeight: tokenCacheBytes,
		Weigher: func(text string, ids []uint32) uint32 {
			return uint32(min(len(text)+4*len(ids)+tokenCacheEntryBytes, math.MaxUint32))
		},
		// Eviction runs on the goroutine that writes: the cache starts none.
		Executor: func(fn func()) { fn() },
	})
	if err != nil {
		return nil, fmt.Errorf("frontend: token cache: %w", err)
	}
	return &BPETokenizer{codec: c, cache: cache}, nil
}

// Name implements Tokenizer.
func (t *BPETokenizer) Name() string { return "o200k_base" }

// VocabSize implements Tokenizer.
func (t *BPETokenizer) VocabSize() int { return o200kSize }

// Encode implements Tokenizer.
func (t *BPETokenizer) Encode(text string) ([]uint32, error) {
	return t.encodeAppend(nil, text)
}

func (t *BPETokenizer) encodeAppend(dst []uint32, text string) ([]uint32, error) {
	for _, part := range splitWhitespaceRuns(text) {
		ids, _, err := t.codec.Encode(part)
		if err != nil {
			return nil, fmt.Errorf("frontend: tokenize: %w", err)
		}
		for _, id := range ids {
			dst = append(dst, uint32(id))
		}
	}
	return dst, nil
}

// maxWhitespaceRun bounds the whitespace the BPE encoder sees in one run.
// Its pre-tokenizer takes a run of mixed spaces and newlines (" \n \n …")
// as one piece and merges it in time quadratic in its length: 64 KiB took
// 2.4 s, the 4 MiB a body may hold would take hours, on the request path.
const maxWhitespaceRun = 256

// splitWhitespaceRuns cuts text inside whitespace runs longer than
// maxWhitespaceRun, every maxWhitespaceRun bytes of the run, so each part
// is encoded on its own. Text without such a run is one part, encoded as
// it always was; a longer run is tokenized a little differently at its
// cuts — still exactly its text, the same way every time.
func splitWhitespaceRuns(text string) []string {
	if text == "" {
		return nil
	}
	var parts []string
	start, run := 0, -1 // the current part; the current run's start (or its last cut)
	for i, r := range text {
		if !unicode.IsSpace(r) {
			run = -1
			continue
		}
		if run < 0 {
			run = i
		}
		if i-run >= maxWhitespaceRun {
			parts = append(parts, text[start:i])
			start, run = i, i
		}
	}
	return append(parts, text[start:])
}

// encodeCached is encodeAppend through the cache.
func (t *BPETokenizer) encodeCached(dst []uint32, text string) ([]uint32, error) {
	if ids, ok := t.cache.GetIfPresent(text); ok {
		return append(dst, ids...), nil
	}
	n := len(dst)
	dst, err := t.encodeAppend(dst, text)
	if err != nil {
		return nil, err
	}
	t.cache.Set(strings.Clone(text), slices.Clone(dst[n:]))
	return dst, nil
}

// ApplyChatTemplate implements Tokenizer.
func (t *BPETokenizer) ApplyChatTemplate(msgs []ChatTurn) ([]uint32, error) {
	return t.RenderChat(msgs, true, false)
}

// RenderChat implements ChatRenderer: the template, ending with the
// assistant's turn prompt when generationPrompt is set, or with the last
// message left open (no <|im_end|>) when continueFinal is.
func (t *BPETokenizer) RenderChat(msgs []ChatTurn, generationPrompt, continueFinal bool) ([]uint32, error) {
	out := make([]uint32, 0, 16)
	var err error
	for i, m := range msgs {
		out = append(out, imStart)
		if out, err = t.encodeCached(out, strings.ToLower(m.Role)); err != nil {
			return nil, err
		}
		out = append(out, imSep)
		if out, err = t.encodeCached(out, m.Content); err != nil {
			return nil, err
		}
		if continueFinal && i == len(msgs)-1 {
			return out, nil
		}
		out = append(out, imEnd)
	}
	if !generationPrompt {
		return out, nil
	}
	out = append(out, imStart)
	if out, err = t.encodeAppend(out, "assistant"); err != nil {
		return nil, err
	}
	return append(out, imSep), nil
}

// chatMarkers names the chat template's special tokens, which the BPE
// vocabulary does not hold.
var chatMarkers = map[uint32]string{imStart: "<|im_start|>", imEnd: "<|im_end|>", imSep: "<|im_sep|>"}

// Decode implements Detokenizer: the text of ids, the chat markers by
// their names, a token that is part of a UTF-8 sequence as its bytes.
func (t *BPETokenizer) Decode(ids []uint32) (string, error) {
	var b strings.Builder
	run := make([]uint, 0, len(ids))
	flush := func() error {
		if len(run) == 0 {
			return nil
		}
		text, err := t.codec.Decode(run) // fails only for an id it lacks
		if err != nil {
			return fmt.Errorf("%w: %w (the %s vocabulary)", ErrUnknownToken, err, t.Name())
		}
		b.WriteString(text)
		run = run[:0]
		return nil
	}
	for _, id := range ids {
		if name, ok := chatMarkers[id]; ok {
			if err := flush(); err != nil {
				return "", err
			}
			b.WriteString(name)
			continue
		}
		run = append(run, uint(id))
	}
	if err := flush(); err != nil {
		return "", err
	}
	return b.String(), nil
}
