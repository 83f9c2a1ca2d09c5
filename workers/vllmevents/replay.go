package vllmevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math"

	"github.com/go-zeromq/zmq4"
)

// replayEnd is vLLM's end-of-replay sequence frame,
// (-1).to_bytes(8, "big", signed=True) (ZmqEventPublisher.END_SEQ).
const replayEnd = math.MaxUint64

// replay asks the engine's replay socket for its buffered batches from
// start on, and calls fn with each, in the order they come, until vLLM's
// end marker; an error of fn ends it and is returned. It implements the
// client side of ZmqEventPublisher._service_replay
// (vllm/distributed/kv_events.py): the request is [empty delimiter, start
// as 8 big-endian bytes] from a DEALER (a REQ socket, as vLLM's example
// uses, could not receive the many replies), each reply [empty delimiter,
// seq, payload] (llm-d's inference simulator and TensorRT-LLM put the
// topic before seq), the end [empty delimiter, END_SEQ, empty]. A fresh socket
// per request keeps a late reply to a timed-out request from being taken
// for a reply to the next one.
func (s *Subscriber) replay(ctx context.Context, start uint64, fn func(seq uint64, payload []byte) error) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReplayTimeout)
	dealer := zmq4.NewDealer(ctx,
		zmq4.WithDialerMaxRetries(1), zmq4.WithDialerRetry(redialInterval),
		zmq4.WithLogger(slog.NewLogLogger(s.log.Handler(), slog.LevelWarn)))
	defer closeSocket(cancel, dealer)
	if err := dealer.Dial(zmqEndpoint(s.cfg.ReplayEndpoint)); err != nil {
		return fmt.Errorf("%w: connect %s: %w", ErrReplay, s.cfg.ReplayEndpoint, err)
	}
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], start)
	if err := dealer.SendMulti(zmq4.NewMsgFrom([]byte{}, req[:])); err != nil {
		return fmt.Errorf("%w: request: %w", ErrReplay, err)
	}
	for {
		msg, err := dealer.Recv()
		if err != nil {
			return fmt.Errorf("%w: %w", ErrReplay, err)
		}
		f := msg.Frames
		if len(f) > 2 && len(f[0]) == 0 {
			f = f[1:] // the delimiter, echoed by the ROUTER
		}
		if len(f) == 3 {
			f = f[1:] // the topic, which llm-d's simulator and TensorRT-LLM send first
		}
		if len(f) != 2 || len(f[0]) != 8 {
			return fmt.Errorf("%w: %w: reply of %d frames", ErrReplay, ErrMalformed, len(msg.Frames))
		}
		seq := binary.BigEndian.Uint64(f[0])
		if seq == replayEnd && len(f[1]) == 0 {
			return nil
		}
		if err := fn(seq, f[1]); err != nil {
			return err
		}
	}
}
