package main

import (
	"bufio"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvbus/kvbus/testenv"
)

// TestProcessKilledFrontendsRequestsAreAborted: a frontend killed -9 in the
// middle of a long streamed answer sends no Abort. Its answer ran on to its
// end (max_tokens 3,000 at 10 ms a token: 30 s of a group's decode) for
// nobody; the schedulers now find that nobody listens on the frontend's
// output subject and, --frontend-gone-after later, abort the request on
// its group, whose rank stops it.
func TestProcessKilledFrontendsRequestsAreAborted(t *testing.T) {
	bin, dir, natsAddr, _ := startNATSProc(t)
	bus := []string{"--nats-url", "nats://" + natsAddr}
	schedMetrics, httpAddr := freeAddr(t), freeAddr(t)
	sched := startProc(t, bin, dir, "scheduler", append([]string{"scheduler", "--metrics-addr", schedMetrics, "--frontend-gone-after", "2s"}, bus...)...)
	worker := startProc(t, bin, dir, "worker", append([]string{"worker", "--group", "g0", "--tp-rank", "0", "--tp-size", "1",
		"--kv-capacity", "64MiB", "--metrics-addr", ""}, bus...)...)
	fe := startProc(t, bin, dir, "frontend", append([]string{"frontend", "--id", "fe-killed", "--http-addr", httpAddr}, bus...)...)
	base := "http://" + httpAddr
	testenv.Eventually(t, 60*time.Second, "/healthz 200", func() bool { return healthz(base+"/healthz") == http.StatusOK })

	body := `{"messages":[{"role":"user","content":"a long story"}],"max_tokens":3000,"ignore_eos":true,"stream":true}`
	resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	lines := bufio.NewScanner(resp.Body)
	for chunks := 0; chunks < 3 && lines.Scan(); { // the answer is under way
		if strings.HasPrefix(lines.Text(), "data: {") {
			chunks++
		}
	}
	if err := fe.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	select {
	case err := <-fe.done:
		fe.done <- err
		if err == nil {
			t.Fatal("the killed frontend exited 0")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the killed frontend is still running")
	}

	logHas := func(p *proc, parts ...string) bool {
		b, _ := os.ReadFile(p.log)
		for _, l := range strings.Split(string(b), "\n") {
			if all(l, parts) {
				return true
			}
		}
		return false
	}
	testenv.Eventually(t, 20*time.Second, "the rank stopping the request of the killed frontend", func() bool {
		return logHas(worker, `"msg":"request aborted"`, `"reason":"frontend gone"`)
	})
	if took := time.Since(killed); took > 15*time.Second {
		t.Errorf("aborted %v after the frontend was killed; want within --frontend-gone-after (2s) and a few probes", took.Round(time.Millisecond))
	}
	if !logHas(sched, "a frontend with requests in flight is gone", `"frontend_id":"fe-killed"`, `"requests":1`) {
		t.Error("the scheduler did not log the frontend gone with its one request")
	}
	// The group carries nothing more: its in-flight count is back to 0.
	inflight := regexp.MustCompile(`(?m)^kvbus_scheduler_group_inflight_requests\{group="g0"[^}]*\} (\S+)$`)
	testenv.Eventually(t, 10*time.Second, "g0's in-flight count back to 0", func() bool {
		r, err := http.Get("http://" + schedMetrics + "/metrics")
		if err != nil {
			return false
		}
		defer r.Body.Close()
		var b strings.Builder
		sc := bufio.NewScanner(r.Body)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			b.WriteString(sc.Text() + "\n")
		}
		m := inflight.FindStringSubmatch(b.String())
		if m == nil {
			return false
		}
		n, err := strconv.ParseFloat(m[1], 64)
		return err == nil && n == 0
	})
}

// all reports whether s holds every one of parts.
func all(s string, parts []string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}
