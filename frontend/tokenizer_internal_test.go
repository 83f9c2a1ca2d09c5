package frontend

import (
	"slices"
	"testing"
)

// TestTokenCacheGivesTheSameIDs tokenizes a growing conversation turn by
// turn, as clients send it, and checks every prompt against the template
// encoded without the cache.
func TestTokenCacheGivesTheSameIDs(t *testing.T) {
	tok, err := NewBPETokenizer()
	if err != nil {
		t.Fatal(err)
	}
	uncached := func(msgs []ChatTurn) []uint32 {
		var out []uint32
		for _, m := range msgs {
			out = append(out, imStart)
			out, _ = tok.encodeAppend(out, m.Role)
			out = append(out, imSep)
			out, _ = tok.encodeAppend(out, m.Content)
			out = append(out, imEnd)
		}
		out = append(out, imStart)
		out, _ = tok.encodeAppend(out, "assistant")
		return append(out, imSep)
	}
	var conv []ChatTurn
	for i, text := range []string{"Hello there!", "Hi! How can I help?", "Tell me about KV caches.", "Hello there!", "", "  spaces  "} {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		conv = append(conv, ChatTurn{Role: role, Content: text})
		got, err := tok.ApplyChatTemplate(conv)
		if err != nil {
			t.Fatal(err)
		}
		if want := uncached(conv); !slices.Equal(got, want) {
			t.Fatalf("turn %d: cached template %v, uncached %v", i, got, want)
		}
	}
	if n := tok.cache.EstimatedSize(); n < 5 {
		t.Fatalf("the cache holds %d texts after six turns: it is not used", n)
	}
}
