package frontend

import (
	"fmt"
	"strings"
	"testing"
)

// benchChatBody is a chat request of turns messages of about 400 bytes
// each, with the sampling fields a benchmark client sends.
func benchChatBody(turns int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"kvbus-sim","stream":true,"stream_options":{"include_usage":true},"max_tokens":64,"temperature":0.7,"seed":7,"messages":[`)
	for i := range turns {
		if i > 0 {
			b.WriteByte(',')
		}
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		fmt.Fprintf(&b, `{"role":%q,"content":%q}`, role, strings.Repeat(fmt.Sprintf("turn %d says something about the weather. ", i), 10))
	}
	b.WriteString(`]}`)
	return []byte(b.String())
}

func BenchmarkParseChat(b *testing.B) {
	for _, turns := range []int{1, 16} {
		body := benchChatBody(turns)
		b.Run(fmt.Sprintf("turns=%d", turns), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := parseChat(body, parseOptions{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkParseCompletionTokenIDs(b *testing.B) {
	var sb strings.Builder
	sb.WriteString(`{"model":"kvbus-sim","max_tokens":16,"prompt":[`)
	for i := range 4000 {
		if i > 0 {
			sb.WriteByte(',')
		}
		fmt.Fprintf(&sb, "%d", i%testVocab)
	}
	sb.WriteString(`]}`)
	body := []byte(sb.String())
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := parseCompletion(body, parseOptions{vocab: testVocab}); err != nil {
			b.Fatal(err)
		}
	}
}
