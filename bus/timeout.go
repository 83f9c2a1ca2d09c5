package bus

import (
	"context"
	"time"
)

// Timeout bounds each handler call's context to d.
func Timeout[M any](d time.Duration) Middleware[M] {
	return func(next Handler[M]) Handler[M] {
		return func(ctx context.Context, msg M) error {
			ctx, cancel := context.WithTimeout(ctx, d)
			defer cancel()
			return next(ctx, msg)
		}
	}
}
