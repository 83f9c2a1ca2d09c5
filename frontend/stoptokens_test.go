package frontend_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/kvbus/kvbus/testenv"
)

// TestStopTokenIDs: vLLM's stop_token_ids reach the engine and end the
// answer there, over real HTTP and the bus: with every id the sim model
// generates listed, the first token ends it, stop_reason is that id (a
// number, as vLLM's), the token is counted and its text left out. They
// were ignored: the answer ran to max_tokens.
func TestStopTokenIDs(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{Ranks: 1})
	ids := make([]string, 0, 1000)
	for id := 1000; id < 2000; id++ { // the sim's word tokens start at 1000
		ids = append(ids, fmt.Sprint(id))
	}
	stop := `,"stop_token_ids":[` + strings.Join(ids, ",") + `]`
	body := func(endpoint, extra string) string {
		if endpoint == "/v1/completions" {
			return `{"model":"` + c.Model + `","prompt":"hi","max_tokens":20,"ignore_eos":true` + extra + `}`
		}
		return `{"model":"` + c.Model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":20,"ignore_eos":true` + extra + `}`
	}
	for _, endpoint := range []string{"/v1/chat/completions", "/v1/completions"} {
		status, _, b := send(t, http.MethodPost, c.URL+endpoint, body(endpoint, stop), nil)
		var resp struct {
			Choices []struct {
				Text         *string
				Message      struct{ Content *string }
				FinishReason string          `json:"finish_reason"`
				StopReason   json.RawMessage `json:"stop_reason"`
			}
			Usage struct {
				CompletionTokens int `json:"completion_tokens"`
			}
		}
		if status != http.StatusOK || json.Unmarshal(b, &resp) != nil || len(resp.Choices) != 1 {
			t.Fatalf("%s: %d %.300s", endpoint, status, b)
		}
		ch := resp.Choices[0]
		text := ch.Text
		if text == nil {
			text = ch.Message.Content
		}
		var reason int
		if ch.FinishReason != "stop" || json.Unmarshal(ch.StopReason, &reason) != nil || reason < 1000 || reason >= 2000 ||
			resp.Usage.CompletionTokens != 1 || text == nil || *text != "" {
			t.Errorf("%s: %.400s; want finish_reason stop, stop_reason a listed id, 1 completion token, no text", endpoint, b)
		}
		// Streamed: the finishing chunk carries the id.
		status, _, b = send(t, http.MethodPost, c.URL+endpoint, body(endpoint, `,"stream":true`+stop), nil)
		if status != http.StatusOK || !strings.Contains(string(b), fmt.Sprintf(`"finish_reason":"stop","stop_reason":%d`, reason)) {
			t.Errorf("%s streamed: %d %.600s; want the finishing chunk with stop_reason %d", endpoint, status, b, reason)
		}
		// An empty list or null asks for nothing.
		for _, extra := range []string{`,"stop_token_ids":[]`, `,"stop_token_ids":null`} {
			status, _, b = send(t, http.MethodPost, c.URL+endpoint, body(endpoint, extra), nil)
			if status != http.StatusOK || !strings.Contains(string(b), `"completion_tokens":20`) {
				t.Errorf("%s %s: %d %.300s; want 20 completion tokens", endpoint, extra, status, b)
			}
		}
	}
	for _, extra := range []string{`,"stop_token_ids":"7"`, `,"stop_token_ids":[-1]`, `,"stop_token_ids":[1.5]`, `,"stop_token_ids":[1,null]`, `,"stop_token_ids":[4294967296]`} {
		status, _, b := send(t, http.MethodPost, c.URL+"/v1/chat/completions", body("", extra), nil)
		if status != http.StatusBadRequest || !strings.Contains(string(b), `"param":"stop_token_ids"`) {
			t.Errorf("%s: %d %.300s; want a 400 naming stop_token_ids", extra, status, b)
		}
	}
}
