//go:build smoke

// Package smoke checks the docker compose cluster end to end: `make smoke`
// (which builds the image first). It starts the cluster, follows a 3-turn
// conversation to every rank of its group, scales the workers to 12 and
// back to 8, kills a worker during 200 requests, and tears everything down.
package smoke

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// base is the frontend published by compose (KVBUS_HTTP_PORT, default 8000).
var base = "http://127.0.0.1:" + cmp.Or(os.Getenv("KVBUS_HTTP_PORT"), "8000")

// compose runs the compose command of the Makefile (COMPOSE, COMPOSE_FILES)
// from the repository root.
func compose(t *testing.T, args ...string) string {
	t.Helper()
	files := strings.Fields(os.Getenv("COMPOSE_FILES"))
	if len(files) == 0 {
		files = []string{"-f", "docker-compose.yml"}
	}
	return composeFiles(t, files, args...)
}

// composeFiles runs the Makefile's compose command with the -f list files.
func composeFiles(t *testing.T, files []string, args ...string) string {
	t.Helper()
	cmdline := strings.Fields(os.Getenv("COMPOSE"))
	if len(cmdline) == 0 {
		cmdline = []string{"docker-compose"}
	}
	cmd := exec.Command(cmdline[0], append(append(cmdline[1:], files...), args...)...)
	cmd.Dir = ".."
	cmd.Env = composeEnv()
	start := time.Now()
	out, err := cmd.CombinedOutput()
	if took := time.Since(start); took > 20*time.Second {
		t.Logf("%s %v took %s", cmdline, args, took.Round(100*time.Millisecond))
	}
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", cmdline, args, err, out)
	}
	return string(out)
}

// composeEnv is the environment of a compose command: docker-compose v1
// gives up on a Docker API call after COMPOSE_HTTP_TIMEOUT (60 s) plus the
// container's stop grace period, which a loaded CI host's daemon exceeded
// stopping four workers (a failed `down`, its containers still running);
// the Makefile exports 180 s, and so does this unless it is set. The
// `docker compose` plugin has no such limit.
func composeEnv() []string {
	env := os.Environ()
	if os.Getenv("COMPOSE_HTTP_TIMEOUT") == "" {
		env = append(env, "COMPOSE_HTTP_TIMEOUT=180")
	}
	return env
}

func docker(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("docker", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("docker %v: %v\n%s", args, err, out)
	}
	return string(out)
}

func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitHealthy waits until the frontend's /healthz answers 200 (a ready
// scheduler exists), as `make up` does.
func waitHealthy(t *testing.T, client *http.Client) {
	t.Helper()
	start := time.Now()
	eventually(t, 120*time.Second, "the frontend's /healthz", func() bool {
		resp, err := client.Get(base + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	t.Logf("healthy %s after up", time.Since(start).Round(100*time.Millisecond))
}

// workers returns the names of the running worker containers.
func workers(t *testing.T) []string {
	var out []string
	for _, id := range strings.Fields(compose(t, "ps", "-q", "worker")) {
		name := strings.TrimPrefix(strings.TrimSpace(docker(t, "inspect", "--format", "{{.Name}} {{.State.Running}}", id)), "/")
		if n, running, _ := strings.Cut(name, " "); running == "true" {
			out = append(out, n)
		}
	}
	return out
}

type logLine struct {
	Msg          string `json:"msg"`
	Group        string `json:"group"`
	TPRank       int    `json:"tp_rank"`
	SessionID    string `json:"session_id"`
	LoadedTokens int    `json:"loaded_tokens"`
}

// workerLines returns each worker's JSON log lines with msg.
func workerLines(t *testing.T, msg string) map[string][]logLine {
	out := map[string][]logLine{}
	for _, w := range workers(t) {
		logs, _ := exec.Command("docker", "logs", w).CombinedOutput()
		sc := bufio.NewScanner(bytes.NewReader(logs))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var l logLine
			if json.Unmarshal(sc.Bytes(), &l) == nil && l.Msg == msg {
				out[w] = append(out[w], l)
			}
		}
	}
	return out
}

func chat(client *http.Client, session string, msgs []map[string]string) (int, map[string]any, error) {
	body, _ := json.Marshal(map[string]any{"messages": msgs, "max_tokens": 8})
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if session != "" {
		req.Header.Set("X-Session-ID", session)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return resp.StatusCode, nil, err
	}
	var out map[string]any
	if err := json.Unmarshal(raw, &out); err != nil {
		return resp.StatusCode, nil, fmt.Errorf("not JSON: %.200s", raw)
	}
	return resp.StatusCode, out, nil
}

// streamChat sends one streamed chat request of maxTokens tokens (with
// ignore_eos) and reads it to its end: an error is a status other than
// 200, an error event, a stream cut before data: [DONE], or fewer tokens
// than asked for.
func streamChat(client *http.Client, session, content string, maxTokens int) (int, error) {
	body, _ := json.Marshal(map[string]any{"messages": []map[string]string{{"role": "user", "content": content}},
		"max_tokens": maxTokens, "ignore_eos": true, "stream": true, "stream_options": map[string]any{"include_usage": true}})
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		return resp.StatusCode, fmt.Errorf("%v: %.300s", err, raw)
	}
	tokens, done := 0, false
	for _, ev := range strings.Split(string(raw), "\n\n") {
		data, ok := strings.CutPrefix(strings.TrimSpace(ev), "data: ")
		switch {
		case !ok:
		case data == "[DONE]":
			done = true
		case strings.Contains(data, `"error"`):
			return resp.StatusCode, fmt.Errorf("error event: %s", data)
		default:
			var chunk struct {
				Usage *struct {
					CompletionTokens int `json:"completion_tokens"`
				}
			}
			if json.Unmarshal([]byte(data), &chunk) == nil && chunk.Usage != nil {
				tokens = chunk.Usage.CompletionTokens
			}
		}
	}
	if !done || tokens != maxTokens {
		return resp.StatusCode, fmt.Errorf("stream cut: [DONE] %v, %d of %d tokens: %.300s", done, tokens, maxTokens, raw)
	}
	return resp.StatusCode, nil
}

func TestSmoke(t *testing.T) {
	compose(t, "down", "-v", "--remove-orphans")
	t.Cleanup(func() { compose(t, "down", "-v", "--remove-orphans") })
	compose(t, "up", "-d", "--scale", "scheduler=2", "--scale", "worker=8")
	client := &http.Client{Timeout: 60 * time.Second}
	waitHealthy(t, client)

	// Used the moment its health check passes, as a user would: a 4-turn
	// conversation, each turn sent as soon as the answer arrives. Every
	// next turn finds >= 95% of the previous prompt's full blocks cached,
	// and every rank of one group logs the session.
	// Least privilege: a worker's key, from inside the network, may not
	// publish a request; the server refuses with a permissions violation.
	probe(t, "worker", "kvbus.req.kvbus-sim", false)
	probe(t, "frontend", "kvbus.req.kvbus-sim", true)

	const session = "smoke-conversation"
	turns, err := testenv.Conversation{BaseURL: base, Client: client, Headers: map[string]string{"X-Session-ID": session}}.Run(t.Context(), 4)
	if err != nil {
		t.Fatal(err)
	}
	for i, share := range testenv.PreviousShares(turns, 16) {
		t.Logf("turn %d: prompt %d tokens, cached %d: %.1f%% of the previous prompt", i+2, turns[i+1].PromptTokens, turns[i+1].CachedTokens, 100*share)
		if share < 0.95 {
			t.Errorf("turn %d found %.1f%% of the previous prompt's %d tokens cached, want >= 95%%", i+2, 100*share, turns[i].PromptTokens/16*16)
		}
	}
	var group string
	ranks := map[int]string{}
	for w, lines := range workerLines(t, "store thread") {
		for _, l := range lines {
			if l.SessionID == session {
				group = l.Group
				ranks[l.TPRank] = w
			}
		}
	}
	if len(ranks) != 4 {
		t.Fatalf("session %s logged by ranks %v of group %s, want all four", session, ranks, group)
	}
	seen := map[string]bool{}
	for _, w := range ranks {
		seen[w] = true
	}
	if len(seen) != 4 {
		t.Errorf("the four ranks are not four containers: %v", ranks)
	}
	t.Logf("session %s: group %s, ranks %v", session, group, ranks)
	topSeesTheCluster(t)

	// Scale to 12 workers: a third group forms and gets requests.
	compose(t, "up", "-d", "--no-recreate", "--scale", "scheduler=2", "--scale", "worker=12")
	eventually(t, 60*time.Second, "a third group placed on", func() bool {
		for i := range 20 {
			if status, _, err := chat(client, fmt.Sprint("spread-", time.Now().UnixNano(), "-", i), []map[string]string{{"role": "user", "content": "spread"}}); err != nil || status != http.StatusOK {
				return false
			}
		}
		for _, lines := range workerLines(t, "store thread") {
			for _, l := range lines {
				if l.Group == "g2" {
					return true
				}
			}
		}
		return false
	})
	// Scale in while conversations run on every group: the removed
	// group's ranks hand their sessions' blocks to the other groups
	// (--drain-handoff) and those conversations' next turns still hit.
	rankOf := map[string]logLine{} // container -> its rank
	for w, lines := range workerLines(t, "rank started") {
		rankOf[w] = lines[len(lines)-1]
	}
	dialogs := map[string]*testenv.Dialog{}
	for i := range 9 {
		session := fmt.Sprint("scale-in-", i)
		d := testenv.Conversation{BaseURL: base, Client: client, Seed: 900 + i, Headers: map[string]string{"X-Session-ID": session}}.Start()
		if _, err := d.Next(t.Context()); err != nil {
			t.Fatal(err)
		}
		dialogs[session] = d
	}
	groupOf := map[string]string{}
	for _, lines := range workerLines(t, "store thread") {
		for _, l := range lines {
			if dialogs[l.SessionID] != nil {
				groupOf[l.SessionID] = l.Group
			}
		}
	}
	before := workers(t)
	compose(t, "up", "-d", "--no-recreate", "--scale", "scheduler=2", "--scale", "worker=8")
	after := workers(t)
	if len(after) != 8 {
		t.Fatalf("%d workers after scaling back, want 8", len(after))
	}
	removed := map[string][]int{} // group -> tp_ranks removed
	for _, w := range before {
		if !slices.Contains(after, w) {
			removed[rankOf[w].Group] = append(removed[rankOf[w].Group], rankOf[w].TPRank)
		}
	}
	if len(removed) != 1 {
		t.Fatalf("scaling 12 -> 8 removed ranks %v, want the four ranks of one group", removed)
	}
	var gone string
	for g := range removed {
		gone = g
	}
	t.Logf("scale-in removed group %s (ranks %v); sessions per group %v", gone, removed[gone], groupOf)
	moved := 0
	for session, d := range dialogs {
		if groupOf[session] != gone {
			continue
		}
		moved++
		turn, err := d.Next(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		share := testenv.PreviousShares(d.Turns, 16)[0]
		t.Logf("session %s (was on %s): turn 2 cached %d of %d prompt tokens: %.1f%% of turn 1's", session, gone, turn.CachedTokens, turn.PromptTokens, 100*share)
		if share < 0.95 {
			t.Errorf("session %s found %.1f%% of its previous prompt after its group was scaled in, want >= 95%% (drain hand-off)", session, 100*share)
		}
	}
	if moved == 0 {
		t.Fatalf("none of %d conversations ran on the removed group %s: %v", len(dialogs), gone, groupOf)
	}
	handed := 0
	for _, lines := range workerLines(t, "kept blocks handed off by a draining group") {
		handed += len(lines)
	}
	if handed < 4 {
		t.Errorf("%d ranks logged blocks handed off by %s, want every rank of a target group (>= 4)", handed, gone)
	}

	// Kill one worker during 200 requests: none is lost (each gets an
	// answer or an explicit error).
	victim := workers(t)[0]
	defer func() {
		// The fault took effect: the killed container is not running.
		if state := strings.TrimSpace(docker(t, "inspect", "--format", "{{.State.Running}}", victim)); state != "false" {
			t.Errorf("%s running=%s after docker kill", victim, state)
		}
	}()
	var sent, ok, explicit, lost atomic.Int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range 200 {
		if i == 60 {
			docker(t, "kill", victim)
		}
		sem <- struct{}{}
		sent.Add(1)
		wg.Go(func() {
			defer func() { <-sem }()
			status, out, err := chat(client, fmt.Sprint("load-", i%20), []map[string]string{{"role": "user", "content": fmt.Sprint("load ", i)}})
			switch {
			case err != nil:
				lost.Add(1)
			case status == http.StatusOK:
				ok.Add(1)
			case out["error"] != nil:
				explicit.Add(1)
			default:
				lost.Add(1)
			}
		})
	}
	wg.Wait()
	t.Logf("kill %s during load: sent %d, ok %d, explicit errors %d, lost %d", victim, sent.Load(), ok.Load(), explicit.Load(), lost.Load())
	if lost.Load() != 0 {
		t.Errorf("%d requests lost", lost.Load())
	}
}

// TestSmokeNATSCluster runs the cluster file (three NATS servers, JetStream
// at replicas 3) and stops the NATS container the frontend is connected to
// while four clients send requests back to back: none fails (an answer
// lost with the server is asked again, a request the log's new leader
// acknowledges late is published again, one that comes while the frontend
// reconnects waits for it), and the pipeline keeps serving after it.
func TestSmokeNATSCluster(t *testing.T) {
	t.Setenv("COMPOSE_FILES", "-f docker-compose.yml -f docker-compose.cluster.yml")
	compose(t, "down", "-v", "--remove-orphans")
	t.Cleanup(func() { compose(t, "down", "-v", "--remove-orphans") })
	compose(t, "up", "-d", "--scale", "scheduler=2", "--scale", "worker=8")
	client := &http.Client{Timeout: 60 * time.Second}
	waitHealthy(t, client)
	server := frontendNATS(t)
	ids := strings.Fields(compose(t, "ps", "-q", server))
	if len(ids) != 1 {
		t.Fatalf("%s containers: %v", server, ids)
	}
	var answered, failed atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				var status int
				var err error
				if c < 2 {
					status, _, err = chat(client, fmt.Sprint("cluster-", c), []map[string]string{{"role": "user", "content": fmt.Sprint("cluster ", c, " ", i)}})
				} else { // streams of ~0.5 s: some are under way at the stop
					status, err = streamChat(client, fmt.Sprint("cluster-", c), fmt.Sprint("stream ", c, " ", i), 48)
				}
				if err != nil || status != http.StatusOK {
					if failed.Add(1) <= 5 {
						t.Logf("client %d, request %d: status %d, %v", c, i, status, err)
					}
					continue
				}
				answered.Add(1)
			}
		})
	}
	time.Sleep(2 * time.Second)
	docker(t, "stop", ids[0])
	atStop := answered.Load()
	// Longer than a frontend waits for an answer it may have lost (10 s).
	time.Sleep(12 * time.Second)
	close(stop)
	wg.Wait()
	// The fault took effect: the frontend's server is down, and the
	// frontend is on another.
	if state := strings.TrimSpace(docker(t, "inspect", "--format", "{{.State.Running}}", ids[0])); state != "false" {
		t.Fatalf("%s running: %s", server, state)
	}
	after := answered.Load() - atStop
	t.Logf("answered %d requests before %s (the frontend's NATS server) stopped and %d after; %d failed; the frontend's %s",
		atStop, server, after, failed.Load(), frontendCounters(client, "kvbus_frontend_asked_again_total", "kvbus_frontend_resends_total"))
	if failed.Load() > 0 {
		t.Errorf("%d requests failed while one of three NATS servers stopped", failed.Load())
	}
	if after < 30 {
		t.Errorf("%d requests answered in the 12 s after %s stopped, want >= 30: the pipeline stalled", after, server)
	}
}

// frontendCounters reads counters from the frontend's /metrics, as
// "name value" pairs.
func frontendCounters(client *http.Client, names ...string) string {
	resp, err := client.Get(base + "/metrics")
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var out []string
	for _, l := range strings.Split(string(raw), "\n") {
		for _, n := range names {
			if strings.HasPrefix(l, n+" ") {
				out = append(out, l)
			}
		}
	}
	return strings.Join(out, ", ")
}

// frontendNATS returns the compose service of the NATS server the frontend
// is connected to, from its "nats connected" log line.
func frontendNATS(t *testing.T) string {
	t.Helper()
	ids := strings.Fields(compose(t, "ps", "-q", "frontend"))
	if len(ids) != 1 {
		t.Fatalf("frontend containers: %v", ids)
	}
	logs, _ := exec.Command("docker", "logs", ids[0]).CombinedOutput()
	sc := bufio.NewScanner(bytes.NewReader(logs))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var l struct{ Msg, Conn, URL string }
		if json.Unmarshal(sc.Bytes(), &l) != nil || l.Msg != "nats connected" || l.Conn != "kvbus-frontend" {
			continue
		}
		if u, err := url.Parse(l.URL); err == nil && u.Hostname() != "" {
			return u.Hostname()
		}
	}
	t.Fatalf("no 'nats connected' line naming a server in the frontend's log:\n%s", logs)
	return ""
}

// engineLines returns the fake engine's request log lines of a service.
func engineLines(t *testing.T, service string) []map[string]any {
	var out []map[string]any
	for _, id := range strings.Fields(compose(t, "ps", "-q", service)) {
		logs, _ := exec.Command("docker", "logs", id).CombinedOutput()
		sc := bufio.NewScanner(bytes.NewReader(logs))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var l map[string]any
			if json.Unmarshal(sc.Bytes(), &l) == nil && l["msg"] == "request" {
				out = append(out, l)
			}
		}
	}
	return out
}

// TestSmokeEngine runs docker-compose.engine.yml: kvbus in front of two
// (fake) vLLM engines. Used the moment its health check passes, a
// conversation finds the whole previous prompt in its engine's own cache,
// the engine gets the session id as X-Session-ID and in vllm_xargs, and
// when that engine's container is killed the conversation goes on on the
// other engine.
func TestSmokeEngine(t *testing.T) {
	t.Setenv("COMPOSE_FILES", "-f docker-compose.engine.yml")
	engineAuthKeys(t)
	compose(t, "down", "-v", "--remove-orphans")
	t.Cleanup(func() { compose(t, "down", "-v", "--remove-orphans") })
	compose(t, "up", "-d")
	client := &http.Client{Timeout: 60 * time.Second}
	waitHealthy(t, client)
	// Both groups up: each engine's worker is healthy.
	eventually(t, 60*time.Second, "both engines' workers healthy", func() bool {
		for _, svc := range []string{"worker0", "worker1"} {
			for _, id := range strings.Fields(compose(t, "ps", "-q", svc)) {
				if strings.TrimSpace(docker(t, "inspect", "--format", "{{.State.Health.Status}}", id)) != "healthy" {
					return false
				}
			}
		}
		return true
	})

	const session = "smoke-engine"
	d := testenv.Conversation{BaseURL: base, Client: client, Headers: map[string]string{"X-Session-ID": session}}.Start()
	for range 3 {
		if _, err := d.Next(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	for i, share := range testenv.PreviousShares(d.Turns, 16) {
		t.Logf("turn %d: prompt %d tokens, cached %d by the engine", i+2, d.Turns[i+1].PromptTokens, d.Turns[i+1].CachedTokens)
		if share < 1 {
			t.Errorf("turn %d found %.2f of the previous prompt in the engine's cache, want 1.00", i+2, share)
		}
	}
	home := ""
	for _, svc := range []string{"engine0", "engine1"} {
		for _, l := range engineLines(t, svc) {
			if l["x_session_id"] == session {
				if l["vllm_xargs_session_id"] != session {
					t.Errorf("%s got X-Session-ID %s but vllm_xargs.session_id %v", svc, session, l["vllm_xargs_session_id"])
				}
				if home != "" && home != svc {
					t.Errorf("the conversation ran on %s and %s", home, svc)
				}
				home = svc
			}
		}
	}
	if home == "" {
		t.Fatal("no engine logged the session")
	}
	// The bus has keys: worker0's is its group's only.
	probe(t, "worker0", "kvbus.hb.g1.0", false)
	other := map[string]string{"engine0": "engine1", "engine1": "engine0"}[home]
	before := len(engineLines(t, other))
	compose(t, "kill", home)
	turn, err := d.Next(t.Context())
	if err != nil {
		t.Fatalf("the turn after %s was killed: %v", home, err)
	}
	if after := len(engineLines(t, other)); after != before+1 {
		t.Errorf("%s served %d requests after %s was killed, want 1 (turn %+v)", other, after-before, home, turn)
	}
}

// engineAuthKeys writes the engine stack's keys (per role, and per group
// for g0 and g1) as `make up-engine` does, unless they exist.
func engineAuthKeys(t *testing.T) {
	t.Helper()
	dir := cmp.Or(os.Getenv("KVBUS_ENGINE_AUTH_DIR"), ".kvbus-auth-engine")
	if !filepath.IsAbs(dir) { // relative to the repository root, as in the compose file
		dir = filepath.Join("..", dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "nats-auth.conf")); err == nil {
		return
	}
	if out, err := exec.Command("../build/docker/kvbus", "auth", "init", dir, "--groups", "g0,g1").CombinedOutput(); err != nil {
		t.Fatalf("kvbus auth init %s --groups g0,g1: %v\n%s", dir, err, out)
	}
}

// probe runs `kvbus auth probe` as a one-off container of service, with its
// key and network, and checks whether the server allowed the publish.
func probe(t *testing.T, service, subject string, allowed bool) {
	t.Helper()
	cmdline := strings.Fields(cmp.Or(os.Getenv("COMPOSE"), "docker-compose"))
	files := strings.Fields(cmp.Or(os.Getenv("COMPOSE_FILES"), "-f docker-compose.yml"))
	args := append(append(cmdline[1:], files...), "run", "--rm", "--no-deps", service, "auth", "probe", "--publish", subject)
	cmd := exec.Command(cmdline[0], args...)
	cmd.Dir = ".."
	cmd.Env = composeEnv()
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	switch {
	case allowed && err == nil && strings.Contains(string(out), "allowed"):
	case !allowed && errors.As(err, &exit) && exit.ExitCode() == 3 && strings.Contains(string(out), "Permissions Violation"):
	default:
		t.Errorf("%s publishing %s: want allowed=%v, got %v:\n%s", service, subject, allowed, err, out)
		return
	}
	t.Logf("%s publishing %s: %s", service, subject, strings.TrimSpace(string(out)))
}

// topSeesTheCluster runs `make top`'s service, kvbus top with the observer
// key, as `kvbus top --once --json`: it sees both groups whole and ready and
// both schedulers ready; and the observer key may publish nothing.
func topSeesTheCluster(t *testing.T) {
	t.Helper()
	out := compose(t, "run", "--rm", "--no-deps", "-T", "top", "top", "--once", "--json", "--watch", "3s")
	i := strings.Index(out, "{\n")
	if i < 0 {
		t.Fatalf("kvbus top --once --json printed no snapshot:\n%s", out)
	}
	var snap struct {
		Groups []struct {
			Name, State string
			Ranks       int
		} `json:"groups"`
		Schedulers []struct {
			ID    string `json:"id"`
			Ready bool   `json:"ready"`
		} `json:"schedulers"`
	}
	if err := json.NewDecoder(strings.NewReader(out[i:])).Decode(&snap); err != nil {
		t.Fatalf("kvbus top's snapshot: %v\n%s", err, out)
	}
	ready := 0
	for _, g := range snap.Groups {
		if g.State == "ready" && g.Ranks == 4 {
			ready++
		}
	}
	readySchedulers := 0
	for _, s := range snap.Schedulers {
		if s.Ready {
			readySchedulers++
		}
	}
	if ready != 2 || readySchedulers != 2 {
		t.Errorf("kvbus top with the observer key saw %d whole ready groups and %d ready schedulers, want 2 and 2:\n%s", ready, readySchedulers, out[i:])
	}
	probe(t, "top", "kvbus.ctl.abort", false)
}

// promQuery runs an instant query against the compose Prometheus.
func promQuery(t *testing.T, base, q string) (float64, string, error) {
	t.Helper()
	return promQueryAt(t, base, q, time.Time{})
}

// promQueryAt runs an instant query at a time (zero: now) and returns the
// first sample's value.
func promQueryAt(t *testing.T, base, q string, at time.Time) (float64, string, error) {
	t.Helper()
	res, status, err := promVector(t, base, q, at)
	if err != nil || len(res) == 0 {
		return 0, status, err
	}
	return res[0].Value, status, nil
}

type promSample struct {
	Labels map[string]string
	Value  float64
}

// promVector runs an instant query at a time (zero: now) and returns every
// sample with its labels.
func promVector(t *testing.T, base, q string, at time.Time) ([]promSample, string, error) {
	t.Helper()
	u := base + "/api/v1/query?query=" + url.QueryEscape(q)
	if !at.IsZero() {
		u += fmt.Sprintf("&time=%.3f", float64(at.UnixMilli())/1000)
	}
	resp, err := http.Get(u)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	var r struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
				Value  [2]any            `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return nil, "", err
	}
	if r.Status != "success" {
		return nil, r.Status, fmt.Errorf("%s: %s", q, r.Error)
	}
	var out []promSample
	for _, s := range r.Data.Result {
		str, _ := s.Value[1].(string)
		v, err := strconv.ParseFloat(str, 64)
		if err != nil {
			return nil, r.Status, err
		}
		out = append(out, promSample{Labels: s.Metric, Value: v})
	}
	return out, r.Status, nil
}

// grafanaVar matches a Grafana template variable in a query: $name,
// ${name} or ${name:format}.
var grafanaVar = regexp.MustCompile(`\$\{([A-Za-z0-9_]+)(?::[a-z]+)?\}|\$([A-Za-z0-9_]+)`)

// expandGrafanaVars replaces a dashboard query's variables as Grafana does
// with every variable at "All" (the dashboard's allValue, .*) and
// $__rate_interval at 1m, so that Prometheus can run it.
func expandGrafanaVars(expr string) string {
	return grafanaVar.ReplaceAllStringFunc(expr, func(m string) string {
		sub := grafanaVar.FindStringSubmatch(m)
		switch sub[1] + sub[2] {
		case "__rate_interval", "__interval", "__range":
			return "1m"
		}
		return ".*"
	})
}

// TestComposeConfigHashes: adding docker-compose.monitoring.yml changes no
// other service's config hash (com.docker.compose.config-hash), in the
// default and the cluster file sets, so switching between `make up` and
// `make up-monitoring` recreates nothing (docker-compose 1.29 reordered the
// NATS service's volumes when merging several files, and the bus restarted).
func TestComposeConfigHashes(t *testing.T) {
	hashes := func(files ...string) map[string]string {
		var args []string
		for _, f := range files {
			args = append(args, "-f", f)
		}
		out := map[string]string{}
		for _, line := range strings.Split(strings.TrimSpace(composeFiles(t, args, "config", "--hash=*")), "\n") {
			if service, hash, ok := strings.Cut(strings.TrimSpace(line), " "); ok {
				out[service] = hash
			}
		}
		return out
	}
	for _, set := range [][]string{{"docker-compose.yml"}, {"docker-compose.yml", "docker-compose.cluster.yml"}} {
		without := hashes(set...)
		with := hashes(append(slices.Clone(set), "docker-compose.monitoring.yml")...)
		if len(without) == 0 || with["prometheus"] == "" {
			t.Fatalf("%v: hashes %v, with monitoring %v", set, without, with)
		}
		for service, h := range without {
			if with[service] != h {
				t.Errorf("%v: service %s's config hash is %s, with docker-compose.monitoring.yml %s: compose would recreate it", set, service, h, with[service])
			}
		}
		t.Logf("%v: %v", set, without)
	}
}

// TestSmokeMonitoring runs the compose cluster with
// docker-compose.monitoring.yml: Prometheus (built from Debian's package)
// finds and scrapes every role, each target labelled with its role, has the
// prompt tokens the clients sent, is healthy, has loaded every rule of
// deploy/prometheus/rules.yml (health ok, none firing), every query of the
// Grafana dashboard (deploy/grafana/kvbus.json) is valid PromQL there, a
// new Prometheus container keeps the old one's data (the volume), and `up`
// without the monitoring file and with it again recreates nothing.
func TestSmokeMonitoring(t *testing.T) {
	promImage := cmp.Or(os.Getenv("KVBUS_PROMETHEUS_IMAGE"), "kvbus-prometheus:dev")
	if err := exec.Command("docker", "image", "inspect", promImage).Run(); err != nil {
		t.Skipf("no %s image (make image-prometheus builds it from Debian's package)", promImage)
	}
	t.Setenv("COMPOSE_FILES", "-f docker-compose.yml -f docker-compose.monitoring.yml")
	port := cmp.Or(os.Getenv("KVBUS_PROMETHEUS_PORT"), "9091")
	prom := "http://127.0.0.1:" + port
	compose(t, "down", "-v", "--remove-orphans")
	t.Cleanup(func() { compose(t, "down", "-v", "--remove-orphans") })
	compose(t, "up", "-d", "--scale", "scheduler=1", "--scale", "worker=4")
	client := &http.Client{Timeout: 60 * time.Second}
	waitHealthy(t, client)
	turns, err := testenv.Conversation{BaseURL: base, Client: client, Headers: map[string]string{"X-Session-ID": "monitored"}}.Run(t.Context(), 3)
	if err != nil {
		t.Fatal(err)
	}
	sent := 0
	for _, turn := range turns {
		sent += turn.PromptTokens
	}
	// 1 frontend + 1 scheduler + 4 workers, each with its role.
	wantRoles := map[string]float64{"frontend": 1, "scheduler": 1, "worker": 4}
	var roles map[string]float64
	eventually(t, 60*time.Second, "Prometheus scraping 6 targets by role with the clients' prompt tokens", func() bool {
		res, _, err := promVector(t, prom, `count by (role) (up{job="kvbus"} == 1)`, time.Time{})
		if err != nil {
			return false
		}
		roles = map[string]float64{}
		for _, s := range res {
			roles[s.Labels["role"]] = s.Value
		}
		if !maps.Equal(roles, wantRoles) {
			return false
		}
		tokens, _, err := promQuery(t, prom, `sum(kvbus_scheduler_prompt_tokens_total)`)
		return err == nil && tokens == float64(sent)
	})
	t.Logf("targets up by role: %v", roles)
	// Healthy (its health check runs the kvbus binary in the image), and
	// every rule of deploy/prometheus/rules.yml loaded and evaluated.
	promID := strings.TrimSpace(compose(t, "ps", "-q", "prometheus"))
	eventually(t, 90*time.Second, "the Prometheus container healthy", func() bool {
		out, err := exec.Command("docker", "inspect", "--format", "{{.State.Health.Status}}", promID).Output()
		return err == nil && strings.TrimSpace(string(out)) == "healthy"
	})
	wantAlerts := []string{"KvbusNoReadyScheduler", "KvbusWorkerGroupNotReady", "KvbusFrontend5xxRate",
		"KvbusCacheHitRatioDrop", "KvbusTTFTHigh", "KvbusRequestLogFilling"}
	var ruleStates []string
	eventually(t, 60*time.Second, "every rule evaluated, health ok", func() bool {
		resp, err := http.Get(prom + "/api/v1/rules")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var r struct {
			Data struct {
				Groups []struct {
					Name  string
					Rules []struct {
						Name, Health, LastError, Type string
					}
				}
			}
		}
		if json.NewDecoder(resp.Body).Decode(&r) != nil {
			return false
		}
		ruleStates = ruleStates[:0]
		ok, alerts := true, map[string]bool{}
		for _, g := range r.Data.Groups {
			for _, rule := range g.Rules {
				ruleStates = append(ruleStates, g.Name+"/"+rule.Name+": "+rule.Health+" "+rule.LastError)
				ok = ok && rule.Health == "ok"
				alerts[rule.Name] = rule.Type == "alerting"
			}
		}
		for _, a := range wantAlerts {
			ok = ok && alerts[a]
		}
		return ok
	})
	t.Logf("%d rules, every one ok", len(ruleStates))
	// Nothing fires on this healthy cluster (a fresh one: the rules that
	// need history cannot fire yet).
	if res, _, err := promVector(t, prom, `ALERTS{alertstate="firing"}`, time.Time{}); err != nil || len(res) > 0 {
		t.Errorf("alerts firing on a healthy cluster: %v %v", res, err)
	}
	// kvbus top, from inside the network with the admin key, sees the group
	// and a conversation that runs while it watches.
	frontendID := strings.TrimSpace(compose(t, "ps", "-q", "frontend"))
	network := strings.TrimSpace(docker(t, "inspect", "--format", "{{range $k, $v := .NetworkSettings.Networks}}{{$k}}{{end}}", frontendID))
	authDir := cmp.Or(os.Getenv("KVBUS_AUTH_DIR"), ".kvbus-auth")
	if !filepath.IsAbs(authDir) { // relative to the repository root, as in the compose files
		authDir, _ = filepath.Abs(filepath.Join("..", authDir))
	}
	topOut := make(chan []byte, 1)
	go func() {
		out, _ := exec.Command("docker", "run", "--rm", "--network", network, "--user", cmp.Or(os.Getenv("KVBUS_UID"), "65532"),
			"-v", authDir+"/admin.nk:/auth/admin.nk:ro", cmp.Or(os.Getenv("KVBUS_IMAGE"), "kvbus:dev"),
			"top", "--once", "--json", "--watch", "8s", "--nats-url", "nats://nats:4222", "--nats-nkey", "/auth/admin.nk").Output()
		topOut <- out
	}()
	time.Sleep(3 * time.Second)
	if _, err := (testenv.Conversation{BaseURL: base, Client: client, Seed: 9, Headers: map[string]string{"X-Session-ID": "watched-by-top"}}).Run(t.Context(), 2); err != nil {
		t.Fatal(err)
	}
	var snap struct {
		Groups []struct {
			Name, State string
			Ranks       int
		}
		Sessions []struct {
			ID    string
			Turns int
		}
	}
	out := <-topOut
	if err := json.Unmarshal(out, &snap); err != nil {
		t.Fatalf("kvbus top --once --json in the network: %v\n%s", err, out)
	}
	if len(snap.Groups) != 1 || snap.Groups[0].State != "ready" || snap.Groups[0].Ranks != 4 ||
		!slices.ContainsFunc(snap.Sessions, func(s struct {
			ID    string
			Turns int
		}) bool {
			return s.ID == "watched-by-top" && s.Turns == 2
		}) {
		t.Errorf("kvbus top saw %s", out)
	}

	for _, q := range testenv.DashboardQueries(t, "../deploy/grafana/kvbus.json") {
		if _, _, err := promQuery(t, prom, expandGrafanaVars(q.Expr)); err != nil {
			t.Errorf("dashboard panel %q: %v", q.Panel, err)
		}
	}
	// A local-only cluster's pool traffic panel shows 0, not "No data".
	if v, _, err := promVector(t, prom, `sum(rate(kvbus_worker_pool_remote_bytes_total[1m])) or on() vector(0)`, time.Time{}); err != nil || len(v) != 1 {
		t.Errorf("pool traffic total: %v %v", v, err)
	}

	// The TSDB is the volume prometheus-data: a new Prometheus container
	// still has what the old one scraped.
	before := time.Now()
	tokens, _, err := promQueryAt(t, prom, `sum(kvbus_scheduler_prompt_tokens_total)`, before)
	if err != nil || tokens == 0 {
		t.Fatalf("prompt tokens before recreating Prometheus: %v %v", tokens, err)
	}
	compose(t, "up", "-d", "--no-deps", "--force-recreate", "prometheus")
	eventually(t, 60*time.Second, "the new Prometheus answering with the old one's samples", func() bool {
		v, _, err := promQueryAt(t, prom, `sum(kvbus_scheduler_prompt_tokens_total)`, before)
		return err == nil && v == tokens
	})

	// `up` with docker-compose.yml alone (what `make up` ran) and again
	// with the monitoring file recreates no container: NATS keeps running.
	ids := func() map[string]string {
		out := map[string]string{}
		for _, id := range strings.Fields(compose(t, "ps", "-q")) {
			out[id] = strings.TrimSpace(docker(t, "inspect", "--format", "{{.Name}} {{.State.StartedAt}}", id))
		}
		return out
	}
	running := ids()
	composeFiles(t, []string{"-f", "docker-compose.yml"}, "up", "-d", "--scale", "scheduler=1", "--scale", "worker=4")
	compose(t, "up", "-d", "--scale", "scheduler=1", "--scale", "worker=4")
	if after := ids(); !maps.Equal(running, after) {
		t.Errorf("up with and without docker-compose.monitoring.yml recreated or restarted containers:\nbefore %v\nafter  %v", running, after)
	}
}

// TestSmokeDownRemovesTheClusterFilesVolumes: `make down`, as the README
// lists it after `make up COMPOSE_FILES="-f docker-compose.yml -f
// docker-compose.cluster.yml"`, removes the second and third NATS servers'
// JetStream volumes too. Before, it read docker-compose.yml alone: their
// containers went as orphans, their volumes nats2-data and nats3-data
// stayed, and the next clustered `make up` started them on the old store.
func TestSmokeDownRemovesTheClusterFilesVolumes(t *testing.T) {
	t.Setenv("COMPOSE_FILES", "-f docker-compose.yml -f docker-compose.cluster.yml")
	compose(t, "down", "-v", "--remove-orphans")
	t.Cleanup(func() { compose(t, "down", "-v", "--remove-orphans") })
	compose(t, "up", "-d", "--no-deps", "nats", "nats2", "nats3")
	ids := strings.Fields(compose(t, "ps", "-q", "nats2"))
	if len(ids) != 1 {
		t.Fatalf("nats2 containers: %v", ids)
	}
	project := strings.TrimSpace(docker(t, "inspect", "-f", `{{index .Config.Labels "com.docker.compose.project"}}`, ids[0]))
	volumes := func() []string {
		return strings.Fields(docker(t, "volume", "ls", "-q", "--filter", "label=com.docker.compose.project="+project))
	}
	if v := volumes(); len(v) < 3 {
		t.Fatalf("project %s's volumes after up: %v, want the three NATS servers'", project, v)
	}
	down := exec.Command("make", "down")
	down.Dir = ".."
	down.Env = slices.DeleteFunc(composeEnv(), func(kv string) bool { return strings.HasPrefix(kv, "COMPOSE_FILES=") })
	if out, err := down.CombinedOutput(); err != nil {
		t.Fatalf("make down: %v\n%s", err, out)
	}
	if v := volumes(); len(v) > 0 {
		t.Errorf("volumes left by make down: %v", v)
	}
}
