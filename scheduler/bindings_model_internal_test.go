package scheduler

import (
	"encoding/json"
	"testing"
)

// TestSessionEntryPerModel: one session id's value keeps a binding per
// model; a value an older kvbus wrote (no model) counts for any model, and
// an older kvbus reads the latest turn at the top level as before.
func TestSessionEntryPerModel(t *testing.T) {
	legacy := sessionEntry{}
	if err := json.Unmarshal([]byte(`{"group":"g3","blocks":4,"last_hash":7,"turn":2,"updated_unix_ms":1}`), &legacy); err != nil {
		t.Fatal(err)
	}
	if b, ok := legacy.of("a"); !ok || b.Group != "g3" || b.Turn != 2 {
		t.Errorf("a legacy binding for model a: %+v %v", b, ok)
	}
	// Model a's turn continues it (its prompt extends the legacy one).
	e := legacy.with(Binding{Model: "a", Group: "a0", Turn: 3, continuesLegacy: true})
	e = e.with(Binding{Model: "b", Group: "b0", Turn: 1})
	tests := []struct {
		model, group string
		turn         int
		ok           bool
	}{
		{"a", "a0", 3, true},
		{"b", "b0", 1, true},
		{"c", "", 0, false},
		{"", "b0", 1, true}, // the latest turn, of whatever model
	}
	for _, tt := range tests {
		if b, ok := e.of(tt.model); ok != tt.ok || b.Group != tt.group || b.Turn != tt.turn {
			t.Errorf("of(%q) = %+v, %v; want group %q turn %d, %v", tt.model, b, ok, tt.group, tt.turn, tt.ok)
		}
	}
	// Model a's next turn replaces only its own binding.
	e = e.with(Binding{Model: "a", Group: "a1", Turn: 4})
	if b, _ := e.of("b"); b.Group != "b0" || b.Turn != 1 {
		t.Errorf("model b's binding after model a's turn: %+v", b)
	}
	if len(e.Others) != 1 {
		t.Errorf("others %+v, want model b's alone", e.Others)
	}
	data, err := json.Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	var old Binding // what a kvbus of before reads
	if err := json.Unmarshal(data, &old); err != nil || old.Group != "a1" || old.Turn != 4 {
		t.Errorf("the value read as an older kvbus does: %+v, %v (%s)", old, err, data)
	}
}

// TestLegacyBindingKeptForItsModel: a binding an older kvbus wrote (no
// model) is kept when another model's turn with the same session id comes
// first (a turn that does not continue it), so the model whose conversation
// it was still finds it; the turn that continues it takes it. Before, the
// first model to use the session id took it, and the other lost it.
func TestLegacyBindingKeptForItsModel(t *testing.T) {
	var legacy sessionEntry
	if err := json.Unmarshal([]byte(`{"group":"g3","blocks":4,"last_hash":7,"turn":2,"updated_unix_ms":1}`), &legacy); err != nil {
		t.Fatal(err)
	}
	e := legacy.with(Binding{Model: "b", Group: "b0", Turn: 1})
	if b, ok := e.of("a"); !ok || b.Group != "g3" || b.Turn != 2 || b.Model != "" {
		t.Errorf("model a after model b's first turn: %+v, %v; want the legacy binding (g3, turn 2)", b, ok)
	}
	if b, _ := e.of("b"); b.Group != "b0" || b.Turn != 1 {
		t.Errorf("model b: %+v", b)
	}
	data, err := json.Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	var read sessionEntry // as another replica reads it from the bucket
	if err := json.Unmarshal(data, &read); err != nil {
		t.Fatal(err)
	}
	if b, ok := read.of("a"); !ok || b.Group != "g3" {
		t.Errorf("model a, read back from %s: %+v, %v", data, b, ok)
	}
	// Model a continues it: it is a's now, and no longer any model's.
	e = read.with(Binding{Model: "a", Group: "g3", Turn: 3, continuesLegacy: true})
	if b, _ := e.of("a"); b.Turn != 3 || b.Model != "a" {
		t.Errorf("model a after continuing: %+v", b)
	}
	if b, ok := e.of("c"); ok {
		t.Errorf("model c after model a continued the legacy binding: %+v, want none", b)
	}
	if b, _ := e.of("b"); b.Group != "b0" || b.Turn != 1 {
		t.Errorf("model b after model a's turn: %+v", b)
	}
}
