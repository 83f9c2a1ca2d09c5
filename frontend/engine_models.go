package frontend

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"
)

// ModelLister is implemented by a tokenizer that can also ask the engines
// behind it which models they serve (EngineTokenizer: their GET
// /v1/models); a frontend in front of engines (Config.Passthrough) finds
// it by a type assertion on its Tokenizer, and serves only --model without
// it. Safe for concurrent use; Models honours ctx's deadline.
type ModelLister interface {
	// Models returns the entries of the first engine's model list that
	// answers, as the engine wrote them.
	Models(ctx context.Context) ([]json.RawMessage, error)
}

// Models implements ModelLister: GET /v1/models of the engines in the
// order /tokenize asks them, each within cfg.Timeout.
func (t *EngineTokenizer) Models(ctx context.Context) ([]json.RawMessage, error) {
	var errs []error
	for _, n := range t.order() {
		data, err := t.modelsAt(ctx, t.bases[n])
		if err == nil {
			return data, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, errors.Join(errs...)
}

func (t *EngineTokenizer) modelsAt(ctx context.Context, base string) ([]json.RawMessage, error) {
	ctx, cancel := context.WithTimeout(ctx, t.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/models", nil)
	if err != nil {
		return nil, err
	}
	if t.cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+t.cfg.APIKey)
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("GET %s/v1/models: %w", base, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxModelList+1))
	if err != nil {
		return nil, fmt.Errorf("GET %s/v1/models: %w", base, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s/v1/models answered %d", base, resp.StatusCode)
	}
	data, err := parseModelList(body)
	if err != nil {
		return nil, fmt.Errorf("GET %s/v1/models: %w", base, err)
	}
	return data, nil
}

// maxModelList bounds the engines' GET /v1/models answer (some thousands
// of entries: a model and its LoRA adapters).
const maxModelList = 1 << 20

// parseModelList reads a GET /v1/models answer: its entries, as the
// engine wrote them.
func parseModelList(body []byte) ([]json.RawMessage, error) {
	if len(body) > maxModelList {
		return nil, fmt.Errorf("the answer exceeds %d bytes", maxModelList)
	}
	var list struct {
		Data []json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil || len(list.Data) == 0 {
		return nil, fmt.Errorf("no model list in the answer (%v)", err)
	}
	return list.Data, nil
}

// modelIDs returns the ids of a model list's entries, and those of the
// entries listed with a parent: LoRA adapters of the base model (vLLM
// lists those of --lora-modules so). An entry whose parent is no string
// keeps its id (it is listed): it is no adapter.
func modelIDs(data []json.RawMessage) (ids, adapters map[string]bool) {
	ids, adapters = map[string]bool{}, map[string]bool{}
	for _, raw := range data {
		var e struct {
			ID     string          `json:"id"`
			Parent json.RawMessage `json:"parent"`
		}
		if json.Unmarshal(raw, &e) != nil || e.ID == "" {
			continue
		}
		ids[e.ID] = true
		var parent string
		if json.Unmarshal(e.Parent, &parent) == nil && parent != "" && parent != e.ID {
			adapters[e.ID] = true
		}
	}
	return ids, adapters
}

// How long the engines' model list is used before it is asked again, and
// how often an unknown model may make the frontend ask.
const (
	engineModelsTTL   = 30 * time.Second
	engineModelsRetry = 5 * time.Second
)

// engineModels caches the engines' model list (--engine openai with
// --tokenizer engine): their ids are served too, and GET /v1/models
// relays their entries (their max_model_len included).
type engineModels struct {
	lister ModelLister  // nil: no engine to ask
	log    *slog.Logger // warns of a failed list, once until one is read again

	mu      sync.Mutex
	failing bool      // the last attempt failed, and was logged
	at      time.Time // of the last attempt
	ok      time.Time // of the last answer
	data    []json.RawMessage
	ids     map[string]bool
	// adapters are the ids listed with a parent: LoRA adapters of the
	// base model (vLLM lists those of --lora-modules so).
	adapters map[string]bool
	fresh    chan struct{} // closed when the running attempt ends; nil when none runs
}

// list returns the engines' entries and ids, asking the engines first when
// the list is older than maxAge (and no attempt was made within
// engineModelsRetry). Concurrent callers share one attempt.
func (m *engineModels) list(ctx context.Context, maxAge time.Duration) ([]json.RawMessage, map[string]bool) {
	if m == nil || m.lister == nil {
		return nil, nil
	}
	m.mu.Lock()
	if time.Since(m.ok) < maxAge || time.Since(m.at) < engineModelsRetry && m.fresh == nil {
		data, ids := m.data, m.ids
		m.mu.Unlock()
		return data, ids
	}
	wait := m.fresh
	if wait == nil {
		wait = make(chan struct{})
		m.fresh, m.at = wait, time.Now()
		go m.refresh(wait)
	}
	m.mu.Unlock()
	select {
	case <-wait:
	case <-ctx.Done():
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.data, m.ids
}

// refresh asks the engines once, independently of the request that made it
// ask (each engine within --tokenizer-timeout).
func (m *engineModels) refresh(done chan struct{}) {
	data, err := m.lister.Models(context.Background())
	m.mu.Lock()
	defer m.mu.Unlock()
	defer close(done)
	m.fresh = nil
	if err != nil {
		// The last list stays. Without a word an operator sees only
		// --model served and the engines' adapters 404 (a 401 of engines
		// started with vLLM's --api-key, the frontend given no key).
		if !m.failing && m.log != nil {
			m.log.Warn("the engines' model list (GET /v1/models of the --tokenizer-url engines) could not be read: "+
				"only --model and the last list read are served (logged once until a list is read again)", "err", err)
		}
		m.failing = true
		return
	}
	m.failing = false
	ids, adapters := modelIDs(data)
	m.data, m.ids, m.adapters, m.ok = data, ids, adapters, time.Now()
}

// adapter reports whether the engines' last model list named id a LoRA
// adapter (an entry with a parent).
func (m *engineModels) adapter(id string) bool {
	if m == nil {
		return false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.adapters[id]
}
