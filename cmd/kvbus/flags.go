package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/alecthomas/kong"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// natsFlags say how a role reaches NATS. The file flags are plain
// strings, expanded by config: kong's type:"path" made an empty value (an
// empty KVBUS_NATS_NKEY=, say) the current directory.
type natsFlags struct {
	NATSURL      string        `name:"nats-url" default:"nats://127.0.0.1:4222" help:"NATS server URL(s), comma-separated."`
	NATSCreds    string        `name:"nats-creds" help:"NATS credentials file (JWT and nkey seed)."`
	NATSNKey     string        `name:"nats-nkey" help:"File holding an nkey seed."`
	NATSToken    string        `name:"nats-token" help:"NATS authentication token."`
	NATSUser     string        `name:"nats-user" help:"NATS user name."`
	NATSPassword string        `name:"nats-password" help:"NATS password (with --nats-user)."`
	NATSTLSCA    string        `name:"nats-tls-ca" help:"CA certificate (PEM) to verify the NATS server."`
	NATSTLSCert  string        `name:"nats-tls-cert" help:"Client certificate (PEM)."`
	NATSTLSKey   string        `name:"nats-tls-key" help:"Client key (PEM)."`
	NATSPing     time.Duration `name:"nats-ping-interval" positive:"" min:"1s" default:"5s" help:"How often to ping the NATS server (at least 1s); a server that answers none of three pings in a row is left for another of the cluster (a host that stopped closes no socket)."`
}

// config is the connection of a role named name whose reply inboxes start
// with inbox (bus.InboxPrefix; "" for the tools, which use the admin key).
// An empty (or blank) value is unset.
func (f natsFlags) config(name, inbox string, log *slog.Logger) bus.Config {
	return bus.Config{
		URL: f.NATSURL, Name: name, CredsFile: filePath(f.NATSCreds), NKeySeedFile: filePath(f.NATSNKey), Token: f.NATSToken,
		User: f.NATSUser, Password: f.NATSPassword,
		TLSCA: filePath(f.NATSTLSCA), TLSCert: filePath(f.NATSTLSCert), TLSKey: filePath(f.NATSTLSKey),
		InboxPrefix: inbox, Logger: log, PingInterval: f.NATSPing,
	}
}

// filePath is a file flag's value with ~ expanded and made absolute, as
// kong's type:"path" does; an empty or blank value stays "" (unset).
func filePath(s string) string {
	if strings.TrimSpace(s) == "" {
		return ""
	}
	return kong.ExpandPath(s)
}

// logFlags choose the log format.
type logFlags struct {
	LogFormat string `name:"log-format" enum:"text,json" default:"text" help:"Log format: text or json."`
	LogLevel  string `name:"log-level" enum:"debug,info,warn,error" default:"info" help:"Least severe level logged."`
	// out receives the logs; nil means standard error (tests set it).
	out io.Writer
}

// AfterApply sends the logs through the process's log sink, which main
// binds: lines are written by one goroutine, off the request path. A nil
// sink (tests) leaves standard error.
func (f *logFlags) AfterApply(sink *logsink.Writer) error {
	if f.out == nil && sink != nil {
		f.out = sink
	}
	return nil
}

func (f logFlags) logger() *slog.Logger {
	var w io.Writer = os.Stderr
	if f.out != nil {
		w = f.out
	}
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(f.LogLevel))
	opts := &slog.HandlerOptions{Level: lvl}
	if f.LogFormat == "json" {
		return slog.New(logsink.NewJSONHandler(w, opts))
	}
	return slog.New(logsink.NewTextHandler(w, opts))
}

// busFlags are shared by every role that talks to the bus.
type busFlags struct {
	natsFlags  `embed:""`
	logFlags   `embed:""`
	pprofFlags `embed:""`
	Prefix     string `name:"subject-prefix" default:"kvbus" help:"First token of every kvbus subject."`
	Replicas   int    `name:"stream-replicas" positive:"" default:"1" help:"JetStream replicas of the request log and the buckets this role creates (3 on a 3-node NATS cluster); capture, replay and tap create none and ignore it."`
}

func (f busFlags) subjects() messages.Subjects { return messages.Subjects{Prefix: f.Prefix} }

// modelFlags name the served model.
type modelFlags struct {
	Model []string `name:"model" default:"kvbus-sim" help:"Served model name. A frontend serves several (comma-separated or repeated; the first is the default of a request naming none); a worker or serve one."`
}

// one is the one model a worker or `kvbus serve` runs: several are
// refused (a repeated --model kept the last, silently).
func (m modelFlags) one() (string, error) {
	if len(m.Model) != 1 || m.Model[0] == "" {
		return "", fmt.Errorf("--model %q: a worker (and kvbus serve) runs one model; start one worker per model, each with its own groups (a frontend may serve several)",
			strings.Join(m.Model, ","))
	}
	return m.Model[0], checkModelName(m.Model[0])
}

// models are a frontend's served models, each once.
func (m modelFlags) models() ([]string, error) {
	var out []string
	for _, name := range m.Model {
		if name == "" {
			return nil, fmt.Errorf("--model %q: a model name is empty", strings.Join(m.Model, ","))
		}
		if err := checkModelName(name); err != nil {
			return nil, err
		}
		if !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	return out, nil
}

// checkValues refuses the frontend's values that parse but cannot work,
// before anything starts (they were served silently): no session header,
// a request log smaller than one request of --max-body-bytes (every such
// request got 503 request_log_full, with a Retry-After for ever), one
// that drops requests younger than --request-timeout.
func (f frontendFlags) checkValues(rl requestLogFlags, t timeoutFlags) error {
	if len(f.SessionHeader) == 0 {
		return fmt.Errorf("--session-header is empty: give the headers to read a session id from (default X-Session-ID,X-Correlation-ID); a body session_id is read before them either way")
	}
	if rl.RequestLogMaxBytes < f.MaxBodyBytes {
		return fmt.Errorf("--request-log-max-bytes %d is below --max-body-bytes %d: the request log could not hold one request that size; give at least %d, or lower --max-body-bytes",
			rl.RequestLogMaxBytes, f.MaxBodyBytes, f.MaxBodyBytes)
	}
	return rl.checkAge(t)
}

// checkAge refuses a request log that drops requests before their
// deadline (--request-log-max-age 1ms dropped every request before a
// scheduler read it).
func (rl requestLogFlags) checkAge(t timeoutFlags) error {
	if rl.RequestLogMaxAge < t.RequestTimeout {
		return fmt.Errorf("--request-log-max-age %s is below --request-timeout %s: the request log would drop requests before their deadline; give at least %s (default 24h)",
			rl.RequestLogMaxAge, t.RequestTimeout, t.RequestTimeout)
	}
	return nil
}

// frontendFlags configure the HTTP frontend.
type frontendFlags struct {
	HTTPAddr          string        `name:"http-addr" default:":8000" help:"HTTP listen address of the OpenAI-compatible API."`
	SessionHeader     []string      `name:"session-header" default:"X-Session-ID,X-Correlation-ID" help:"Headers read for a session id, in order of precedence (repeatable)."`
	MaxModelLen       int           `name:"max-model-len" positive:"" default:"8192" help:"Largest prompt + completion, in tokens."`
	MaxBodyBytes      byteSize      `name:"max-body-bytes" positive:"" default:"4194304" help:"Largest request body, in bytes or a size such as 8MiB (413 above)."`
	MaxInflight       int           `name:"max-inflight" default:"4096" help:"Generate requests served at once; more get 429 with Retry-After (0: no bound)."`
	APIKey            string        `name:"api-key" help:"Require Authorization: Bearer <key> on /v1/ routes (like vLLM's --api-key)."`
	AllowedOrigins    []string      `name:"allowed-origins" default:"*" help:"Origins browsers may call the API from (CORS), like vLLM's --allowed-origins; * allows any; empty: none."`
	ReadHeaderTimeout time.Duration `name:"read-header-timeout" positive:"" default:"10s" help:"Time a client has to send a request's headers before its connection is closed."`
	IdleTimeout       time.Duration `name:"idle-timeout" positive:"" default:"120s" help:"Idle keep-alive connections are closed after this."`
	StopTimeout       time.Duration `name:"stop-timeout" default:"0s" help:"On SIGTERM, the most the stop may take: requests still running then get a 503 shutting_down (an error event in a stream) and the listener closes; set it a few seconds below the grace period of what stops the process (Kubernetes: 30 s), so clients get an error they retry, not a reset (0: no bound but --request-timeout per request)."`
	ReusePort         bool          `name:"reuse-port" help:"Listen with SO_REUSEPORT (Linux), so that a replacement frontend started with it too listens on the same --http-addr before this one stops; on SIGTERM this one's listener then closes at once, and the requests still sent on connections it has are served, each answered with Connection: close, so that clients move without an error."`
	StopGrace         time.Duration `name:"stop-grace" negative:"allowed" default:"500ms" help:"On SIGTERM, how long, once the requests accepted before it are answered, new requests still get a 503 shutting_down (Connection: close), and /health a 503, before the listener closes (raise it to the deregistration delay of a load balancer in front; 0: the default; negative: none)."`
}

// requestLogFlags bound the JetStream request log; whichever role creates
// the log (frontend or scheduler) applies them.
type requestLogFlags struct {
	RequestLogMaxBytes     byteSize      `name:"request-log-max-bytes" positive:"" default:"1073741824" help:"Cap of the JetStream request log, in bytes or a size such as 2GiB; when undispatched requests fill it, new requests get 503 request_log_full (applies when the log is created)."`
	RequestLogMaxAge       time.Duration `name:"request-log-max-age" positive:"" default:"24h" help:"How long the request log keeps a request (applies when the log is created)."`
	RequestLogHistoryBytes byteSize      `name:"request-log-history-bytes" default:"0" help:"Bytes (or a size such as 64MiB) of dispatched requests kept in the log for capture; schedulers purge older ones (0: half the log's cap, --request-log-max-bytes of the role that created it)."`
}

func (f requestLogFlags) streamConfig() bus.StreamConfig {
	return bus.StreamConfig{MaxBytes: int64(f.RequestLogMaxBytes), MaxAge: f.RequestLogMaxAge, HistoryBytes: int64(f.RequestLogHistoryBytes)}
}

// newOnes says what a stopping frontend does with new requests.
func (f frontendFlags) newOnes() string {
	if f.ReusePort {
		return "its listener closed: new connections go to the frontend sharing the port; requests on open ones are served, with Connection: close"
	}
	return "new ones get 503 shutting_down"
}

// baseConfig maps the flags onto a frontend configuration; the caller adds
// the connection, subjects, model and logging.
func (f frontendFlags) baseConfig(rl requestLogFlags) frontend.Config {
	return frontend.Config{
		Version: buildVersion(), Addr: f.HTTPAddr, SessionHeaders: f.SessionHeader, MaxModelLen: f.MaxModelLen, MaxBodyBytes: int64(f.MaxBodyBytes),
		MaxInflight: f.MaxInflight, APIKey: f.APIKey, AllowedOrigins: f.AllowedOrigins,
		RequestLogMaxBytes: int64(rl.RequestLogMaxBytes), RequestLogMaxAge: rl.RequestLogMaxAge, RequestLogHistoryBytes: int64(rl.RequestLogHistoryBytes),
		ReadHeaderTimeout: f.ReadHeaderTimeout, IdleTimeout: f.IdleTimeout, StopGrace: f.StopGrace, StopTimeout: f.StopTimeout,
		ReusePort: f.ReusePort,
	}
}

// timeoutFlags bound a request end to end.
type timeoutFlags struct {
	RequestTimeout time.Duration `name:"request-timeout" positive:"" default:"60s" help:"Deadline of a request, from arrival to its last token."`
}

// schedulerFlags configure placement.
type schedulerFlags struct {
	Policy           string        `name:"policy" enum:"kv,session,round-robin,random,least-loaded" default:"kv" help:"Placement policy: kv (least prefill cost from the KV index, session as a signal), session (rendezvous on the session id, bounded load), or the baselines round-robin, random, least-loaded."`
	SessionTTL       time.Duration `name:"session-ttl" positive:"" default:"30m" help:"How long a session binding (session → group) lives after its last turn."`
	MaxSessions      int           `name:"max-sessions" positive:"" default:"1000000" help:"Sessions bound at once (the session bucket's bound, and each scheduler's copy of it): beyond it a new session's turns are placed by their prompt alone until older bindings expire."`
	SessionEpsilon   float64       `name:"session-epsilon" default:"0.25" help:"Bounded-load slack of the session policy: a group above (1+ε)× the mean load passes the session on."`
	BlockSize        int           `name:"block-size" positive:"" default:"16" help:"Tokens per KV block."`
	HeartbeatTimeout time.Duration `name:"heartbeat-timeout" positive:"" default:"3s" help:"A group is ready when all its ranks sent a heartbeat within this."`
	NoGroupWait      time.Duration `name:"no-group-wait" positive:"" default:"2s" help:"How long a request waits for a ready worker group before it gets 503 no_ready_group with Retry-After."`
	ResendAfter      time.Duration `name:"resend-after" positive:"" default:"1s" help:"A ReqMeta that a rank has not answered (receipt or result) within this is published again, up to 3 times."`
	FrontendGone     time.Duration `name:"frontend-gone-after" positive:"" default:"10s" help:"A frontend with requests in flight that nobody hears on its output subject for this long (killed: it sent no abort) is gone, and its requests are aborted on their groups; keep it above a frontend's reconnect to another NATS server."`
	Pool             string        `name:"pool" enum:"local,global" default:"global" help:"KV pool: local (a group loads what its own ranks hold) or global (the ranks' stores are one pool: a LoadSpec may read runs of the prefix from other groups, and kv costs loads in prefill time)."`
}

// engineFlags configure ranks and the sim engine.
type engineFlags struct {
	ModelProfile     string        `name:"model-profile" default:"llama-3.1-8b" help:"KV shape of the model: llama-3.1-8b, llama-3.1-70b or tiny."`
	KVCapacity       string        `name:"kv-capacity" default:"1GiB" help:"Block store capacity per rank: a size (64GiB, 512MB) or tokens (4Mtok, 512ktok)."`
	KVPayload        string        `name:"kv-payload" enum:"bytes,accounting" default:"bytes" help:"What a rank keeps per block: the full deterministic bytes, or an 8-byte digest while charging the full size (accounting)."`
	Evict            string        `name:"evict" enum:"lru,session" default:"lru" help:"Eviction: lru, or session (evict a session's blocks together, by the store's group tag)."`
	TimeScale        float64       `name:"time-scale" default:"1" help:"Multiplies the engine's modelled durations; 0 makes it instant."`
	PrefillPerToken  time.Duration `name:"prefill-per-token" default:"60us" help:"Sim engine: prefill time per uncached prompt token."`
	LoadPerToken     time.Duration `name:"load-per-token" default:"5us" help:"Sim engine: time to load one cached token's KV."`
	RemoteLoad       time.Duration `name:"remote-load-per-token" default:"15us" help:"Sim engine: time to load one cached token's KV from another group's segment of the pool (--pool global)."`
	DecodePerToken   time.Duration `name:"decode-per-token" default:"10ms" help:"Sim engine: time per output token after the first (the prefill yields the first, as in vLLM)."`
	HeartbeatEvery   time.Duration `name:"heartbeat-interval" positive:"" min:"10ms" default:"1s" help:"How often a rank sends a heartbeat (at least 10ms)."`
	ShutdownTimeout  time.Duration `name:"shutdown-timeout" positive:"" default:"10s" help:"How long a stopping rank lets in-flight requests finish."`
	SaveWait         time.Duration `name:"save-wait" positive:"" default:"2s" help:"How long a load waits for a block this rank is still saving (the previous turn's); past it the block is recomputed."`
	DrainHandoff     string        `name:"drain-handoff" default:"512MiB" help:"When a group is scaled down, each of its ranks hands up to this much of its most recently used blocks (whole sessions; a size or tokens) to the same rank of other ready groups before it exits, so its conversations keep their cache; 0 turns it off."`
	DefaultMaxTokens int           `name:"default-max-tokens" positive:"" default:"256" help:"Sim engine: max tokens when a request sets none."`
	StreamReplay     string        `name:"stream-replay" default:"64MiB" help:"A driver rank keeps the outputs of its answers, up to this size, to send again those lost on the bus (a NATS server of a cluster stopped): a stream's for 10 s after it ends, so that a frontend that lost some can ask for them and the client's stream goes on instead of ending with output_lost; every answer's until its NATS server confirmed it, sent again after the driver's own reconnect instead of waiting for --request-timeout; 0 keeps none."`
}

// checkSizes reports a bad --model-profile, --kv-capacity or
// --drain-handoff, or a store larger than the memory here (unless
// engineCache: a model server keeps the cache), before a role connects to
// anything.
func (f engineFlags) checkSizes(tpSize, blockSize int, engineCache bool) error {
	profile, err := workers.LookupModelProfile(f.ModelProfile)
	if err != nil {
		return err
	}
	capacity, err := kvCapacity(f.KVCapacity, profile.BytesPerTokenPerRank(tpSize), blockSize)
	if err != nil {
		return err
	}
	if !engineCache {
		if err := fitStores(f.KVPayload, f.KVCapacity, 1, capacity, rolesNone); err != nil {
			return err
		}
	}
	if _, err = f.drainHandoff(profile.BytesPerTokenPerRank(tpSize)); err != nil {
		return err
	}
	_, err = f.streamReplay()
	return err
}

// streamReplay is --stream-replay in bytes (negative: off, as
// workers.RankConfig.ReplayBytes takes it).
func (f engineFlags) streamReplay() (int64, error) {
	if strings.TrimSpace(f.StreamReplay) == "0" {
		return -1, nil
	}
	n, err := workers.ParseCapacity(f.StreamReplay, 0)
	if err != nil {
		return 0, fmt.Errorf("--stream-replay: bad size %q: want a size such as 64MiB (or 0 to keep nothing)", f.StreamReplay)
	}
	return n, nil
}

// kvCapacity is --kv-capacity in bytes per rank. Less than one block of
// blockSize tokens is refused: a rank could hold nothing ("12" is 12 bytes).
func kvCapacity(s string, bytesPerToken, blockSize int) (int64, error) {
	n, err := workers.ParseCapacity(s, bytesPerToken)
	if err != nil {
		return 0, fmt.Errorf("--kv-capacity: %w", err)
	}
	if block := int64(bytesPerToken) * int64(max(blockSize, 1)); n < block {
		return 0, fmt.Errorf("--kv-capacity %s is %d bytes per rank, less than one block of %d tokens (%d bytes): give a size such as 8GiB or a token count such as 4Mtok",
			s, n, blockSize, block)
	}
	return n, nil
}

// drainHandoff is --drain-handoff in bytes per rank (0: off).
// handoffOn reports whether --drain-handoff is not 0.
func (f engineFlags) handoffOn() bool { return strings.TrimSpace(f.DrainHandoff) != "0" }

func (f engineFlags) drainHandoff(bytesPerToken int) (int64, error) {
	if !f.handoffOn() {
		return 0, nil
	}
	n, err := workers.ParseCapacity(f.DrainHandoff, bytesPerToken)
	if err != nil {
		return 0, fmt.Errorf("--drain-handoff: %w (or 0 to turn it off)", err)
	}
	return n, nil
}

func (f engineFlags) engine() (*workers.SimEngine, error) {
	return workers.NewSimEngine(workers.SimConfig{
		Profile: workers.SimProfile{PrefillPerToken: f.PrefillPerToken, LoadPerToken: f.LoadPerToken, RemoteLoadPerToken: f.RemoteLoad,
			DecodePerToken: f.DecodePerToken},
		TimeScale: f.TimeScale, DefaultMaxTokens: f.DefaultMaxTokens,
	})
}

// engineAdapterFlags put model servers behind the groups (--engine openai).
type engineAdapterFlags struct {
	Engine                string        `name:"engine" enum:"sim,openai" default:"sim" help:"What runs requests on a group's driver rank: sim (the simulated engine) or openai (an OpenAI-compatible model server such as vLLM at --engine-url; the group is then one rank, and the engine's KV events feed the index)."`
	EngineURL             []string      `name:"engine-url" sep:"," help:"--engine openai: the engine's base URL, http(s)://HOST:PORT (kvbus adds /v1/chat/completions, /v1/completions, /health). serve takes one per group, comma-separated."`
	EngineModel           string        `name:"engine-model" help:"--engine openai: the model name the engine serves, when clients use another (--model); empty sends the client's."`
	EngineAPIKey          string        `name:"engine-api-key" help:"--engine openai: sent to the engine as Authorization: Bearer <key> (vLLM's --api-key); never logged."`
	EngineMaxConcurrency  int           `name:"engine-max-concurrency" positive:"" default:"256" help:"--engine openai: requests in flight at one engine; more wait in the rank."`
	EngineConnectTimeout  time.Duration `name:"engine-connect-timeout" positive:"" default:"5s" help:"--engine openai: bound on connecting to the engine."`
	EngineTimeout         time.Duration `name:"engine-timeout" default:"0s" help:"--engine openai: bound on one request at the engine, its retries and waits for a healthy engine included (0: only --request-timeout)."`
	EngineHealthInterval  time.Duration `name:"engine-health-interval" positive:"" min:"10ms" default:"1s" help:"--engine openai: how often the engine's /health is polled (at least 10ms); while it fails the group takes no requests and its queued ones move."`
	EngineHealthTimeout   time.Duration `name:"engine-health-timeout" positive:"" default:"5s" help:"--engine openai: bound on one /health poll; a healthy engine is taken out after 3 failed polls in a row (at once when it refuses the connection or a request finds it down)."`
	EngineUnavailableWait time.Duration `name:"engine-unavailable-wait" positive:"" default:"2s" help:"--engine openai: how long a request waits for an engine that is down (or to be moved to another group) before it fails with 503 group_failed."`
	engineTLSFlags        `embed:""`
	KVEvents              []string `name:"kv-events" sep:"," help:"--engine openai: the engine's ZeroMQ KV event publisher to connect to, tcp://HOST:PORT (vLLM's --kv-events-config endpoint). serve takes one per group."`
	KVEventsBind          []string `name:"kv-events-bind" sep:"," help:"--engine openai: bind a SUB socket here, tcp://ADDR:PORT, for engines that connect to their subscriber (llm-d's simulator), instead of --kv-events."`
	KVEventsTopic         string   `name:"kv-events-topic" help:"--engine openai: topic prefix of the engine's KV events (vLLM's kv-events-config topic); empty: all."`
	KVEventsReplay        []string `name:"kv-events-replay" sep:"," help:"--engine openai: the engine's KV event replay endpoint (vLLM's replay_endpoint), to recover lost batches; without it a gap clears the group's blocks."`
}

// openAI returns the engine configuration of group i's model server and
// its KV event subscription (nil without one).
func (f engineAdapterFlags) openAI(i int) (workers.OpenAIConfig, *vllmevents.Config, error) {
	nth := func(list []string, name string) (string, error) {
		switch {
		case len(list) == 0:
			return "", nil
		case i >= len(list):
			return "", fmt.Errorf("%s has %d entries: give one per group", name, len(list))
		}
		return list[i], nil
	}
	url, err := nth(f.EngineURL, "--engine-url")
	if err != nil {
		return workers.OpenAIConfig{}, nil, err
	}
	tlsCfg, err := f.tls()
	if err != nil {
		return workers.OpenAIConfig{}, nil, err
	}
	oc := workers.OpenAIConfig{URL: url, Model: f.EngineModel, APIKey: f.EngineAPIKey, MaxConcurrency: f.EngineMaxConcurrency,
		ConnectTimeout: f.EngineConnectTimeout, Timeout: f.EngineTimeout, HealthInterval: f.EngineHealthInterval, HealthTimeout: f.EngineHealthTimeout,
		UnavailableWait: f.EngineUnavailableWait, TLS: tlsCfg}
	if err := oc.Validate(); err != nil {
		return oc, nil, err
	}
	connect, err := nth(f.KVEvents, "--kv-events")
	if err != nil {
		return oc, nil, err
	}
	bind, err := nth(f.KVEventsBind, "--kv-events-bind")
	if err != nil {
		return oc, nil, err
	}
	replay, err := nth(f.KVEventsReplay, "--kv-events-replay")
	if err != nil {
		return oc, nil, err
	}
	if connect == "" && bind == "" {
		if replay != "" {
			return oc, nil, errors.New("--kv-events-replay needs --kv-events or --kv-events-bind")
		}
		return oc, nil, nil
	}
	if connect != "" && bind != "" {
		return oc, nil, errors.New("give --kv-events (connect to the engine) or --kv-events-bind (the engine connects), not both")
	}
	ev := &vllmevents.Config{Endpoint: connect, Topic: f.KVEventsTopic, ReplayEndpoint: replay}
	if bind != "" {
		ev.Endpoint, ev.Bind = bind, true
	}
	if err := ev.Validate(); err != nil {
		return oc, nil, fmt.Errorf("--kv-events: %w", err)
	}
	return oc, ev, nil
}

// engineTLSFlags: how kvbus's clients of the engines (the driver ranks, and
// the frontend's --tokenizer engine) connect to an https engine.
type engineTLSFlags struct {
	EngineTLSCA       string `name:"engine-tls-ca" type:"path" help:"--engine openai: CA certificate (PEM) to verify an https engine."`
	EngineTLSCert     string `name:"engine-tls-cert" type:"path" help:"--engine openai: client certificate (PEM) for an engine that wants mutual TLS."`
	EngineTLSKey      string `name:"engine-tls-key" type:"path" help:"--engine openai: client key (PEM)."`
	EngineTLSInsecure bool   `name:"engine-tls-insecure-skip-verify" help:"--engine openai: do not verify the engine's certificate (testing only)."`
}

// tls is the engine's TLS configuration; nil means Go's defaults.
func (f engineTLSFlags) tls() (*tls.Config, error) {
	if f.EngineTLSCA == "" && f.EngineTLSCert == "" && !f.EngineTLSInsecure {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: f.EngineTLSInsecure} //nolint:gosec // the operator asked for it
	if f.EngineTLSCA != "" {
		pem, err := os.ReadFile(f.EngineTLSCA)
		if err != nil {
			return nil, fmt.Errorf("--engine-tls-ca: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--engine-tls-ca %s holds no PEM certificate", f.EngineTLSCA)
		}
	}
	if (f.EngineTLSCert == "") != (f.EngineTLSKey == "") {
		return nil, errors.New("--engine-tls-cert and --engine-tls-key go together")
	}
	if f.EngineTLSCert != "" {
		cert, err := tls.LoadX509KeyPair(f.EngineTLSCert, f.EngineTLSKey)
		if err != nil {
			return nil, fmt.Errorf("--engine-tls-cert/--engine-tls-key: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// tokenizerFlags choose how the frontend tokenizes.
type tokenizerFlags struct {
	Tokenizer        string        `name:"tokenizer" enum:"o200k,engine" default:"o200k" help:"o200k (the embedded o200k_base BPE with a ChatML template, for the sim) or engine (the engine's POST /tokenize at --tokenizer-url, so block hashes match its cache)."`
	TokenizerURL     []string      `name:"tokenizer-url" sep:"," help:"--tokenizer engine: base URLs of engines serving the model, comma-separated; the first that answers tokenizes."`
	TokenizerTimeout time.Duration `name:"tokenizer-timeout" positive:"" default:"5s" help:"--tokenizer engine: bound on one /tokenize call to one engine; past it the next --tokenizer-url is asked (and the slow one only after the others for 10s); when none answers, the request gets 503 tokenizer_unavailable."`
}

// tokenizer returns the configured tokenizer; nil means the embedded one.
// It names no model: the engine tokenizes for the one it serves. apiKey
// (--engine-api-key) goes to the engines as a bearer token: vLLM's
// --api-key guards its /v1/models, which --tokenizer engine reads; tf
// (--engine-tls-*) is how it connects to https engines.
func (f tokenizerFlags) tokenizer(apiKey string, tf engineTLSFlags) (frontend.Tokenizer, error) {
	if f.Tokenizer != "engine" {
		if len(f.TokenizerURL) > 0 {
			return nil, errors.New("--tokenizer-url needs --tokenizer engine")
		}
		return nil, nil
	}
	tlsCfg, err := tf.tls()
	if err != nil {
		return nil, err
	}
	return frontend.NewEngineTokenizer(frontend.EngineTokenizerConfig{URLs: f.TokenizerURL, Timeout: f.TokenizerTimeout, APIKey: apiKey, TLS: tlsCfg})
}

// checkModelName refuses a model name with spaces around it: `--model
// "a, b"` (or KVBUS_MODEL="a, b") served " b", which no client names, and
// every request for b was a 404 listing "a,  b". It also refuses a name too
// long for the request subject (messages.MaxModelBytes): the first request
// for it got its frontend's NATS connection closed.
func checkModelName(n string) error {
	if n != strings.TrimSpace(n) {
		return fmt.Errorf("--model: the model name %q has spaces around it, which clients would have to send; "+
			"separate names with a comma alone (--model a,b) or repeat --model", n)
	}
	if len(n) > messages.MaxModelBytes {
		return fmt.Errorf("--model: the model name %.40q… is %d bytes long, and a model name may be at most %d: "+
			"it is spelled in the request subject, and NATS closes the connection of a client whose subject is "+
			"too long; serve the model under a shorter name", n, len(n), messages.MaxModelBytes)
	}
	return nil
}

// maxStreamReplicas is JetStream's bound on a stream's replicas
// (server.StreamMaxReplicas).
const maxStreamReplicas = 5

// checkReplicas refuses, before connecting, a --stream-replicas JetStream
// never keeps (the server said "maximum replicas is 5", naming no flag).
func (f busFlags) checkReplicas() error {
	if f.Replicas > maxStreamReplicas {
		return fmt.Errorf("--stream-replicas %d: JetStream keeps at most %d replicas; give the number of servers of the NATS cluster (3 on a 3-node cluster), or 1 on one server",
			f.Replicas, maxStreamReplicas)
	}
	return nil
}

// jsReplicasNotSupported is the JetStream API error of a stream or bucket
// with replicas > 1 on a server that is not clustered.
const jsReplicasNotSupported = 10074

// replicasAdvice adds to err, a role's error, what to give --stream-replicas
// when the NATS server refused its replicas for running alone: the
// server's words ("replicas > 1 not supported in non-clustered mode")
// named neither the flag nor what to do.
func (f busFlags) replicasAdvice(err error) error {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == jsReplicasNotSupported {
		return fmt.Errorf("%w: --stream-replicas %d needs a NATS cluster of as many servers, and this NATS server runs alone: give --stream-replicas 1 (the default), or run a cluster (kvbus nats --cluster-addr … --routes …)",
			err, f.Replicas)
	}
	return err
}

// given names the engine TLS flags given.
func (f engineTLSFlags) given() []string {
	var out []string
	for _, g := range []struct {
		name string
		set  bool
	}{{"--engine-tls-ca", f.EngineTLSCA != ""}, {"--engine-tls-cert", f.EngineTLSCert != ""}, {"--engine-tls-key", f.EngineTLSKey != ""},
		{"--engine-tls-insecure-skip-verify", f.EngineTLSInsecure}} {
		if g.set {
			out = append(out, g.name)
		}
	}
	return out
}

// openAIOnly refuses the flags of --engine openai given to the sim engine,
// which ignored them without a word (--engine-tls-ca naming no file at
// all, say). tokenizerEngine: --tokenizer engine uses --engine-api-key and
// the TLS flags too (serve).
func (f engineAdapterFlags) openAIOnly(tokenizerEngine bool) error {
	if f.Engine == workers.EngineOpenAI {
		return nil
	}
	var given []string
	for _, g := range []struct {
		name string
		set  bool
	}{{"--engine-url", len(f.EngineURL) > 0}, {"--engine-model", f.EngineModel != ""}, {"--kv-events", len(f.KVEvents) > 0},
		{"--kv-events-bind", len(f.KVEventsBind) > 0}, {"--kv-events-topic", f.KVEventsTopic != ""}, {"--kv-events-replay", len(f.KVEventsReplay) > 0}} {
		if g.set {
			given = append(given, g.name)
		}
	}
	if !tokenizerEngine {
		if f.EngineAPIKey != "" {
			given = append(given, "--engine-api-key")
		}
		given = append(given, f.engineTLSFlags.given()...)
	}
	if len(given) > 0 {
		return fmt.Errorf("%s given, but only --engine openai uses them and the sim engine runs here: add --engine openai, or drop them (a value may come from a KVBUS_* environment variable)",
			strings.Join(given, ", "))
	}
	return nil
}

// tokenizerOnly refuses the frontend's flags of --tokenizer engine given
// with the embedded tokenizer, which ignored them.
func (f tokenizerFlags) tokenizerOnly(apiKey string, tf engineTLSFlags) error {
	if f.Tokenizer == "engine" {
		return nil
	}
	given := tf.given()
	if apiKey != "" {
		given = append([]string{"--engine-api-key"}, given...)
	}
	if len(given) > 0 {
		return fmt.Errorf("%s given, but a frontend uses them only with --tokenizer engine and the embedded tokenizer runs here: add --tokenizer engine --tokenizer-url …, or drop them (a value may come from a KVBUS_* environment variable)",
			strings.Join(given, ", "))
	}
	return nil
}
