package frontend_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestCORS: browsers call the API as they call vLLM's (--allowed-origins,
// default *): a preflight is answered before the API key is checked, with
// every method and the requested headers allowed; answers carry
// Access-Control-Allow-Origin; an origin not in the list gets no
// permission; without origins the frontend answers no preflight.
func TestCORS(t *testing.T) {
	preflight := map[string]string{"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
		"Access-Control-Request-Headers": "authorization,content-type"}
	t.Run("any origin", func(t *testing.T) {
		fe := startFrontend(t, func(c *frontend.Config) { c.AllowedOrigins, c.APIKey = []string{"*"}, "k" })
		answering(t, fe, func(*messages.Request) []*messages.Output {
			return []*messages.Output{{Index: 0, Text: "ok", FinishReason: "stop", Usage: &messages.Usage{PromptTokens: 1, CompletionTokens: 1}}}
		})
		status, h, b := testenv.Send(t, http.MethodOptions, fe.url+"/v1/chat/completions", "", preflight)
		if status != http.StatusOK || h.Get("Access-Control-Allow-Origin") != "*" || !strings.Contains(h.Get("Access-Control-Allow-Methods"), "POST") ||
			h.Get("Access-Control-Allow-Headers") != "authorization,content-type" {
			t.Errorf("preflight: %d %v %s", status, h, b)
		}
		status, h, b = testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", `{"model":"kvbus-sim",`+chatHi[1:]+`}`,
			map[string]string{"Origin": "http://app.example", "Authorization": "Bearer k"})
		if status != http.StatusOK || h.Get("Access-Control-Allow-Origin") != "*" {
			t.Errorf("request from an origin: %d, Access-Control-Allow-Origin %q: %s", status, h.Get("Access-Control-Allow-Origin"), b)
		}
		if status, h, _ = testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", "{}", map[string]string{"Origin": "http://app.example"}); status != http.StatusUnauthorized || h.Get("Access-Control-Allow-Origin") != "*" {
			t.Errorf("without the key: %d, Access-Control-Allow-Origin %q; want 401, readable by the page", status, h.Get("Access-Control-Allow-Origin"))
		}
	})
	t.Run("listed origins", func(t *testing.T) {
		fe := startFrontend(t, func(c *frontend.Config) { c.AllowedOrigins = []string{"http://app.example"} })
		status, h, _ := testenv.Send(t, http.MethodOptions, fe.url+"/v1/models", "", preflight)
		if status != http.StatusOK || h.Get("Access-Control-Allow-Origin") != "http://app.example" || h.Get("Vary") != "Origin" {
			t.Errorf("listed origin: %d %v", status, h)
		}
		other := map[string]string{"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
		status, h, _ = testenv.Send(t, http.MethodOptions, fe.url+"/v1/models", "", other)
		if status != http.StatusBadRequest || h.Get("Access-Control-Allow-Origin") != "" {
			t.Errorf("other origin: %d %v; want 400 without permission", status, h)
		}
	})
	t.Run("off", func(t *testing.T) {
		fe := startFrontend(t, func(*frontend.Config) {})
		status, h, _ := testenv.Send(t, http.MethodOptions, fe.url+"/v1/chat/completions", "", preflight)
		if status != http.StatusMethodNotAllowed || h.Get("Access-Control-Allow-Origin") != "" {
			t.Errorf("no origins: %d %v; want 405 without permission", status, h)
		}
	})
}
