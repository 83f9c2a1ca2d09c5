package fakeengine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
)

// publisher plays vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py):
// a PUB socket sending three-frame messages (topic, seq as 8 big-endian
// bytes, msgspec payload), seq counting from 0 (KVEventsConfig.FirstSeq), and optionally a ROUTER
// answering replay requests from a buffer of the last batches. Its send
// and skip methods are called under the Engine's lock; the replay buffer
// has its own lock, shared with the replay goroutine.
type publisher struct {
	topic  string
	enc    batchEncoder
	cancel context.CancelFunc
	pub    zmq4.Socket
	addr   string // the bound address, "tcp://host:port", or the one connected to
	router zmq4.Socket
	raddr  string
	wg     sync.WaitGroup

	// Owned by the Engine's lock.
	seq  uint64
	drop int // batches still to drop (buffered, not sent)
	lose int // batches still to lose (not numbered, buffered nor sent)

	bufMu   sync.Mutex
	buffer  []buffered // a ring of the last bufSize batches
	bufNext int        // where the next batch goes once the ring is full
	bufSize int
}

type buffered struct {
	seq     uint64
	payload []byte
}

// quietLog discards go-zeromq's logging (connection errors of peers going
// away, which a test fake need not report).
func quietLog() *log.Logger { return log.New(io.Discard, "", 0) }

func newPublisher(cfg *KVEventsConfig, hashBytes bool) (*publisher, error) {
	ctx, cancel := context.WithCancel(context.Background())
	p := &publisher{
		topic:   cfg.Topic,
		enc:     batchEncoder{form: cfg.EventForm, hashBytes: hashBytes, dpRank: cfg.DataParallelRank, zeroRoot: cfg.ZeroRootParent},
		cancel:  cancel,
		bufSize: cfg.BufferSteps,
		seq:     cfg.FirstSeq,
	}
	p.pub = zmq4.NewPub(ctx, zmq4.WithLogger(quietLog()),
		zmq4.WithDialerRetry(50*time.Millisecond), zmq4.WithDialerMaxRetries(-1),
		zmq4.WithAutomaticReconnect(cfg.Connect))
	if cfg.Connect {
		// ZeroMQ connects in the background, and reconnects, as libzmq
		// does for vLLM; Dial retries until it succeeds or ctx ends.
		p.addr = cfg.Endpoint
		p.wg.Go(func() { _ = p.pub.Dial(cfg.Endpoint) })
	} else {
		if err := p.pub.Listen(cfg.Endpoint); err != nil {
			p.close()
			return nil, fmt.Errorf("fakeengine: bind KV events %s: %w", cfg.Endpoint, err)
		}
		p.addr = boundAddr(cfg.Endpoint, p.pub)
	}
	if cfg.ReplayEndpoint != "" {
		p.router = zmq4.NewRouter(ctx, zmq4.WithLogger(quietLog()))
		if err := p.router.Listen(cfg.ReplayEndpoint); err != nil {
			p.close()
			return nil, fmt.Errorf("fakeengine: bind KV events replay %s: %w", cfg.ReplayEndpoint, err)
		}
		p.raddr = boundAddr(cfg.ReplayEndpoint, p.router)
		p.wg.Go(func() { p.serveReplay(ctx) })
	}
	return p, nil
}

// boundAddr returns the address a socket bound, for ipc the endpoint.
func boundAddr(endpoint string, s zmq4.Socket) string {
	if strings.HasPrefix(endpoint, "ipc://") || s.Addr() == nil {
		return endpoint
	}
	return "tcp://" + s.Addr().String()
}

// send encodes and publishes one batch with the next sequence number;
// it is called under the Engine's lock, which orders the batches. A PUB
// socket never blocks: with no subscriber (yet) the batch is dropped, as
// vLLM's is.
func (p *publisher) send(evs []kvEvent) error {
	if p.lose > 0 {
		p.lose--
		return nil
	}
	payload, err := p.enc.encode(float64(time.Now().UnixNano())/1e9, evs)
	if err != nil {
		return fmt.Errorf("fakeengine: encode KV events: %w", err)
	}
	seq := p.seq
	p.seq++
	var sb [8]byte
	binary.BigEndian.PutUint64(sb[:], seq)
	if p.bufSize > 0 {
		p.bufMu.Lock()
		if len(p.buffer) < p.bufSize {
			p.buffer = append(p.buffer, buffered{seq, payload})
		} else {
			p.buffer[p.bufNext] = buffered{seq, payload}
			p.bufNext = (p.bufNext + 1) % p.bufSize
		}
		p.bufMu.Unlock()
	}
	if p.drop > 0 {
		p.drop--
		return nil
	}
	if err := p.pub.SendMulti(zmq4.NewMsgFrom([]byte(p.topic), sb[:], payload)); err != nil {
		return fmt.Errorf("fakeengine: publish KV events: %w", err)
	}
	return nil
}

// subscribed reports whether a subscriber's subscription matching the
// topic has reached the PUB socket: batches sent before are dropped.
func (p *publisher) subscribed() bool {
	for _, s := range p.pub.(zmq4.Topics).Topics() {
		if strings.HasPrefix(p.topic, s) {
			return true
		}
	}
	return false
}

// serveReplay answers replay requests as ZmqEventPublisher._service_replay
// does: a request [identity, "", start_seq as 8 big-endian bytes] gets one
// [identity, "", seq, payload] per buffered batch with seq >= start_seq,
// oldest first, then [identity, "", END_SEQ, ""]. Requests of another
// number of frames are ignored (vLLM logs them).
func (p *publisher) serveReplay(ctx context.Context) {
	for {
		msg, err := p.router.Recv()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		f := msg.Frames
		if len(f) != 3 {
			continue // vLLM logs "Invalid replay request"
		}
		// vLLM reads int.from_bytes(start_seq_bytes, "big") and does not
		// look at the delimiter.
		id, start := f[0], uint64(0)
		for _, b := range f[2] {
			start = start<<8 | uint64(b)
		}
		for _, b := range p.replayFrom(start) {
			var sb [8]byte
			binary.BigEndian.PutUint64(sb[:], b.seq)
			_ = p.router.SendMulti(zmq4.NewMsgFrom(id, []byte{}, sb[:], b.payload))
		}
		// vLLM's END_SEQ, (-1).to_bytes(8, "big", signed=True).
		end := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
		_ = p.router.SendMulti(zmq4.NewMsgFrom(id, []byte{}, end, []byte{}))
	}
}

// replayFrom returns the buffered batches with seq >= start, oldest first.
func (p *publisher) replayFrom(start uint64) []buffered {
	p.bufMu.Lock()
	defer p.bufMu.Unlock()
	var out []buffered
	for i := range len(p.buffer) {
		b := p.buffer[(p.bufNext+i)%len(p.buffer)]
		if b.seq >= start {
			out = append(out, b)
		}
	}
	return out
}

// close closes the sockets and waits for the publisher's goroutines, but
// for go-zeromq's PUB writer, which never stops (v0.17.0).
func (p *publisher) close() {
	p.cancel()
	_ = p.pub.Close()
	if p.router != nil {
		_ = p.router.Close()
		drain(p.router)
	}
	p.wg.Wait()
}

// drain empties what a closed socket's connection readers still queue:
// go-zeromq's reader goroutine blocks sending into its 10-message queue
// when it is full, and would outlive the socket. With the socket's context
// cancelled Recv picks at random between a queued message and the
// cancellation, so 16 cancellations in a row mean, but for a chance of
// 2^-16, that nothing is queued (as workers/vllmevents' closeSocket).
func drain(s zmq4.Socket) {
	for misses := 0; misses < 16; {
		if _, err := s.Recv(); errors.Is(err, context.Canceled) {
			misses++
		} else {
			misses = 0
		}
	}
}
