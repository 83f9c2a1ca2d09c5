package bus

import (
	"fmt"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// A full disk. When a stream's file store fails a write (no space left on
// the device under --data-dir), nats-server marks the stream failed and
// refuses every later publish to it until the server restarts, even once
// the disk has room again: the request log then refuses every request,
// each after the frontend's publish timeout. So a standalone server checks
// its streams every storeCheckInterval; one that failed a write is said in
// an error naming the store directory, and once that directory's volume
// has room again (storeRoomToRestart) the server restarts its JetStream
// in place: the streams are read back from disk, and the clients stay
// connected. A server of a cluster only says so: its streams' other
// replicas go on, and it rejoins them when restarted.

const (
	storeCheckInterval = 2 * time.Second
	// storeRestartEvery bounds the restarts of a volume that fills again.
	storeRestartEvery = 10 * time.Second
	// storeReportEvery repeats the error while the volume stays full.
	storeReportEvery = time.Minute
)

// storeRoomToRestart is the free space a volume needs before the streams
// are restarted on it: a tenth of it, at most 64 MiB.
func storeRoomToRestart(total uint64) uint64 { return min(total/10, 64<<20) }

// watchStore checks the streams for write errors until stop is closed.
func (s *Server) watchStore(stop <-chan struct{}) {
	t := time.NewTicker(storeCheckInterval)
	defer t.Stop()
	var reported, restarted time.Time
	// down: the last restart failed (a volume out of inodes fails
	// nats-server's check that its store takes a new file), leaving
	// JetStream stopped or half started, with no stream to report a write
	// error: it is tried again until one succeeds.
	down := false
	// limits is JetStream's configuration before its first restart: its
	// storage limit (by default three quarters of what the store's volume
	// had free at start, plus what the streams held), which a restart
	// keeps rather than take a new one from the room freed.
	var limits *server.JetStreamConfig
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		failed := s.streamWriteErrors()
		if down {
			failed = append(failed, "JetStream itself: its last restart failed")
		}
		if len(failed) == 0 {
			if !reported.IsZero() {
				s.logger.Info("JetStream writes its store again", "store_dir", s.storeDir)
				reported = time.Time{}
			}
			continue
		}
		free, total, err := volumeSpace(s.storeDir)
		now := time.Now()
		room := err == nil && free >= storeRoomToRestart(total)
		clustered := s.cfg.Cluster != ""
		if reported.IsZero() || now.Sub(reported) >= storeReportEvery {
			what := "it restarts JetStream in place once the volume has room: free space there, or give --data-dir a larger volume"
			if clustered {
				what = "the stream's other replicas serve it; restart this server once its volume has room"
			}
			s.logger.Error("the NATS server cannot write its store (a full disk?): those streams refuse every publish — the request log every request; "+what,
				"store_dir", s.storeDir, "streams", strings.Join(failed, "; "), "free_bytes", free, "needed_bytes", storeRoomToRestart(total))
			reported = now
		}
		if clustered || !room || now.Sub(restarted) < storeRestartEvery {
			continue
		}
		restarted = now
		if limits == nil {
			limits = s.JetStreamConfig()
		}
		err = s.restartJetStream(limits)
		if down = err != nil; down {
			s.logger.Error("cannot restart JetStream after its store failed a write: it tries again every "+storeRestartEvery.String()+
				" while the volume has room; make room there (free inodes too), or restart the server", "store_dir", s.storeDir, "err", err)
			continue
		}
		s.logger.Warn("JetStream restarted in place after its store failed a write: the streams were read back from disk, clients stayed connected",
			"store_dir", s.storeDir, "free_bytes", free)
	}
}

// streamWriteErrors returns, for each stream that failed a write, its name
// and error.
func (s *Server) streamWriteErrors() []string {
	h := s.Healthz(&server.HealthzOptions{Details: true})
	var out []string
	for _, e := range h.Errors {
		if e.Type == server.HealthzErrorStream && strings.Contains(e.Error, "write error") {
			out = append(out, e.Error)
		}
	}
	return out
}

// restartJetStream stops JetStream and starts it again on the same store
// as at start, with the configuration it ran with (limits; nil:
// nats-server's own, from the room the volume has now). A limit taken
// from the room just freed on a full volume is below what the streams
// hold, and the server then refuses every publish as insufficient
// resources.
func (s *Server) restartJetStream(limits *server.JetStreamConfig) error {
	if err := s.ShutdownJetStream(); err != nil {
		return fmt.Errorf("stop JetStream: %w", err)
	}
	cfg := server.JetStreamConfig{Strict: true, CompressOK: true}
	if limits != nil {
		cfg = *limits
	}
	// EnableJetStream adds its own directory (jetstream) to StoreDir.
	cfg.StoreDir = s.base.StoreDir
	s.log.quiet.Store(true) // its banner, as at start
	defer s.log.quiet.Store(false)
	return s.EnableJetStream(&cfg)
}

// volumeSpace returns the bytes free (to an unprivileged writer) and in all
// on the volume holding dir.
func volumeSpace(dir string) (free, total uint64, err error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0, 0, err
	}
	return st.Bavail * uint64(st.Bsize), st.Blocks * uint64(st.Bsize), nil
}
