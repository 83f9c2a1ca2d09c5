package main

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/testenv/fakeengine"
)

// TestProcessEngineCluster puts the real binary in front of two fake vLLM
// engines, each role its own process as an operator runs them: workers
// with --engine openai and --kv-events, a frontend with --tokenizer engine.
// Used the second /healthz passes, conversations find the whole previous
// prompt in their engine's own cache, the engine gets the session id in
// both places vLLM reads it, and when an engine dies its conversations go
// on on the other one.
func TestProcessEngineCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	dir := t.TempDir()
	bin := buildBinary(t, dir)
	var engines []*fakeengine.Engine
	for i := range 2 {
		e, err := fakeengine.New(fakeengine.Config{ModelName: "kvbus-sim", HashBytes: i == 0,
			KVEvents: &fakeengine.KVEventsConfig{Endpoint: "tcp://127.0.0.1:0"}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = e.Close() })
		engines = append(engines, e)
	}
	natsAddr, httpAddr := freeAddr(t), freeAddr(t)
	bus := []string{"--nats-url", "nats://" + natsAddr}
	startProc(t, bin, dir, "nats", "nats", "--addr", natsAddr, "--data-dir", filepath.Join(dir, "js"))
	startProc(t, bin, dir, "scheduler", append([]string{"scheduler", "--pool", "local", "--metrics-addr", freeAddr(t), "--heartbeat-timeout", "1s"}, bus...)...)
	for i, e := range engines {
		startProc(t, bin, dir, fmt.Sprint("worker-", i), append([]string{"worker", "--group", fmt.Sprint("g", i), "--tp-size", "1",
			"--engine", "openai", "--engine-url", e.URL(), "--kv-events", e.KVEventsAddr(), "--engine-health-interval", "200ms",
			"--heartbeat-interval", "200ms", "--metrics-addr", freeAddr(t)}, bus...)...)
	}
	startProc(t, bin, dir, "frontend", append([]string{"frontend", "--http-addr", httpAddr, "--engine", "openai",
		"--tokenizer", "engine", "--tokenizer-url", engines[0].URL() + "," + engines[1].URL()}, bus...)...)
	base := "http://" + httpAddr
	testenv.Eventually(t, 60*time.Second, "/healthz 200", func() bool { return healthz(base+"/healthz") == http.StatusOK })
	for _, e := range engines {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		err := e.WaitSubscribed(ctx)
		cancel()
		if err != nil {
			t.Fatalf("a worker never subscribed to its engine's KV events: %v", err)
		}
	}

	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	onEngine := func(reqID string) int {
		for i, e := range engines {
			for _, r := range e.Requests() {
				if strings.HasPrefix(r.Header.Get("X-Request-Id"), reqID) && r.Path == "/v1/chat/completions" {
					if r.Header.Get("X-Session-ID") == "" || r.VLLMXArgs["session_id"] != r.Header.Get("X-Session-ID") {
						t.Errorf("engine %d got X-Session-ID %q and vllm_xargs %v", i, r.Header.Get("X-Session-ID"), r.VLLMXArgs)
					}
					return i
				}
			}
		}
		t.Fatalf("no engine got %s", reqID)
		return -1
	}
	dialogs := make([]*testenv.Dialog, 4)
	homes := make([]int, 4)
	for conv := range dialogs {
		dialogs[conv] = testenv.Conversation{BaseURL: base, Client: client, Seed: conv,
			Headers: map[string]string{"X-Session-ID": fmt.Sprint("proc-engine-", conv)}}.Start()
		for range 3 {
			if _, err := dialogs[conv].Next(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		turns := dialogs[conv].Turns
		homes[conv] = onEngine(turns[0].RequestID)
		for i, share := range testenv.PreviousShares(turns, fakeengine.DefaultBlockSize) {
			if share < 1 {
				t.Errorf("conversation %d turn %d: %.2f of the previous prompt cached in the engine, want 1.00", conv, i+2, share)
			}
			if e := onEngine(turns[i+1].RequestID); e != homes[conv] {
				t.Errorf("conversation %d turn %d ran on engine %d, its first on %d", conv, i+2, e, homes[conv])
			}
		}
	}
	// Engine 0 dies: its conversations go on on engine 1.
	if err := engines[0].Close(); err != nil {
		t.Fatal(err)
	}
	for conv, d := range dialogs {
		turn, err := d.Next(context.Background())
		if err != nil {
			t.Fatalf("conversation %d after its engine died: %v", conv, err)
		}
		if e := onEngine(turn.RequestID); e != 1 {
			t.Errorf("conversation %d ran on engine %d after engine 0 died", conv, e)
		}
	}
}
