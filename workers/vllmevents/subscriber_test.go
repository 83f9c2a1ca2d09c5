package vllmevents_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

const testTopic = "kv@pod-a@Qwen/Qwen3-8B"

var quietLog = log.New(io.Discard, "", 0)

// testPub is a PUB socket sending vLLM's three-frame messages, as
// ZmqEventPublisher._publisher_thread does: topic, seq.to_bytes(8, "big"),
// payload.
type testPub struct {
	sock zmq4.Socket
}

// newPub returns a PUB that binds 127.0.0.1 on an ephemeral port (vLLM's
// default role) or, with dial set, connects to dial (llm-d's simulator).
func newPub(t *testing.T, dial string) (*testPub, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sock := zmq4.NewPub(ctx, zmq4.WithLogger(quietLog), zmq4.WithDialerRetry(20*time.Millisecond))
	t.Cleanup(func() {
		cancel()
		_ = sock.Close()
	})
	if dial != "" {
		if err := sock.Dial(dial); err != nil {
			t.Fatal(err)
		}
		return &testPub{sock: sock}, dial
	}
	if err := sock.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	return &testPub{sock: sock}, "tcp://" + sock.Addr().String()
}

// waitSubscribed waits until a subscriber's subscription to topic has
// reached the PUB, after which nothing sent is dropped.
func (p *testPub) waitSubscribed(t *testing.T, topic string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !slices.Contains(p.sock.(zmq4.Topics).Topics(), topic) {
		if time.Now().After(deadline) {
			t.Fatalf("no subscription to %q", topic)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (p *testPub) send(t *testing.T, topic string, seq uint64, payload []byte) {
	t.Helper()
	var s [8]byte
	binary.BigEndian.PutUint64(s[:], seq)
	p.sendFrames(t, []byte(topic), s[:], payload)
}

func (p *testPub) sendFrames(t *testing.T, frames ...[]byte) {
	t.Helper()
	if err := p.sock.SendMulti(zmq4.NewMsgFrom(frames...)); err != nil {
		t.Fatal(err)
	}
}

// replayBuffer is the batches a test's replay socket holds, by seq; set
// may be called while it serves.
type replayBuffer struct {
	mu      sync.Mutex
	batches map[uint64][]byte
	asked   int // requests served
	// topic, when set, is sent before each reply's seq, as llm-d's
	// inference simulator and TensorRT-LLM do (vLLM sends none).
	topic []byte
}

func (b *replayBuffer) set(batches map[uint64][]byte) {
	b.mu.Lock()
	b.batches = batches
	b.mu.Unlock()
}

// from returns the seqs from start on, in order, and their batches.
func (b *replayBuffer) from(start uint64) ([]uint64, map[uint64][]byte) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.asked++
	var seqs []uint64
	for s := range b.batches {
		if s >= start {
			seqs = append(seqs, s)
		}
	}
	slices.Sort(seqs)
	return seqs, b.batches
}

// startReplay serves vLLM's replay protocol (ZmqEventPublisher.
// _service_replay) from buffer on a ROUTER bound to an ephemeral port,
// until the test ends.
func startReplay(t *testing.T, buffer *replayBuffer) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sock := zmq4.NewRouter(ctx, zmq4.WithLogger(quietLog))
	if err := sock.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		_ = sock.Close()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			msg, err := sock.Recv()
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				continue
			}
			if len(msg.Frames) != 3 { // identity, delimiter, start seq
				t.Errorf("replay request of %d frames", len(msg.Frames))
				continue
			}
			id := msg.Frames[0]
			seqs, batches := buffer.from(binary.BigEndian.Uint64(msg.Frames[2]))
			reply := func(topic, seq, payload []byte) {
				frames := [][]byte{id, {}, seq, payload}
				if topic != nil {
					frames = [][]byte{id, {}, topic, seq, payload}
				}
				_ = sock.SendMulti(zmq4.NewMsgFrom(frames...))
			}
			for _, s := range seqs {
				var sb [8]byte
				binary.BigEndian.PutUint64(sb[:], s)
				reply(buffer.topic, sb[:], batches[s])
			}
			end := [8]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
			var endTopic []byte
			if buffer.topic != nil {
				endTopic = []byte{} // the simulator's end has an empty topic
			}
			reply(endTopic, end[:], []byte{})
		}
	})
	return "tcp://" + sock.Addr().String()
}

// recorder collects what a Subscriber delivers and reports.
type recorder struct {
	mu      sync.Mutex
	seqs    []uint64
	batches []*vllmevents.Batch
	gaps    [][2]uint64
	got     chan struct{}
}

func newRecorder() *recorder { return &recorder{got: make(chan struct{}, 1000)} }

func (r *recorder) handle(seq uint64, b *vllmevents.Batch) error {
	r.mu.Lock()
	r.seqs = append(r.seqs, seq)
	r.batches = append(r.batches, b)
	r.mu.Unlock()
	r.got <- struct{}{}
	return nil
}

func (r *recorder) onGap(from, to uint64) {
	r.mu.Lock()
	r.gaps = append(r.gaps, [2]uint64{from, to})
	r.mu.Unlock()
}

// wait waits for n more deliveries.
func (r *recorder) wait(t *testing.T, n int) {
	t.Helper()
	for range n {
		select {
		case <-r.got:
		case <-time.After(10 * time.Second):
			r.mu.Lock()
			defer r.mu.Unlock()
			t.Fatalf("timed out; delivered %v, gaps %v", r.seqs, r.gaps)
		}
	}
}

// expect checks what was delivered and reported: the batches numbered
// seqs, each the one numbered() made for its seq, and the gaps.
func (r *recorder) expect(t *testing.T, seqs []uint64, gaps [][2]uint64) {
	t.Helper()
	got, gotGaps := r.state()
	if !slices.Equal(got, seqs) || !slices.Equal(gotGaps, gaps) {
		t.Fatalf("seqs %v gaps %v, want %v and %v", got, gotGaps, seqs, gaps)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, b := range r.batches {
		if b.Events[0].BlockHashes[0] != vllmevents.HashFromUint64(1000+got[i]) {
			t.Fatalf("seq %d delivered batch %+v", got[i], b)
		}
	}
}

// numbered returns a batch for each seq, as a replay buffer holds them:
// the batch of seq n removes block 1000+n, at engine time 1000+n.
func numbered(t *testing.T, seqs []uint64) map[uint64][]byte {
	batches := map[uint64][]byte{}
	for _, s := range seqs {
		batches[s] = batch(t, formMapEvents, 1000+s)
	}
	return batches
}

func (r *recorder) state() ([]uint64, [][2]uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.seqs), slices.Clone(r.gaps)
}

// run runs s until the test ends, failing it if Run fails.
func run(t *testing.T, s *vllmevents.Subscriber, h vllmevents.Handler) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, h) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Run did not return after its context ended")
		}
	})
}

func newSub(t *testing.T, cfg vllmevents.Config) *vllmevents.Subscriber {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s, err := vllmevents.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func batch(t *testing.T, f form, hash uint64) []byte {
	return encodeBatch(t, f, float64(hash), []vEvent{vRemoved{Hashes: ints(hash), Medium: "GPU"}.event()}, 0)
}

// TestSubscriberConnect: the Subscriber connects to a binding publisher,
// as to vLLM, and delivers batches of every form in order.
func TestSubscriberConnect(t *testing.T) {
	pub, ep := newPub(t, "")
	rec := newRecorder()
	s := newSub(t, vllmevents.Config{Endpoint: ep, Topic: testTopic, OnGap: rec.onGap})
	run(t, s, rec.handle)
	pub.waitSubscribed(t, testTopic)
	for i, f := range forms {
		pub.send(t, testTopic, uint64(10+i), batch(t, f, uint64(100+i)))
	}
	rec.wait(t, len(forms))
	seqs, gaps := rec.state()
	if !slices.Equal(seqs, []uint64{10, 11, 12}) || len(gaps) != 0 {
		t.Fatalf("seqs %v, gaps %v", seqs, gaps)
	}
	for i, b := range rec.batches {
		if len(b.Events) != 1 || b.Events[0].BlockHashes[0] != vllmevents.HashFromUint64(uint64(100+i)) {
			t.Fatalf("batch %d: %+v", i, b)
		}
	}
	if st := s.Stats(); st.Received != 3 || st.Delivered != 3 {
		t.Fatalf("stats %+v", st)
	}
}

// TestSubscriberBind: the Subscriber binds and the publisher connects, as
// llm-d's simulator does.
func TestSubscriberBind(t *testing.T) {
	rec := newRecorder()
	s := newSub(t, vllmevents.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, OnGap: rec.onGap})
	run(t, s, rec.handle)
	var addr net.Addr
	for deadline := time.Now().Add(10 * time.Second); addr == nil; addr = s.Addr() {
		if time.Now().After(deadline) {
			t.Fatal("the Subscriber did not bind")
		}
		time.Sleep(5 * time.Millisecond)
	}
	pub, _ := newPub(t, "tcp://"+addr.String())
	pub.waitSubscribed(t, "")
	pub.send(t, "any topic", 0, batch(t, formMap, 1))
	pub.send(t, "", 1, batch(t, formArray, 2))
	rec.wait(t, 2)
	if seqs, gaps := rec.state(); !slices.Equal(seqs, []uint64{0, 1}) || len(gaps) != 0 {
		t.Fatalf("seqs %v, gaps %v", seqs, gaps)
	}
}

// TestSubscriberTopic: only the subscribed topic's messages are delivered.
func TestSubscriberTopic(t *testing.T) {
	pub, ep := newPub(t, "")
	rec := newRecorder()
	s := newSub(t, vllmevents.Config{Endpoint: ep, Topic: testTopic, OnGap: rec.onGap})
	run(t, s, rec.handle)
	pub.waitSubscribed(t, testTopic)
	pub.send(t, "kv@pod-b@Qwen/Qwen3-8B", 0, batch(t, formArray, 1))
	pub.send(t, testTopic, 5, batch(t, formArray, 2))
	pub.send(t, "other", 1, batch(t, formArray, 3))
	pub.send(t, testTopic, 6, batch(t, formArray, 4))
	rec.wait(t, 2)
	if seqs, gaps := rec.state(); !slices.Equal(seqs, []uint64{5, 6}) || len(gaps) != 0 {
		t.Fatalf("seqs %v, gaps %v", seqs, gaps)
	}
}

// TestSubscriberGap reports missing batches, a restart and an undecodable
// batch, each before the batch after it.
func TestSubscriberGap(t *testing.T) {
	pub, ep := newPub(t, "")
	rec := newRecorder()
	var gapsBefore []int
	s := newSub(t, vllmevents.Config{Endpoint: ep, OnGap: func(from, to uint64) {
		rec.onGap(from, to)
		seqs, _ := rec.state()
		gapsBefore = append(gapsBefore, len(seqs))
	}})
	run(t, s, rec.handle)
	pub.waitSubscribed(t, "")
	pub.send(t, "", 7, batch(t, formArray, 1))         // the first: no gap
	pub.send(t, "", 8, batch(t, formArray, 1))         //
	pub.send(t, "", 11, batch(t, formArray, 1))        // 9 and 10 lost
	pub.send(t, "", 12, []byte{0xc1})                  // undecodable: 12 lost
	pub.sendFrames(t, []byte(""), []byte{1})           // not vLLM's frames: ignored
	pub.sendFrames(t, []byte(""), []byte{1}, []byte{}) // a short seq: ignored
	pub.send(t, "", 13, batch(t, formArray, 1))        //
	pub.send(t, "", 0, batch(t, formArray, 1))         // the engine restarted
	rec.wait(t, 5)
	seqs, gaps := rec.state()
	if !slices.Equal(seqs, []uint64{7, 8, 11, 13, 0}) {
		t.Fatalf("seqs %v", seqs)
	}
	if want := [][2]uint64{{9, 11}, {12, 13}, {14, 0}}; !slices.Equal(gaps, want) {
		t.Fatalf("gaps %v, want %v", gaps, want)
	}
	if want := []int{2, 3, 4}; !slices.Equal(gapsBefore, want) {
		t.Fatalf("gaps reported after %v deliveries, want %v", gapsBefore, want)
	}
	if st := s.Stats(); st.Malformed != 3 || st.Gaps != 3 {
		t.Fatalf("stats %+v", st)
	}
}

// TestSubscriberReplay fills a gap from the replay socket; what the
// replay buffer no longer has is reported. (The buffer is empty when the
// Subscriber joins: the engine had published nothing.)
func TestSubscriberReplay(t *testing.T) {
	for _, tc := range []struct {
		name     string
		buffer   []uint64
		wantSeqs []uint64
		wantGaps [][2]uint64
	}{
		{"whole", []uint64{0, 1, 2, 3, 4, 5}, []uint64{0, 1, 2, 3, 4}, nil},
		{"partial", []uint64{3, 4}, []uint64{0, 3, 4}, [][2]uint64{{1, 3}}},
		{"end", []uint64{1}, []uint64{0, 1, 4}, [][2]uint64{{2, 4}}},
		{"empty", nil, []uint64{0, 4}, [][2]uint64{{1, 4}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			buffer := &replayBuffer{}
			replay := startReplay(t, buffer)
			pub, ep := newPub(t, "")
			rec := newRecorder()
			s := newSub(t, vllmevents.Config{Endpoint: ep, ReplayEndpoint: replay, OnGap: rec.onGap})
			run(t, s, rec.handle)
			pub.waitSubscribed(t, "")
			pub.send(t, "", 0, batch(t, formMapEvents, 1000))
			rec.wait(t, 1)
			batches := numbered(t, tc.buffer)
			buffer.set(batches)
			pub.send(t, "", 4, batch(t, formMapEvents, 1004))
			rec.wait(t, len(tc.wantSeqs)-1)
			rec.expect(t, tc.wantSeqs, tc.wantGaps)
		})
	}
}

// TestSubscriberJoinsARunningEngine: a Subscriber started beside a
// running engine (a worker restarted) first gets what the engine's replay
// buffer holds, before any new batch: without a gap for what the buffer no
// longer has, and without delivering twice the live batches that were
// queued while it replayed. An engine that had published nothing when Run
// started is asked again at its first batch numbered above 0; without a
// replay endpoint the Subscriber starts where it joined.
func TestSubscriberJoinsARunningEngine(t *testing.T) {
	for _, tc := range []struct {
		name     string
		buffer   []uint64
		late     bool // the buffer fills after Run asked
		wantSeqs []uint64
		wantGaps [][2]uint64
	}{
		{"whole", []uint64{0, 1, 2, 3, 4, 5}, false, []uint64{0, 1, 2, 3, 4, 5, 6}, nil},
		{"llm-d's simulator: from 1, with topics", []uint64{1, 2, 3, 4, 5}, false, []uint64{1, 2, 3, 4, 5, 6}, nil},
		{"the buffer's start evicted", []uint64{3, 4, 5}, false, []uint64{3, 4, 5, 6}, nil},
		{"a hole in the buffer", []uint64{2, 4, 5}, false, []uint64{2, 4, 5, 6}, [][2]uint64{{3, 4}}},
		{"asked at the first batch", []uint64{0, 1, 2, 3, 4, 5}, true, []uint64{0, 1, 2, 3, 4, 5, 6}, nil},
		{"empty", nil, false, []uint64{4, 5, 6}, nil},
		{"no replay endpoint", nil, false, []uint64{4, 5, 6}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			batches := numbered(t, tc.buffer)
			buffer := &replayBuffer{}
			if strings.HasPrefix(tc.name, "llm-d") {
				buffer.topic = []byte("kv@127.0.0.1:8000@kvbus-sim")
			}
			if !tc.late {
				buffer.set(batches)
			}
			cfg := vllmevents.Config{}
			if tc.name != "no replay endpoint" {
				cfg.ReplayEndpoint = startReplay(t, buffer)
			}
			pub, ep := newPub(t, "")
			rec := newRecorder()
			cfg.Endpoint, cfg.OnGap = ep, rec.onGap
			s := newSub(t, cfg)
			run(t, s, rec.handle)
			pub.waitSubscribed(t, "")
			if tc.late {
				for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
					buffer.mu.Lock()
					asked := buffer.asked
					buffer.mu.Unlock()
					if asked > 0 {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("Run did not ask the replay socket")
					}
				}
				buffer.set(batches)
			}
			// 4 and 5 came live while the Subscriber replayed (the
			// same bytes as the buffer's), then 6.
			for seq := uint64(4); seq <= 6; seq++ {
				pub.send(t, "", seq, batch(t, formMapEvents, 1000+seq))
			}
			rec.wait(t, len(tc.wantSeqs))
			time.Sleep(100 * time.Millisecond) // nothing more comes
			rec.expect(t, tc.wantSeqs, tc.wantGaps)
		})
	}

	// An engine that restarts after the Subscriber joined numbers from 0
	// again, with later times: not taken for batches already replayed.
	buffer := &replayBuffer{}
	buffer.set(map[uint64][]byte{0: batch(t, formMapEvents, 1000), 1: batch(t, formMapEvents, 1001)})
	pub, ep := newPub(t, "")
	rec := newRecorder()
	s := newSub(t, vllmevents.Config{Endpoint: ep, ReplayEndpoint: startReplay(t, buffer), OnGap: rec.onGap})
	run(t, s, rec.handle)
	pub.waitSubscribed(t, "")
	pub.send(t, "", 0, batch(t, formMapEvents, 2000))
	rec.wait(t, 3)
	if seqs, gaps := rec.state(); !slices.Equal(seqs, []uint64{0, 1, 0}) || !slices.Equal(gaps, [][2]uint64{{2, 0}}) {
		t.Fatalf("restarted engine: seqs %v gaps %v, want [0 1 0] and [[2 0]]", seqs, gaps)
	}
}

// TestSubscriberReplayUnreachable reports the gap when the replay socket
// does not answer.
func TestSubscriberReplayUnreachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0") // accepts, never speaks ZMTP
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	pub, ep := newPub(t, "")
	rec := newRecorder()
	s := newSub(t, vllmevents.Config{Endpoint: ep, ReplayEndpoint: "tcp://" + l.Addr().String(),
		ReplayTimeout: 200 * time.Millisecond, OnGap: rec.onGap})
	run(t, s, rec.handle)
	pub.waitSubscribed(t, "")
	pub.send(t, "", 0, batch(t, formArray, 1))
	pub.send(t, "", 2, batch(t, formArray, 1))
	rec.wait(t, 2)
	if seqs, gaps := rec.state(); !slices.Equal(seqs, []uint64{0, 2}) || !slices.Equal(gaps, [][2]uint64{{1, 2}}) {
		t.Fatalf("seqs %v, gaps %v", seqs, gaps)
	}
}

// TestSubscriberHandlerError ends Run with the handler's error.
func TestSubscriberHandlerError(t *testing.T) {
	pub, ep := newPub(t, "")
	s := newSub(t, vllmevents.Config{Endpoint: ep})
	boom := errors.New("boom")
	done := make(chan error, 1)
	go func() {
		done <- s.Run(context.Background(), func(uint64, *vllmevents.Batch) error { return boom })
	}()
	pub.waitSubscribed(t, "")
	pub.send(t, "", 0, batch(t, formArray, 1))
	select {
	case err := <-done:
		if !errors.Is(err, boom) {
			t.Fatalf("Run = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return")
	}
}

// TestSubscriberWaitsForEngine: a connecting Subscriber started before the
// engine waits for it, and returns when its context ends even if the
// engine never comes.
func TestSubscriberWaitsForEngine(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ep := "tcp://" + l.Addr().String()
	_ = l.Close() // nothing listens there now

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	s := newSub(t, vllmevents.Config{Endpoint: ep})
	if err := s.Run(ctx, func(uint64, *vllmevents.Batch) error { return nil }); err != nil {
		t.Fatalf("Run = %v", err)
	}

	rec := newRecorder()
	s = newSub(t, vllmevents.Config{Endpoint: ep})
	run(t, s, rec.handle)
	time.Sleep(100 * time.Millisecond)
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	sock := zmq4.NewPub(ctx2, zmq4.WithLogger(quietLog))
	defer sock.Close()
	if err := sock.Listen(ep); err != nil {
		t.Skipf("port taken meanwhile: %v", err)
	}
	pub := &testPub{sock: sock}
	pub.waitSubscribed(t, "")
	pub.send(t, "", 0, batch(t, formArray, 1))
	rec.wait(t, 1)
}

func TestSubscriberRunTwice(t *testing.T) {
	_, ep := newPub(t, "")
	s := newSub(t, vllmevents.Config{Endpoint: ep})
	run(t, s, func(uint64, *vllmevents.Batch) error { return nil })
	time.Sleep(50 * time.Millisecond)
	if err := s.Run(context.Background(), func(uint64, *vllmevents.Batch) error { return nil }); !errors.Is(err, vllmevents.ErrConfig) {
		t.Fatalf("second Run = %v", err)
	}
	if err := newSub(t, vllmevents.Config{Endpoint: ep}).Run(context.Background(), nil); !errors.Is(err, vllmevents.ErrConfig) {
		t.Fatalf("Run without a handler = %v", err)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg vllmevents.Config
		ok  bool
	}{
		{vllmevents.Config{Endpoint: "tcp://127.0.0.1:5557"}, true},
		{vllmevents.Config{Endpoint: "tcp://vllm-0.vllm:5557", ReplayEndpoint: "tcp://vllm-0.vllm:5558"}, true},
		{vllmevents.Config{Endpoint: "tcp://*:5557", Bind: true}, true},
		{vllmevents.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true}, true},
		{vllmevents.Config{Endpoint: "ipc:///tmp/kv.sock"}, true},
		{vllmevents.Config{}, false},
		{vllmevents.Config{Endpoint: "127.0.0.1:5557"}, false},
		{vllmevents.Config{Endpoint: "udp://127.0.0.1:5557"}, false},
		{vllmevents.Config{Endpoint: "tcp://*:5557"}, false},
		{vllmevents.Config{Endpoint: "tcp://127.0.0.1"}, false},
		{vllmevents.Config{Endpoint: "ipc://"}, false},
		{vllmevents.Config{Endpoint: "tcp://h:1", ReplayEndpoint: "tcp://*:5558"}, false},
		{vllmevents.Config{Endpoint: "tcp://h:1", ReplayTimeout: -time.Second}, false},
		// A port that is no port was taken, and the subscriber retried a
		// connection that could never be made, warning of it for ever.
		{vllmevents.Config{Endpoint: "tcp://vllm-0:555x"}, false},
		{vllmevents.Config{Endpoint: "tcp://vllm-0:70000"}, false},
		{vllmevents.Config{Endpoint: "tcp://vllm-0:-1"}, false},
		{vllmevents.Config{Endpoint: "tcp://vllm-0:00"}, false}, // port 0, which only a bind may take
		{vllmevents.Config{Endpoint: "tcp://*:5557x", Bind: true}, false},
		{vllmevents.Config{Endpoint: "tcp://h:1", ReplayEndpoint: "tcp://h:http"}, false},
	} {
		err := tc.cfg.Validate()
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, vllmevents.ErrConfig)) {
			t.Errorf("%+v: Validate = %v", tc.cfg, err)
		}
		if _, err := vllmevents.New(tc.cfg); (err == nil) != tc.ok {
			t.Errorf("%+v: New = %v", tc.cfg, err)
		}
	}
}

// ExampleSubscriber wires a Subscriber to a Translator, as a kvbus rank
// fronting vLLM would.
func ExampleSubscriber() {
	tr, err := vllmevents.NewTranslator(vllmevents.TranslatorConfig{BlockSize: 16, Hash: chained("my-model")})
	if err != nil {
		panic(err)
	}
	publish := func([]messages.KVEvent) {} // the rank's KV event log
	s, err := vllmevents.New(vllmevents.Config{
		Endpoint:       "tcp://127.0.0.1:5557", // vLLM's kv-events-config endpoint
		ReplayEndpoint: "tcp://127.0.0.1:5558", // and replay_endpoint
		Topic:          "kv-events",
		// Run's goroutine calls OnGap and the handler: no lock needed.
		OnGap: func(from, to uint64) { publish(tr.Reset()) },
	})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	err = s.Run(ctx, func(seq uint64, b *vllmevents.Batch) error {
		evs, err := tr.Translate(b)
		if err != nil {
			slog.Warn("vLLM KV events not indexed", "seq", seq, "err", err)
		}
		publish(evs)
		return nil
	})
	fmt.Println(err)
	// Output: <nil>
}

// TestSubscriberSilentPeers: a peer that accepts TCP but never speaks ZMTP
// neither keeps Run from returning when its context ends, nor, connecting
// to a binding Subscriber, keeps real publishers out for longer than the
// handshake timeout; its connection is closed.
func TestSubscriberSilentPeers(t *testing.T) {
	defer vllmevents.SetHandshakeTimeout(300 * time.Millisecond)()

	t.Run("connect", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		accepted := make(chan net.Conn, 100)
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					close(accepted)
					return
				}
				accepted <- c
			}
		}()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		s := newSub(t, vllmevents.Config{Endpoint: "tcp://" + l.Addr().String()})
		start := time.Now()
		if err := s.Run(ctx, func(uint64, *vllmevents.Batch) error { return nil }); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d > 3*time.Second {
			t.Fatalf("Run returned %v after its context ended", d-time.Second)
		}
		_ = l.Close()
		n := 0
		for c := range accepted {
			n++
			// The Subscriber closed its end: a read ends.
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, err := io.ReadAll(c); err != nil {
				t.Errorf("connection %d still open: %v", n, err)
			}
			_ = c.Close()
		}
		if n < 2 {
			t.Errorf("%d connection attempts in a second, want a retry after the handshake timeout", n)
		}
	})

	t.Run("bind", func(t *testing.T) {
		rec := newRecorder()
		s := newSub(t, vllmevents.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true})
		run(t, s, rec.handle)
		deadline := time.Now().Add(10 * time.Second)
		for s.Addr() == nil {
			if time.Now().After(deadline) {
				t.Fatal("the Subscriber did not bind")
			}
			time.Sleep(5 * time.Millisecond)
		}
		silent, err := net.Dial("tcp", s.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer silent.Close()
		pub, _ := newPub(t, "tcp://"+s.Addr().String())
		pub.waitSubscribed(t, "")
		pub.send(t, "", 0, batch(t, formArray, 1))
		rec.wait(t, 1)
		_ = silent.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadAll(silent); err != nil {
			t.Errorf("the silent connection is still open: %v", err)
		}
	})
}

// TestSubscriberRefusesOversizedFrames: a peer of a binding Subscriber
// (--kv-events-bind) that names a frame, or sends a message of frames,
// above what a batch of KV events can be is cut off at the header, before
// go-zeromq allocates what it names. Before, the Subscriber allocated any
// size a header named (up to 2^63 bytes: out of memory, the worker gone)
// and kept the connection open for its body.
func TestSubscriberRefusesOversizedFrames(t *testing.T) {
	s := newSub(t, vllmevents.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true})
	rec := newRecorder()
	run(t, s, rec.handle)
	for deadline := time.Now().Add(10 * time.Second); s.Addr() == nil; {
		if time.Now().After(deadline) {
			t.Fatal("the Subscriber did not bind")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// handshake connects as a ZMTP 3.0 PUB with the NULL mechanism.
	handshake := func(t *testing.T) net.Conn {
		c, err := net.Dial("tcp", s.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		greeting := make([]byte, 64)
		greeting[0], greeting[9], greeting[10] = 0xff, 0x7f, 3
		copy(greeting[12:], "NULL")
		ready := append([]byte{5}, "READY"...)
		ready = append(ready, 11)
		ready = append(ready, "Socket-Type"...)
		ready = binary.BigEndian.AppendUint32(ready, 3)
		ready = append(ready, "PUB"...)
		if _, err := c.Write(append(append(greeting, 0x04, byte(len(ready))), ready...)); err != nil {
			t.Fatal(err)
		}
		return c
	}
	closed := func(t *testing.T, c net.Conn) {
		t.Helper()
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		// EOF, or a reset (closed with what was sent still unread).
		if _, err := io.ReadAll(c); err != nil && !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("the connection is still open: %v", err)
		}
	}
	t.Run("one frame", func(t *testing.T) {
		c := handshake(t)
		hdr := []byte{0x02}
		hdr = binary.BigEndian.AppendUint64(hdr, 64<<20) // 64 MiB, and nothing of it sent
		if _, err := c.Write(hdr); err != nil {
			t.Fatal(err)
		}
		closed(t, c)
	})
	t.Run("many frames", func(t *testing.T) {
		c := handshake(t)
		frame := binary.BigEndian.AppendUint64([]byte{0x02 | 0x01}, 1<<20)
		frame = append(frame, make([]byte, 1<<20)...)
		for range 12 { // 12 MiB as one message, never ended
			if _, err := c.Write(frame); err != nil {
				break // cut off
			}
		}
		closed(t, c)
	})
	// A well-formed peer still gets its batches through.
	pub, _ := newPub(t, "tcp://"+s.Addr().String())
	pub.waitSubscribed(t, "")
	pub.send(t, "", 0, batch(t, formArray, 1))
	rec.wait(t, 1)
}

// TestSubscriberTellsTheEnginesFirstBatch: Batch.First marks the first
// batch the engine published: one numbered 0 (vLLM), or, when the engine's
// replay endpoint answered that it held nothing before it, the first
// delivered whatever its number (llm-d's inference simulator counts from
// 1). Before, a caller could only take seq 0 for the first, and took the
// simulator's first batch for one heard from the middle of its stream.
func TestSubscriberTellsTheEnginesFirstBatch(t *testing.T) {
	for _, tc := range []struct {
		name      string
		replay    bool
		buffer    []uint64 // what the replay endpoint holds
		live      []uint64
		wantFirst []bool // per delivered batch, in order
	}{
		{"vLLM, from 0", true, nil, []uint64{0, 1}, []bool{true, false}},
		{"llm-d's simulator, from 1", true, nil, []uint64{1, 2}, []bool{true, false}},
		{"joined a running engine", true, []uint64{1, 2, 3}, []uint64{4}, []bool{false, false, false, false}},
		{"no replay endpoint, from 1", false, nil, []uint64{1, 2}, []bool{false, false}},
		{"no replay endpoint, from 0", false, nil, []uint64{0, 1}, []bool{true, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := vllmevents.Config{}
			if tc.replay {
				buffer := &replayBuffer{topic: []byte("kv@127.0.0.1:8000@kvbus-sim")}
				batches := map[uint64][]byte{}
				for _, s := range tc.buffer {
					batches[s] = batch(t, formArray, 1000+s)
				}
				buffer.set(batches)
				cfg.ReplayEndpoint = startReplay(t, buffer)
			}
			pub, ep := newPub(t, "")
			rec := newRecorder()
			cfg.Endpoint, cfg.OnGap = ep, rec.onGap
			run(t, newSub(t, cfg), rec.handle)
			pub.waitSubscribed(t, "")
			for _, seq := range tc.live {
				pub.send(t, "", seq, batch(t, formArray, 1000+seq))
			}
			rec.wait(t, len(tc.wantFirst))
			rec.mu.Lock()
			defer rec.mu.Unlock()
			var first []bool
			for _, b := range rec.batches {
				first = append(first, b.First)
			}
			if !slices.Equal(first, tc.wantFirst) {
				t.Fatalf("seqs %v: First %v, want %v", rec.seqs, first, tc.wantFirst)
			}
		})
	}
}
