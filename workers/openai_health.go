package workers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

// The engine's health: GET /health polled every HealthInterval, restarts
// told apart from outages, and a request's wait for an engine that is down.

// Healthy reports whether the engine takes requests, and why not.
func (e *OpenAIEngine) Healthy() (bool, string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.healthy, e.why
}

// setHealth records a health change and reports whether it was one.
func (e *OpenAIEngine) setHealth(ok bool, why string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.setHealthLocked(ok, why)
}

// setPolled records the result of a health poll that began when the
// health's change channel was since. It reports whether the poll changed
// the health, and returns the channel that the next change closes. A poll
// that overlapped a change (a request that found the engine down) is stale
// and dropped, since returned closed: it would undo what the request saw.
func (e *OpenAIEngine) setPolled(since chan struct{}, ok bool, why string) (bool, chan struct{}) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.changed != since {
		return false, since
	}
	return e.setHealthLocked(ok, why), e.changed
}

func (e *OpenAIEngine) setHealthLocked(ok bool, why string) bool {
	if e.healthy == ok {
		e.why = why
		return false
	}
	e.healthy, e.why = ok, why
	close(e.changed)
	e.changed = make(chan struct{})
	if ok {
		e.log.Info("engine healthy: the group takes requests")
	} else {
		e.log.Warn("engine not healthy: the group takes no requests", "reason", why)
	}
	return true
}

// WatchHealth polls GET /health every HealthInterval until ctx ends and
// calls changed (if not nil) after each change of health, also when a
// request found the engine down. Only a poll makes the engine healthy
// again: a request's failure is followed by the next regular poll, not by
// one at once, so that health cannot flip as fast as requests fail. A
// healthy engine is marked not healthy by engineHealthFailures failed
// polls in a row (a slow or failed /health under load would otherwise move
// every request not yet answered), or by one that could not connect at all.
func (e *OpenAIEngine) WatchHealth(ctx context.Context, changed func()) {
	e.WatchHealthAndRestarts(ctx, changed, nil)
}

// WatchHealthAndRestarts is WatchHealth that also tells restarted (if not
// nil) when the engine restarted, by the rules of restartRules: before the
// poll that found it changes the health, so a rank clears the engine's
// blocks before it heartbeats ready again.
func (e *OpenAIEngine) WatchHealthAndRestarts(ctx context.Context, changed func(), restarted func(EngineRestart)) {
	t := time.NewTicker(e.cfg.HealthInterval)
	defer t.Stop()
	fails := 0 // polls failed in a row
	rules := newRestartRules()
	for poll := true; ; {
		e.mu.Lock()
		ch, healthy := e.changed, e.healthy
		e.mu.Unlock()
		if poll {
			at := time.Now()
			ok, why, gone := e.checkHealth(ctx)
			if ctx.Err() != nil {
				return
			}
			if e.requestFoundGone.Swap(false) {
				rules.requestFoundGone()
			}
			if ok {
				fails = 0
				var start float64
				read := rules.wantIdentity()
				if read {
					start = e.startTime(ctx)
					if ctx.Err() != nil {
						return
					}
				}
				if rs, restart := rules.pollPassed(at, read, start); restart && restarted != nil {
					restarted(rs)
				}
			} else {
				fails++
				rules.pollFailed(gone)
			}
			switch {
			case !ok && healthy && !gone && fails < engineHealthFailures:
				e.log.Info("engine /health failed: the group stays ready unless it fails again",
					"reason", why, "failed_polls", fails, "of", engineHealthFailures)
			default:
				if !ok && fails >= engineHealthFailures {
					why = fmt.Sprintf("%s (%d polls in a row)", why, fails)
				}
				var moved bool
				if moved, ch = e.setPolled(ch, ok, why); moved && changed != nil {
					changed()
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			poll = true
		case <-ch: // a request found the engine down: tell the cluster now
			poll = false
			if changed != nil {
				changed()
			}
		}
	}
}

// checkHealth asks GET /health, within HealthTimeout. gone reports a
// failure to connect at all (refused, no such host): the engine is not
// there, as opposed to slow or answering an error.
func (e *OpenAIEngine) checkHealth(ctx context.Context) (ok bool, why string, gone bool) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.HealthTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.base+"/health", nil)
	if err != nil {
		return false, err.Error(), true
	}
	e.authorize(req.Header)
	resp, err := e.client.Do(req)
	if err != nil {
		var op *net.OpError
		gone := errors.As(err, &op) && op.Op == "dial" && !op.Timeout()
		return false, fmt.Sprintf("GET /health: %v", err), gone
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return false, fmt.Sprintf("GET /health answered %d", resp.StatusCode), false
	}
	return true, "", false
}

// awaitHealthy waits until the engine is healthy, or ctx ends, or
// UnavailableWait has passed since *down: when the request first found the
// engine down, which is set now if it is zero and the engine is down.
// failure is how the request's last attempt failed ("" before the first).
func (e *OpenAIEngine) awaitHealthy(ctx context.Context, down *time.Time, failure string) error {
	for {
		e.mu.Lock()
		ok, why, ch := e.healthy, e.why, e.changed
		e.mu.Unlock()
		if ok {
			return nil
		}
		if down.IsZero() {
			*down = time.Now()
		}
		left := e.cfg.UnavailableWait - time.Since(*down)
		if left <= 0 {
			if failure != "" && !strings.Contains(why, failure) {
				why = failure + "; " + why
			}
			return fmt.Errorf("%w: %s; it did not recover within %s, and no other worker group took the request",
				ErrEngineUnavailable, why, e.cfg.UnavailableWait)
		}
		timer := time.NewTimer(left)
		select {
		case <-ctx.Done():
			timer.Stop()
			return ctx.Err()
		case <-ch:
			timer.Stop()
		case <-timer.C:
		}
	}
}
