package frontend

import (
	"encoding/json"
	"errors"
	"net/http"
	"testing"
)

// TestTokenizeAnswerWithoutTokens: a 200 whose body has no "tokens" array
// (a proxy's page, another API's answer) is the engine's failure, not an
// empty prompt: the client got a 400 "prompt is empty" for it.
func TestTokenizeAnswerWithoutTokens(t *testing.T) {
	for _, body := range []string{`{}`, `{"count":3}`, `{"tokens":null}`, `{"ok":true}`} {
		ids, err := tokenizeAnswer(http.StatusOK, []byte(body))
		if !errors.Is(err, ErrTokenizerUnavailable) {
			t.Errorf("%s: ids %v, err %v; want ErrTokenizerUnavailable", body, ids, err)
		}
	}
	if ids, err := tokenizeAnswer(http.StatusOK, []byte(`{"count":0,"tokens":[]}`)); err != nil || ids == nil || len(ids) != 0 {
		t.Errorf("an empty token list: %v, %v; want none, no error", ids, err)
	}
}

// FuzzTokenizeAnswer: an engine's /tokenize answer is read without a
// panic as its tokens, the engine's refusal of the request (a 4xx
// TokenizeError) or its failure (ErrTokenizerUnavailable); tokens come
// only from a 200 whose "tokens" array holds them.
func FuzzTokenizeAnswer(f *testing.F) {
	for _, s := range []struct {
		status int
		body   string
	}{
		{200, `{"count":3,"max_model_len":4096,"tokens":[1,2,3],"token_strs":null}`}, {200, `{"tokens":[]}`},
		{200, `{"tokens":null}`}, {200, `{}`}, {200, ``}, {200, `{"tokens":[-1]}`}, {200, `{"tokens":[1.5]}`},
		{200, `{"tokens":[4294967296]}`}, {200, `{"tokens":"1,2"}`}, {200, `{"Tokens":[1],"tokens":[2]}`},
		{400, `{"error":{"message":"bad","type":"BadRequestError","code":400}}`}, {400, `{"object":"error","message":"x"}`},
		{401, `{"error":"no"}`}, {404, ``}, {500, `<html>`}, {302, ``}, {0, ``}, {999, `{}`},
	} {
		f.Add(s.status, []byte(s.body))
	}
	f.Fuzz(func(t *testing.T, status int, data []byte) {
		ids, err := tokenizeAnswer(status, data)
		var te *TokenizeError
		switch {
		case err == nil:
			var out struct {
				Tokens []json.Number `json:"tokens"`
			}
			if status != http.StatusOK || ids == nil || json.Unmarshal(data, &out) != nil || len(out.Tokens) != len(ids) {
				t.Fatalf("status %d, %q accepted as %v", status, data, ids)
			}
		case errors.As(err, &te):
			if te.Status != status || status < 400 || status >= 500 || te.Status == http.StatusUnauthorized || te.Status == http.StatusNotFound {
				t.Fatalf("status %d refused as the request's fault: %v", status, err)
			}
		case !errors.Is(err, ErrTokenizerUnavailable):
			t.Fatalf("status %d, %q: %v is neither", status, data, err)
		}
	})
}
