package replay

import (
	"fmt"

	"github.com/kvbus/kvbus/scheduler"
	"github.com/zeebo/xxh3"
)

// InferSessions gives sessions to a trace that has none: a request
// continues the session of the earlier request with the longest prompt
// whose full blocks (blockTokens each) its prompt starts with, the latest
// of equal ones; otherwise it starts a session. Captured requests of two
// models, or two cache salts, share no prefix, as they share no cache.
func InferSessions(t *Trace, blockTokens int) {
	type key = uint64
	owner := map[key]string{} // hash of a full-block prefix → session
	next := 0
	for i := range t.Items {
		it := &t.Items[i]
		if it.SessionID != "" {
			continue
		}
		full := len(it.Prompt) / blockTokens
		prefixes := make([]uint64, full)
		var h uint64
		if it.Request != nil {
			h = scheduler.PromptSeed(it.Request.Model, it.Request.LoRAName, it.Request.CacheSalt)
		}
		for b := range full {
			h = xxh3.HashSeed(u32Bytes(it.Prompt[b*blockTokens:(b+1)*blockTokens]), h)
			prefixes[b] = h
		}
		for b := full - 1; b >= 0; b-- {
			if s, ok := owner[prefixes[b]]; ok {
				it.SessionID = s
				break
			}
		}
		if it.SessionID == "" {
			next++
			it.SessionID = fmt.Sprintf("inferred-%d", next)
		}
		if full > 0 {
			owner[prefixes[full-1]] = it.SessionID
		}
	}
}

func u32Bytes(s []uint32) []byte {
	b := make([]byte, 4*len(s))
	for i, v := range s {
		b[4*i], b[4*i+1], b[4*i+2], b[4*i+3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
	}
	return b
}
