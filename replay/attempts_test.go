package replay_test

import (
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/replay"
	"github.com/kvbus/kvbus/testenv"
)

// TestReplayFollowsTheNewestAttempt: onto the bus, a replay follows a
// request's newest attempt as a frontend does. An older attempt's outputs
// are dropped: the error of a group given up, or its late answer, ended
// a request whose newer attempt answered it. An answer begun
// by one attempt and moved to another ends with group_failed when it
// streams, as a streaming client's does; one that does not stream is the
// new attempt's whole answer, as a frontend gives it (it ended with
// group_failed before).
func TestReplayFollowsTheNewestAttempt(t *testing.T) {
	srv, nc, _ := requestLog(t)
	var subj messages.Subjects
	outputs := map[string][]messages.Output{
		// Attempt 0's group, given up, fails after attempt 1 began.
		"superseded": {
			{Attempt: 1, Text: "a"},
			{Attempt: 0, Error: &messages.OutputError{Code: "group_failed", Message: "the worker group g0 stopped"}},
			{Attempt: 1, Text: "b", FinishReason: "length", Usage: &messages.Usage{PromptTokens: 512, CompletionTokens: 2, CachedTokens: 256}},
		},
		// Attempt 0's group, given up, still finishes after attempt 1 began.
		"late": {
			{Attempt: 1, Text: "a"},
			{Attempt: 0, Text: "b", FinishReason: "length", Usage: &messages.Usage{PromptTokens: 512, CompletionTokens: 1, CachedTokens: 0}},
			{Attempt: 1, Text: "c", FinishReason: "length", Usage: &messages.Usage{PromptTokens: 512, CompletionTokens: 2, CachedTokens: 128}},
		},
		// Moved after its answer began.
		"moved": {
			{Attempt: 0, Text: "a"},
			{Attempt: 1, Text: "b", FinishReason: "length", Usage: &messages.Usage{PromptTokens: 512, CompletionTokens: 1, CachedTokens: 64}},
		},
		"moved-stream": {
			{Attempt: 0, Text: "a"},
			{Attempt: 1, Text: "b", FinishReason: "length", Usage: &messages.Usage{PromptTokens: 512, CompletionTokens: 1, CachedTokens: 64}},
		},
	}
	sub, err := nc.Subscribe(subj.RequestAll(), func(m *nats.Msg) {
		req, err := messages.DecodeRequest(m.Data)
		if err != nil {
			t.Error(err)
			return
		}
		for i, o := range outputs[req.SessionID] {
			o.ReqID, o.Index = req.RequestID, i
			data, err := messages.Marshal(&o)
			if err != nil {
				t.Error(err)
			}
			if err := nc.Publish(subj.Out(req.FrontendID), data); err != nil {
				t.Error(err)
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	var trace strings.Builder
	for _, s := range []string{"superseded", "late", "moved"} {
		trace.WriteString(`{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1], "session_id": "` + s + `"}` + "\n")
	}
	tr, err := replay.ReadTrace(strings.NewReader(trace.String()), replay.FormatMooncake)
	if err != nil {
		t.Fatal(err)
	}
	// The last request streams, as a captured one can.
	streamed := &messages.Request{RequestID: "moved-stream-1", SessionID: "moved-stream", Model: "kvbus-sim",
		PromptTokenIDs: make([]uint32, 512), Stream: true, SamplingParams: messages.SamplingParams{MaxTokens: 1}}
	tr.Items = append(tr.Items, replay.Item{SessionID: "moved-stream", Prompt: streamed.PromptTokenIDs, Request: streamed})
	r, err := replay.New(replay.Config{Target: srv.ClientURL(), Conn: testenv.Connect(t, srv), Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	results, _, err := r.Run(t.Context(), tr.Items)
	if err != nil {
		t.Fatal(err)
	}
	if res := results[0]; res.Err != "" || res.CachedTokens != 256 {
		t.Errorf("a given-up attempt failing late: err %q, cached tokens %d; want attempt 1's answer, 256 cached", res.Err, res.CachedTokens)
	}
	if res := results[1]; res.Err != "" || res.CachedTokens != 128 {
		t.Errorf("a given-up attempt finishing late: err %q, cached tokens %d; want attempt 1's answer, 128 cached", res.Err, res.CachedTokens)
	}
	if res := results[2]; res.Err != "" || res.CachedTokens != 64 {
		t.Errorf("moved after its answer began, not streamed: err %q, cached tokens %d; want attempt 1's whole answer, 64 cached", res.Err, res.CachedTokens)
	}
	if res := results[3]; !strings.HasPrefix(res.Err, "group_failed: ") {
		t.Errorf("moved after its answer began to stream: err %q; want group_failed", res.Err)
	}
}
