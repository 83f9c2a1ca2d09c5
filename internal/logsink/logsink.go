// Package logsink takes log lines off the request path: a Writer buffers
// what is written to it and one goroutine writes the buffer out, so that
// a burst of lines from many goroutines costs one system call instead of
// one each, and no caller waits on the terminal, the pipe or the disk.
//
// Nothing is dropped: when the buffer holds Config.MaxBuffered bytes, Write
// waits for the goroutine to catch up. Lines reach the underlying writer in
// the order Write was called, each whole.
package logsink

import (
	"errors"
	"fmt"
	"io"
	"sync"
)

// ErrClosed is returned by Write after Close.
var ErrClosed = errors.New("logsink: writer closed")

// DefaultMaxBuffered is the buffer bound when Config.MaxBuffered is 0.
const DefaultMaxBuffered = 1 << 20

// Config configures a Writer.
type Config struct {
	// Out receives the lines. Required. Only the Writer's goroutine writes
	// to it.
	Out io.Writer
	// MaxBuffered bounds the bytes waiting to be written; Write blocks
	// above it. 0 means DefaultMaxBuffered.
	MaxBuffered int
}

// Validate reports a missing Out or a negative bound.
func (c Config) Validate() error {
	if c.Out == nil {
		return errors.New("logsink: Out is required")
	}
	if c.MaxBuffered < 0 {
		return fmt.Errorf("logsink: MaxBuffered %d is negative", c.MaxBuffered)
	}
	return nil
}

// Writer is an io.Writer safe for concurrent use. Close must be called
// once the process is done logging: it writes what is buffered.
type Writer struct {
	out  io.Writer
	max  int
	mu   sync.Mutex
	cond *sync.Cond // signalled when buf is drained or the writer closes
	buf  []byte     // lines waiting to be written
	wake chan struct{}
	done chan struct{}
	err  error // the last error of Out, reported by Close
	shut bool
}

// New starts a Writer's goroutine.
func New(cfg Config) (*Writer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.MaxBuffered == 0 {
		cfg.MaxBuffered = DefaultMaxBuffered
	}
	w := &Writer{out: cfg.Out, max: cfg.MaxBuffered, wake: make(chan struct{}, 1), done: make(chan struct{})}
	w.cond = sync.NewCond(&w.mu)
	go w.loop()
	return w, nil
}

// Write queues a copy of p. It blocks only while MaxBuffered bytes wait.
func (w *Writer) Write(p []byte) (int, error) {
	w.mu.Lock()
	for len(w.buf) >= w.max && !w.shut {
		w.cond.Wait()
	}
	if w.shut {
		w.mu.Unlock()
		return 0, ErrClosed
	}
	w.buf = append(w.buf, p...)
	w.signal()
	w.mu.Unlock()
	return len(p), nil
}

// signal wakes the goroutine; w.mu is held.
func (w *Writer) signal() {
	select {
	case w.wake <- struct{}{}:
	default: // a wake-up is already pending
	}
}

func (w *Writer) loop() {
	defer close(w.done)
	var spare []byte
	for {
		<-w.wake
		w.mu.Lock()
		batch := w.buf
		w.buf = spare[:0]
		shut := w.shut
		w.cond.Broadcast()
		w.mu.Unlock()
		if len(batch) > 0 {
			if _, err := w.out.Write(batch); err != nil {
				w.mu.Lock()
				w.err = err
				w.mu.Unlock()
			}
		}
		spare = batch
		if shut {
			return
		}
	}
}

// Close writes what is buffered, stops the goroutine and returns the last
// error Out gave, if any. Writes after Close fail with ErrClosed.
func (w *Writer) Close() error {
	w.mu.Lock()
	if w.shut {
		w.mu.Unlock()
		<-w.done
		return nil
	}
	w.shut = true
	w.cond.Broadcast()
	w.signal()
	w.mu.Unlock()
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}
