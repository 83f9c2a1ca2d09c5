package replay

import (
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"time"
)

type traceLabLine struct {
	SessionID    string `json:"session_id"`
	RoundIndex   *int   `json:"round_index"`
	InputTotal   *int   `json:"input_tokens_total"`
	PrefixTokens *int   `json:"prefix_tokens"`
	NewlyAppend  *int   `json:"newly_append_tokens"`
	OutputTokens *int   `json:"output_tokens"`
	TimingEvents []struct {
		Timestamp string `json:"timestamp"`
	} `json:"timing_events"`
}

// readTraceLab reads TraceLab round traces (one LLM call per line, explicit
// session ids). It has no block hashes, so prompts are synthetic: round k of
// a session reuses the first prefix_tokens of the session's conversation so
// far (the previous prompt and its output) and appends fresh tokens up to
// input_tokens_total. Sessions keep their relative timing and all start at
// time 0.
func readTraceLab(r io.Reader, tail *lastByteReader) (*Trace, error) {
	type round struct {
		line   traceLabLine
		at     time.Time
		lineNo int
	}
	bySession := map[string][]round{}
	var order []string
	cut, err := lines(r, tail, func(n int, line []byte) error {
		var l traceLabLine
		if err := json.Unmarshal(line, &l); err != nil {
			return fmt.Errorf("%w: line %d: %w", ErrFormat, n, incomplete(err, line))
		}
		switch {
		case l.SessionID == "" || l.RoundIndex == nil || l.InputTotal == nil || l.OutputTokens == nil || len(l.TimingEvents) == 0:
			return fmt.Errorf("%w: line %d: session_id, round_index, input_tokens_total, output_tokens and timing_events are required", ErrFormat, n)
		case *l.InputTotal < 1 || *l.OutputTokens < 0 || (l.PrefixTokens != nil && *l.PrefixTokens < 0):
			return fmt.Errorf("%w: line %d: negative or empty token counts", ErrFormat, n)
		case *l.InputTotal > maxPromptTokens || *l.OutputTokens > maxPromptTokens:
			return fmt.Errorf("%w: line %d: input_tokens_total %d or output_tokens %d over %d", ErrFormat, n, *l.InputTotal, *l.OutputTokens, maxPromptTokens)
		}
		at, err := time.Parse(time.RFC3339Nano, l.TimingEvents[0].Timestamp)
		if err != nil {
			return fmt.Errorf("%w: line %d: %s", ErrFormat, n, badTime(l.TimingEvents[0].Timestamp, "RFC 3339", err))
		}
		if _, ok := bySession[l.SessionID]; !ok {
			order = append(order, l.SessionID)
		}
		bySession[l.SessionID] = append(bySession[l.SessionID], round{l, at, n})
		return nil
	})
	if err != nil {
		return nil, err
	}
	t := &Trace{}
	if cut != "" {
		t.Damage = append(t.Damage, cut)
	}
	for si, sid := range order {
		rounds := bySession[sid]
		sort.SliceStable(rounds, func(i, j int) bool { return *rounds[i].line.RoundIndex < *rounds[j].line.RoundIndex })
		start := rounds[0].at
		var conv []uint32 // the session's conversation so far
		for ri, rd := range rounds {
			l := rd.line
			if ri > 0 && rd.at.Before(rounds[ri-1].at) {
				// Timed by it, this round would be sent before the
				// round whose conversation its prompt continues.
				prev := rounds[ri-1]
				return nil, fmt.Errorf("%w: line %d: round %d of session %s starts at %s, before round %d (line %d) at %s: a session's rounds must start in round_index order",
					ErrFormat, rd.lineNo, *l.RoundIndex, quoteField(sid), rd.at.Format(time.RFC3339Nano), *prev.line.RoundIndex, prev.lineNo, prev.at.Format(time.RFC3339Nano))
			}
			prefix := 0
			if l.PrefixTokens != nil {
				prefix = min(*l.PrefixTokens, len(conv), *l.InputTotal)
			}
			prompt := append(make([]uint32, 0, *l.InputTotal), conv[:prefix]...)
			fresh := uint64(si)<<40 | uint64(ri)<<20
			for b := uint64(0); len(prompt) < *l.InputTotal; b++ {
				prompt = appendBlockTokens(prompt, fresh|b|1<<62, min(MooncakeBlockTokens, *l.InputTotal-len(prompt)))
			}
			conv = append(prompt[:len(prompt):len(prompt)], appendBlockTokens(nil, fresh|1<<61, *l.OutputTokens)...)
			t.Items = append(t.Items, Item{
				At: max(rd.at.Sub(start), 0), SessionID: sid, Prompt: prompt,
				OutputTokens: *l.OutputTokens, OriginalID: fmt.Sprintf("%s#%d", sid, *l.RoundIndex),
			})
		}
	}
	return t, nil
}
