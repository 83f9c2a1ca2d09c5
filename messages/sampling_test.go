package messages_test

import (
	"encoding/json"
	"testing"

	"github.com/kvbus/kvbus/messages"
)

// TestPutSetFields: the fields a token-id prompt carries to an engine's
// /v1/completions (the worker's trace body and replay's HTTP body) go under
// vLLM's names when set, and nothing when they are not.
func TestPutSetFields(t *testing.T) {
	seed := int64(-5)
	for _, tc := range []struct {
		p    messages.SamplingParams
		want string
	}{
		{messages.SamplingParams{MaxTokens: 7, Temperature: 0.3, ExtraArgs: messages.Args{"session_id": "s"}}, `{}`},
		{messages.SamplingParams{MinTokens: 2, Seed: &seed, Stop: []string{"\n"}, StopTokenIDs: messages.TokenIDs{7, 9},
			IncludeStopStr: true, IgnoreEOS: true},
			`{"ignore_eos":true,"include_stop_str_in_output":true,"min_tokens":2,"seed":-5,"stop":["\n"],"stop_token_ids":[7,9]}`},
	} {
		body := map[string]any{}
		tc.p.PutSetFields(body)
		got, err := json.Marshal(body)
		if err != nil || string(got) != tc.want {
			t.Errorf("%+v: %s (%v), want %s", tc.p, got, err, tc.want)
		}
	}
}
