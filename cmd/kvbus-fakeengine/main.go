// Command kvbus-fakeengine runs testenv/fakeengine, a fake vLLM
// OpenAI-compatible server with a prefix cache and vLLM's ZeroMQ KV events,
// as a process: it stands in for GPU engines behind `kvbus worker --engine
// openai` where there are none (CI, laptops, docker-compose.engine.yml). It
// is a test tool, not a model server: replies are a deterministic function
// of the prompt.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/alecthomas/kong"

	"github.com/kvbus/kvbus/testenv/fakeengine"
)

type cli struct {
	Addr              string        `name:"addr" default:":8000" help:"HTTP listen address."`
	Model             string        `name:"served-model-name" default:"fake/model" help:"Served model name (vLLM's --served-model-name)."`
	MaxModelLen       int           `name:"max-model-len" default:"8192" help:"Context length (vLLM's --max-model-len)."`
	BlockSize         int           `name:"block-size" default:"16" help:"KV block size (vLLM's --block-size)."`
	CacheBlocks       int           `name:"cache-blocks" default:"4096" help:"Prefix cache capacity in blocks."`
	ReplyTokens       int           `name:"reply-tokens" default:"8" help:"Words in every reply."`
	APIKey            string        `name:"api-key" help:"Require Authorization: Bearer <key> under /v1 (vLLM's --api-key)."`
	TimeToFirstToken  time.Duration `name:"time-to-first-token" default:"0s" help:"Delay of the first token."`
	InterTokenLatency time.Duration `name:"inter-token-latency" default:"0s" help:"Delay of every later token."`
	KVEvents          string        `name:"kv-events" help:"Publish KV events as vLLM's ZmqEventPublisher: bind this endpoint (tcp://*:5557), or connect to it with --kv-events-connect."`
	KVEventsConnect   bool          `name:"kv-events-connect" help:"Connect the PUB socket to a binding subscriber (llm-d's simulator style)."`
	KVEventsTopic     string        `name:"kv-events-topic" help:"Topic frame of every KV event message."`
	KVEventsReplay    string        `name:"kv-events-replay" help:"Bind vLLM's replay ROUTER socket here."`
	EventForm         string        `name:"event-form" enum:"map,array" default:"map" help:"KV event encoding: map (tagged named fields) or array."`
	HashBytes         bool          `name:"hash-bytes" help:"Block hashes as 32-byte sha256 digests (vLLM's default) instead of integers."`
	LoRAModules       []string      `name:"lora-modules" help:"LoRA adapters served next to the model, as vLLM's --lora-modules name=path (the fake loads nothing: the name is what counts)."`
}

func main() {
	var c cli
	kong.Parse(&c, kong.Name("kvbus-fakeengine"), kong.Description("A fake vLLM server for tests and demos: OpenAI endpoints, /tokenize, /health and ZeroMQ KV events."),
		kong.DefaultEnvars("FAKEENGINE"))
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	cfg := fakeengine.Config{Addr: c.Addr, ModelName: c.Model, MaxModelLen: c.MaxModelLen, BlockSize: c.BlockSize,
		CacheBlocks: c.CacheBlocks, ReplyTokens: c.ReplyTokens, APIKey: c.APIKey, HashBytes: c.HashBytes,
		TimeToFirstToken: c.TimeToFirstToken, InterTokenLatency: c.InterTokenLatency}
	for _, m := range c.LoRAModules {
		name, _, _ := strings.Cut(m, "=")
		cfg.LoRAModules = append(cfg.LoRAModules, name)
	}
	if c.KVEvents != "" {
		form := fakeengine.EventFormMap
		if c.EventForm == "array" {
			form = fakeengine.EventFormArray
		}
		cfg.KVEvents = &fakeengine.KVEventsConfig{Endpoint: c.KVEvents, Connect: c.KVEventsConnect, Topic: c.KVEventsTopic,
			ReplayEndpoint: c.KVEventsReplay, EventForm: form}
	}
	e, err := fakeengine.New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvbus-fakeengine:", err)
		os.Exit(2)
	}
	log.Info("fake engine serving", "url", e.URL(), "model", e.ModelName(), "kv_events", e.KVEventsAddr())
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// Every generate request is logged with what kvbus sent it, so that a
	// compose test can check the session id reached the engine.
	seen := 0
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		var reqs []fakeengine.Received
		reqs, seen = e.RequestsSince(seen)
		for _, r := range reqs {
			if strings.HasPrefix(r.Path, "/v1/") && r.Method == "POST" {
				log.Info("request", "path", r.Path, "status", r.Status, "x_request_id", r.Header.Get("X-Request-Id"),
					"x_session_id", r.Header.Get("X-Session-ID"), "vllm_xargs_session_id", r.VLLMXArgs["session_id"],
					"prompt_tokens", len(r.PromptTokens), "cached_tokens", r.CachedTokens)
			}
		}
	}
	log.Info("fake engine stopping")
	if err := e.Close(); err != nil {
		log.Error("close", "err", err)
	}
}
