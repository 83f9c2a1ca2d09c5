package replay

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
)

// readAzure reads the Azure LLM inference trace CSV
// (TIMESTAMP,ContextTokens,GeneratedTokens). It has no sessions and no
// prefixes: every prompt is unique, so no sharing is invented.
func readAzure(r io.Reader, tail *lastByteReader) (*Trace, error) {
	cr := csv.NewReader(r)
	cr.ReuseRecord = true
	cr.FieldsPerRecord = 3
	hdr, err := cr.Read()
	if err != nil || strings.Join(hdr, ",") != "TIMESTAMP,ContextTokens,GeneratedTokens" {
		return nil, fmt.Errorf("%w: want the header TIMESTAMP,ContextTokens,GeneratedTokens", ErrFormat)
	}
	t := &Trace{}
	// record reads line n's record into t.
	record := func(n int, rec []string, err error) error {
		if err != nil {
			if errors.Is(err, csv.ErrFieldCount) && len(rec) < 3 {
				err = fmt.Errorf("%w: %w", errIncomplete, err)
			}
			return fmt.Errorf("%w: line %d: %w", ErrFormat, n, err)
		}
		if rec[1] == "" || rec[2] == "" { // a line cut after a comma, if it is the last
			return fmt.Errorf("%w: %w: line %d: a token count is empty", ErrFormat, errIncomplete, n)
		}
		at, err := time.Parse("2006-01-02 15:04:05.9999999", rec[0])
		if err != nil {
			return fmt.Errorf("%w: line %d: %s", ErrFormat, n, badTime(rec[0], "2006-01-02 15:04:05.9999999", err))
		}
		in, err1 := strconv.Atoi(rec[1])
		out, err2 := strconv.Atoi(rec[2])
		if err1 != nil || err2 != nil || in < 1 || out < 0 || in > maxPromptTokens || out > maxPromptTokens {
			return fmt.Errorf("%w: line %d: bad token counts %s, %s", ErrFormat, n, quoteField(rec[1]), quoteField(rec[2]))
		}
		prompt := make([]uint32, 0, in)
		for b := uint64(0); len(prompt) < in; b++ {
			prompt = appendBlockTokens(prompt, uint64(n)<<24|b|1<<63, min(MooncakeBlockTokens, in-len(prompt)))
		}
		// The absolute time for now (fromEarliest, below).
		t.Items = append(t.Items, Item{At: time.Duration(at.UnixNano()), Prompt: prompt, OutputTokens: out, OriginalID: "line-" + strconv.Itoa(n)})
		return nil
	}
	var pending error // the last record's error
	pendingLine := 0
	for {
		rec, err := cr.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if pending != nil {
			return nil, pending // a refused record that is not the last
		}
		// The file's own line (blank lines are skipped by the reader,
		// not counted). A record the reader could not parse (a quote
		// unclosed or astray) has no field to ask it of.
		var n int
		if pe := (*csv.ParseError)(nil); errors.As(err, &pe) {
			n = pe.StartLine
		} else {
			n, _ = cr.FieldPos(0)
		}
		if err := record(n, rec, err); err != nil {
			pending, pendingLine = err, n
		}
	}
	if pending != nil {
		if tail == nil || tail.last == '\n' || !errors.Is(pending, errIncomplete) {
			return nil, pending
		}
		t.Damage = append(t.Damage, cutTail(pendingLine, pending))
	}
	fromEarliest(t.Items)
	return t, nil
}
