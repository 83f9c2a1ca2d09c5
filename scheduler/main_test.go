package scheduler_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine (a scheduler's
// consumer, a NATS connection, an embedded server) outlives them.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
