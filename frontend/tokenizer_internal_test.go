package frontend

import (
	"slices"
	"strings"
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

// TestLongWhitespaceRunsAreSplit: runs of mixed spaces and newlines, which
// the BPE encoder merges in quadratic time (256 KiB of " \n" took ~40 s),
// are encoded in parts: the ids still decode to exactly the text, the same
// ids every time, and text without such a run is encoded as one part.
func TestLongWhitespaceRunsAreSplit(t *testing.T) {
	tok, err := NewBPETokenizer()
	if err != nil {
		t.Fatal(err)
	}
	decode := func(ids []uint32) string {
		t.Helper()
		in := make([]uint, len(ids))
		for i, id := range ids {
			in[i] = uint(id)
		}
		text, err := tok.codec.Decode(in)
		if err != nil {
			t.Fatal(err)
		}
		return text
	}
	for _, text := range []string{
		strings.Repeat(" \n", 128<<10),
		"before" + strings.Repeat("\t \n", 1000) + "after\u3000\u3000" + strings.Repeat("\u3000 ", 500) + "end",
	} {
		ids, err := tok.Encode(text)
		if err != nil {
			t.Fatal(err)
		}
		if got := decode(ids); got != text {
			t.Errorf("%d bytes of text decode to %d different bytes", len(text), len(got))
		}
		if again, _ := tok.Encode(text); !slices.Equal(again, ids) {
			t.Error("the same text gave other ids")
		}
	}
	for _, text := range []string{"", "Hello there!", "  spaces  ", strings.Repeat(" ", maxWhitespaceRun), "a\n\n\nb"} {
		if parts := splitWhitespaceRuns(text); len(parts) > 1 {
			t.Errorf("%q split in %d parts", text, len(parts))
		}
	}
	if parts := splitWhitespaceRuns(strings.Repeat(" ", 3*maxWhitespaceRun+1)); len(parts) != 4 || strings.Join(parts, "") != strings.Repeat(" ", 3*maxWhitespaceRun+1) {
		t.Errorf("a run of 3×%d+1 spaces split in %d parts", maxWhitespaceRun, len(parts))
	}
}
