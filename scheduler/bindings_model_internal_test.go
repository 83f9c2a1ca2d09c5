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
	e := legacy.with(Binding{Model: "a", Group: "a0", Turn: 3})
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
