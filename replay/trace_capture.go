package replay

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/kvbus/kvbus/messages"
)

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
