package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/kvbus/kvbus/replay"
)

type captureCmd struct {
	Record captureRecordCmd `cmd:"" default:"withargs" help:"Copy requests from the bus into a capture file (the default)."`
	Stats  captureStatsCmd  `cmd:"" help:"Summarise a capture file."`
}

type captureRecordCmd struct {
	busFlags `embed:""`
	Out      string        `name:"out" required:"" type:"path" help:"Capture file to write."`
	Follow   bool          `name:"follow" help:"Keep capturing new requests until interrupted."`
	Since    time.Time     `name:"since" format:"2006-01-02T15:04:05Z07:00" help:"Start at requests logged at or after this time (RFC 3339)."`
	FromSeq  uint64        `name:"from-seq" help:"Start at this sequence of the request log."`
	Until    time.Time     `name:"until" format:"2006-01-02T15:04:05Z07:00" help:"Stop at requests logged after this time (RFC 3339)."`
	For      time.Duration `name:"for" help:"With --follow, stop after this long."`
}

func (c *captureRecordCmd) Run(ctx context.Context) error {
	log := c.logger()
	onStop(ctx, log, func() stopPlan {
		return stopPlan{doing: "closing " + c.Out + " with the requests captured so far", inFlight: -1}
	})
	if c.For > 0 && !c.Follow {
		return errors.New("--for bounds a --follow capture: add --follow, or bound a capture of the log with --until")
	}
	cfg := replay.CaptureConfig{Subjects: c.subjects(), Follow: c.Follow, Since: c.Since, FromSeq: c.FromSeq, Until: c.Until, Logger: log}
	if err := cfg.Validate(); err != nil {
		return err
	}
	out, err := createOutput(c.Out)
	if err != nil {
		return err
	}
	ctx, nc, err := connect(ctx, c.natsFlags, "kvbus-capture", "", log)
	if err != nil {
		out.discard()
		return err
	}
	defer drain(nc)
	if c.For > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.For)
		defer cancel()
	}
	cfg.Conn = nc
	n, err := replay.Capture(ctx, cfg, out)
	if err != nil && n == 0 {
		out.discard() // an existing file stays as it was
		return err
	}
	if n == 0 {
		// A file of no request replays nothing, and would have replaced
		// an earlier capture of the same name.
		out.discard()
		if c.Follow {
			return fmt.Errorf("no request was logged while the capture followed the log: %s is left as it was (nothing was written)", c.Out)
		}
		return fmt.Errorf("the request log holds no request in the range asked for: %s is left as it was (nothing was written); check --since, --from-seq and --until (without them capture copies the whole log)", c.Out)
	}
	if cerr := out.commit(); cerr != nil {
		return errors.Join(err, cerr)
	}
	if err != nil {
		return fmt.Errorf("%w (the %d requests captured before it are in %s)", err, n, c.Out)
	}
	log.Info("capture done", "file", c.Out, "requests", n)
	return nil
}

type captureStatsCmd struct {
	File string `arg:"" type:"existingfile" help:"Capture file."`
}

func (c *captureStatsCmd) Run() error {
	f, err := os.Open(c.File)
	if err != nil {
		return err
	}
	defer f.Close()
	s, err := replay.Stats(f)
	if s != nil {
		s.Write(os.Stdout)
	}
	return err
}

type tapCmd struct {
	busFlags `embed:""`
	Session  string `name:"session" help:"Only this session's messages (requests, ReqMetas, results, outputs)."`
	Subject  string `name:"subject" help:"Subject to tap (default: every kvbus subject)."`
}

func (c *tapCmd) Run(ctx context.Context) error {
	log := c.logger()
	if err := replay.CheckTapSubject(c.Subject); err != nil { // before waiting for NATS
		return err
	}
	ctx, nc, err := connect(ctx, c.natsFlags, "kvbus-tap", "", log)
	if err != nil {
		return err
	}
	defer closeConn(nc)
	return roleErr(ctx, replay.Tap(ctx, replay.TapConfig{Conn: nc, Subjects: c.subjects(), SessionID: c.Session, Subject: c.Subject}, os.Stdout))
}
