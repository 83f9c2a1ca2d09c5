package vllmevents_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/workers/vllmevents"
)

// interopPublisher plays vLLM's ZmqEventPublisher with libzmq (pyzmq):
// three-frame messages on a PUB (an XPUB, to see the subscription arrive;
// the same on the wire), and _service_replay's protocol, copied from
// vllm/distributed/kv_events.py, on a ROUTER. msgspec is not packaged for
// Debian, so the payloads are packed by msgpack-python in msgspec's shapes
// (lists for array_like structs, dicts for tagged ones, bytes as bin).
// Batches 2 and 3 are only in the replay buffer.
const interopPublisher = `
import sys, zmq, msgpack
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
port = pub.bind_to_random_port("tcp://127.0.0.1")
router = ctx.socket(zmq.ROUTER)
rport = router.bind_to_random_port("tcp://127.0.0.1")
print(port, rport, flush=True)
topic = b"kv-events"
assert pub.recv() == b"\x01" + topic
END_SEQ = (-1).to_bytes(8, "big", signed=True)
sha = bytes(range(32))
big = 15760518052499183552
t = lambda a, n: list(range(a, a + n))
def stored_array(hashes, parent, tokens):
    return ["BlockStored", hashes, parent, tokens, 4, None, "GPU", None]
def stored_map(hashes, parent, tokens):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": 4, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}
batches = [
    [1.0, [stored_array([big], None, t(0, 4))], 0],
    [2.0, [stored_map([sha], big, t(4, 4))]],
    {"ts": 3.0, "events": [stored_map([7], sha, t(8, 4))], "data_parallel_rank": 0},
    [4.0, [["BlockRemoved", [big], "GPU"], ["SomethingNew", 1]], 0],
    [5.0, [{"type": "BlockStored", "block_hashes": [-3], "parent_block_hash": 7,
            "token_ids": t(12, 4), "block_size": 4, "lora_id": None, "medium": None,
            "lora_name": None}], 0],
]
buffer = []
for seq, b in enumerate(batches):
    payload = msgpack.packb(b, use_bin_type=True)
    buffer.append((seq, payload))
    if seq not in (2, 3):
        pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
poller = zmq.Poller()
poller.register(router, zmq.POLLIN)
poller.register(sys.stdin, zmq.POLLIN)
while True:
    ready = dict(poller.poll(10000))
    if not ready or sys.stdin.fileno() in ready:
        break
    frame = router.recv_multipart()
    if len(frame) != 3:
        continue
    client_id, _, start_seq_bytes = frame
    start_seq = int.from_bytes(start_seq_bytes, "big")
    for seq, buf in buffer:
        if seq >= start_seq:
            router.send_multipart((client_id, b"", seq.to_bytes(8, "big"), buf))
    router.send_multipart((client_id, b"", END_SEQ, b""))
`

// pythonWithZMQ returns a Python with pyzmq and msgpack, or "".
func pythonWithZMQ() string {
	for _, py := range []string{"python3", "/usr/bin/python3"} {
		if exec.Command(py, "-c", "import zmq, msgpack").Run() == nil {
			return py
		}
	}
	return ""
}

// TestInteropLibzmq runs the Subscriber and a Translator against a libzmq
// publisher that behaves like vLLM's, replay included. It needs python3
// with pyzmq and msgpack (Debian: python3-zmq python3-msgpack) and skips
// without them.
func TestInteropLibzmq(t *testing.T) {
	py := pythonWithZMQ()
	if py == "" {
		t.Skip("no python3 with pyzmq and msgpack (apt-get install python3-zmq python3-msgpack)")
	}
	script := filepath.Join(t.TempDir(), "publisher.py")
	if err := os.WriteFile(script, []byte(interopPublisher), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(py, script)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = stdin.Close() // the publisher exits
		if err := cmd.Wait(); err != nil {
			t.Errorf("publisher: %v\n%s", err, stderr.String())
		}
	}()
	var port, rport int
	if _, err := fmt.Fscan(bufio.NewReader(stdout), &port, &rport); err != nil {
		t.Fatalf("publisher's ports: %v\n%s", err, stderr.String())
	}

	tr := newTranslator(t, vllmevents.TranslatorConfig{})
	var out []messages.KVEvent
	rec := newRecorder()
	s := newSub(t, vllmevents.Config{
		Endpoint:       fmt.Sprintf("tcp://127.0.0.1:%d", port),
		ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", rport),
		Topic:          "kv-events",
		OnGap:          rec.onGap,
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = s.Run(ctx, func(seq uint64, b *vllmevents.Batch) error {
		evs, err := tr.Translate(b)
		if err != nil {
			t.Errorf("seq %d: %v", seq, err)
		}
		out = append(out, evs...)
		if err := rec.handle(seq, b); err != nil {
			return err
		}
		if seq == 4 {
			cancel()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	seqs, gaps := rec.state()
	if !slices.Equal(seqs, []uint64{0, 1, 2, 3, 4}) || len(gaps) != 0 {
		t.Fatalf("seqs %v, gaps %v\n%s", seqs, gaps, stderr.String())
	}
	if st := s.Stats(); st.Replayed != 2 {
		t.Errorf("replayed %d batches, want 2", st.Replayed)
	}
	if b := rec.batches[3]; b.Skipped != 1 || b.UnknownTags[0] != "SomethingNew" {
		t.Errorf("batch 3: %+v", b)
	}
	// Blocks A B C stored, A removed, D stored after C: kvbus's hashes of
	// the prompt 0..15, whichever form and hash type each event came in.
	want := kvHashes(seq(0, 16))
	var stored, removed []uint64
	for _, ev := range out {
		switch ev.Type {
		case messages.EventBlockStored:
			stored = append(stored, ev.BlockHashes...)
		case messages.EventBlockRemoved:
			removed = append(removed, ev.BlockHashes...)
		}
	}
	if !slices.Equal(stored, want) || !slices.Equal(removed, want[:1]) || tr.Len() != 3 {
		t.Fatalf("stored %x, removed %x (want %x, %x), Len %d", stored, removed, want, want[:1], tr.Len())
	}
}

// interopDialer plays llm-d's inference simulator, whose (libzmq) PUB
// connects to a binding subscriber.
const interopDialer = `
import sys, zmq, msgpack
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
pub.connect(sys.argv[1])
assert pub.recv() == b"\x01"
for seq in range(3):
    payload = msgpack.packb({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}]}, use_bin_type=True)
    pub.send_multipart((b"kv@sim@model", seq.to_bytes(8, "big"), payload))
sys.stdin.read()
`

// TestInteropLibzmqBind: a binding Subscriber receives from a libzmq PUB
// that connects to it.
func TestInteropLibzmqBind(t *testing.T) {
	py := pythonWithZMQ()
	if py == "" {
		t.Skip("no python3 with pyzmq and msgpack (apt-get install python3-zmq python3-msgpack)")
	}
	rec := newRecorder()
	s := newSub(t, vllmevents.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, OnGap: rec.onGap})
	run(t, s, rec.handle)
	deadline := time.Now().Add(10 * time.Second)
	for s.Addr() == nil {
		if time.Now().After(deadline) {
			t.Fatal("the Subscriber did not bind")
		}
		time.Sleep(5 * time.Millisecond)
	}
	script := filepath.Join(t.TempDir(), "dialer.py")
	if err := os.WriteFile(script, []byte(interopDialer), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(py, script, "tcp://"+s.Addr().String())
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("dialer: %v\n%s", err, stderr.String())
		}
	}()
	rec.wait(t, 3)
	if seqs, gaps := rec.state(); !slices.Equal(seqs, []uint64{0, 1, 2}) || len(gaps) != 0 {
		t.Fatalf("seqs %v, gaps %v", seqs, gaps)
	}
}
