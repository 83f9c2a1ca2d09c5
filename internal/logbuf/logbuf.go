// Package logbuf holds Buffer, a concurrency-safe buffer of log output for
// tests: testenv's LogBuffer, here so that a package testenv imports (whose
// internal tests cannot import testenv) can use it too.
package logbuf

import (
	"bytes"
	"strings"
	"sync"
)

// Buffer is a concurrency-safe buffer of log output. The zero value is
// ready to use.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write implements io.Writer.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Take returns everything written since the last Take (or the start),
// and forgets it.
func (b *Buffer) Take() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := b.buf.String()
	b.buf.Reset()
	return out
}

// Lines returns the log lines that contain every one of substrs.
func (b *Buffer) Lines(substrs ...string) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for _, l := range strings.Split(b.buf.String(), "\n") {
		ok := l != ""
		for _, s := range substrs {
			ok = ok && strings.Contains(l, s)
		}
		if ok {
			out = append(out, l)
		}
	}
	return out
}
