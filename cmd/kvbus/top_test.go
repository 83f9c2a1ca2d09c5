package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alecthomas/kong"
	"github.com/charmbracelet/x/vt"
	"github.com/creack/pty"

	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/top"
)

// converse runs one short conversation per session, turn after turn.
func converse(t *testing.T, base string, sessions ...string) {
	t.Helper()
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	for i, s := range sessions {
		if _, err := (testenv.Conversation{BaseURL: base, Client: client, Model: "kvbus-sim", Seed: 70 + i,
			Headers: map[string]string{"X-Session-ID": s}}).Run(context.Background(), 3); err != nil {
			t.Error(err)
		}
	}
}

// TestTopOnceJSON: `kvbus top --once --json` prints one snapshot of the
// cluster it watched: its groups and the sessions that ran meanwhile.
func TestTopOnceJSON(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := buildBinary(t, t.TempDir())
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Ranks: 2})
	cmd := exec.Command(bin, "top", "--once", "--json", "--watch", "4s", "--nats-url", c.NATSURL)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	following := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if strings.Contains(sc.Text(), "following the bus") {
				close(following)
				break
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
	}()
	out := make(chan []byte, 1)
	go func() { b, _ := cmd.Output(); out <- b }()
	select {
	case <-following: // what is published from now on is in the snapshot
	case <-time.After(30 * time.Second):
		t.Fatal("top --once never said it follows the bus")
	}
	converse(t, c.URL, "json-a", "json-b")
	var s top.Snapshot
	raw := <-out
	if err := json.Unmarshal(raw, &s); err != nil {
		t.Fatalf("not a snapshot: %v\n%s", err, raw)
	}
	if len(s.Groups) != 2 || s.Groups[0].Name != "g0" || s.Groups[0].State != "ready" || s.Finished != 6 || len(s.Sessions) != 2 {
		t.Errorf("snapshot %s", raw)
	}
}

// TestTopInATerminal drives `kvbus top` in a pseudo-terminal, as a person
// would look at it: the screen shows the group rows and the sessions that
// ran, "/" filters one session, "q" quits.
func TestTopInATerminal(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := buildBinary(t, t.TempDir())
	c := testenv.StartCluster(t, testenv.ClusterConfig{Groups: 2, Ranks: 2})
	cmd := exec.Command(bin, "top", "--refresh", "200ms", "--nats-url", c.NATSURL)
	ptmx, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 40, Cols: 150})
	if err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// vt's SafeEmulator does not lock String: one lock around the
	// emulator's writes and reads. Its answers to the program's terminal
	// queries go back to the program (the emulator blocks until they are
	// read); that reader is left blocked at the end, as closing the
	// emulator races with it (see TestMain).
	screen := &lockedScreen{e: vt.NewEmulator(150, 40)}
	copies := make(chan struct{}, 1)
	go func() { _, _ = io.Copy(screen, ptmx); copies <- struct{}{} }()
	go func() { _, _ = io.Copy(ptmx, screen.e) }()
	defer func() {
		_ = cmd.Process.Kill()
		_ = ptmx.Close()
		<-copies
	}()
	look := func(what string, ok func(string) bool) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for !ok(screen.String()) {
			if time.Now().After(deadline) {
				t.Fatalf("the screen never showed %s:\n%s", what, screen.String())
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	look("the title", func(s string) bool { return strings.Contains(s, "kvbus top") })
	converse(t, c.URL, "pty-one", "pty-two")
	look("both groups and both sessions", func(s string) bool {
		return strings.Contains(s, "g0") && strings.Contains(s, "g1") && strings.Contains(s, "ready") &&
			strings.Contains(s, "pty-one") && strings.Contains(s, "pty-two")
	})
	for _, k := range []string{"/", "t", "w", "o", "\r"} {
		if _, err := fmt.Fprint(ptmx, k); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	look("only the filtered session", func(s string) bool {
		return strings.Contains(s, "pty-two") && !strings.Contains(s, "pty-one") && strings.Contains(s, `filter "two"`)
	})
	if _, err := fmt.Fprint(ptmx, "q"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("top exited with %v after q", err)
		}
	case <-time.After(10 * time.Second):
		t.Error("top did not quit on q")
	}
}

// lockedScreen serializes an emulator's writes with reads of its screen.
type lockedScreen struct {
	mu sync.Mutex
	e  *vt.Emulator
}

func (l *lockedScreen) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.e.Write(p)
}

func (l *lockedScreen) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.e.String()
}

// TestTopRefusesBadFlags: a negative --sessions is refused (`top --once
// --sessions=-1` panicked: slice bounds out of range), and so is a window
// that is not positive (--window=-1s silently became 1 min).
func TestTopRefusesBadFlags(t *testing.T) {
	for _, tc := range []struct{ arg, want string }{
		{"--sessions=-1", "--sessions"},
		{"--window=-1s", "--window"},
		{"--window=0s", "--window"},
		{"--refresh=-1s", "--refresh"},
		{"--watch=-1s", "--watch"},
	} {
		var c cli
		p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"), kong.Exit(func(int) {}))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := p.Parse([]string{"top", "--once", tc.arg}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("kvbus top --once %s: %v; want it refused naming %s", tc.arg, err, tc.want)
		}
	}
	// Run, as a caller that did not parse the flags: refused before it
	// connects, not a panic after the watch.
	srv := testenv.StartNATS(t)
	cmd := &topCmd{natsFlags: natsFlags{NATSURL: srv.ClientURL()}, Once: true, JSON: true, Watch: 0, Refresh: time.Second,
		Window: time.Minute, Sessions: -1, errOut: io.Discard}
	if err := cmd.Run(t.Context()); err == nil || !strings.Contains(err.Error(), "--sessions") {
		t.Errorf("Run with --sessions=-1: %v", err)
	}
}

// TestTopSaysWhereItConnects: against a NATS that is not there, top says at
// once which URL it connects to (it waited 10 s in silence), without the
// password, and gives up with an error naming the URL and what to check.
func TestTopSaysWhereItConnects(t *testing.T) {
	addr := freeAddr(t) // nothing listens there
	logs := &testenv.LogBuffer{}
	cmd := &topCmd{natsFlags: natsFlags{NATSURL: "nats://kvbus:hunter2@" + addr}, Once: true, Watch: time.Second, Refresh: time.Second,
		Window: time.Minute, Sessions: 10, HeartbeatTimeout: 3 * time.Second, MaxSessions: 10, errOut: logs, connectTimeout: 1500 * time.Millisecond}
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- cmd.Run(t.Context()) }()
	testenv.Eventually(t, 500*time.Millisecond, "top to say where it connects", func() bool {
		return len(logs.Lines("connecting to NATS", addr)) > 0
	})
	err := <-done
	if err == nil || !strings.Contains(err.Error(), addr) || !strings.Contains(err.Error(), "gave up after 1.5s") ||
		!strings.Contains(err.Error(), "reachable") || time.Since(start) < 1500*time.Millisecond {
		t.Errorf("top against nothing: %v after %s; want an error naming %s and what to check, after 1.5 s", err, time.Since(start), addr)
	}
	if strings.Contains(logs.String(), "hunter2") || err != nil && strings.Contains(err.Error(), "hunter2") {
		t.Errorf("the password was printed:\n%s\n%v", logs.String(), err)
	}
}

// TestTopOnceIsPlainForScripts: `kvbus top --once` into a pipe writes no
// escape sequence and no help line for keys (it wrote both), and `--once
// --json` on an empty cluster prints empty lists, not null.
func TestTopOnceIsPlainForScripts(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := buildBinary(t, t.TempDir())
	srv := testenv.StartNATS(t)
	out, err := exec.Command(bin, "top", "--once", "--watch", "200ms", "--nats-url", srv.ClientURL()).Output()
	if err != nil {
		t.Fatalf("top --once: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "\x1b") || strings.Contains(string(out), "q quit") || !strings.Contains(string(out), "kvbus top") {
		t.Errorf("top --once into a pipe:\n%q", out)
	}
	out, err = exec.Command(bin, "top", "--once", "--json", "--watch", "200ms", "--nats-url", srv.ClientURL()).Output()
	if err != nil {
		t.Fatalf("top --once --json: %v\n%s", err, out)
	}
	for _, want := range []string{`"groups": []`, `"schedulers": []`, `"sessions": []`} {
		if !strings.Contains(string(out), want) {
			t.Errorf("top --once --json on an empty cluster lacks %s:\n%s", want, out)
		}
	}
}

// TestTopFlagsSayWhatTheyNeed: --json without --once says it needs --once
// (it failed opening a TTY), --refresh above 1 s is honoured (it was
// silently clamped), and --heartbeat-timeout and --max-sessions must be
// positive.
func TestTopFlagsSayWhatTheyNeed(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string // "": accepted
	}{
		{[]string{"top", "--json"}, "--json needs --once"},
		{[]string{"top", "--refresh", "5s"}, ""},
		{[]string{"top", "--heartbeat-timeout", "4s"}, ""},
		{[]string{"top", "--heartbeat-timeout", "0s"}, "--heartbeat-timeout"},
		{[]string{"top", "--max-sessions", "0"}, "--max-sessions"},
	} {
		var c cli
		p, err := kong.New(&c, kong.Bind((*logsink.Writer)(nil)), kong.DefaultEnvars("KVBUS"), kong.Exit(func(int) {}))
		if err != nil {
			t.Fatal(err)
		}
		_, err = p.Parse(tc.args)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("kvbus %s: %v", strings.Join(tc.args, " "), err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("kvbus %s: %v; want it refused naming %s", strings.Join(tc.args, " "), err, tc.want)
		}
	}
}

// TestTopLiveNeedsATerminalOnStdout: the live view with its output
// redirected (kvbus top > file, kvbus top | less, a terminal on its input
// only) exits at once, before it connects, saying to use --once. Before,
// it wrote a few escape sequences into the file, never a frame, and ran
// until killed without a word (exit 0); with no terminal at all it failed
// after connecting with bubbletea's "could not open TTY".
func TestTopLiveNeedsATerminalOnStdout(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := buildBinary(t, t.TempDir())
	srv := testenv.StartNATS(t)
	var out bytes.Buffer
	cmd := exec.Command(bin, "top", "--nats-url", srv.ClientURL())
	cmd.Stdout = &out // a pipe; input and standard error are the terminal
	ptmx, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 40, Cols: 120})
	if err != nil {
		t.Fatal(err)
	}
	var screen syncBuffer
	copied := make(chan struct{})
	go func() { _, _ = io.Copy(&screen, ptmx); close(copied) }()
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err = <-exited:
	case <-time.After(5 * time.Second):
		_ = cmd.Process.Kill()
		err = <-exited
		_ = ptmx.Close()
		<-copied
		t.Fatalf("top with its output not a terminal still ran after 5 s (killed: %v); its standard output: %q", err, out.String())
	}
	_ = ptmx.Close()
	<-copied
	said := screen.String()
	if err == nil || !strings.Contains(said, "--once") || !strings.Contains(said, "terminal") || strings.Contains(said, "nats connected") {
		t.Errorf("top with its output not a terminal: exit %v, said %q; want a non-zero exit before connecting, naming --once", err, said)
	}
	if out.Len() != 0 {
		t.Errorf("top wrote %q to its output, which is not a terminal; want nothing", out.String())
	}
}

// TestTopStoppedWhileConnecting: a signal while top waits for NATS stops it
// as it stops tap and the roles (errStoppedConnecting: exit 0, nothing
// more said). It exited 1 with "cannot connect to NATS …: context
// canceled … (start one with `kvbus nats` …)".
func TestTopStoppedWhileConnecting(t *testing.T) {
	addr := freeAddr(t) // nothing listens there
	logs := &testenv.LogBuffer{}
	cmd := &topCmd{natsFlags: natsFlags{NATSURL: "nats://" + addr}, Once: true, Watch: time.Second, Refresh: time.Second,
		Window: time.Minute, Sessions: 10, HeartbeatTimeout: 3 * time.Second, MaxSessions: 10, errOut: logs}
	ctx, stop := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- cmd.Run(ctx) }()
	testenv.Eventually(t, 5*time.Second, "top to wait for NATS", func() bool {
		return len(logs.Lines("cannot reach NATS yet")) > 0
	})
	stop() // the signal
	select {
	case err := <-done:
		if !errors.Is(err, errStoppedConnecting) {
			t.Errorf("top stopped while connecting: %v; want errStoppedConnecting (exit 0, no advice to start NATS)", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("top did not stop within 3 s of the signal")
	}
}
