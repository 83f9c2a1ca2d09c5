package workers

import (
	"log/slog"
	"sync"
)

// offloader runs handlers that may wait long (a pool read waiting for a
// save, a hand-off being copied) off their subscription's goroutine, so
// that the messages behind them are not held up, with no more than its
// slots at once. It is safe for concurrent use. Once closed it runs
// nothing more in the background: close waits for what it runs, and a
// subscription still delivering (the rank answers pool reads until Run
// returns) runs its handlers inline from then on.
type offloader struct {
	slots  chan struct{}
	mu     sync.Mutex // guards closed, and wg's Add against close's Wait
	closed bool
	wg     sync.WaitGroup
}

func newOffloader(slots int) *offloader { return &offloader{slots: make(chan struct{}, slots)} }

// run runs f on a goroutine of its own while a slot is free and o is open,
// else inline here. An error of f run in the background is logged with
// msg and attrs.
func (o *offloader) run(log *slog.Logger, f, inline func() error, msg string, attrs ...any) error {
	o.mu.Lock()
	if o.closed {
		o.mu.Unlock()
		return inline()
	}
	select {
	case o.slots <- struct{}{}:
		o.wg.Add(1)
		o.mu.Unlock()
	default:
		o.mu.Unlock()
		return inline()
	}
	go func() {
		defer o.wg.Done()
		defer func() { <-o.slots }()
		if err := f(); err != nil {
			log.Warn(msg, append(attrs, "err", err)...)
		}
	}()
	return nil
}

// close stops running in the background and waits for what runs there.
func (o *offloader) close() {
	o.mu.Lock()
	o.closed = true
	o.mu.Unlock()
	o.wg.Wait()
}
