package replay

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/zeebo/xxh3"
)

// MooncakeBlockTokens is the size of one Mooncake trace block (hash_id).
const MooncakeBlockTokens = 512

type mooncakeLine struct {
	Timestamp    *float64        `json:"timestamp"`
	InputLength  *int            `json:"input_length"`
	OutputLength *int            `json:"output_length"`
	HashIDs      []int64         `json:"hash_ids"`
	SessionID    json.RawMessage `json:"session_id"`
}

// blocksOf is how many Mooncake blocks a prompt of n tokens takes.
func blocksOf(n int) int { return (n + MooncakeBlockTokens - 1) / MooncakeBlockTokens }

func readMooncake(r io.Reader, tail *lastByteReader) (*Trace, error) {
	t := &Trace{}
	cut, err := lines(r, tail, func(n int, line []byte) error {
		var m mooncakeLine
		if err := json.Unmarshal(line, &m); err != nil {
			return fmt.Errorf("%w: line %d: %w", ErrFormat, n, incomplete(err, line))
		}
		switch {
		case m.Timestamp == nil || m.InputLength == nil || m.OutputLength == nil:
			return fmt.Errorf("%w: line %d: timestamp, input_length and output_length are required", ErrFormat, n)
		case *m.InputLength < 1 || *m.OutputLength < 0 || *m.Timestamp < 0 || math.IsNaN(*m.Timestamp) || math.IsInf(*m.Timestamp, 0):
			return fmt.Errorf("%w: line %d: negative or empty lengths or timestamp", ErrFormat, n)
		case *m.InputLength > len(m.HashIDs)*MooncakeBlockTokens:
			return fmt.Errorf("%w: line %d: %d hash_ids do not cover input_length %d in %d-token blocks (%d needed)", ErrFormat, n,
				len(m.HashIDs), *m.InputLength, MooncakeBlockTokens, blocksOf(*m.InputLength))
		case *m.InputLength <= (len(m.HashIDs)-1)*MooncakeBlockTokens:
			return fmt.Errorf("%w: line %d: %d hash_ids are more than input_length %d needs in %d-token blocks (%d)", ErrFormat, n,
				len(m.HashIDs), *m.InputLength, MooncakeBlockTokens, blocksOf(*m.InputLength))
		case *m.InputLength > maxPromptTokens || *m.OutputLength > maxPromptTokens:
			return fmt.Errorf("%w: line %d: input_length %d or output_length %d over %d tokens", ErrFormat, n, *m.InputLength, *m.OutputLength, maxPromptTokens)
		case *m.Timestamp > float64(365*24*time.Hour/time.Millisecond):
			return fmt.Errorf("%w: line %d: timestamp %g ms is over a year", ErrFormat, n, *m.Timestamp)
		}
		prompt := make([]uint32, 0, *m.InputLength)
		for _, id := range m.HashIDs { // the last block only as long as needed: no array grown past the prompt
			prompt = appendBlockTokens(prompt, uint64(id), min(MooncakeBlockTokens, *m.InputLength-len(prompt)))
		}
		it := Item{
			At:           time.Duration(*m.Timestamp * float64(time.Millisecond)),
			Prompt:       prompt[:*m.InputLength],
			OutputTokens: *m.OutputLength,
			OriginalID:   "line-" + strconv.Itoa(n),
		}
		if len(m.SessionID) > 0 && string(m.SessionID) != "null" {
			var s string
			if err := json.Unmarshal(m.SessionID, &s); err != nil {
				it.SessionID = strings.Trim(string(m.SessionID), `"`) // a number: use its text
			} else {
				it.SessionID = s
			}
		}
		t.Items = append(t.Items, it)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if cut != "" {
		t.Damage = append(t.Damage, cut)
	}
	return t, nil
}

// appendBlockTokens appends n deterministic token ids for block id: equal
// ids give equal tokens, so prefix sharing in a trace is real.
func appendBlockTokens(dst []uint32, id uint64, n int) []uint32 {
	x := xxh3.HashSeed(binaryU64(id), 0x6b76627573) // "kvbus"
	for range n {
		x += 0x9e3779b97f4a7c15
		z := (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		dst = append(dst, uint32(1000+(z^(z>>31))%150000))
	}
	return dst
}

func binaryU64(v uint64) []byte {
	var b [8]byte
	for i := range b {
		b[i] = byte(v >> (8 * i))
	}
	return b[:]
}
