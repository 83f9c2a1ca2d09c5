package frontend

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/kvbus/kvbus/messages"
)

// maxWholeAnswer bounds an engine's whole (not streamed) answer put
// together from its parts (workers' splitAnswer): a worker reads at most
// this much of the engine's answer (maxEngineBody) and refuses more.
const maxWholeAnswer = messages.MaxMessageBytes

// relay writes a real engine's answer as the engine wrote it (--engine
// openai): its streamed chunks as server-sent events, or its JSON body.
// Nothing is written before the engine's first chunk, so an engine that
// refuses the request (a 400 for a field it does not take) gets its status
// and body to the client unchanged.
func (g *generation) relay(rw http.ResponseWriter, ctx context.Context, deadline time.Time, stream bool) int {
	c := g.choices[0]
	w := newAnswerWriter(rw)
	h := w.Header()
	flush := w.flush
	started := false
	begin := func() {
		if !started {
			setStreamHeaders(h)
			w.WriteHeader(http.StatusOK)
			started = true
		}
	}
	event := func(data []byte) {
		_, _ = w.Write([]byte("data: "))
		_, _ = w.Write(data)
		_, _ = w.Write([]byte("\n\n"))
	}
	var answer []byte
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for !g.allDone() {
		items, apiErr := g.next(ctx, timer)
		if apiErr != nil {
			// Its client left it, or its deadline cut it, unfinished:
			// counted as aborted, with the prompt it prefilled.
			g.completed()
			if apiErr.Status == 499 {
				return apiErr.Status
			}
			if started {
				b, _ := json.Marshal(apiErr.body())
				event(b)
				event([]byte("[DONE]")) // flushed with the body's end
				// Counted under its status, whatever the headers said.
				return apiErr.Status
			}
			writeError(w, apiErr)
			return apiErr.Status
		}
		for _, it := range items {
			if raw := it.out.Raw; len(raw) > 0 {
				if !stream {
					// An answer too large for one message on the bus comes
					// in parts, from index 0 of its attempt on.
					if it.out.Index == 0 {
						answer = answer[:0]
					}
					if len(answer)+len(raw) > maxWholeAnswer {
						// No worker sends more (it reads at most as much
						// of the engine's answer): the parts would grow
						// the frontend's memory without end.
						g.abort("the answer's parts exceed the largest whole answer")
						c.done, c.err, answer = true, outputError("engine_error",
							fmt.Sprintf("the engine's answer exceeds %d bytes", maxWholeAnswer)), nil
						break
					}
					answer = append(answer, raw...)
					continue
				}
				begin()
				event(raw)
			}
		}
		if started && !g.allDone() { // the last events go out with [DONE], in one write
			flush()
		}
		if w.err != nil {
			return g.cutOff(w.err)
		}
	}
	if c.err != nil {
		g.completed() // a prompt that failed after its prefill still counts it
		g.log.Warn("request failed", "code", c.err.Code, "status", c.err.Status, "err", c.err.Message)
		body := c.errRaw
		if len(body) == 0 {
			body, _ = json.Marshal(c.err.body())
		}
		if started { // the stream had begun: the error is its last event
			event(body)
			event([]byte("[DONE]"))
			return c.err.Status
		}
		if len(c.errRaw) == 0 {
			writeError(w, c.err)
		} else {
			h.Set("Content-Type", "application/json")
			w.WriteHeader(c.err.Status)
			_, _ = w.Write(body)
		}
		return c.err.Status
	}
	if stream {
		begin()
		// Not flushed: net/http flushes it with the chunked body's end when
		// the handler returns, in one write where a flush here made two.
		event([]byte("[DONE]"))
	} else {
		h.Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(answer)
	}
	if w.err != nil {
		return g.cutOff(w.err)
	}
	u := c.usage
	g.vm.finished(u.PromptTokens, u.CompletionTokens, u.CachedTokens, c.finish, time.Since(g.start).Seconds())
	g.log.Info("request completed", "engine", true, "stream", stream, "prompt_tokens", u.PromptTokens, "cached_tokens", u.CachedTokens,
		"completion_tokens", u.CompletionTokens, "ms", time.Since(g.start).Milliseconds())
	return http.StatusOK
}
