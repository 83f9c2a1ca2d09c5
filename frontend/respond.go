package frontend

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/messages"
)

// Writing a generation's answer: one JSON response (respond) or an SSE
// stream (stream), in OpenAI's and vLLM's shapes.

// respond waits for every choice and writes one JSON response.
func (g *generation) respond(w http.ResponseWriter, ctx context.Context, deadline time.Time) int {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for !g.allDone() {
		if _, err := g.next(ctx, timer); err != nil {
			if err.Status != 499 {
				writeError(w, err)
			}
			// What its client left, or its deadline cut, unfinished counts
			// as aborted, with what it prefilled and generated.
			g.completed()
			return err.Status
		}
	}
	for _, c := range g.choices {
		if c.err != nil {
			g.log.Warn("request failed", "code", c.err.Code, "err", c.err.Message)
			writeError(w, c.err)
			g.completed() // a prompt that failed after its prefill still counts it
			return c.err.Status
		}
	}
	resp := completionJSON{ID: g.id, Created: g.created, Model: g.model, Usage: ptr(g.usage())}
	for i, c := range g.choices {
		ch := choiceJSON{Index: i, FinishReason: ptr(c.finish), StopReason: c.stopReason}
		if ch.StopReason == nil {
			ch.StopReason = json.RawMessage("null")
		}
		if g.endpoint == messages.EndpointChat {
			resp.Object = "chat.completion"
			ch.Message = &messageJSON{Role: "assistant", Content: ptr(c.text.String())}
		} else {
			resp.Object = "text_completion"
			ch.Text = ptr(c.text.String())
		}
		resp.Choices = append(resp.Choices, ch)
	}
	aw := newAnswerWriter(w)
	writeJSON(aw, http.StatusOK, resp)
	if aw.err != nil {
		return g.cutOff(aw.err)
	}
	u := resp.Usage
	g.completed()
	logsink.Info(g.log, "request completed", "prompt_tokens", u.PromptTokens, "cached_tokens", u.PromptTokensDetails.CachedTokens,
		"completion_tokens", u.CompletionTokens, "ms", time.Since(g.start).Milliseconds())
	return http.StatusOK
}

// answerWriter writes an answer and keeps the first write that failed: its
// client did not read it by the write deadline (the request's deadline and
// writeGrace, serveGenerate), or went away. Writes after it fail at once.
type answerWriter struct {
	http.ResponseWriter
	rc  *http.ResponseController
	err error
}

func newAnswerWriter(w http.ResponseWriter) *answerWriter {
	return &answerWriter{ResponseWriter: w, rc: http.NewResponseController(w)}
}

func (a *answerWriter) Write(p []byte) (int, error) {
	if a.err != nil {
		return 0, a.err
	}
	n, err := a.ResponseWriter.Write(p)
	if err != nil {
		a.err = err
	}
	return n, err
}

// flush sends what is buffered to the client.
func (a *answerWriter) flush() {
	if a.err != nil {
		return
	}
	if err := a.rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		a.err = err
	}
}

// cutOff ends a generation whose answer could not be written (err): its
// unfinished bus requests are aborted, and it counts as what it was for its
// client, a 504 when the client had not read the answer by the request's
// deadline, a 499 when it went away, not as the 200 its headers said.
func (g *generation) cutOff(err error) int {
	status, reason := 499, messages.AbortReasonClientGone
	msg := "answer cut off: its client went away before reading it"
	if errors.Is(err, os.ErrDeadlineExceeded) {
		status, reason = http.StatusGatewayTimeout, messages.AbortReasonTimeout
		msg = "answer cut off: its client had not read it by the request's deadline (--request-timeout and a second); it reads too slowly"
	}
	g.abort(reason)
	g.completed() // what was unfinished counts as aborted
	g.log.Warn(msg, "timeout", g.s.cfg.RequestTimeout, "ms", time.Since(g.start).Milliseconds(), "err", err)
	return status
}

// stream writes server-sent events as outputs arrive. The status line, the
// headers and the role chunk wait for the request's first output: an error
// before it (no ready group, overloaded, a timeout) is answered with its
// HTTP status, as without streaming, so that clients and SDKs retry a 503
// or 429 as they would any other.
//
// With continuousUsage every chunk but the usage one carries the usage of
// its choice so far, the role chunk included, as vLLM's do.
func (g *generation) stream(rw http.ResponseWriter, ctx context.Context, deadline time.Time, includeUsage, continuousUsage bool) int {
	w := newAnswerWriter(rw)
	send := func(v any) {
		b, _ := json.Marshal(v)
		_, _ = fmt.Fprintf(w, "data: %s\n\n", b)
	}
	flush := w.flush
	object := "text_completion"
	if g.endpoint == messages.EndpointChat {
		object = "chat.completion.chunk"
	}
	started := false
	begin := func() {
		started = true
		setStreamHeaders(w.Header())
		w.WriteHeader(http.StatusOK)
		if g.endpoint == messages.EndpointChat {
			// vLLM and OpenAI open with the role. Like vLLM, it goes out
			// with the first output, in the same write.
			for i, c := range g.choices {
				chunk := completionJSON{ID: g.id, Object: object, Created: g.created, Model: g.model,
					Choices: []choiceJSON{{Index: i, Delta: &messageJSON{Role: "assistant", Content: ptr("")}}}}
				if continuousUsage {
					chunk.Usage = c.usageSoFar(0)
				}
				send(chunk)
			}
		}
	}
	// completion counts each choice's tokens streamed so far.
	var completion []int
	if continuousUsage {
		completion = make([]int, len(g.choices))
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	// held: what came before the stream began, while no choice had
	// answered (its outputs carry no text; or the choices that ended, ended
	// in errors).
	var held []choiceOutput
	for !g.allDone() {
		items, err := g.next(ctx, timer)
		if err != nil {
			// What its client left, or its deadline cut, unfinished counts
			// as aborted, with what it prefilled and generated.
			g.completed()
		}
		switch {
		case err != nil && !started:
			if err.Status != 499 {
				writeError(w, err)
			}
			return err.Status
		case err != nil:
			if err.Status != 499 {
				send(err.body())
				_, _ = fmt.Fprint(w, "data: [DONE]\n\n") // flushed with the body's end
			}
			return err.Status
		case !started:
			if e := g.failedFirst(); e != nil {
				g.log.Warn("request failed", "code", e.Code, "err", e.Message)
				writeError(w, e)
				return e.Status
			}
			if !g.answering() {
				// Every choice may yet fail (the scheduler refuses each
				// prompt of a list on its own): then the status says so.
				held = append(held, items...)
				continue
			}
			begin()
			items, held = append(held, items...), nil
		}
		for _, it := range items {
			c, o := g.choices[it.choice], it.out
			if o.Error != nil { // the choice's error (text that came before it in the batch went out)
				g.log.Warn("request failed while streaming", "code", c.err.Code, "err", c.err.Message)
				send(c.err.body())
				continue
			}
			if continuousUsage {
				completion[it.choice] += len(o.TokenIDs)
				if o.FinishReason != "" && o.Usage != nil {
					completion[it.choice] = o.Usage.CompletionTokens // the engine's count
				}
			}
			if o.Text == "" && o.FinishReason == "" {
				continue
			}
			ch := choiceJSON{Index: it.choice}
			if o.FinishReason != "" {
				ch.FinishReason = ptr(o.FinishReason)
			}
			if g.endpoint == messages.EndpointChat {
				ch.Delta = &messageJSON{}
				if o.Text != "" {
					ch.Delta.Content = ptr(o.Text)
				}
				if o.FinishReason != "" { // vLLM sets it on the finishing chunk only
					ch.StopReason = stopReason(o)
				}
			} else {
				ch.Text = ptr(o.Text)
				ch.StopReason = stopReason(o) // null until the end, on every chunk
			}
			chunk := completionJSON{ID: g.id, Object: object, Created: g.created, Model: g.model, Choices: []choiceJSON{ch}}
			if continuousUsage {
				chunk.Usage = c.usageSoFar(completion[it.choice])
			}
			send(chunk)
		}
		if !g.allDone() { // the last events go out with [DONE], in one write
			flush()
		}
		if w.err != nil {
			return g.cutOff(w.err)
		}
	}
	if !started {
		begin()
	}
	if includeUsage {
		send(completionJSON{ID: g.id, Object: object, Created: g.created, Model: g.model, Choices: []choiceJSON{}, Usage: ptr(g.usage())})
	}
	// Not flushed: net/http flushes it with the chunked body's end when
	// the handler returns, in one write where a flush here made two.
	_, _ = fmt.Fprint(w, "data: [DONE]\n\n")
	if w.err != nil {
		return g.cutOff(w.err)
	}
	u := g.usage()
	msg := "request completed"
	// A stream that ended with an error event counts under that error's
	// status, not the 200 its headers said: an alert on the share of 5xx
	// sees the streams that failed.
	status := http.StatusOK
	for _, c := range g.choices {
		if c.err != nil && status == http.StatusOK { // logged as it went out; this line must not say it completed
			msg = "request ended with an error after its stream began"
			status = c.err.Status
		}
	}
	g.completed()
	logsink.Info(g.log, msg, "stream", true, "prompt_tokens", u.PromptTokens, "cached_tokens", u.PromptTokensDetails.CachedTokens,
		"completion_tokens", u.CompletionTokens, "ms", time.Since(g.start).Milliseconds())
	return status
}

// failedFirst returns the error of a request whose choices all ended in
// errors before any text: nothing was streamed, so its status can still
// say so.
func (g *generation) failedFirst() *APIError {
	for _, c := range g.choices {
		if c.err == nil || c.text.Len() > 0 {
			return nil
		}
	}
	return g.choices[0].err
}

// answering reports whether a choice has text, or finished without an
// error: the stream begins then.
func (g *generation) answering() bool {
	for _, c := range g.choices {
		if c.text.Len() > 0 || c.done && c.err == nil {
			return true
		}
	}
	return false
}

// OpenAI response shapes.
type completionJSON struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []choiceJSON `json:"choices"`
	Usage   *usageJSON   `json:"usage,omitempty"`
}

type choiceJSON struct {
	Index        int          `json:"index"`
	Message      *messageJSON `json:"message,omitempty"`
	Delta        *messageJSON `json:"delta,omitempty"`
	Text         *string      `json:"text,omitempty"`
	Logprobs     *struct{}    `json:"logprobs"`
	FinishReason *string      `json:"finish_reason"`
	// StopReason is vLLM's stop_reason: the stop string or token id that
	// ended the choice, JSON null when it ended otherwise; left out where
	// vLLM leaves it out (a chat chunk that does not finish).
	StopReason json.RawMessage `json:"stop_reason,omitempty"`
}

// stopReason is vLLM's stop_reason of a finished choice: the stop string
// or the stop token id that ended it, else null.
func stopReason(o *messages.Output) json.RawMessage {
	switch {
	case o.StopToken != nil:
		return strconv.AppendUint(nil, uint64(*o.StopToken), 10)
	case o.StopReason != "":
		if b, err := json.Marshal(o.StopReason); err == nil {
			return b
		}
	}
	return json.RawMessage("null")
}

type messageJSON struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type usageJSON struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
	// PromptTokensDetails is on a response's usage, not on a chunk's
	// continuous usage (vLLM's neither).
	PromptTokensDetails *promptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

func ptr[T any](v T) *T { return &v }

// setStreamHeaders sets a server-sent event stream's headers, as vLLM's
// (Starlette adds the charset); Connection: keep-alive unless a stopping
// frontend set close (leaveWhenDraining), which it overrode.
func setStreamHeaders(h http.Header) {
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	if h.Get("Connection") == "" {
		h.Set("Connection", "keep-alive")
	}
}
