package replay

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/scheduler"
)

// Trace formats.
const (
	FormatAuto     = "auto"
	FormatCapture  = "capture"
	FormatMooncake = "mooncake"
	FormatTraceLab = "tracelab"
	FormatAzure    = "azure"
)

// MooncakeBlockTokens is the size of one Mooncake trace block (hash_id).
const MooncakeBlockTokens = 512

// maxTraceLineBytes bounds one line of a JSONL or CSV trace.
const maxTraceLineBytes = 16 << 20

// maxPromptTokens bounds a trace request's input or output tokens (4Mi): far
// above any model's context, far below what would exhaust memory.
const maxPromptTokens = 1 << 22

// ErrFormat is wrapped by trace parsing errors.
var ErrFormat = errors.New("replay: bad trace")

// Item is one request of a trace, ready to replay.
type Item struct {
	// At is the request's time from the start of the trace.
	At time.Duration
	// SessionID is the conversation ("" when the trace has none).
	SessionID string
	// Prompt is the prompt's token ids.
	Prompt []uint32
	// OutputTokens is the exact number of tokens to generate (0: as the
	// captured request's sampling params say).
	OutputTokens int
	// OriginalID is the request id in the trace, if any.
	OriginalID string
	// Request is the captured request, for capture replays.
	Request *messages.Request
	// Subject is the captured subject, for capture replays.
	Subject string
}

// Trace is a parsed trace, items sorted by At.
type Trace struct {
	Format string
	Items  []Item
	// Damage says what of a damaged capture file was left out (frames
	// that are not requests, a truncated tail) and why; empty when the
	// whole file was read.
	Damage []string
}

// Sessions returns the number of distinct conversations: a session id a
// capture has with two models is two, as the schedulers and a replay's
// turn depths count them.
func (t *Trace) Sessions() int {
	seen := map[conversation]bool{}
	for _, it := range t.Items {
		if it.SessionID != "" {
			seen[conversation{it.capturedModel(), it.SessionID}] = true
		}
	}
	return len(seen)
}

// Models returns the models the trace's requests ask for when the replay
// gives none, sorted: each captured request's own, DefaultModel for a
// trace's.
func (t *Trace) Models() []string {
	var models []string
	for _, it := range t.Items {
		m := cmp.Or(it.capturedModel(), DefaultModel)
		if !slices.Contains(models, m) {
			models = append(models, m)
		}
	}
	slices.Sort(models)
	return models
}

// conversation is a session of one model.
type conversation struct{ model, session string }

// capturedModel is the model a captured request asked for ("" for a
// trace's).
func (it *Item) capturedModel() string {
	if it.Request == nil {
		return ""
	}
	return it.Request.Model
}

// ReadTraceFile reads a trace in format (FormatAuto detects it).
func ReadTraceFile(path, format string) (*Trace, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ReadTrace(f, format)
}

// ReadTrace reads a trace from r.
func ReadTrace(r io.Reader, format string) (*Trace, error) {
	tail := &lastByteReader{r: r}
	br := bufio.NewReaderSize(tail, 1<<16)
	if bom, _ := br.Peek(3); string(bom) == "\xef\xbb\xbf" {
		_, _ = br.Discard(3) // a UTF-8 byte order mark
	}
	head, _ := br.Peek(4096)
	detected := detectFormat(head)
	if format == "" || format == FormatAuto {
		if len(head) < 4096 && len(bytes.TrimSpace(head)) == 0 {
			return nil, fmt.Errorf("%w: the file is empty: there is no request to replay", ErrFormat)
		}
		format = detected
		if format == "" {
			return nil, fmt.Errorf("%w: cannot tell the format; give --format capture, mooncake, tracelab or azure", ErrFormat)
		}
	}
	var (
		t   *Trace
		err error
	)
	switch format {
	case FormatCapture:
		t, err = readCaptureTrace(br)
	case FormatMooncake:
		t, err = readMooncake(br, tail)
	case FormatTraceLab:
		t, err = readTraceLab(br, tail)
	case FormatAzure:
		t, err = readAzure(br, tail)
	default:
		return nil, fmt.Errorf("%w: unknown format %q (want auto, capture, mooncake, tracelab, azure)", ErrFormat, format)
	}
	if err != nil {
		if detected != "" && detected != format {
			// --format names another format than the file's.
			return nil, fmt.Errorf("%w (the file's content looks like --format %s: give that, or auto)", err, detected)
		}
		return nil, err
	}
	// The frontend refuses such session ids; replayed onto the bus they
	// would reach the ranks' logs and the operators' terminals (kvbus top).
	// It trims them first, and a blank one is no session: so here, or the
	// bus would get sessions the frontend never makes.
	for i := range t.Items {
		t.Items[i].SessionID = strings.TrimSpace(t.Items[i].SessionID)
		it := t.Items[i]
		if err := messages.CheckSessionID(it.SessionID); err != nil {
			id := it.SessionID
			if len(id) > 64 {
				id = id[:64] + "…"
			}
			return nil, fmt.Errorf("%w: request %d of the trace (id %q): session id %q: %w", ErrFormat, i+1, it.OriginalID, id, err)
		}
	}
	t.Format = format
	sort.SliceStable(t.Items, func(i, j int) bool { return t.Items[i].At < t.Items[j].At })
	return t, nil
}

func detectFormat(head []byte) string {
	switch {
	case bytes.HasPrefix(head, []byte(captureMagic)):
		return FormatCapture
	case bytes.HasPrefix(head, []byte("TIMESTAMP,")):
		return FormatAzure
	}
	line, _, _ := bytes.Cut(bytes.TrimLeft(head, " \t\r\n"), []byte("\n"))
	var probe map[string]json.RawMessage
	if json.Unmarshal(line, &probe) != nil {
		// A long first line may be cut by the peek: look at its keys.
		switch {
		case bytes.Contains(line, []byte(`"hash_ids"`)):
			return FormatMooncake
		case bytes.Contains(line, []byte(`"round_index"`)):
			return FormatTraceLab
		}
		return ""
	}
	switch {
	case probe["hash_ids"] != nil:
		return FormatMooncake
	case probe["round_index"] != nil:
		return FormatTraceLab
	}
	return ""
}

// lastByteReader remembers the last byte read through it: whether a file
// ends with a line break.
type lastByteReader struct {
	r    io.Reader
	last byte
}

func (l *lastByteReader) Read(p []byte) (int, error) {
	n, err := l.r.Read(p)
	if n > 0 {
		l.last = p[n-1]
	}
	return n, err
}

// errIncomplete marks a line that is the start of a valid one, cut short.
var errIncomplete = errors.New("the line ends before its request does")

// incomplete is err marked errIncomplete when it says that line ends
// before its JSON does.
func incomplete(err error, line []byte) error {
	var se *json.SyntaxError
	if errors.As(err, &se) && se.Offset >= int64(len(line)) {
		return fmt.Errorf("%w: %w", errIncomplete, err)
	}
	return err
}

// cutTail is the Damage note of a trace's last line that ends before its
// request does and that the file ends in without a line break: a line cut
// short (a copy of a trace still being written, a file cut at a byte
// count), left out as a capture's cut tail is.
func cutTail(n int, err error) string {
	return fmt.Sprintf("line %d, the last, is cut short (the file ends in it without a line break) and is left out: %v", n, err)
}

// lines calls f for each non-empty line of r, with its 1-based number. A
// last line that f refused as errIncomplete and that the file ends in
// without a line break (tail saw the file's last byte) is cut short: it is
// left out and said in the returned note, not an error.
func lines(r io.Reader, tail *lastByteReader, f func(n int, line []byte) error) (cut string, err error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<16), maxTraceLineBytes)
	n := 0
	var pending error // f's error on the last non-empty line so far
	pendingLine := 0
	for sc.Scan() {
		n++
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		if pending != nil {
			return "", pending // a refused line that is not the last
		}
		if err := f(n, line); err != nil {
			pending, pendingLine = err, n
		}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return "", fmt.Errorf("%w: line %d: longer than %d MiB, more than one request's line can be: check that the file is a JSONL trace (one request a line) of the --format it is read as", ErrFormat, n+1, maxTraceLineBytes>>20)
		}
		return "", fmt.Errorf("%w: line %d: %v", ErrFormat, n+1, err)
	}
	if pending != nil {
		if pendingLine == n && tail != nil && tail.last != '\n' && errors.Is(pending, errIncomplete) {
			return cutTail(pendingLine, pending), nil
		}
		return "", pending
	}
	return "", nil
}

// readCaptureTrace reads a capture's requests; a request a frontend
// published again (its answer lost on the bus) is left out when its first
// publish is in the file. A damaged file — a frame
// that is not a request, or a tail cut short (a capture killed, a copy of
// a live one, a full disk) — gives the requests it has, and says in Damage
// what was left out; only a file with none is an error.
func readCaptureTrace(r io.Reader) (*Trace, error) {
	cr, err := NewCaptureReader(r)
	if err != nil {
		return nil, err
	}
	t := &Trace{}
	skipped, firstSkip := 0, ""
	ids := map[string]bool{}
	var frames []int // each item's frame
	for i := 0; ; i++ {
		f, err := cr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			// A frame whose length or bytes are wrong: what follows cannot
			// be found.
			t.Damage = append(t.Damage, fmt.Sprintf("the file is damaged from frame %d on (%v): the %d requests before it are kept", i, err, len(t.Items)))
			break
		}
		req, err := decodeReplayable(f.Payload)
		if err != nil {
			if skipped++; skipped == 1 {
				firstSkip = fmt.Sprintf("frame %d: %v", i, err)
			}
			continue
		}
		if askedAgain(req, ids) {
			continue
		}
		sid := req.SamplingParams.SessionFromExtraArgs()
		if sid == "" {
			sid = req.SessionID
		}
		t.Items = append(t.Items, Item{
			At: time.Duration(f.Time.UnixNano()), SessionID: sid, Prompt: req.PromptTokenIDs,
			OriginalID: req.RequestID, Request: req, Subject: f.Subject,
		})
		frames = append(frames, i)
	}
	if skipped > 0 {
		t.Damage = append(t.Damage, fmt.Sprintf("%d frames are not requests kvbus can replay and are left out (the first: %s)", skipped, firstSkip))
	}
	if note := dropStrayTimes(t, frames); note != "" {
		t.Damage = append(t.Damage, note)
	}
	if len(t.Items) == 0 && len(t.Damage) > 0 {
		return nil, fmt.Errorf("%w: no request can be read from the capture: %s", ErrFormat, strings.Join(t.Damage, "; "))
	}
	// Frames of a live capture are in arrival order, not always in log
	// order.
	fromEarliest(t.Items)
	return t, nil
}

// maxCaptureSpan bounds how far a captured request's time may lie from
// the capture's median: a frame beyond it has a damaged timestamp (one
// flipped byte put a request in 1828, and the replay waited for it).
const maxCaptureSpan = 365 * 24 * time.Hour

// dropStrayTimes leaves out the items (read from frames) whose time is
// more than maxCaptureSpan from the median of all, and says which, or
// returns "".
func dropStrayTimes(t *Trace, frames []int) string {
	if len(t.Items) == 0 {
		return ""
	}
	times := make([]time.Duration, len(t.Items))
	for i, it := range t.Items {
		times[i] = it.At
	}
	slices.Sort(times)
	median := times[len(times)/2]
	kept := t.Items[:0]
	dropped, first := 0, ""
	for i, it := range t.Items {
		if d := it.At - median; d > maxCaptureSpan || d < -maxCaptureSpan {
			if dropped++; dropped == 1 {
				first = fmt.Sprintf("frame %d at %s", frames[i], time.Unix(0, int64(it.At)).UTC().Format(time.RFC3339))
			}
			continue
		}
		kept = append(kept, it)
	}
	t.Items = kept
	if dropped == 0 {
		return ""
	}
	return fmt.Sprintf("%d requests whose time is more than a year from the capture's others (a damaged timestamp) are left out (the first: %s)", dropped, first)
}

// askedAgain reports whether req is a frontend's second publish of a
// request whose first is among ids, the ids read so far (req's is added):
// the client sent it once, and a replay sends it once, under its first id.
func askedAgain(req *messages.Request, ids map[string]bool) bool {
	if req.AgainOf != "" && ids[req.AgainOf] {
		return true
	}
	ids[req.RequestID] = true
	return false
}

// fromEarliest makes the items' times, absolute as read, relative to the
// earliest of them: a file's records need not be in time order.
func fromEarliest(items []Item) {
	if len(items) == 0 {
		return
	}
	start := slices.MinFunc(items, func(a, b Item) int { return cmp.Compare(a.At, b.At) }).At
	for i := range items {
		items[i].At -= start
	}
}

type mooncakeLine struct {
	Timestamp    *float64        `json:"timestamp"`
	InputLength  *int            `json:"input_length"`
	OutputLength *int            `json:"output_length"`
	HashIDs      []int64         `json:"hash_ids"`
	SessionID    json.RawMessage `json:"session_id"`
}

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
		case *m.InputLength > len(m.HashIDs)*MooncakeBlockTokens || *m.InputLength <= (len(m.HashIDs)-1)*MooncakeBlockTokens:
			return fmt.Errorf("%w: line %d: %d hash_ids do not cover input_length %d in %d-token blocks", ErrFormat, n, len(m.HashIDs), *m.InputLength, MooncakeBlockTokens)
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

// maxErrField bounds how much of a trace's field an error quotes: a
// field of a file that is not the trace it is read as can be megabytes.
const maxErrField = 64

// quoteField is s quoted for an error, cut to maxErrField bytes.
func quoteField(s string) string { return strconv.Quote(clip(s, maxErrField)) }

// badTime says that timestamp s did not parse: with time.Parse's err, or,
// for a long s (which err quotes whole, twice), with layout.
func badTime(s, layout string, err error) string {
	if len(s) > maxErrField {
		return fmt.Sprintf("timestamp %s: not a time of the layout %s", quoteField(s), layout)
	}
	return fmt.Sprintf("timestamp %q: %v", s, err)
}

// decodeReplayable decodes a captured request a replay can send: one with
// a prompt (Stats counts the others as malformed, as a replay leaves them
// out).
func decodeReplayable(payload []byte) (*messages.Request, error) {
	req, err := messages.DecodeRequest(payload)
	if err == nil && len(req.PromptTokenIDs) == 0 {
		err = fmt.Errorf("request %s has an empty prompt", req.RequestID)
	}
	return req, err
}

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
