package vllmevents

import (
	"encoding/binary"
	"testing"
)

// FuzzFrameLimit: frameLimit never panics, and finds the same verdict
// however the stream is cut into reads (whole, and split at step).
func FuzzFrameLimit(f *testing.F) {
	short := []byte{0x01, 3, 'a', 'b', 'c', 0x00, 0}
	long := binary.BigEndian.AppendUint64([]byte{0x02}, maxZMTPMessageBytes+1)
	more := binary.BigEndian.AppendUint64([]byte{0x03}, 1<<20)
	cmd := binary.BigEndian.AppendUint64([]byte{0x06}, maxCommandBytes+1)
	for _, seed := range [][]byte{short, long, more, cmd, append(short, long...)} {
		f.Add(seed, uint8(1))
		f.Add(seed, uint8(4))
	}
	f.Fuzz(func(t *testing.T, stream []byte, step uint8) {
		var whole, split frameLimit
		wantErr := whole.feed(stream) != nil
		n := max(int(step), 1)
		gotErr := false
		for i := 0; i < len(stream) && !gotErr; i += n {
			gotErr = split.feed(stream[i:min(i+n, len(stream))]) != nil
		}
		if gotErr != wantErr {
			t.Fatalf("stream % x: refused whole %v, in reads of %d %v", stream, wantErr, n, gotErr)
		}
	})
}
