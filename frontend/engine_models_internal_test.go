package frontend

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestModelListParentIsNoString: an entry whose parent is no string (a
// number, an object) is listed, so its id is served; it is no adapter.
// Before, the entry failed to decode whole and its id was not served
// though GET /v1/models relayed it.
func TestModelListParentIsNoString(t *testing.T) {
	data, err := parseModelList([]byte(`{"object":"list","data":[
		{"id":"base","parent":null},{"id":"sql","parent":"base"},{"id":"odd","parent":5},{"id":"obj","parent":{}},
		{"id":"self","parent":"self"},{"id":""},{"id":7},"x"]}`))
	if err != nil {
		t.Fatal(err)
	}
	ids, adapters := modelIDs(data)
	for _, id := range []string{"base", "sql", "odd", "obj", "self"} {
		if !ids[id] {
			t.Errorf("%q is listed but not served", id)
		}
	}
	if len(ids) != 5 {
		t.Errorf("ids %v; want the five listed with a string id", ids)
	}
	if len(adapters) != 1 || !adapters["sql"] {
		t.Errorf("adapters %v; want sql only", adapters)
	}
}

// TestModelListAboveItsLimit: an answer above maxModelList is refused as
// too large, not read cut short (and reported as no JSON).
func TestModelListAboveItsLimit(t *testing.T) {
	body := `{"data":[{"id":"m","pad":"` + strings.Repeat("x", maxModelList) + `"}]}`
	if _, err := parseModelList([]byte(body)); err == nil || !strings.Contains(err.Error(), "exceeds") {
		t.Fatalf("a model list of %d bytes: %v; want it refused as too large", len(body), err)
	}
}

// FuzzModelList: an engine's GET /v1/models answer is read without a
// panic; what it lists is served (an entry with an "id" string), and an
// adapter is among the ids.
func FuzzModelList(f *testing.F) {
	for _, s := range []string{
		``, `{}`, `[]`, `null`, `{"data":null}`, `{"data":[]}`, `{"data":{}}`, `{"data":[1,"a",null,[]]}`,
		`{"object":"list","data":[{"id":"m","object":"model","root":"m","parent":null,"max_model_len":4096}]}`,
		`{"data":[{"id":"m"},{"id":"a","parent":"m"},{"id":"b","parent":"b"},{"id":"c","parent":7}]}`,
		`{"data":[{"id":"\ud800","parent":"m"},{"ID":"x","Parent":"m"},{"id":"y","id":"z"}]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		data, err := parseModelList(body)
		if err != nil {
			if data != nil {
				t.Fatalf("entries %v with error %v", data, err)
			}
			return
		}
		if len(data) == 0 {
			t.Fatal("an empty list accepted")
		}
		served, adapters := modelIDs(data)
		for a := range adapters {
			if !served[a] {
				t.Fatalf("adapter %q is no id", a)
			}
		}
		for _, raw := range data {
			var e map[string]json.RawMessage
			if json.Unmarshal(raw, &e) != nil {
				continue
			}
			// encoding/json matches keys case-insensitively: an entry
			// with "ID" beside "id" is left out of this check.
			ids, parents := 0, 0
			for k := range e {
				switch {
				case strings.EqualFold(k, "id"):
					ids++
				case strings.EqualFold(k, "parent"):
					parents++
				}
			}
			var id string
			if ids == 1 && parents <= 1 && json.Unmarshal(e["id"], &id) == nil && id != "" && !served[id] {
				t.Fatalf("entry %s is listed but its id %q not served", raw, id)
			}
		}
	})
}
