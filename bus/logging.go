package bus

import (
	"context"
	"log/slog"
)

// Logging logs every handler error at warn level with the handler's name.
// Handlers log what they do themselves, with req_id and session_id.
func Logging[M any](log *slog.Logger, name string) Middleware[M] {
	return func(next Handler[M]) Handler[M] {
		return func(ctx context.Context, msg M) error {
			err := next(ctx, msg)
			if err != nil {
				log.WarnContext(ctx, "message handler failed", "handler", name, "err", err)
			}
			return err
		}
	}
}
