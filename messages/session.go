package messages

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxSessionIDBytes is the longest session id kvbus accepts.
const MaxSessionIDBytes = 256

// ErrSessionID is wrapped by CheckSessionID's errors.
var ErrSessionID = errors.New("bad session id")

// CheckSessionID reports whether id may be a session id: at most
// MaxSessionIDBytes of valid UTF-8 without control characters (it reaches
// logs, terminals and engines). The empty id (no session) passes.
func CheckSessionID(id string) error {
	switch {
	case len(id) > MaxSessionIDBytes:
		return fmt.Errorf("%w: %d bytes; a session id may have at most %d", ErrSessionID, len(id), MaxSessionIDBytes)
	case !utf8.ValidString(id):
		return fmt.Errorf("%w: not valid UTF-8", ErrSessionID)
	case strings.ContainsFunc(id, unicode.IsControl):
		return fmt.Errorf("%w: contains a control character", ErrSessionID)
	}
	return nil
}
