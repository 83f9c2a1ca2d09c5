package fakeengine

import (
	"encoding/binary"
	"hash/fnv"
	"strings"
	"unicode"
)

// VocabSize is the size of the fake tokenizer's vocabulary: token ids are
// below it. It is above 2^17, so that about a quarter of the word ids
// exceed 200,000, as in real vocabularies (Qwen's has 151,646 ids,
// Gemma's 262,144).
const VocabSize = 1 << 18

// Special token ids. Word ids start at firstWordID.
const (
	// TokenBOS begins a sequence: the chat template starts with it, and a
	// text prompt gets it when add_special_tokens is true (the default of
	// /v1/completions and of /tokenize with a prompt).
	TokenBOS uint32 = 1
	// TokenEOT ends a chat message in the template, and is the fake
	// model's end-of-sequence token: a reply that ends by itself ends with
	// it (finish_reason "stop"), as vLLM counts the EOS token among the
	// completion tokens without putting it in the text.
	TokenEOT uint32 = 2
	// Role markers open a message in the chat template; TokenAssistant is
	// also the generation prompt.
	TokenSystem    uint32 = 3
	TokenUser      uint32 = 4
	TokenAssistant uint32 = 5
	TokenTool      uint32 = 6
	// TokenOtherRole opens a message of any other role.
	TokenOtherRole uint32 = 7

	firstWordID uint32 = 16
)

// specialString returns a special token's string, for /tokenize's
// return_token_strs.
func specialString(id uint32) string {
	switch id {
	case TokenBOS:
		return "<|bos|>"
	case TokenEOT:
		return "<|end|>"
	case TokenSystem:
		return "<|system|>"
	case TokenUser:
		return "<|user|>"
	case TokenAssistant:
		return "<|assistant|>"
	case TokenTool:
		return "<|tool|>"
	}
	return "<|role|>"
}

// Tokenize splits text into pieces, each a maximal run of letters and
// digits or a single other non-space character, whitespace separating
// pieces and producing none, and maps each piece to a word id derived from
// its FNV-1a hash, in [16, VocabSize). It is deterministic and
// prefix-stable at whitespace: Tokenize(a+" "+b) is Tokenize(a) followed by
// Tokenize(b). It never returns special tokens. With addSpecial, TokenBOS
// comes first (vLLM's add_special_tokens).
func Tokenize(text string, addSpecial bool) []uint32 {
	ids, _ := tokenize(text, addSpecial, false)
	return ids
}

// tokenize is Tokenize, also returning the pieces when withStrs.
func tokenize(text string, addSpecial, withStrs bool) ([]uint32, []string) {
	var ids []uint32
	var strs []string
	if addSpecial {
		ids = append(ids, TokenBOS)
		if withStrs {
			strs = append(strs, specialString(TokenBOS))
		}
	}
	start := -1 // start of the current run of letters and digits
	flush := func(end int) {
		if start >= 0 {
			ids = append(ids, wordID(text[start:end]))
			if withStrs {
				strs = append(strs, text[start:end])
			}
			start = -1
		}
	}
	for i, r := range text {
		switch {
		case unicode.IsLetter(r) || unicode.IsDigit(r):
			if start < 0 {
				start = i
			}
		case unicode.IsSpace(r):
			flush(i)
		default:
			flush(i)
			piece := string(r)
			ids = append(ids, wordID(piece))
			if withStrs {
				strs = append(strs, piece)
			}
		}
	}
	flush(len(text))
	return ids, strs
}

// wordID maps a piece of text to its token id.
func wordID(piece string) uint32 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(piece))
	return firstWordID + uint32(h.Sum64()%uint64(VocabSize-firstWordID))
}

// Message is one chat message as the fake chat template sees it.
type Message struct {
	Role    string
	Content string
}

// roleToken returns the marker opening a message of role.
func roleToken(role string) uint32 {
	switch role {
	case "system", "developer":
		return TokenSystem
	case "user":
		return TokenUser
	case "assistant":
		return TokenAssistant
	case "tool":
		return TokenTool
	}
	return TokenOtherRole
}

// ChatTemplate renders messages to token ids as the fake model's chat
// template: TokenBOS, then per message its role marker, Tokenize(content)
// and TokenEOT, then, with addGenerationPrompt, TokenAssistant. With
// continueFinal the last message is left open (no TokenEOT) and no
// generation prompt is added, as vLLM's continue_final_message. This is
// what /v1/chat/completions prefills and what /tokenize with messages
// returns, as vLLM tokenizes the rendered template without adding special
// tokens (add_special_tokens defaults to false for chat requests;
// addSpecial true prepends another TokenBOS).
func ChatTemplate(msgs []Message, addGenerationPrompt, continueFinal, addSpecial bool) []uint32 {
	ids, _ := chatTemplate(msgs, addGenerationPrompt, continueFinal, addSpecial, false)
	return ids
}

func chatTemplate(msgs []Message, addGenerationPrompt, continueFinal, addSpecial, withStrs bool) ([]uint32, []string) {
	var ids []uint32
	var strs []string
	add := func(id uint32) {
		ids = append(ids, id)
		if withStrs {
			strs = append(strs, specialString(id))
		}
	}
	if addSpecial {
		add(TokenBOS)
	}
	add(TokenBOS)
	for i, m := range msgs {
		add(roleToken(m.Role))
		t, s := tokenize(m.Content, false, withStrs)
		ids = append(ids, t...)
		strs = append(strs, s...)
		if !(continueFinal && i == len(msgs)-1) {
			add(TokenEOT)
		}
	}
	if addGenerationPrompt && !continueFinal {
		add(TokenAssistant)
	}
	return ids, strs
}

// replyVocabulary are the words the fake model answers with.
const replyVocabulary = "alpha bravo charlie delta echo foxtrot golf hotel " +
	"india juliett kilo lima mike november oscar papa"

// Reply returns the fake model's reply to a prompt of token ids: n words
// chosen by a hash of the prompt, their text (words joined by single
// spaces) and their token ids (Tokenize of each word). A reply that ends by
// itself is followed by TokenEOT, which is not in the text.
func Reply(prompt []uint32, n int) (words []string, ids []uint32) {
	h := fnv.New64a()
	var b [4]byte
	for _, t := range prompt {
		binary.BigEndian.PutUint32(b[:], t)
		_, _ = h.Write(b[:])
	}
	start := h.Sum64()
	replyWords := strings.Fields(replyVocabulary)
	words = make([]string, n)
	ids = make([]uint32, n)
	for i := range n {
		w := replyWords[(start+uint64(i))%uint64(len(replyWords))]
		words[i] = w
		ids[i] = wordID(w)
	}
	return words, ids
}

// ReplyText joins reply words as the reply's text.
func ReplyText(words []string) string { return strings.Join(words, " ") }
