package workers_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// blockLoadThread sends a ReqMeta whose LoadSpec reads a segment that
// never answers: the load thread of every rank is held for SaveWait, so
// that the ReqMetas sent behind it queue up.
func blockLoadThread(t *testing.T, env *rankEnv) {
	t.Helper()
	for r := range worldSize {
		if _, err := env.nc.Subscribe(env.subj.Pool("gx", r), func(*nats.Msg) {}); err != nil {
			t.Fatal(err)
		}
	}
	if err := env.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	blocker := newMeta("blocker", "sb", testenv.PromptTokens(1, 2*blockSize))
	blocker.LoadSpec = &messages.LoadSpec{CanLoad: true, KVPoolCachedTokens: blockSize,
		Remote: []messages.RemoteRun{{Group: "gx", FromBlock: 0, Blocks: 1}}}
	env.sendMeta(blocker)
}

// supersededPairs sends attempts 0 and 1 of n streamed requests (req-0 …)
// to ranks whose load thread is held, so that both wait in the load queue
// and attempt 1 supersedes attempt 0, and waits for each attempt 1's final
// output.
func supersededPairs(t *testing.T, n int) *rankEnv {
	t.Helper()
	env := startRanks(t, rankEnvConfig{saveWait: 300 * time.Millisecond})
	blockLoadThread(t, env)
	for i := range n {
		for attempt := range 2 {
			m := newMeta(fmt.Sprint("req-", i), fmt.Sprint("s", i), testenv.PromptTokens(10+i, 2*blockSize))
			m.Stream, m.Attempt = true, attempt
			env.sendMeta(m)
		}
	}
	for i := range n {
		id := fmt.Sprint("req-", i)
		testenv.Eventually(t, waitFor, "attempt 1's final output of "+id, func() bool {
			for _, o := range env.outputs(id) {
				if o.Attempt == 1 && o.Final() {
					return true
				}
			}
			return false
		})
	}
	return env
}

// TestResendFindsTheNewerAttempt: attempt 0 of a request is superseded on
// the same group by attempt 1 while both wait in the load queue. The
// driver starts a goroutine for each; the older one may start keeping its
// outputs after the newer did. Its memory must still hold the newer
// attempt's outputs, which the frontend follows and may ask for again.
// Before, the older attempt's entry replaced the newer one's in about a
// third of such requests, and a frontend that lost outputs on the bus
// ended the stream with output_lost.
func TestResendFindsTheNewerAttempt(t *testing.T) {
	const n = 20
	env := supersededPairs(t, n)
	lost := 0
	for i := range n {
		data, err := messages.Marshal(&messages.Resend{ReqID: fmt.Sprint("req-", i), Attempt: 1, FromIndex: 0})
		if err != nil {
			t.Fatal(err)
		}
		msg, err := env.nc.Request(env.subj.ResendGroup(testGroup), data, 500*time.Millisecond)
		if err != nil {
			lost++
			continue
		}
		if reply, err := messages.DecodeResendReply(msg.Data); err != nil || reply.Error != "" || reply.Resent == 0 {
			lost++
		}
	}
	if lost > 0 {
		t.Errorf("%d of %d streamed requests (attempt 1, ended well within --stream-replay's age): the driver could not send their outputs again", lost, n)
	}
}

// TestSupersededAttemptSaysNothing: a request's attempt 1 comes to the
// group running its attempt 0 (a scheduler replica placed it again). The
// newer attempt answers; the older one is cancelled and must not end the
// answer: a frontend follows attempt 0 until attempt 1's first output, and
// an error of attempt 0 reaching it before then ended the client's answer
// with engine_error ("superseded by a newer attempt") while attempt 1 ran
// on for nobody.
func TestSupersededAttemptSaysNothing(t *testing.T) {
	const n = 10
	env := supersededPairs(t, n)
	for i := range n {
		for _, o := range env.outputs(fmt.Sprint("req-", i)) {
			if o.Attempt == 0 && o.Error != nil {
				t.Errorf("req-%d: attempt 0, superseded, sent an error: %s: %s", i, o.Error.Code, o.Error.Message)
			}
		}
	}
}

// TestAbortedRequestLeavesThePrefillQueueAtOnce: a request aborted while it
// waits behind a slow load leaves the driver's prefill queue at once: the
// next heartbeat no longer counts its tokens, though the load thread has
// not reached it. Before, the schedulers saw the group loaded with work
// nobody waited for until the load ahead ended (up to --save-wait).
func TestAbortedRequestLeavesThePrefillQueueAtOnce(t *testing.T) {
	env := startRanks(t, rankEnvConfig{saveWait: 3 * time.Second})
	blockLoadThread(t, env)
	env.sendMeta(newMeta("gone", "sg", testenv.PromptTokens(7, 10*blockSize)))
	queued := func() int64 {
		hbs := env.heartbeats(0)
		if len(hbs) == 0 {
			return -1
		}
		return hbs[len(hbs)-1].QueuedPrefillTokens
	}
	// The blocker's uncached block and all of "gone".
	testenv.Eventually(t, waitFor, "the driver's queue with both requests", func() bool { return queued() == int64(11*blockSize) })
	data, err := messages.Marshal(&messages.Abort{ReqID: "gone", Reason: messages.AbortReasonClientGone})
	if err != nil {
		t.Fatal(err)
	}
	if err := env.nc.Publish(env.subj.AbortGroup(testGroup), data); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 2*time.Second, "the aborted request off the driver's queue", func() bool { return queued() == int64(blockSize) })
}

// TestAbortedRequestLeavesTheInflightCountAtOnce: a request aborted while
// it waits behind a slow load no longer counts in the requests in flight
// the driver's heartbeats report, though the load thread has not reached
// it. The scheduler counted it out when the Abort came; before, the
// heartbeat the driver sends at the Abort counted it in again, and every
// replica saw the group with 5 requests in flight instead of 2 until the
// load ahead ended (up to --save-wait; found by aborting requests queued
// behind a save wait in a `kvbus serve`).
func TestAbortedRequestLeavesTheInflightCountAtOnce(t *testing.T) {
	env := startRanks(t, rankEnvConfig{saveWait: 3 * time.Second})
	blockLoadThread(t, env)
	env.sendMeta(newMeta("gone", "sg", testenv.PromptTokens(7, 10*blockSize)))
	env.sendMeta(newMeta("stays", "ss", testenv.PromptTokens(8, 10*blockSize)))
	inflight := func() int {
		hbs := env.heartbeats(0)
		if len(hbs) == 0 {
			return -1
		}
		return hbs[len(hbs)-1].InflightRequests
	}
	testenv.Eventually(t, waitFor, "the driver's heartbeat with the three requests", func() bool { return inflight() == 3 })
	env.publish(env.subj.AbortGroup(testGroup), &messages.Abort{ReqID: "gone", Reason: messages.AbortReasonClientGone})
	testenv.Eventually(t, 2*time.Second, "the aborted request out of the requests in flight", func() bool { return inflight() == 2 })
}
