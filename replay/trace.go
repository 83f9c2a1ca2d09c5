package replay

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// Trace formats.
const (
	FormatAuto     = "auto"
	FormatCapture  = "capture"
	FormatMooncake = "mooncake"
	FormatTraceLab = "tracelab"
	FormatAzure    = "azure"
)

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
