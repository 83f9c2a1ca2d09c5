package workers

import (
	"strings"
	"testing"
)

// FuzzParseSlotKind: a slot's token comes from the bucket, written by any
// worker (any kvbus version, any --model): parseSlotKind never panics, and
// reads back the model and size slotToken wrote, whatever the model holds.
func FuzzParseSlotKind(f *testing.F) {
	f.Add("w", "NUIDCLAIM", "m", 1, []byte("w#NUIDCLAIM#m#1"))
	f.Add("host-1", "NUIDCLAIM", "org/m#v2", 2, []byte("w#NUIDCLAIM#m"))
	f.Add("h", "c", "", 0, []byte("w#NUIDCLAIM"))
	f.Add("h", "c", "a#8", 4, []byte("w#c#a#b#8"))
	f.Add("h", "c", "meta-llama/Llama-3.1-8B-Instruct", 8, []byte(""))
	f.Fuzz(func(t *testing.T, owner, claim, model string, size int, raw []byte) {
		_ = parseSlotKind(raw) // any bytes: no panic
		if strings.Contains(owner, "#") || strings.Contains(claim, "#") || size < 0 {
			return // a host name and a nuid hold no '#'; --tp-size is positive
		}
		want := slotKind{model, size}
		token := slotToken(owner, claim, want)
		if got := parseSlotKind([]byte(token)); got != want {
			t.Errorf("parseSlotKind(%q) = %+v, want %+v", token, got, want)
		}
	})
}
