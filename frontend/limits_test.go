package frontend_test

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/internal/logbuf"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

func send(t *testing.T, method, url, body string, headers map[string]string) (int, http.Header, []byte) {
	t.Helper()
	return testenv.Send(t, method, url, body, headers)
}

func errorOf(t *testing.T, body []byte) (typ, code string) {
	t.Helper()
	var e struct {
		Error struct {
			Type string  `json:"type"`
			Code *string `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(body, &e); err != nil {
		t.Fatalf("not an OpenAI error body: %s", body)
	}
	if e.Error.Code != nil {
		code = *e.Error.Code
	}
	return e.Error.Type, code
}

func TestAPIKey(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{APIKey: "s3cret"})
	chat := `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	for _, tc := range []struct {
		name, auth string
		want       int
	}{
		{"no key", "", http.StatusUnauthorized},
		{"wrong key", "Bearer nope", http.StatusUnauthorized},
		{"not a bearer", "Basic s3cret", http.StatusUnauthorized},
		{"right key", "Bearer s3cret", http.StatusOK},
	} {
		status, _, body := send(t, http.MethodPost, c.URL+"/v1/chat/completions", chat, map[string]string{"Authorization": tc.auth})
		if status != tc.want {
			t.Errorf("%s: status %d, want %d: %s", tc.name, status, tc.want, body)
			continue
		}
		if status == http.StatusUnauthorized {
			if typ, code := errorOf(t, body); typ != "authentication_error" || code != "invalid_api_key" {
				t.Errorf("%s: error type %q code %q", tc.name, typ, code)
			}
			if strings.Contains(string(body), "s3cret") {
				t.Errorf("%s: the key leaks into the error", tc.name)
			}
		}
	}
	// Probes stay open, like vLLM's.
	if status, _, _ := send(t, http.MethodGet, c.URL+"/health", "", nil); status != http.StatusOK {
		t.Errorf("/health needs no key, got %d", status)
	}
	if got := c.Logs.Lines("s3cret"); len(got) != 0 {
		t.Errorf("the API key appears in the logs: %v", got)
	}
}

func TestMaxInflight(t *testing.T) {
	// A slow engine keeps one streaming request in flight.
	c := testenv.StartCluster(t, testenv.ClusterConfig{MaxInflight: 1, TimeScale: 1})
	slow := `{"messages":[{"role":"user","content":"slow"}],"max_tokens":100,"ignore_eos":true,"stream":true}`
	done := make(chan int, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(slow))
		client := &http.Client{Timeout: 30 * time.Second}
		defer client.CloseIdleConnections()
		resp, err := client.Do(req)
		if err != nil {
			done <- 0
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	testenv.Eventually(t, 10*time.Second, "the slow request in flight", func() bool {
		return len(c.Logs.Lines(`msg="store thread"`)) >= 4
	})
	status, h, body := send(t, http.MethodPost, c.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":1}`, nil)
	if status != http.StatusTooManyRequests || h.Get("Retry-After") == "" {
		t.Fatalf("second request: status %d Retry-After %q: %s", status, h.Get("Retry-After"), body)
	}
	if typ, code := errorOf(t, body); typ != "rate_limit_error" || code != "overloaded" {
		t.Errorf("error type %q code %q", typ, code)
	}
	if got := <-done; got != http.StatusOK {
		t.Errorf("the admitted request ended with %d", got)
	}
}

func TestBusDownIsAFast503(t *testing.T) {
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	c.NATS.Shutdown()
	testenv.Eventually(t, 10*time.Second, "frontend sees NATS down", func() bool {
		status, _, _ := send(t, http.MethodGet, c.URL+"/healthz", "", nil)
		return status == http.StatusServiceUnavailable
	})
	status, h, body := send(t, http.MethodPost, c.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`, nil)
	if status != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
		t.Fatalf("status %d Retry-After %q: %s", status, h.Get("Retry-After"), body)
	}
	if _, code := errorOf(t, body); code != "bus_unavailable" {
		t.Errorf("code %q", code)
	}
}

// TestStopListAboveItsBoundIsA400: a stop list longer than
// frontend.MaxStopStrings is refused with a 400 naming stop and the bound.
// The bound was the bus decoders' (messages.MaxArrayLen strings, ~1 MiB of
// body, within the body limit): one request of 2,048 tokens with 262,143
// stop strings cost the driver 4.7 s of CPU where 1,024 cost 0.48 s and 4
// cost 0.44 s (make run, the process's CPU per request).
func TestStopListAboveItsBoundIsA400(t *testing.T) {
	fe := startFrontend(t, func(*frontend.Config) {})
	for _, n := range []int{frontend.MaxStopStrings + 1, messages.MaxArrayLen + 1} {
		body := `{"model":"kvbus-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stop":[` +
			strings.Repeat(`"a",`, n-1) + `"a"]}`
		status, _, b := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", body, nil)
		if status != http.StatusBadRequest || !strings.Contains(string(b), `"param":"stop"`) || !strings.Contains(string(b), fmt.Sprintf("at most %d", frontend.MaxStopStrings)) {
			t.Errorf("stop with %d strings: %d %.300s; want a 400 naming stop and its bound", n, status, b)
		}
	}
}

// TestRequestAboveTheBusMaxPayloadIsA413: with real engines the client's
// body travels in the Request. Against a NATS server with a 1 MiB
// max_payload (an external server's default), a 1.5 MiB body within
// --max-body-bytes is a 413, not a 503 "retry shortly" that no retry can
// pass.
func TestRequestAboveTheBusMaxPayloadIsA413(t *testing.T) {
	fe := startStandaloneOn(t, bus.ServerConfig{MaxPayload: 1 << 20}, true, func(c *frontend.Config) { c.Passthrough = true })
	img := strings.Repeat("A", 1536<<10)
	body := `{"model":"kvbus-sim","messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},` +
		`{"type":"image_url","image_url":{"url":"data:image/png;base64,` + img + `"}}]}],"max_tokens":4}`
	status, h, b := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", body, nil)
	if status != http.StatusRequestEntityTooLarge || h.Get("Retry-After") != "" || !strings.Contains(string(b), "max_payload") {
		t.Errorf("1.5 MiB body on a 1 MiB bus: %d Retry-After %q %.300s; want a 413 naming max_payload", status, h.Get("Retry-After"), b)
	}
}

// TestRequestAboveTheDecodersLimitIsA413: against a NATS server whose
// max_payload is above kvbus's messages.MaxMessageBytes (an external
// server may take up to 64 MiB), a Request above the latter is a 413
// too: the request log's stream and the schedulers' decoders refuse it.
// It was a 503 "retry shortly" that no retry can pass.
func TestRequestAboveTheDecodersLimitIsA413(t *testing.T) {
	fe := startStandaloneOn(t, bus.ServerConfig{MaxPayload: 16 << 20}, true, func(c *frontend.Config) { c.Passthrough, c.MaxBodyBytes = true, 16<<20 })
	img := strings.Repeat("A", messages.MaxMessageBytes)
	body := `{"model":"kvbus-sim","messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},` +
		`{"type":"image_url","image_url":{"url":"data:image/png;base64,` + img + `"}}]}],"max_tokens":4}`
	status, h, b := testenv.Send(t, http.MethodPost, fe.url+"/v1/chat/completions", body, nil)
	if status != http.StatusRequestEntityTooLarge || h.Get("Retry-After") != "" || !strings.Contains(string(b), "request_too_large") {
		t.Errorf("an 8 MiB body on a 16 MiB bus: %d Retry-After %q %.300s; want a 413", status, h.Get("Retry-After"), b)
	}
}

// TestWrongAPIKeyIsCountedAndLogged proves that a request refused for its
// API key shows: kvbus_frontend_requests_total counts it under status 401,
// and the refusal log has a line at once with the code invalid_api_key,
// then counts the next ones, never with the header's value. It failed
// before: a client with a wrong key showed in no metric and no log line.
func TestWrongAPIKeyIsCountedAndLogged(t *testing.T) {
	logs := &logbuf.Buffer{}
	fe := startFrontend(t, func(c *frontend.Config) {
		c.APIKey, c.Logger = "s3cret", slog.New(slog.NewJSONHandler(logs, nil))
	})
	chat := `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	for _, auth := range []string{"Bearer wr0ng-key-1", "Bearer wr0ng-key-2", ""} {
		if status, _, body := send(t, http.MethodPost, fe.url+"/v1/chat/completions", chat, map[string]string{"Authorization": auth}); status != http.StatusUnauthorized {
			t.Fatalf("%q: %d %s, want 401", auth, status, body)
		}
	}
	if status, _, _ := send(t, http.MethodPost, fe.url+"/v1/completions", `{"prompt":"hi"}`, map[string]string{"Authorization": "Bearer wr0ng-key-3"}); status != http.StatusUnauthorized {
		t.Fatalf("completions: %d, want 401", status)
	}
	_, _, metrics := send(t, http.MethodGet, fe.url+"/metrics", "", nil)
	for _, want := range []string{`kvbus_frontend_requests_total{endpoint="chat",model="",status="401"} 3`,
		`kvbus_frontend_requests_total{endpoint="completions",model="",status="401"} 1`} {
		if !strings.Contains(string(metrics), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	got := logs.Lines("requests refused before reaching the bus")
	if len(got) != 1 || !strings.Contains(got[0], `"last_code":"invalid_api_key"`) || !strings.Contains(got[0], `"last_status":401`) {
		t.Errorf("refusal log: %q; want one line at once naming invalid_api_key (the next ones counted)", got)
	}
	if leaked := logs.Lines("wr0ng-key"); len(leaked) != 0 {
		t.Errorf("the header's value appears in the log: %q", leaked)
	}
}
