package frontend

import (
	"bytes"
	"encoding/json"
	"testing"
)

// FuzzTokenizeRequest: a /tokenize or /detokenize body is refused with a
// 400, or tokenized into ids that decode back to the prompt's text.
func FuzzTokenizeRequest(f *testing.F) {
	for _, s := range []string{
		``, `{`, `[]`, `null`, `{}`,
		`{"prompt":"hello world"}`, `{"prompt":"a\u0000b  \n\n  c","return_token_strs":true}`,
		`{"prompt":["a"]}`, `{"prompt":"x","messages":[]}`,
		`{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false,"continue_final_message":true}`,
		`{"messages":[{"role":"assistant","content":null}],"continue_final_message":true}`,
		`{"messages":[{"role":"","content":"x"}]}`, `{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}`,
		`{"tokens":[1,2,200264,200266]}`, `{"tokens":[]}`, `{"tokens":[-1]}`, `{"tokens":[1.0,"2"]}`,
		`{"PROMPT":"x","prompt":"y","Tokens":[1]}`,
	} {
		f.Add([]byte(s))
	}
	tok, err := NewBPETokenizer()
	if err != nil {
		f.Fatal(err)
	}
	s := &Server{tok: tok}
	f.Fuzz(func(t *testing.T, body []byte) {
		var req tokenizeRequest
		if e := decodeJSON(body, &req); e != nil {
			checkFuzzError(t, e)
			return
		}
		if ids, e := s.tokenizeForClient(&req); e != nil {
			checkFuzzError(t, e)
		} else {
			text, err := tok.Decode(ids)
			if err != nil {
				t.Fatalf("the ids of %s do not decode: %v", body, err)
			}
			var prompt string
			if raw := bytes.TrimSpace(req.Prompt); len(raw) > 0 && raw[0] == '"' && json.Unmarshal(raw, &prompt) == nil && text != prompt {
				t.Fatalf("prompt %q decodes back as %q", prompt, text)
			}
		}
		var dreq detokenizeRequest
		if e := decodeJSON(body, &dreq); e != nil {
			checkFuzzError(t, e)
			return
		}
		if raw := bytes.TrimSpace(dreq.Tokens); len(raw) > 0 {
			if ids, e := tokenIDs(raw, tok.VocabSize(), "tokens"); e != nil {
				checkFuzzError(t, e)
			} else {
				_, _ = tok.Decode(ids) // an error is the id's, never a panic
			}
		}
	})
}
