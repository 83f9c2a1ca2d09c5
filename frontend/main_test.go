package frontend_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine outlives them: the
// in-process clusters stop every role at cleanup and the tests' HTTP clients
// close their idle connections, so nothing is ignored.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
