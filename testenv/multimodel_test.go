package testenv_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/cluster"
	"github.com/kvbus/kvbus/frontend"
	"github.com/kvbus/kvbus/internal/logsink"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
	"github.com/kvbus/kvbus/workers"
)

// multiModel is one bus serving two models: an in-process cluster of model
// "a" (groups g0, …, a scheduler, and a frontend serving every name of
// frontendModels) and ranks of model "b" started beside it on the same
// NATS, as `kvbus worker --model b --group b0` processes would be.
type multiModel struct {
	c    *cluster.Cluster
	url  string
	logs *testenv.LogBuffer
	reg  *prometheus.Registry
}

type multiModelConfig struct {
	groupsA        int
	frontendModels []string
	requestTimeout time.Duration
	// delayFirstReqMeta delays the first ReqMeta of model a's ranks of
	// these tp_ranks.
	delayFirstReqMeta map[int]time.Duration
}

func startMultiModel(t *testing.T, cfg multiModelConfig) *multiModel {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	logs := &testenv.LogBuffer{}
	reg := prometheus.NewRegistry()
	c, err := cluster.Start(context.Background(), cluster.Config{
		DataDir: t.TempDir(), Groups: cfg.groupsA, Ranks: 2, Model: "a", ModelProfile: "tiny", KVCapacity: 16 << 20,
		Sim:               workers.SimConfig{Profile: workers.DefaultSimProfile()},
		HeartbeatInterval: 100 * time.Millisecond, HeartbeatTimeout: time.Second, ShutdownTimeout: 2 * time.Second,
		RequestTimeout: cfg.requestTimeout, DelayFirstReqMeta: cfg.delayFirstReqMeta,
		Frontend: &frontend.Config{Listener: ln, Models: cfg.frontendModels, StopGrace: 100 * time.Millisecond},
		Logger:   slog.New(logsink.NewTextHandler(logs, nil)), Registry: reg,
	})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	t.Cleanup(func() {
		c.Stop()
		if err := c.Wait(); err != nil {
			t.Errorf("cluster role failed: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := c.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	return &multiModel{c: c, url: "http://" + ln.Addr().String(), logs: logs, reg: reg}
}

// startRanks starts a group of ranks on the cluster's NATS, each rank
// serving models[rank], and stops them at cleanup.
func (m *multiModel) startRanks(t *testing.T, group string, models ...string) {
	t.Helper()
	profile, err := workers.LookupModelProfile("tiny")
	if err != nil {
		t.Fatal(err)
	}
	engine, err := workers.NewSimEngine(workers.SimConfig{Profile: workers.DefaultSimProfile()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	for r, model := range models {
		nc, err := bus.Connect(t.Context(), bus.Config{URL: m.c.NATSURL, Name: fmt.Sprintf("kvbus-worker-%s-%d", group, r), Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		rank, err := workers.NewRank(workers.RankConfig{
			Conn: nc, Group: group, TPRank: r, TPSize: len(models), EPRank: r, EPSize: len(models),
			Model: model, Profile: profile, CapacityBytes: 16 << 20, Payload: workers.PayloadBytes, Engine: engine,
			HeartbeatInterval: 100 * time.Millisecond, ShutdownTimeout: 2 * time.Second,
			Logger: slog.New(logsink.NewTextHandler(m.logs, nil)),
		})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			defer nc.Close()
			if err := rank.Run(ctx); err != nil {
				t.Errorf("rank %s/%d: %v", group, r, err)
			}
		})
	}
}

// waitGroups waits until the scheduler sees exactly the ready groups want.
func (m *multiModel) waitGroups(t *testing.T, want ...string) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, fmt.Sprintf("ready groups %v", want), func() bool {
		var got []string
		for _, g := range m.c.Schedulers[0].PlaceableGroups(time.Now()) {
			got = append(got, g.Name)
		}
		return fmt.Sprint(got) == fmt.Sprint(want)
	})
}

// metas records the group of every ReqMeta by its request's model.
func (m *multiModel) metas(t *testing.T) func() map[string][]string {
	t.Helper()
	o := testenv.ObserveBus(t, m.c.NATS, "kvbus.meta.>")
	return func() map[string][]string {
		out := map[string][]string{}
		for _, msg := range o.Messages() {
			meta, err := messages.DecodeReqMeta(msg.Data)
			if err != nil {
				t.Errorf("ReqMeta on %s: %v", msg.Subject, err)
				continue
			}
			out[meta.Model] = append(out[meta.Model], meta.Group)
		}
		return out
	}
}

func (m *multiModel) chat(t *testing.T, model, session, content string) (int, map[string]any) {
	t.Helper()
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":2}`, model, content)
	status, _, b := testenv.Send(t, http.MethodPost, m.url+"/v1/chat/completions", body, map[string]string{"X-Session-ID": session})
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("answer %d is not JSON: %v: %s", status, err, b)
	}
	return status, out
}

// TestMultiModelPlacement: two models on one bus, one frontend serving
// both. Every request of model a goes to model a's groups and every request
// of model b to model b's; a model that no worker serves gets a 503 naming
// it, not an answer from another model's workers. Before, the scheduler
// placed on any ready group whatever the model: about half of each model's
// requests were answered by the other model's ranks, and a model without
// workers was answered by another's.
func TestMultiModelPlacement(t *testing.T) {
	m := startMultiModel(t, multiModelConfig{groupsA: 2, frontendModels: []string{"a", "b", "c"}})
	metas := m.metas(t)
	m.startRanks(t, "b0", "b", "b")
	m.startRanks(t, "b1", "b", "b")
	m.waitGroups(t, "b0", "b1", "g0", "g1")

	status, _, body := testenv.Send(t, http.MethodGet, m.url+"/v1/models", "", nil)
	var list struct{ Data []struct{ ID string } }
	if err := json.Unmarshal(body, &list); status != http.StatusOK || err != nil || len(list.Data) != 3 ||
		list.Data[0].ID != "a" || list.Data[1].ID != "b" || list.Data[2].ID != "c" {
		t.Errorf("GET /v1/models: %d %s, want a, b and c", status, body)
	}

	groupsOf := map[string][]string{"a": {"g0", "g1"}, "b": {"b0", "b1"}}
	for i := range 12 {
		for _, model := range []string{"a", "b"} {
			status, out := m.chat(t, model, fmt.Sprintf("s%d", i), fmt.Sprintf("hello %d", i))
			if status != http.StatusOK {
				t.Fatalf("model %s: %d %v", model, status, out)
			}
			if out["model"] != model {
				t.Errorf("answer names model %v, want %s", out["model"], model)
			}
		}
	}
	got := metas()
	for model, groups := range got {
		for _, g := range groups {
			if !strings.Contains(strings.Join(groupsOf[model], " "), g) {
				t.Errorf("a request of model %s was placed on group %s, of another model (placements %v)", model, g, groups)
			}
		}
	}
	if len(got["a"]) < 12 || len(got["b"]) < 12 { // a resend counts again
		t.Errorf("placements %v, want 12 per model", got)
	}

	// The metrics say which model: the frontend's requests, the scheduler's
	// ready groups and group gauges.
	for _, model := range []string{"a", "b"} {
		if n := testenv.CounterSum(t, m.reg, "kvbus_frontend_requests_total", map[string]string{"model": model, "status": "200"}); n != 12 {
			t.Errorf("kvbus_frontend_requests_total{model=%q,status=\"200\"} = %v, want 12", model, n)
		}
	}
	testenv.Eventually(t, 5*time.Second, "per-model scheduler gauges", func() bool {
		return testenv.GaugeSum(t, m.reg, "kvbus_scheduler_model_ready_groups", map[string]string{"model": "a"}) == 2 &&
			testenv.GaugeSum(t, m.reg, "kvbus_scheduler_model_ready_groups", map[string]string{"model": "b"}) == 2 &&
			testenv.SeriesCount(t, m.reg, "kvbus_scheduler_group_blocks", map[string]string{"group": "b1", "model": "b"}) == 1
	})

	// The schedulers tell the frontends which models they can place (a
	// frontend of c alone would not be ready).
	nc, err := nats.Connect(m.c.NATSURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	anns, err := nc.SubscribeSync(messages.Subjects{}.AnnounceRole(messages.RoleScheduler))
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "an announcement of models a and b", func() bool {
		msg, err := anns.NextMsg(time.Second)
		if err != nil {
			return false
		}
		a, err := messages.DecodeAnnouncement(msg.Data)
		return err == nil && slices.Equal(a.ReadyModels, []string{"a", "b"})
	})

	// Model c is served by the frontend, by no worker.
	start := time.Now()
	status, out := m.chat(t, "c", "s-c", "hello")
	errBody, _ := out["error"].(map[string]any)
	msg, _ := errBody["message"].(string)
	if status != http.StatusServiceUnavailable || !strings.Contains(msg, `model "c"`) || !strings.Contains(msg, `"a", "b"`) {
		t.Fatalf("model without workers: %d %v, want a 503 naming model c and the models served", status, out)
	}
	if waited := time.Since(start); waited > 10*time.Second {
		t.Errorf("model without workers answered after %s", waited)
	}
	if n := len(metas()["c"]); n != 0 {
		t.Errorf("model c's request was placed %d times", n)
	}
}

// TestMultiModelSessions: one session id used with two models is two
// conversations. Before, the session binding was per session id: model b's
// first turn counted as the conversation's second turn (the scheduler's
// turn_depth metrics), and each model's turn overwrote the other's binding.
func TestMultiModelSessions(t *testing.T) {
	m := startMultiModel(t, multiModelConfig{groupsA: 1, frontendModels: []string{"a", "b"}})
	m.startRanks(t, "b0", "b", "b")
	m.waitGroups(t, "b0", "g0")

	long := strings.Repeat("a conversation of many words that fill blocks ", 20)
	for _, model := range []string{"a", "b"} {
		if status, out := m.chat(t, model, "shared", long); status != http.StatusOK {
			t.Fatalf("model %s: %d %v", model, status, out)
		}
	}
	bindings := m.c.Schedulers[0].Bindings()
	testenv.Eventually(t, 5*time.Second, "a binding per model", func() bool {
		a, okA := bindings.GetModel("a", "shared")
		b, okB := bindings.GetModel("b", "shared")
		return okA && okB && a.Group == "g0" && b.Group == "b0" && a.Turn == 1 && b.Turn == 1
	})
	if n := testenv.CounterSum(t, m.reg, "kvbus_scheduler_prompt_tokens_total", map[string]string{"turn_depth": "2"}); n != 0 {
		t.Errorf("model b's first turn was counted as the session's second (%v prompt tokens at turn depth 2)", n)
	}
	// Model a's next turn follows its own first turn.
	if status, out := m.chat(t, "a", "shared", long+" and more"); status != http.StatusOK {
		t.Fatalf("model a, turn 2: %d %v", status, out)
	}
	testenv.Eventually(t, 5*time.Second, "model a's turn 2", func() bool {
		a, _ := bindings.GetModel("a", "shared")
		b, _ := bindings.GetModel("b", "shared")
		return a.Turn == 2 && a.Group == "g0" && b.Turn == 1 && b.Group == "b0"
	})
	// The hit ratio's counters are per model: a's second turn and the
	// tokens it loaded are a's, and b has one turn, loaded from nothing.
	// Before, they had no model label: a's and b's turns were summed.
	_, turn2 := m.chat(t, "a", "shared", long+" and more, and more")
	usage := turn2["usage"].(map[string]any)
	prompt := int(usage["prompt_tokens"].(float64))
	cached := int(usage["prompt_tokens_details"].(map[string]any)["cached_tokens"].(float64))
	testenv.Eventually(t, 5*time.Second, "model a's turn 3 counted", func() bool {
		return int(testenv.CounterSum(t, m.reg, "kvbus_scheduler_prompt_tokens_total", map[string]string{"model": "a", "turn_depth": "3"})) == prompt
	})
	if got := int(testenv.CounterSum(t, m.reg, "kvbus_scheduler_cached_tokens_total", map[string]string{"model": "a", "turn_depth": "3"})); got != cached || cached == 0 {
		t.Errorf("model a's turn 3: %d cached tokens counted, the answer says %d (want the same, and its previous turn's blocks)", got, cached)
	}
	for _, depth := range []string{"2", "3"} {
		if n := testenv.CounterSum(t, m.reg, "kvbus_scheduler_prompt_tokens_total", map[string]string{"model": "b", "turn_depth": depth}); n != 0 {
			t.Errorf("model b: %v prompt tokens at turn depth %s, want none (b had one turn)", n, depth)
		}
	}
	if n := testenv.CounterSum(t, m.reg, "kvbus_scheduler_cached_tokens_total", map[string]string{"model": "b"}); n != 0 {
		t.Errorf("model b: %v cached tokens, want none (its one turn found nothing)", n)
	}
}

// TestMultiModelMixedGroup: a group whose ranks serve different models
// (workers of two models given one --group, or sharing --rank auto slots)
// takes no request and is reported. Before, it was ready and answered both
// models' requests with ranks of both.
func TestMultiModelMixedGroup(t *testing.T) {
	m := startMultiModel(t, multiModelConfig{groupsA: 1, frontendModels: []string{"a", "b"}})
	m.startRanks(t, "mix", "a", "b")
	m.startRanks(t, "b0", "b", "b")
	m.waitGroups(t, "b0", "g0")
	testenv.Eventually(t, 5*time.Second, "the mixed group reported", func() bool {
		return strings.Contains(m.logs.String(), "serve different models") && strings.Contains(m.logs.String(), "group=mix")
	})
	// Heard for a while, it is still not a group.
	time.Sleep(500 * time.Millisecond)
	for _, g := range m.c.Schedulers[0].Groups() {
		if g.Name == "mix" {
			t.Fatalf("the mixed group is ready: %+v", g)
		}
	}
}

// TestMultiModelFailoverKeepsTheModel: a request whose group fails before
// it answers is dispatched again only to a group of its model. Before,
// rescue moved it to any ready group: model b's ranks answered model a's
// request.
func TestMultiModelFailoverKeepsTheModel(t *testing.T) {
	m := startMultiModel(t, multiModelConfig{groupsA: 1, frontendModels: []string{"a", "b"}, requestTimeout: 5 * time.Second,
		delayFirstReqMeta: map[int]time.Duration{0: 3 * time.Second, 1: 3 * time.Second}})
	metas := m.metas(t)
	m.startRanks(t, "b0", "b", "b")
	m.waitGroups(t, "b0", "g0")

	done := make(chan int, 1)
	go func() {
		status, _ := m.chat(t, "a", "fo", "hello")
		done <- status
	}()
	testenv.Eventually(t, 5*time.Second, "the request placed on g0", func() bool { return len(metas()["a"]) > 0 })
	if err := m.c.KillRank("g0", 1); err != nil {
		t.Fatal(err)
	}
	// Its group is judged failed a heartbeat timeout (1 s) after the kill;
	// the request waits for a group of model a, until its deadline, or is
	// answered by g0's driver once its ReqMeta's delay ends.
	<-done
	for _, g := range metas()["a"] {
		if g != "g0" {
			t.Errorf("model a's request was dispatched again on %s, a group of model b", g)
		}
	}
}

// TestMultiModelLegacyBinding: a session binding written by a kvbus before
// bindings were per model (no model, no others) still serves the model whose
// conversation it is after another model's turn used the same session id:
// model b's first turn is counted as its first, and model a's next turn
// follows a's previous one. Before, model b took the old binding (its first
// turn counted as the conversation's second) and model a lost it (its next
// turn counted as a first).
func TestMultiModelLegacyBinding(t *testing.T) {
	m := startMultiModel(t, multiModelConfig{groupsA: 1, frontendModels: []string{"a", "b"}})
	m.startRanks(t, "b0", "b", "b")
	m.waitGroups(t, "b0", "g0")

	long := strings.Repeat("a conversation of many words that fill blocks ", 20)
	if status, out := m.chat(t, "a", "upgraded", long); status != http.StatusOK {
		t.Fatalf("model a, turn 1: %d %v", status, out)
	}
	bindings := m.c.Schedulers[0].Bindings()
	testenv.Eventually(t, 5*time.Second, "model a's binding", func() bool {
		a, ok := bindings.GetModel("a", "upgraded")
		return ok && a.Turn == 1 && a.Model == "a"
	})
	// Rewrite it as an older kvbus wrote it.
	js, err := jetstream.New(testenv.Connect(t, m.c.NATS))
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(t.Context(), messages.SessionBucket)
	if err != nil {
		t.Fatal(err)
	}
	key := messages.SessionKey("upgraded")
	// The replica writes its binding to the bucket after it holds it (on
	// a busy host, later than the check above).
	var e jetstream.KeyValueEntry
	testenv.Eventually(t, 5*time.Second, "model a's binding in the session bucket", func() bool {
		e, err = kv.Get(t.Context(), key)
		return err == nil
	})
	var v map[string]json.RawMessage // last_hash is a uint64: no float64 in between
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		t.Fatal(err)
	}
	delete(v, "model")
	delete(v, "others")
	old, _ := json.Marshal(v)
	if _, err := kv.Put(t.Context(), key, old); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "the scheduler reads the old binding", func() bool {
		a, ok := bindings.GetModel("a", "upgraded")
		return ok && a.Model == ""
	})

	if status, out := m.chat(t, "b", "upgraded", long); status != http.StatusOK {
		t.Fatalf("model b, turn 1: %d %v", status, out)
	}
	testenv.Eventually(t, 5*time.Second, "model b's own binding", func() bool {
		b, ok := bindings.GetModel("b", "upgraded")
		return ok && b.Model == "b"
	})
	if b, _ := bindings.GetModel("b", "upgraded"); b.Turn != 1 {
		t.Errorf("model b's first turn was counted as turn %d", b.Turn)
	}
	// Model a's next turn: the conversation so far, and a new question.
	body := fmt.Sprintf(`{"model":"a","messages":[{"role":"user","content":%q},{"role":"assistant","content":"an answer"},`+
		`{"role":"user","content":"and more"}],"max_tokens":2}`, long)
	if status, _, b := testenv.Send(t, http.MethodPost, m.url+"/v1/chat/completions", body, map[string]string{"X-Session-ID": "upgraded"}); status != http.StatusOK {
		t.Fatalf("model a, turn 2: %d %s", status, b)
	}
	testenv.Eventually(t, 5*time.Second, "model a's turn 2 follows its turn 1", func() bool {
		a, _ := bindings.GetModel("a", "upgraded")
		return a.Model == "a" && a.Turn == 2 && a.Group == "g0"
	})
	if b, _ := bindings.GetModel("b", "upgraded"); b.Turn != 1 || b.Group != "b0" {
		t.Errorf("model b's binding after model a's turn: %+v", b)
	}
}
