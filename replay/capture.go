// Package replay captures request streams from the bus, reads captured and
// public trace formats (kvbus capture files, Mooncake JSONL, TraceLab round
// traces, the Azure LLM inference CSV), replays them onto the bus or an HTTP
// frontend, open or closed loop, and reports latency and cache hit ratios
// against the ideal of an infinite shared cache.
package replay

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbus/kvbus/messages"
)

// Capture file format (all integers little-endian):
//
//	header: "KVBUSCAP" (8 bytes), version u16 (1), reserved u16 (0)
//	frames: length u32, then a msgpack map of that many bytes:
//	        {"t": log time, Unix ns (int), "s": subject (str), "p": payload (bin)}
//
// Payloads are the bytes as they were on the bus.
const (
	captureMagic   = "KVBUSCAP"
	captureVersion = 1
	// MaxFrameBytes bounds one frame, so that a corrupt length cannot make a
	// reader allocate gigabytes.
	MaxFrameBytes = messages.MaxMessageBytes + 4096
)

// ErrNotCapture is returned by NewCaptureReader for a file that is not a
// kvbus capture.
var ErrNotCapture = errors.New("replay: not a kvbus capture file")

// ErrCorrupt is wrapped by frame decoding errors.
var ErrCorrupt = errors.New("replay: corrupt capture frame")

// Frame is one captured bus message.
type Frame struct {
	Time    time.Time
	Subject string
	Payload []byte
}

type frameWire struct {
	T int64  `msgpack:"t"`
	S string `msgpack:"s"`
	P []byte `msgpack:"p"`
}

// CaptureWriter writes a capture file. Not safe for concurrent use.
type CaptureWriter struct {
	w   *bufio.Writer
	buf bytes.Buffer
	n   int
}

// NewCaptureWriter writes the header to w.
func NewCaptureWriter(w io.Writer) (*CaptureWriter, error) {
	bw := bufio.NewWriterSize(w, 1<<16)
	hdr := make([]byte, 0, 12)
	hdr = append(hdr, captureMagic...)
	hdr = binary.LittleEndian.AppendUint16(hdr, captureVersion)
	hdr = binary.LittleEndian.AppendUint16(hdr, 0)
	if _, err := bw.Write(hdr); err != nil {
		return nil, err
	}
	return &CaptureWriter{w: bw}, nil
}

// Write appends one frame.
func (c *CaptureWriter) Write(f Frame) error {
	c.buf.Reset()
	if err := msgpack.NewEncoder(&c.buf).Encode(frameWire{T: f.Time.UnixNano(), S: f.Subject, P: f.Payload}); err != nil {
		return err
	}
	if c.buf.Len() > MaxFrameBytes {
		return fmt.Errorf("%w: a frame of %d bytes is over the %d-byte limit", ErrCorrupt, c.buf.Len(), MaxFrameBytes)
	}
	var l [4]byte
	binary.LittleEndian.PutUint32(l[:], uint32(c.buf.Len()))
	if _, err := c.w.Write(l[:]); err != nil {
		return err
	}
	_, err := c.w.Write(c.buf.Bytes())
	c.n++
	return err
}

// Frames returns how many frames were written.
func (c *CaptureWriter) Frames() int { return c.n }

// Flush writes buffered frames out.
func (c *CaptureWriter) Flush() error { return c.w.Flush() }

// CaptureReader reads a capture file.
type CaptureReader struct {
	r *bufio.Reader
	n int
}

// NewCaptureReader checks the header.
func NewCaptureReader(r io.Reader) (*CaptureReader, error) {
	br := bufio.NewReaderSize(r, 1<<16)
	hdr := make([]byte, 12)
	if _, err := io.ReadFull(br, hdr); err != nil || string(hdr[:8]) != captureMagic {
		return nil, ErrNotCapture
	}
	if v := binary.LittleEndian.Uint16(hdr[8:]); v != captureVersion {
		return nil, fmt.Errorf("%w: version %d (this kvbus reads %d)", ErrNotCapture, v, captureVersion)
	}
	return &CaptureReader{r: br}, nil
}

// Next returns the next frame, or io.EOF after the last one.
func (c *CaptureReader) Next() (Frame, error) {
	var l [4]byte
	if _, err := io.ReadFull(c.r, l[:]); err != nil {
		if errors.Is(err, io.EOF) {
			return Frame{}, io.EOF
		}
		return Frame{}, fmt.Errorf("%w %d: truncated length: %v", ErrCorrupt, c.n, err)
	}
	n := binary.LittleEndian.Uint32(l[:])
	if n > MaxFrameBytes {
		return Frame{}, fmt.Errorf("%w %d: %d bytes (limit %d)", ErrCorrupt, c.n, n, MaxFrameBytes)
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(c.r, buf); err != nil {
		return Frame{}, fmt.Errorf("%w %d: truncated: %v", ErrCorrupt, c.n, err)
	}
	var fw frameWire
	if err := messages.Unmarshal(buf, &fw); err != nil {
		return Frame{}, fmt.Errorf("%w %d: %v", ErrCorrupt, c.n, err)
	}
	c.n++
	return Frame{Time: time.Unix(0, fw.T), Subject: fw.S, Payload: fw.P}, nil
}
