package bus

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
)

// ErrPanic is wrapped by the error Recover returns for a panicking handler.
var ErrPanic = errors.New("bus: handler panicked")

// Recover turns a panic in the handler into an error carrying the stack, so
// that one malformed message cannot take a process down.
func Recover[M any]() Middleware[M] {
	return func(next Handler[M]) Handler[M] {
		return func(ctx context.Context, msg M) (err error) {
			defer func() {
				if r := recover(); r != nil {
					err = fmt.Errorf("%w: %v\n%s", ErrPanic, r, debug.Stack())
				}
			}()
			return next(ctx, msg)
		}
	}
}
