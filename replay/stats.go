package replay

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"time"
)

// CaptureStats summarises a capture file.
type CaptureStats struct {
	Requests    int            `json:"requests"`
	Span        time.Duration  `json:"span_ns"`
	First, Last time.Time      `json:"-"`
	Subjects    map[string]int `json:"subjects"`
	// Models counts the requests by the model they ask for (two models
	// may share a subject: a.x and a_x are both kvbus.req.a_x).
	Models map[string]int `json:"models"`
	// Sessions counts conversations: a session id sent with two models
	// is two, as a replay and the schedulers count them.
	Sessions     int `json:"sessions"`
	PromptTokens struct {
		Min, Max int
		Mean     float64
	} `json:"prompt_tokens"`
	MaxTokensMean float64 `json:"max_tokens_mean"`
	Malformed     int     `json:"malformed"`
	// AskedAgain counts the requests a frontend published again whose
	// first publish is in the file: a replay leaves them out.
	AskedAgain int `json:"asked_again"`
}

// Stats reads a capture file and summarises it. Of a file with a damaged
// tail it returns the summary of the frames before it, and the error.
func Stats(r io.Reader) (*CaptureStats, error) {
	cr, err := NewCaptureReader(r)
	if err != nil {
		return nil, err
	}
	s := &CaptureStats{Subjects: map[string]int{}, Models: map[string]int{}}
	sessions, ids := map[conversation]bool{}, map[string]bool{}
	var prompt, maxTok int
	for {
		f, err := cr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			// A damaged tail: the stats of what was read, and the error.
			s.finish(sessions, prompt, maxTok)
			return s, fmt.Errorf("%w (the stats above are of the %d frames before it)", err, s.Requests)
		}
		// Frames of a live capture are in arrival order, not always in
		// log order: the span is from the earliest to the latest.
		if s.Requests == 0 || f.Time.Before(s.First) {
			s.First = f.Time
		}
		if s.Requests == 0 || f.Time.After(s.Last) {
			s.Last = f.Time
		}
		s.Requests++
		s.Subjects[f.Subject]++
		req, err := decodeReplayable(f.Payload)
		if err != nil { // left out of a replay too
			s.Malformed++
			continue
		}
		if askedAgain(req, ids) {
			s.AskedAgain++
			continue
		}
		s.Models[req.Model]++
		// The session a replay gives the request (readCaptureTrace).
		if sid := cmp.Or(req.SamplingParams.SessionFromExtraArgs(), req.SessionID); sid != "" {
			sessions[conversation{req.Model, sid}] = true
		}
		n := len(req.PromptTokenIDs)
		if s.Requests-s.Malformed-s.AskedAgain == 1 || n < s.PromptTokens.Min {
			s.PromptTokens.Min = n
		}
		s.PromptTokens.Max = max(s.PromptTokens.Max, n)
		prompt += n
		maxTok += req.SamplingParams.MaxTokens
	}
	s.finish(sessions, prompt, maxTok)
	return s, nil
}

// finish computes what Stats sums up as it reads.
func (s *CaptureStats) finish(sessions map[conversation]bool, prompt, maxTok int) {
	s.Span = s.Last.Sub(s.First)
	s.Sessions = len(sessions)
	if ok := s.Requests - s.Malformed - s.AskedAgain; ok > 0 {
		s.PromptTokens.Mean = float64(prompt) / float64(ok)
		s.MaxTokensMean = float64(maxTok) / float64(ok)
	}
}

// Write prints the stats for a person.
func (s *CaptureStats) Write(w io.Writer) {
	fmt.Fprintf(w, "requests      %d (%d malformed)\n", s.Requests, s.Malformed)
	if s.AskedAgain > 0 {
		fmt.Fprintf(w, "asked again   %d (published again by a frontend, its answer lost: a replay sends each once)\n", s.AskedAgain)
	}
	if s.Requests > 0 {
		fmt.Fprintf(w, "time          %s → %s (%s)\n", s.First.UTC().Format(time.RFC3339Nano), s.Last.UTC().Format(time.RFC3339Nano), s.Span)
	}
	fmt.Fprintf(w, "sessions      %d\n", s.Sessions)
	fmt.Fprintf(w, "prompt tokens min %d, mean %.1f, max %d\n", s.PromptTokens.Min, s.PromptTokens.Mean, s.PromptTokens.Max)
	fmt.Fprintf(w, "max_tokens    mean %.1f\n", s.MaxTokensMean)
	for _, m := range slices.Sorted(maps.Keys(s.Models)) {
		fmt.Fprintf(w, "model         %q: %d\n", m, s.Models[m])
	}
	for _, subj := range slices.Sorted(maps.Keys(s.Subjects)) {
		fmt.Fprintf(w, "subject       %s: %d\n", subj, s.Subjects[subj])
	}
}
