// Package validatetest checks a Config.Validate table case the way every
// kvbus package's table does: a case that wants nothing is valid, and a
// case that wants a flag name is refused with an error that wraps the
// package's sentinel and names that flag.
package validatetest

import (
	"errors"
	"strings"
	"testing"
)

// Refused checks Validate's err for the case name: want "" means valid (err
// must be nil); otherwise err must wrap sentinel and contain want (the flag
// or field it names). It reports a mismatch on t and returns whether the
// case wants a refusal, so that the caller goes on to check that the
// constructor refuses the config with the same error.
func Refused(t testing.TB, name string, err, sentinel error, want string) bool {
	t.Helper()
	if want == "" {
		if err != nil {
			t.Errorf("%s: Validate: %v, want nil", name, err)
		}
		return false
	}
	if !errors.Is(err, sentinel) || !strings.Contains(err.Error(), want) {
		t.Errorf("%s: Validate: %v, want an error wrapping %q naming %s", name, err, sentinel, want)
	}
	return true
}

// SameError checks that the constructor (what) refused the config with
// Validate's error.
func SameError(t testing.TB, name, what string, got, validate error) {
	t.Helper()
	if got == nil || validate == nil || got.Error() != validate.Error() {
		t.Errorf("%s: %s: %v, want Validate's %v", name, what, got, validate)
	}
}
