package workers_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine (a rank's threads, a
// NATS connection, an engine timer) outlives them.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
