package vllmevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// DefaultReplayTimeout is Config.ReplayTimeout's default.
const DefaultReplayTimeout = 2 * time.Second

// redialInterval is how often a connecting Subscriber retries an engine
// that is not (or no longer) listening.
const redialInterval = 250 * time.Millisecond

// Config configures a Subscriber.
type Config struct {
	// Endpoint is the engine's event endpoint, "tcp://host:port" or
	// "ipc:///path". vLLM binds its PUB socket (its --kv-events-config
	// endpoint "tcp://*:5557"), so by default the Subscriber connects.
	Endpoint string
	// Bind makes the Subscriber bind Endpoint and let publishers connect,
	// as llm-d's inference simulator does; "tcp://*:5557" binds every
	// interface, port 0 an ephemeral port (see Addr).
	Bind bool
	// Topic is the topic prefix subscribed to (vLLM's kv-events-config
	// topic); empty means every topic.
	Topic string
	// ReplayEndpoint is the engine's replay ROUTER endpoint (vLLM's
	// replay_endpoint), always connected to; empty disables replay, and
	// then every gap is reported to OnGap.
	ReplayEndpoint string
	// ReplayTimeout bounds one replay request; zero means
	// DefaultReplayTimeout.
	ReplayTimeout time.Duration
	// OnGap is told, on Run's goroutine and before the batch that follows
	// them is handled, of batches that were lost: those numbered from
	// `from` up to, not including, `to` (missed, not replayable, or not
	// decodable). to < from means the engine's sequence went back: it
	// restarted, with an empty cache. Either way the engine's state is no
	// longer known: the caller should rebuild (Translator.Reset). Nil
	// means the gaps are only logged and counted.
	OnGap func(from, to uint64)
	// Logger receives problems with the stream; nil means slog.Default().
	Logger *slog.Logger
}

// Validate checks c.
func (c *Config) Validate() error {
	if err := CheckEndpoint(c.Endpoint, c.Bind); err != nil {
		return fmt.Errorf("%w: endpoint: %w", ErrConfig, err)
	}
	if c.ReplayEndpoint != "" {
		if err := CheckEndpoint(c.ReplayEndpoint, false); err != nil {
			return fmt.Errorf("%w: replay endpoint: %w", ErrConfig, err)
		}
	}
	if c.ReplayTimeout < 0 {
		return fmt.Errorf("%w: negative replay timeout", ErrConfig)
	}
	return nil
}

// CheckEndpoint checks a ZeroMQ endpoint: tcp://host:port or ipc://path;
// one to connect to (bind false) needs a host and a port.
func CheckEndpoint(ep string, bind bool) error {
	scheme, addr, ok := strings.Cut(ep, "://")
	switch {
	case ep == "":
		return errors.New("empty")
	case !ok:
		return fmt.Errorf("%q is not transport://address", ep)
	case scheme == "ipc":
		if addr == "" {
			return fmt.Errorf("%q has no path", ep)
		}
		return nil
	case scheme != "tcp":
		return fmt.Errorf("%q: transport %q, want tcp or ipc", ep, scheme)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q: %w", ep, err)
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if port != "*" && err != nil {
		return fmt.Errorf("%q: port %q: give a port number from 1 to 65535 (* or 0 binds any free one)", ep, port)
	}
	if !bind && (host == "" || host == "*" || port == "*" || n == 0) {
		return fmt.Errorf("%q: a connected endpoint needs a host and a port", ep)
	}
	return nil
}

// Handler handles one decoded batch with the engine's sequence number. It
// runs on Run's goroutine; the batch is the handler's. An error ends Run.
type Handler func(seq uint64, b *Batch) error

// SubscriberStats are a Subscriber's counters since it was made.
type SubscriberStats struct {
	Received  uint64 // messages received on the event socket
	Delivered uint64 // batches handed to the handler (replayed ones included)
	Replayed  uint64 // batches recovered by replay
	Malformed uint64 // messages or payloads that could not be decoded
	Filtered  uint64 // messages of another topic
	Gaps      uint64 // gaps reported to OnGap
}

// Subscriber receives an engine's KV event batches over ZeroMQ. Run may
// be called again after it returns, not concurrently; Addr and Stats are
// safe for concurrent use.
type Subscriber struct {
	cfg Config
	log *slog.Logger

	running atomic.Bool
	addrMu  sync.Mutex
	addr    net.Addr

	received, delivered, replayed, malformed, filtered, gaps atomic.Uint64

	// Owned by Run's goroutine.
	started bool    // a seq was seen since Run started
	next    uint64  // the seq expected next
	lastTS  float64 // the engine time of the last batch delivered
	// joinedTS is the engine time of the last batch replayed when Run
	// joined a running engine's stream, until a live batch from after it
	// came: a live batch numbered below next and no later than it is one
	// of those, queued while they were replayed.
	joinedTS float64
	// firstNext: before any batch was delivered, the engine's replay
	// endpoint answered that it held no batch below the one to come, so
	// the next batch delivered is the first the engine published, whatever
	// its number (vLLM counts from 0, llm-d's inference simulator from 1).
	firstNext bool
}

// New returns a Subscriber for cfg, which it validates.
func New(cfg Config) (*Subscriber, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.ReplayTimeout == 0 {
		cfg.ReplayTimeout = DefaultReplayTimeout
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Subscriber{cfg: cfg, log: log.With("endpoint", cfg.Endpoint)}, nil
}

// Addr returns the address a binding Subscriber listens on while it runs,
// nil otherwise.
func (s *Subscriber) Addr() net.Addr {
	s.addrMu.Lock()
	defer s.addrMu.Unlock()
	return s.addr
}

func (s *Subscriber) setAddr(a net.Addr) {
	s.addrMu.Lock()
	s.addr = a
	s.addrMu.Unlock()
}

// Stats returns the Subscriber's counters.
func (s *Subscriber) Stats() SubscriberStats {
	return SubscriberStats{
		Received: s.received.Load(), Delivered: s.delivered.Load(), Replayed: s.replayed.Load(),
		Malformed: s.malformed.Load(), Filtered: s.filtered.Load(), Gaps: s.gaps.Load(),
	}
}

// Run subscribes and hands every batch to h, in sequence order, until ctx
// ends (then it returns nil, within about 250 ms, having closed its
// sockets and stopped its goroutines) or h fails (then it returns h's
// error). A connecting
// Subscriber waits for the engine and reconnects when it goes away
// (ZeroMQ's job); a binding one fails if it cannot bind. A peer that does
// not complete its ZeroMQ handshake within 10 s is dropped. Every message is
// checked (three frames: topic, 8-byte big-endian seq, payload) and
// decoded. With a ReplayEndpoint, Run first asks it for what it holds from
// 0 on (the blocks the engine cached before this Subscriber heard it),
// and again before a first message numbered above 0 if that found
// nothing. After the first message, a seq other than the one expected is
// a gap,
// which is replayed from ReplayEndpoint if set, and otherwise (or for what
// replay cannot recover) reported to OnGap. A payload that does not decode
// is logged and reported as a gap of one.
func (s *Subscriber) Run(ctx context.Context, h Handler) error {
	if h == nil {
		return fmt.Errorf("%w: nil handler", ErrConfig)
	}
	if !s.running.CompareAndSwap(false, true) {
		return fmt.Errorf("%w: Run called while running", ErrConfig)
	}
	defer s.running.Store(false)
	s.started, s.joinedTS, s.firstNext = false, 0, false

	ctx, cancel := context.WithCancel(ctx)
	sock := zmq4.NewSub(ctx,
		zmq4.WithDialerMaxRetries(-1), zmq4.WithDialerRetry(redialInterval),
		// Redialling a binding socket would dial its own endpoint.
		zmq4.WithAutomaticReconnect(!s.cfg.Bind),
		zmq4.WithLogger(slog.NewLogLogger(s.log.Handler(), slog.LevelWarn)))
	defer closeSocket(cancel, sock)
	defer s.setAddr(nil)

	if err := sock.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		return fmt.Errorf("vllmevents: subscribe %q: %w", s.cfg.Topic, err)
	}
	if s.cfg.Bind {
		if err := sock.Listen(zmqEndpoint(s.cfg.Endpoint)); err != nil {
			return fmt.Errorf("vllmevents: bind %s: %w", s.cfg.Endpoint, err)
		}
		if path, ok := strings.CutPrefix(s.cfg.Endpoint, "ipc://"); ok {
			defer os.Remove(path) // as libzmq does; go-zeromq only does it for its own ipc://
		}
		s.setAddr(sock.Addr())
	} else if !s.dial(ctx, sock) {
		return nil
	}
	if s.cfg.ReplayEndpoint != "" {
		// Join the engine's stream: its replay buffer tells the blocks it
		// cached before this Subscriber heard it (a worker started beside
		// a running engine). An engine that does not answer is not up
		// yet, or has published nothing: its first batch asks again.
		if err := s.replayRange(ctx, 0, math.MaxUint64, h, slog.LevelDebug); err != nil {
			return err
		}
	}
	for {
		msg, err := sock.Recv()
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			// A connection ended (the socket redials by itself).
			s.log.Debug("KV event connection ended", "err", err)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		s.received.Add(1)
		if err := s.handle(ctx, msg.Frames, h); err != nil {
			return err
		}
	}
}

// dial connects sock to the engine, retrying until it succeeds (true) or
// ctx ends (false). go-zeromq retries a refused connection by itself; a
// failed handshake (a peer that is not a ZeroMQ PUB) comes back here.
func (s *Subscriber) dial(ctx context.Context, sock zmq4.Socket) bool {
	backoff := redialInterval
	for {
		err := sock.Dial(zmqEndpoint(s.cfg.Endpoint))
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		s.log.Warn("cannot connect to the engine's KV events", "err", err, "retry_in", backoff)
		select {
		case <-ctx.Done():
			return false
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// handle checks one message and delivers it, replaying or reporting what
// it reveals was missed.
func (s *Subscriber) handle(ctx context.Context, frames [][]byte, h Handler) error {
	if len(frames) != 3 {
		s.malformed.Add(1)
		s.log.Warn("KV event message without vLLM's three frames", "frames", len(frames))
		return nil
	}
	topic, seqb, payload := frames[0], frames[1], frames[2]
	if !strings.HasPrefix(string(topic), s.cfg.Topic) {
		// The publisher filters by subscription; this is a backstop.
		s.filtered.Add(1)
		return nil
	}
	if len(seqb) != 8 {
		s.malformed.Add(1)
		s.log.Warn("KV event message with a sequence frame of the wrong size", "bytes", len(seqb))
		return nil
	}
	seq := binary.BigEndian.Uint64(seqb)
	if !s.started && seq > 0 && s.cfg.ReplayEndpoint != "" {
		// The engine published before: join its stream (Run's attempt
		// found nothing, or no engine yet).
		if err := s.replayRange(ctx, 0, seq, h, slog.LevelWarn); err != nil {
			return err
		}
	}
	if s.joinedTS != 0 {
		if seq < s.next {
			if b, err := Decode(payload); err == nil && b.TS <= s.joinedTS {
				return nil // replayed when Run joined the stream
			}
		}
		s.joinedTS = 0
	}
	if s.started && seq != s.next {
		if seq > s.next && s.cfg.ReplayEndpoint != "" {
			if err := s.replayRange(ctx, s.next, seq, h, slog.LevelWarn); err != nil {
				return err
			}
		}
		if seq != s.next {
			s.gap(s.next, seq)
		}
	}
	return s.deliver(seq, payload, h)
}

// deliver decodes one batch and hands it to h; a batch that does not
// decode is a gap of one.
func (s *Subscriber) deliver(seq uint64, payload []byte, h Handler) error {
	first := seq == 0 || s.firstNext
	s.started, s.next, s.firstNext = true, seq+1, false
	b, err := Decode(payload)
	if err != nil {
		s.malformed.Add(1)
		s.log.Warn("undecodable KV event batch", "seq", seq, "err", err)
		s.gap(seq, seq+1)
		return nil
	}
	s.delivered.Add(1)
	s.lastTS = b.TS
	b.First = first
	if err := h(seq, b); err != nil {
		return fmt.Errorf("vllmevents: handler (seq %d): %w", seq, err)
	}
	return nil
}

func (s *Subscriber) gap(from, to uint64) {
	s.gaps.Add(1)
	level := slog.LevelWarn
	if s.cfg.OnGap != nil {
		level = slog.LevelDebug // the caller says what the gap means to it
	}
	if to < from {
		s.log.Log(context.Background(), level, "KV event sequence went back: the engine restarted", "expected", from, "got", to)
	} else {
		s.log.Log(context.Background(), level, "KV event batches lost", "from", from, "to", to)
	}
	if s.cfg.OnGap != nil {
		s.cfg.OnGap(from, to)
	}
}

// replayRange replays the batches numbered from `from` up to `to` and
// delivers those it gets, reporting holes between them (not before the
// first batch since Run started: batches the buffer no longer has from
// before it are history, not a gap); it returns only a handler's error (a
// failed replay is logged at failLevel: the caller reports what is still
// missing).
func (s *Subscriber) replayRange(ctx context.Context, from, to uint64, h Handler, failLevel slog.Level) error {
	joining := !s.started
	var herr error
	errStop := errors.New("stop")
	below := false // the engine holds a batch below to
	err := s.replay(ctx, from, func(seq uint64, payload []byte) error {
		if seq < to {
			below = true
		}
		if seq < s.next || seq >= to {
			return nil // already delivered, or to come live
		}
		if s.started && seq > s.next {
			s.gap(s.next, seq) // no longer in the engine's buffer
		}
		s.replayed.Add(1)
		if herr = s.deliver(seq, payload, h); herr != nil {
			return errStop
		}
		return nil
	})
	if herr != nil {
		return herr
	}
	if err != nil && ctx.Err() == nil {
		s.log.Log(ctx, failLevel, "KV event replay failed", "replay_endpoint", s.cfg.ReplayEndpoint, "from", from, "err", err)
	}
	if joining && s.started {
		s.joinedTS = s.lastTS
	}
	if joining && !s.started && err == nil && !below {
		// The engine answered that it holds nothing before the batch to
		// come: that one is its first.
		s.firstNext = true
	}
	return nil
}

// closeSocket cancels a socket's context, closes it and drains what its
// connection readers still queue: go-zeromq's reader goroutine blocks
// sending into its 10-message queue when it is full, and would outlive the
// socket. With the context cancelled, Recv picks at random between a queued
// message and the cancellation, so 16 cancellations in a row mean, but for
// a chance of 2^-16, that nothing is queued.
func closeSocket(cancel context.CancelFunc, sock zmq4.Socket) {
	cancel()
	_ = sock.Close()
	for misses := 0; misses < 16; {
		if _, err := sock.Recv(); errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			misses++
		} else {
			misses = 0
		}
	}
}
