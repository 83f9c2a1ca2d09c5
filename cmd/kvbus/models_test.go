package main

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/testenv/fakeengine"
)

// TestModelFlag: a frontend serves every --model given (comma-separated or
// repeated, each once); a worker and `kvbus serve` refuse more than one
// rather than keep the last, as a repeated --model did.
func TestModelFlag(t *testing.T) {
	c := parseCLI(t, "frontend", "--model", "a,b", "--model", "c", "--model", "a")
	if got, err := c.Frontend.models(); err != nil || !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Errorf("frontend --model a,b --model c --model a: %v, %v; want [a b c]", got, err)
	}
	if got, _ := parseCLI(t, "frontend").Frontend.models(); !slices.Equal(got, []string{"kvbus-sim"}) {
		t.Errorf("frontend's default models %v, want [kvbus-sim]", got)
	}
	for _, args := range [][]string{
		{"worker", "--model", "a,b", "--metrics-addr", ""},
		{"worker", "--model", "a", "--model", "b", "--metrics-addr", ""},
		{"serve", "--model", "a,b", "--http-addr", "127.0.0.1:0", "--nats-addr", "127.0.0.1:0"},
	} {
		c := parseCLI(t, args...)
		var err error
		if args[0] == "worker" {
			err = c.Worker.Run(t.Context())
		} else {
			err = c.Serve.Run(t.Context())
		}
		if err == nil || !strings.Contains(err.Error(), "runs one model") {
			t.Errorf("%v: %v, want a refusal saying it runs one model", args, err)
		}
	}
}

// TestModelNamesTooLongForASubjectAreRefused: a model name goes into the
// request subject (kvbus.req.<model-token>), and NATS closes the connection
// of a client whose protocol line is over 4096 bytes: a frontend served a
// 5,000-byte name, and the first request for it cut the frontend off NATS
// (every later request of every model a 503). The frontend, a worker and
// `kvbus serve` now refuse such a name at start, naming the limit; the
// longest name allowed is served.
func TestModelNamesTooLongForASubjectAreRefused(t *testing.T) {
	long := "org/" + strings.Repeat("x", 5000)
	for _, args := range [][]string{
		{"frontend", "--model", "a," + long, "--http-addr", "127.0.0.1:0", "--nats-url", "nats://127.0.0.1:1"},
		{"worker", "--model", long, "--metrics-addr", "", "--nats-url", "nats://127.0.0.1:1"},
		{"serve", "--model", long, "--http-addr", "127.0.0.1:0", "--nats-addr", "127.0.0.1:0"},
	} {
		err := runRole(t, args...)
		if err == nil || !strings.Contains(err.Error(), "5004 bytes long") || !strings.Contains(err.Error(), "at most 1024") {
			t.Errorf("%v: %v, want a refusal naming the name's length and the limit", args[0], err)
		}
	}
	longest := strings.Repeat("m", 1024)
	if got, err := parseCLI(t, "frontend", "--model", longest).Frontend.models(); err != nil || !slices.Equal(got, []string{longest}) {
		t.Errorf("a 1024-byte name: %v, %v; want it served", got, err)
	}
}

// TestModelNamesWithSpacesAreRefused: `--model "a, b"` (the way a list is
// often written, in KVBUS_MODEL too) is refused naming the name with spaces.
// Before, the frontend served " b": /v1/models listed it, and every request
// for b got a 404 saying the served models were "a,  b".
func TestModelNamesWithSpacesAreRefused(t *testing.T) {
	for _, args := range [][]string{
		{"frontend", "--model", "a, b", "--http-addr", "127.0.0.1:0", "--nats-url", "nats://127.0.0.1:1"},
		{"worker", "--model", " b", "--metrics-addr", "", "--nats-url", "nats://127.0.0.1:1"},
		{"serve", "--model", "b ", "--http-addr", "127.0.0.1:0", "--nats-addr", "127.0.0.1:0"},
	} {
		err := runRole(t, args...)
		if err == nil || !strings.Contains(err.Error(), "spaces around it") || !strings.Contains(err.Error(), "--model a,b") {
			t.Errorf("%v: %v, want a refusal naming the name with spaces", args, err)
		}
	}
}

// TestEngineTokenizerFrontendServesOneModel: a frontend in front of
// engines (--engine openai) with --tokenizer engine serves one --model. Its
// engines' /tokenize and /v1/models are asked without a model name, of
// whichever --tokenizer-url answers first, so with --model a,b a prompt of
// b was tokenized by a's engine (hashes that never match b's engine's
// blocks) and a name only one engine lists went on the bus under the first
// --model: with engines of org/a (a's) and org/b (b's), org/b's requests
// were placed on a's groups, hashed from a's seed, and org/a was a 404 while
// the list came from b's engine. Refused at start now, naming the models;
// one model, or several with the sim engine, start as before.
func TestEngineTokenizerFrontendServesOneModel(t *testing.T) {
	run := func(args ...string) error {
		c := parseCLI(t, append([]string{"frontend", "--http-addr", "127.0.0.1:0", "--nats-url", "nats://127.0.0.1:1"}, args...)...)
		ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
		defer cancel()
		return c.Frontend.Run(ctx)
	}
	engine := []string{"--tokenizer", "engine", "--tokenizer-url", "http://127.0.0.1:1"}
	err := run(append([]string{"--model", "a,b", "--engine", "openai"}, engine...)...)
	if err == nil || !strings.Contains(err.Error(), "one --model") || !strings.Contains(err.Error(), `"a,b"`) {
		t.Errorf("--model a,b --engine openai --tokenizer engine: %v; want a refusal naming the models", err)
	}
	for _, args := range [][]string{
		append([]string{"--model", "a", "--engine", "openai"}, engine...),
		append([]string{"--model", "a,b"}, engine...),
		{"--model", "a,b", "--engine", "openai"},
	} {
		if err := run(args...); err != nil && strings.Contains(err.Error(), "one --model") {
			t.Errorf("%v: %v; want it to start", args, err)
		}
	}
}

// TestOneFrontendServesTwoModels: `kvbus frontend --model a,b` in front of a
// worker group of each model: /v1/models lists both, and each model's
// requests are answered by its own group.
func TestOneFrontendServesTwoModels(t *testing.T) {
	srv := testenv.StartNATS(t)
	natsURL := srv.ClientURL()
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	httpAddr := freeAddr(t)
	run := func(args ...string) {
		c := parseCLI(t, append(args, "--nats-url", natsURL, "--log-level", "error")...)
		wg.Go(func() {
			var err error
			switch args[0] {
			case "worker":
				err = c.Worker.Run(ctx)
			case "scheduler":
				err = c.Scheduler.Run(ctx)
			default:
				err = c.Frontend.Run(ctx)
			}
			if err != nil && ctx.Err() == nil {
				t.Errorf("%v: %v", args, err)
			}
		})
	}
	run("scheduler", "--metrics-addr", "")
	for _, m := range []string{"a", "b"} {
		run("worker", "--model", m, "--group", "g"+m, "--tp-rank", "0", "--tp-size", "1", "--time-scale", "0", "--kv-capacity", "64MiB", "--metrics-addr", "")
	}
	run("frontend", "--model", "a,b", "--http-addr", httpAddr)
	base := "http://" + httpAddr
	testenv.Eventually(t, 30*time.Second, "/healthz 200", func() bool { return healthz(base+"/healthz") == http.StatusOK })

	status, _, body := testenv.Send(t, http.MethodGet, base+"/v1/models", "", nil)
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &list); status != http.StatusOK || err != nil || len(list.Data) != 2 || list.Data[0].ID != "a" || list.Data[1].ID != "b" {
		t.Errorf("/v1/models: %d %s, want a and b", status, body)
	}
	for _, m := range []string{"a", "b", "a", "b"} {
		var status int
		var body []byte
		// A group is placeable once the scheduler heard it: the first
		// request of a model may find its group not yet ready.
		testenv.Eventually(t, 10*time.Second, "model "+m+" answered", func() bool {
			status, _, body = testenv.Send(t, http.MethodPost, base+"/v1/chat/completions",
				fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"which model?"}],"max_tokens":2}`, m), nil)
			return status == http.StatusOK
		})
		var out struct {
			Model string `json:"model"`
		}
		if err := json.Unmarshal(body, &out); err != nil || out.Model != m {
			t.Errorf("model %s: answer %s", m, body)
		}
	}
	status, _, body = testenv.Send(t, http.MethodPost, base+"/v1/chat/completions", `{"model":"c","messages":[{"role":"user","content":"x"}]}`, nil)
	if status != http.StatusNotFound {
		t.Errorf("an unknown model: %d %s, want a 404 naming the served models", status, body)
	}
}

// TestEngineTokenizerSendsTheEngineAPIKey: in front of engines started with
// vLLM's --api-key, which guards /v1/, the frontend's --tokenizer engine
// reads their GET /v1/models with --engine-api-key (the frontend's own flag;
// serve's, the workers' one): /v1/models lists the engines' entries, a LoRA
// adapter of theirs included, and a request naming the adapter is not a
// 404. Before, the frontend had no way to send the key (its tokenizer's
// APIKey was never set): every model list it asked for was a 401, dropped
// without a word, so only --model was served and the adapter was a 404.
func TestEngineTokenizerSendsTheEngineAPIKey(t *testing.T) {
	e, err := fakeengine.New(fakeengine.Config{ModelName: "kvbus-sim", APIKey: "sk-engine", LoRAModules: []string{"ad1"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	natsURL := testenv.StartNATS(t).ClientURL()
	for _, cmd := range []string{"frontend", "serve"} {
		t.Run(cmd, func(t *testing.T) {
			base := startEngineFrontend(t, cmd, natsURL, e.URL(), "--engine-api-key", "sk-engine")
			var status int
			var body []byte
			status, _, body = testenv.Send(t, http.MethodGet, base+"/v1/models", "", nil)
			if status != http.StatusOK {
				t.Errorf("%s --engine-api-key: GET /v1/models: %d %s, want 200", cmd, status, body)
			}
			var list struct {
				Data []struct {
					ID string `json:"id"`
				} `json:"data"`
			}
			var ids []string
			if err := json.Unmarshal(body, &list); err == nil {
				for _, m := range list.Data {
					ids = append(ids, m.ID)
				}
			}
			if !slices.Contains(ids, "ad1") {
				t.Errorf("%s --engine-api-key: /v1/models lists %v (%s), want the engine's adapter ad1 too", cmd, ids, body)
			}
			status, _, body = testenv.Send(t, http.MethodPost, base+"/v1/chat/completions",
				`{"model":"ad1","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`, nil)
			if status == http.StatusNotFound {
				t.Errorf("%s: a request for the engine's adapter ad1: %d %s", cmd, status, body)
			}
		})
	}
}

// TestEngineTokenizerVerifiesHTTPSEnginesWithTheEngineCA: the frontend's
// --tokenizer engine connects to https engines with --engine-tls-ca (the
// frontend's own flag; serve's, the workers' one), as the driver ranks do:
// /tokenize answers with the engine's tokens and /v1/models lists the
// engine's entries. Before, the frontend had no such flag and serve gave its
// own to the workers only: an engine whose certificate a private CA signed
// failed every /tokenize the frontend asked ("certificate signed by unknown
// authority"), so every request was a 503 tokenizer_unavailable.
func TestEngineTokenizerVerifiesHTTPSEnginesWithTheEngineCA(t *testing.T) {
	e, err := fakeengine.New(fakeengine.Config{ModelName: "kvbus-sim", LoRAModules: []string{"ad1"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	up, err := url.Parse(e.URL())
	if err != nil {
		t.Fatal(err)
	}
	engine := httptest.NewTLSServer(httputil.NewSingleHostReverseProxy(up))
	t.Cleanup(engine.Close)
	ca := filepath.Join(t.TempDir(), "engine-ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: engine.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	natsURL := testenv.StartNATS(t).ClientURL()
	for _, cmd := range []string{"frontend", "serve"} {
		t.Run(cmd, func(t *testing.T) {
			base := startEngineFrontend(t, cmd, natsURL, engine.URL, "--engine-tls-ca", ca)
			status, _, body := testenv.Send(t, http.MethodPost, base+"/tokenize", `{"prompt":"hello there"}`, nil)
			if status != http.StatusOK || !strings.Contains(string(body), `"tokens"`) {
				t.Errorf("%s --engine-tls-ca: /tokenize: %d %s, want the https engine's tokens", cmd, status, body)
			}
			status, _, body = testenv.Send(t, http.MethodGet, base+"/v1/models", "", nil)
			if status != http.StatusOK {
				t.Errorf("%s --engine-api-key: GET /v1/models: %d %s, want 200", cmd, status, body)
			}
			if status != http.StatusOK || !strings.Contains(string(body), `"ad1"`) {
				t.Errorf("%s --engine-tls-ca: /v1/models: %d %s, want the https engine's adapter ad1 listed", cmd, status, body)
			}
		})
	}
}

// startEngineFrontend runs `kvbus frontend` (on natsURL) or `kvbus serve`
// (cmd) with --engine openai and --tokenizer engine in front of engineURL,
// and args, until the test ends; it returns the base URL once the HTTP
// server listens.
func startEngineFrontend(t *testing.T, cmd, natsURL, engineURL string, args ...string) string {
	t.Helper()
	httpAddr := freeAddr(t)
	args = append([]string{cmd, "--http-addr", httpAddr, "--engine", "openai", "--tokenizer", "engine",
		"--tokenizer-url", engineURL, "--log-level", "error"}, args...)
	if cmd == "frontend" {
		args = append(args, "--nats-url", natsURL)
	} else {
		args = append(args, "--engine-url", engineURL, "--nats-addr", freeAddr(t), "--ranks", "1")
	}
	c := parseCLI(t, args...)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		if cmd == "frontend" {
			done <- c.Frontend.Run(ctx)
		} else {
			done <- c.Serve.Run(ctx)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	base := "http://" + httpAddr
	testenv.Eventually(t, 30*time.Second, cmd+" listening", func() bool {
		select {
		case err := <-done:
			done <- err // for the cleanup
			t.Fatalf("%s: %v", cmd, err)
		default:
		}
		return healthz(base+"/livez") == http.StatusOK
	})
	return base
}

// runRole runs the frontend, worker or serve command line args for at most
// 10 s and returns its error.
func runRole(t *testing.T, args ...string) error {
	t.Helper()
	c := parseCLI(t, args...)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	switch args[0] {
	case "frontend":
		return c.Frontend.Run(ctx)
	case "worker":
		return c.Worker.Run(ctx)
	case "serve":
		return c.Serve.Run(ctx)
	}
	t.Fatalf("runRole: no role %q", args[0])
	return nil
}
