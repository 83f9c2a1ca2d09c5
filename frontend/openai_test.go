package frontend

import (
	"encoding/json"
	"math"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvbus/kvbus/messages"
)

// testVocab is the vocabulary size used for completion token-id checks.
const testVocab = 1000

func TestParseCompletionValid(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		body  string
		check func(t *testing.T, p *parsedRequest)
	}{
		{
			name: "prompt string with defaults",
			body: `{"model":"m","prompt":"hello"}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "endpoint", p.endpoint, messages.EndpointCompletions)
				eq(t, "model", p.model, "m")
				eq(t, "texts", p.texts, []string{"hello"})
				eq(t, "tokenPrompts", p.tokenPrompts, [][]uint32(nil))
				eq(t, "max_tokens", p.params.MaxTokens, 16) // OpenAI's default for completions
				eq(t, "maxTokensSet", p.maxTokensSet, true)
				eq(t, "temperature", p.params.Temperature, 1.0)
				eq(t, "top_p", p.params.TopP, 1.0)
				eq(t, "stream", p.stream, false)
				eq(t, "stop", p.params.Stop, []string(nil))
			},
		},
		{
			name: "list of strings",
			body: `{"prompt":["a","b"]}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "texts", p.texts, []string{"a", "b"})
			},
		},
		{
			name: "token-id array",
			body: `{"prompt":[0,1,999]}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "tokenPrompts", p.tokenPrompts, [][]uint32{{0, 1, 999}})
				eq(t, "texts", p.texts, []string(nil))
			},
		},
		{
			name: "list of token arrays",
			body: `{"prompt":[[1,2],[3]]}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "tokenPrompts", p.tokenPrompts, [][]uint32{{1, 2}, {3}})
			},
		},
		{
			name: "sampling parameters",
			body: `{"prompt":"x","max_tokens":7,"min_tokens":2,"temperature":0,"top_p":0.5,"n":1,"seed":42,"ignore_eos":true}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "max_tokens", p.params.MaxTokens, 7)
				eq(t, "min_tokens", p.params.MinTokens, 2)
				eq(t, "temperature", p.params.Temperature, 0.0)
				eq(t, "top_p", p.params.TopP, 0.5)
				if p.params.Seed == nil || *p.params.Seed != 42 {
					t.Errorf("seed = %v, want 42", p.params.Seed)
				}
				eq(t, "ignore_eos", p.params.IgnoreEOS, true)
			},
		},
		{
			name: "stop as string",
			body: `{"prompt":"x","stop":"\n"}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "stop", p.params.Stop, []string{"\n"})
			},
		},
		{
			name: "stop as list",
			body: `{"prompt":"x","stop":["a","b"]}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "stop", p.params.Stop, []string{"a", "b"})
			},
		},
		{
			name: "stream with include_usage",
			body: `{"prompt":"x","stream":true,"stream_options":{"include_usage":true}}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "stream", p.stream, true)
				eq(t, "includeUsage", p.includeUsage, true)
			},
		},
		{
			name: "body session_id is kept raw for ResolveSession",
			body: `{"prompt":"x","session_id":"abc"}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "session_id", string(p.session.BodySessionID), `"abc"`)
				eq(t, "vllm_xargs.session_id", p.session.XargsSessionID, json.RawMessage(nil))
			},
		},
		{
			name: "vllm_xargs passes other keys through",
			body: `{"prompt":"x","vllm_xargs":{"session_id":"s","foo":1,"bar":"baz","nested":{"k":[true]}}}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "vllm_xargs.session_id", string(p.session.XargsSessionID), `"s"`)
				eq(t, "foo", p.xargs["foo"], any(1.0))
				eq(t, "bar", p.xargs["bar"], any("baz"))
				eq(t, "nested", p.xargs["nested"], any(map[string]any{"k": []any{true}}))
			},
		},
		{
			name: "vllm_xargs null is ignored",
			body: `{"prompt":"x","vllm_xargs":null}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "xargs", len(p.xargs), 0)
			},
		},
		{
			name: "whole-number floats in token ids",
			body: `{"prompt":[[1.0,2],[3e0]],"max_tokens":4.0}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "tokenPrompts", p.tokenPrompts, [][]uint32{{1, 2}, {3}})
				eq(t, "max_tokens", p.params.MaxTokens, 4)
			},
		},
		{
			name: "PROMPT is not prompt",
			body: `{"PROMPT":"a","prompt":"b","Stop":"x"}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "texts", p.texts, []string{"b"})
				eq(t, "stop", p.params.Stop, []string(nil))
			},
		},
		{
			name: "kv_transfer_params passed through",
			body: `{"prompt":"x","kv_transfer_params":{"do_remote_prefill":true}}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "kv_transfer_params", p.kvTransfer, map[string]any{"do_remote_prefill": true})
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p, err := parseCompletion([]byte(tt.body), parseOptions{vocab: testVocab})
			if err != nil {
				t.Fatalf("parseCompletion(%s): %v", tt.body, err)
			}
			tt.check(t, p)
		})
	}
}

func TestParseChatValid(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		body  string
		check func(t *testing.T, p *parsedRequest)
	}{
		{
			name: "string content with defaults",
			body: `{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "endpoint", p.endpoint, messages.EndpointChat)
				eq(t, "model", p.model, "m")
				eq(t, "turns", p.turns, []ChatTurn{{Role: "user", Content: "hi"}})
				eq(t, "maxTokensSet", p.maxTokensSet, false) // the server derives it from --max-model-len
				eq(t, "temperature", p.params.Temperature, 1.0)
				eq(t, "top_p", p.params.TopP, 1.0)
			},
		},
		{
			name: "text-part arrays",
			body: `{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "turns", p.turns, []ChatTurn{{Role: "user", Content: "a\nb"}})
			},
		},
		{
			name: "every role, assistant content may be null",
			body: `{"messages":[{"role":"system","content":"s"},{"role":"developer","content":"d"},{"role":"user","content":"u"},` +
				`{"role":"assistant","content":null},{"role":"tool","content":"t"}]}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "turns", p.turns, []ChatTurn{
					{Role: "system", Content: "s"}, {Role: "developer", Content: "d"}, {Role: "user", Content: "u"},
					{Role: "assistant", Content: ""}, {Role: "tool", Content: "t"},
				})
			},
		},
		{
			name: "max_tokens alone",
			body: `{"messages":[{"role":"user","content":"hi"}],"max_tokens":10}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "max_tokens", p.params.MaxTokens, 10)
				eq(t, "maxTokensSet", p.maxTokensSet, true)
			},
		},
		{
			name: "max_completion_tokens overrides max_tokens",
			body: `{"messages":[{"role":"user","content":"hi"}],"max_tokens":10,"max_completion_tokens":20}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "max_tokens", p.params.MaxTokens, 20)
				eq(t, "maxTokensSet", p.maxTokensSet, true)
			},
		},
		{
			name: "stop as string",
			body: `{"messages":[{"role":"user","content":"hi"}],"stop":"END"}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "stop", p.params.Stop, []string{"END"})
			},
		},
		{
			name: "stop as list",
			body: `{"messages":[{"role":"user","content":"hi"}],"stop":["a","b"]}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "stop", p.params.Stop, []string{"a", "b"})
			},
		},
		{
			name: "vllm_xargs passes other keys through",
			body: `{"messages":[{"role":"user","content":"hi"}],"vllm_xargs":{"session_id":"s","priority":3}}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "vllm_xargs.session_id", string(p.session.XargsSessionID), `"s"`)
				eq(t, "priority", p.xargs["priority"], any(3.0))
			},
		},
		{
			name: "stream with stream_options",
			body: `{"messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":false}}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "stream", p.stream, true)
				eq(t, "includeUsage", p.includeUsage, false)
			},
		},
		{
			name: "continuous_usage_stats needs include_usage",
			body: `{"messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":true}}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "includeUsage", p.includeUsage, false)
				eq(t, "continuousUsage", p.continuousUsage, false)
			},
		},
		{
			name: "continuous_usage_stats, include_usage by default",
			body: `{"messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"continuous_usage_stats":true}}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "includeUsage", p.includeUsage, true)
				eq(t, "continuousUsage", p.continuousUsage, true)
			},
		},
		{
			name: "empty stream_options without stream",
			body: `{"messages":[{"role":"user","content":"hi"}],"stream_options":{}}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "stream", p.stream, false)
				eq(t, "includeUsage", p.includeUsage, false)
			},
		},
		{
			name: "any role",
			body: `{"messages":[{"role":"observation","content":"o"},{"role":"Custom Role","content":"c"}]}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "turns", p.turns, []ChatTurn{{Role: "observation", Content: "o"}, {Role: "Custom Role", Content: "c"}})
			},
		},
		{
			name: "whole-number floats for integers",
			body: `{"messages":[{"role":"user","content":"hi"}],"max_tokens":10.0,"max_completion_tokens":2e1,"min_tokens":1.0,"seed":-3.0,"n":1.0,"top_logprobs":0.0}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "max_tokens", p.params.MaxTokens, 20)
				eq(t, "min_tokens", p.params.MinTokens, 1)
				eq(t, "seed", p.params.Seed, ptr(int64(-3)))
			},
		},
		{
			name: "request_id",
			body: `{"messages":[{"role":"user","content":"hi"}],"request_id":" my-id "}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "requestID", p.requestID, "my-id")
			},
		},
		{
			name: "keys match as written",
			body: `{"messages":[{"role":"user","content":[{"type":"text","text":"a","TEXT":"b"}],"Content":"x","ROLE":"system"}],` +
				`"STREAM":true,"Max_Tokens":5,"max_tokens":7,"Seed":1,"SESSION_ID":"s","stream_options":{"Include_Usage":true}}`,
			check: func(t *testing.T, p *parsedRequest) {
				eq(t, "turns", p.turns, []ChatTurn{{Role: "user", Content: "a"}})
				eq(t, "stream", p.stream, false)
				eq(t, "max_tokens", p.params.MaxTokens, 7)
				eq(t, "seed", p.params.Seed, (*int64)(nil))
				eq(t, "session_id", p.session.BodySessionID, json.RawMessage(nil))
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p, err := parseChat([]byte(tt.body), parseOptions{})
			if err != nil {
				t.Fatalf("parseChat(%s): %v", tt.body, err)
			}
			tt.check(t, p)
		})
	}
}

func TestParseInvalid(t *testing.T) {
	t.Parallel()
	const chat, completions = messages.EndpointChat, messages.EndpointCompletions
	msgs := `"messages":[{"role":"user","content":"hi"}]`
	tests := []struct {
		name     string
		endpoint string
		body     string
		param    string // "" means null
	}{
		{"wrong type: temperature string", chat, `{` + msgs + `,"temperature":"hot"}`, "temperature"},
		{"wrong type: temperature string (completions)", completions, `{"prompt":"x","temperature":"hot"}`, "temperature"},
		{"wrong type: max_tokens string", chat, `{` + msgs + `,"max_tokens":"ten"}`, "max_tokens"},
		{"wrong type: max_tokens fractional", completions, `{"prompt":"x","max_tokens":1.5}`, "max_tokens"},
		{"wrong type: stream string", chat, `{` + msgs + `,"stream":"yes"}`, "stream"},
		{"wrong type: messages object", chat, `{"messages":{"role":"user"}}`, "messages"},
		{"wrong type: model number", chat, `{` + msgs + `,"model":7}`, "model"},
		{"temperature 3", chat, `{` + msgs + `,"temperature":3}`, "temperature"},
		{"temperature negative", completions, `{"prompt":"x","temperature":-0.1}`, "temperature"},
		{"top_p 0", chat, `{` + msgs + `,"top_p":0}`, "top_p"},
		{"top_p above 1", completions, `{"prompt":"x","top_p":1.01}`, "top_p"},
		{"max_tokens 0", chat, `{` + msgs + `,"max_tokens":0}`, "max_tokens"},
		{"max_tokens 0 (completions)", completions, `{"prompt":"x","max_tokens":0}`, "max_tokens"},
		{"max_completion_tokens 0", chat, `{` + msgs + `,"max_completion_tokens":0}`, "max_completion_tokens"},
		{"min_tokens negative", completions, `{"prompt":"x","min_tokens":-1}`, "min_tokens"},
		{"n 2", chat, `{` + msgs + `,"n":2}`, "n"},
		{"n 2 (completions)", completions, `{"prompt":"x","n":2}`, "n"},
		// Fields the sim engine would ignore: refused, naming the field.
		{"tools", chat, `{` + msgs + `,"tools":[{"type":"function","function":{"name":"f"}}]}`, "tools"},
		{"tool_choice auto", chat, `{` + msgs + `,"tool_choice":"auto"}`, "tool_choice"},
		{"response_format json_object", chat, `{` + msgs + `,"response_format":{"type":"json_object"}}`, "response_format"},
		{"logprobs true", chat, `{` + msgs + `,"logprobs":true}`, "logprobs"},
		{"logprobs 2 (completions)", completions, `{"prompt":"x","logprobs":2}`, "logprobs"},
		{"top_logprobs", chat, `{` + msgs + `,"top_logprobs":3}`, "top_logprobs"},
		{"echo (completions)", completions, `{"prompt":"x","echo":true}`, "echo"},
		{"logit_bias", completions, `{"prompt":"x","logit_bias":{"50256":-100}}`, "logit_bias"},
		{"guided_json", chat, `{` + msgs + `,"guided_json":{"type":"object"}}`, "guided_json"},
		{"guided_regex", completions, `{"prompt":"x","guided_regex":"a+"}`, "guided_regex"},
		{"guided_choice", chat, `{` + msgs + `,"guided_choice":["a","b"]}`, "guided_choice"},
		{"guided_grammar", completions, `{"prompt":"x","guided_grammar":"root ::= x"}`, "guided_grammar"},
		{"structured_outputs", chat, `{` + msgs + `,"structured_outputs":{"choice":["a"]}}`, "structured_outputs"},
		{"stop number", chat, `{` + msgs + `,"stop":5}`, "stop"},
		{"stop list with a number", completions, `{"prompt":"x","stop":["a",1]}`, "stop"},
		{"empty messages", chat, `{"messages":[]}`, "messages"},
		{"missing messages", chat, `{"model":"m"}`, "messages"},
		{"missing role", chat, `{"messages":[{"content":"hi"}]}`, "messages[0].role"},
		{"empty role in second message", chat, `{"messages":[{"role":"user","content":"a"},{"role":"","content":"b"}]}`, "messages[1].role"},
		{"role a number", chat, `{"messages":[{"role":1,"content":"a"}]}`, "messages.role"},
		{"ROLE is not role", chat, `{"messages":[{"ROLE":"user","content":"a"}]}`, "messages[0].role"},
		{"user content missing", chat, `{"messages":[{"role":"user"}]}`, "messages[0].content"},
		{"content number", chat, `{"messages":[{"role":"user","content":5}]}`, "messages[0].content"},
		{"image_url content part", chat,
			`{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"http://x/y.png"}}]}]}`,
			"messages[0].content[1]"},
		{"text part without text", chat, `{"messages":[{"role":"user","content":[{"type":"text"}]}]}`, "messages[0].content[0]"},
		{"stream_options without stream", chat, `{` + msgs + `,"stream_options":{"include_usage":true}}`, "stream_options"},
		{"stream_options without stream (completions)", completions, `{"prompt":"x","stream":false,"stream_options":{"include_usage":false}}`, "stream_options"},
		{"stream_options a string", completions, `{"prompt":"x","stream":true,"stream_options":"yes"}`, "stream_options"},
		{"continuous_usage_stats not a boolean", chat, `{` + msgs + `,"stream":true,"stream_options":{"continuous_usage_stats":1}}`, "stream_options.continuous_usage_stats"},
		{"empty stop", chat, `{` + msgs + `,"stop":""}`, "stop"},
		{"empty stop in a list", completions, `{"prompt":"x","stop":["a",""]}`, "stop"},
		{"request_id a number", chat, `{` + msgs + `,"request_id":1}`, "request_id"},
		{"request_id not printable", completions, `{"prompt":"x","request_id":"a\u0001b"}`, "request_id"},
		{"request_id too long", completions, `{"prompt":"x","request_id":"` + strings.Repeat("r", 129) + `"}`, "request_id"},
		{"seed fractional", completions, `{"prompt":"x","seed":1.5}`, "seed"},
		{"seed beyond int64", completions, `{"prompt":"x","seed":9223372036854775808.0}`, "seed"},
		{"n fractional", chat, `{` + msgs + `,"n":1.5}`, "n"},
		{"min_tokens fractional", chat, `{` + msgs + `,"min_tokens":0.5}`, "min_tokens"},
		{"max_completion_tokens fractional", chat, `{` + msgs + `,"max_completion_tokens":1e-1}`, "max_completion_tokens"},
		{"max_tokens a bool", chat, `{` + msgs + `,"max_tokens":true}`, "max_tokens"},
		{"token id fractional in a list", completions, `{"prompt":[[1],[2.5]]}`, "prompt"},
		{"token id string", completions, `{"prompt":[1,"2"]}`, "prompt"},
		{"MESSAGES is not messages", chat, `{"MESSAGES":[{"role":"user","content":"hi"}]}`, "messages"},
		{"include_usage not a boolean", chat, `{` + msgs + `,"stream":true,"stream_options":{"include_usage":"yes"}}`, "stream_options.include_usage"},
		{"vllm_xargs not an object: string", chat, `{` + msgs + `,"vllm_xargs":"session_id=a"}`, "vllm_xargs"},
		{"vllm_xargs not an object: array", completions, `{"prompt":"x","vllm_xargs":[{"session_id":"a"}]}`, "vllm_xargs"},
		{"vllm_xargs not an object: number", completions, `{"prompt":"x","vllm_xargs":1}`, "vllm_xargs"},
		{"token id out of vocab", completions, `{"prompt":[1,1000]}`, "prompt"},
		{"token id negative", completions, `{"prompt":[-1]}`, "prompt"},
		{"token id out of vocab in second list", completions, `{"prompt":[[1],[2,100000]]}`, "prompt[1]"},
		{"token id null", completions, `{"prompt":[1,null,2]}`, "prompt"},
		{"token id fractional", completions, `{"prompt":[1.5]}`, "prompt"},
		{"empty prompt array", completions, `{"prompt":[]}`, "prompt"},
		{"empty token list in list", completions, `{"prompt":[[1],[]]}`, "prompt[1]"},
		{"prompt mixes strings and numbers", completions, `{"prompt":["a",1]}`, "prompt"},
		{"prompt missing", completions, `{"model":"m"}`, "prompt"},
		{"prompt null", completions, `{"prompt":null}`, "prompt"},
		{"prompt object", completions, `{"prompt":{"text":"x"}}`, "prompt"},
		{"invalid JSON", chat, `{"messages":[`, ""},
		{"invalid JSON (completions)", completions, `{"prompt":"x",}`, ""},
		{"trailing garbage", completions, `{"prompt":"x"} {}`, ""},
		{"empty body", chat, ``, ""},
		{"blank body (completions)", completions, " \n\t", ""},
		{"body is an array", chat, `[]`, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var err *APIError
			if tt.endpoint == chat {
				_, err = parseChat([]byte(tt.body), parseOptions{})
			} else {
				_, err = parseCompletion([]byte(tt.body), parseOptions{vocab: testVocab})
			}
			if err == nil {
				t.Fatalf("%s %s: no error, want a 400 naming %q", tt.endpoint, tt.body, tt.param)
			}
			if err.Status != http.StatusBadRequest || err.Type != "invalid_request_error" || err.Param != tt.param {
				t.Errorf("error = {Status: %d, Type: %q, Param: %q}, want {400, invalid_request_error, %q} (message %q)",
					err.Status, err.Type, err.Param, tt.param, err.Message)
			}
			if strings.TrimSpace(err.Message) == "" || strings.HasPrefix(err.Message, " ") {
				t.Errorf("badly formed Message %q", err.Message)
			}
		})
	}
}

// TestParsePassthrough proves that with real engines behind the frontend
// (passthrough) the fields the sim cannot honour, n above 1, roles of the
// engine's template and content parts other than text are accepted, the
// body is kept as the client sent it (the engine gets it), and the turns
// hold the text parts only, joined by newlines, as vLLM renders them with
// its "string" content format. Without passthrough each is a 400.
func TestParsePassthrough(t *testing.T) {
	t.Parallel()
	pass := parseOptions{passthrough: true, vocab: testVocab}
	sim := parseOptions{vocab: testVocab}
	// simOnlyFields are fields, with values that ask for something, that the
	// sim engine cannot honour.
	simOnlyFields := map[string]string{
		"tools":              `[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]`,
		"tool_choice":        `"required"`,
		"response_format":    `{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object"}}}`,
		"logprobs":           `true`,
		"top_logprobs":       `5`,
		"echo":               `true`,
		"logit_bias":         `{"50256":-100}`,
		"guided_json":        `{"type":"object"}`,
		"guided_regex":       `"[a-z]+"`,
		"guided_choice":      `["yes","no"]`,
		"guided_grammar":     `"root ::= \"a\""`,
		"structured_outputs": `{"choice":["yes","no"]}`,
	}
	msgs := `"messages":[{"role":"user","content":"hi"}]`
	for field, value := range simOnlyFields {
		for _, body := range []string{`{` + msgs + `,"` + field + `":` + value + `}`, `{"prompt":"x","` + field + `":` + value + `}`} {
			parse := parseChat
			if !strings.Contains(body, msgs) {
				parse = parseCompletion
			}
			p, err := parse([]byte(body), pass)
			if err != nil {
				t.Errorf("passthrough %s: %v", body, err)
				continue
			}
			if string(p.body) != body {
				t.Errorf("passthrough %s: body kept as %s", body, p.body)
			}
			if _, err := parse([]byte(body), sim); err == nil || err.Param != field {
				t.Errorf("sim %s: error %v, want a 400 naming %s", body, err, field)
			}
		}
	}
	for _, tt := range []struct {
		name  string
		body  string
		turns []ChatTurn // chat only
		param string     // of the sim's error
	}{
		{"n 2", `{` + msgs + `,"n":2}`, []ChatTurn{{Role: "user", Content: "hi"}}, "n"},
		{"n 3 (completions)", `{"prompt":"x","n":3,"best_of":3}`, nil, "n"},
		{"non-text parts around text parts", `{"messages":[{"role":"user","content":[` +
			`{"type":"image_url","image_url":{"url":"http://x/y.png"}},{"type":"text","text":"a"},` +
			`{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}},{"type":"text","text":"b"}]}]}`,
			[]ChatTurn{{Role: "user", Content: "a\nb"}}, "messages[0].content[0]"},
		{"only an image", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AA=="}}]}]}`,
			[]ChatTurn{{Role: "user", Content: ""}}, "messages[0].content[0]"},
		{"a role of the engine's template, null user content", `{"messages":[{"role":"ipython","content":"out"},{"role":"user","content":null}]}`,
			[]ChatTurn{{Role: "ipython", Content: "out"}, {Role: "user", Content: ""}}, "messages[1].content"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			parse := parseChat
			if tt.turns == nil {
				parse = parseCompletion
			}
			p, err := parse([]byte(tt.body), pass)
			if err != nil {
				t.Fatalf("passthrough: %v", err)
			}
			if string(p.body) != tt.body {
				t.Errorf("body kept as %s", p.body)
			}
			if tt.turns != nil {
				eq(t, "turns", p.turns, tt.turns)
			}
			if _, err := parse([]byte(tt.body), sim); err == nil || err.Param != tt.param {
				t.Errorf("sim: error %v, want a 400 naming %s", err, tt.param)
			}
		})
	}
}

// TestParseEchoWithoutGeneration: with real engines, a completion with
// echo and max_tokens 0 (score a prompt: its logprobs, nothing generated)
// goes to the engine, as vLLM serves it (CompletionRequest's
// echo_without_generation: the prompt back, one token computed and not
// returned), on the bus with max_tokens 1. max_tokens 0 without echo, or
// on a chat, stays vLLM's 400; with the sim, echo (and logprobs) is a 400
// either way. It
// was a 400 "max_tokens must be at least 1" that never reached the engine.
func TestParseEchoWithoutGeneration(t *testing.T) {
	t.Parallel()
	pass := parseOptions{passthrough: true, vocab: testVocab}
	for _, body := range []string{`{"prompt":"x","echo":true,"max_tokens":0,"logprobs":1}`, `{"prompt":[[1,2],[3]],"echo":true,"max_tokens":0.0}`} {
		p, err := parseCompletion([]byte(body), pass)
		if err != nil {
			t.Errorf("passthrough %s: %v", body, err)
			continue
		}
		if p.params.MaxTokens != 1 || !p.maxTokensSet || string(p.body) != body {
			t.Errorf("passthrough %s: max_tokens %d (set %v), body %s; want 1 on the bus and the body as sent", body, p.params.MaxTokens, p.maxTokensSet, p.body)
		}
		if _, err := parseCompletion([]byte(body), parseOptions{vocab: testVocab}); err == nil || (err.Param != "echo" && err.Param != "logprobs") {
			t.Errorf("sim %s: error %v, want a 400 naming echo or logprobs", body, err)
		}
	}
	for _, tt := range []struct {
		body  string
		parse func([]byte, parseOptions) (*parsedRequest, *APIError)
	}{
		{`{"prompt":"x","max_tokens":0}`, parseCompletion},
		{`{"prompt":"x","echo":false,"max_tokens":0}`, parseCompletion},
		{`{"prompt":"x","echo":true,"max_tokens":-1}`, parseCompletion},
		{`{"messages":[{"role":"user","content":"hi"}],"echo":true,"max_tokens":0}`, parseChat},
	} {
		if _, err := tt.parse([]byte(tt.body), pass); err == nil || err.Param != "max_tokens" {
			t.Errorf("passthrough %s: error %v, want a 400 naming max_tokens", tt.body, err)
		}
	}
}

// eq reports a mismatch of one field.
func eq[T any](t *testing.T, what string, got, want T) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s = %#v, want %#v", what, got, want)
	}
}

// sameParse fails the test unless p and q are the same request but for
// how their JSON was written.
func sameParse(t *testing.T, p, q *parsedRequest) {
	t.Helper()
	value := func(raw json.RawMessage) any {
		var v any
		if json.Unmarshal(raw, &v) != nil {
			return string(raw)
		}
		return v
	}
	eq(t, "session_id", value(p.session.BodySessionID), value(q.session.BodySessionID))
	eq(t, "vllm_xargs.session_id", value(p.session.XargsSessionID), value(q.session.XargsSessionID))
	p2, q2 := *p, *q
	p2.body, q2.body, p2.session, q2.session = nil, nil, SessionInput{}, SessionInput{}
	eq(t, "parsed request", p2, q2)
}

func parseSeeds(f *testing.F, bodies ...string) {
	for _, b := range bodies {
		f.Add([]byte(b))
	}
}

// checkFuzzError asserts the shape every parse error must have.
func checkFuzzError(t *testing.T, err *APIError) {
	t.Helper()
	if err.Status != http.StatusBadRequest || err.Message == "" || err.Type != typeInvalidRequest {
		t.Fatalf("bad error: %+v", err)
	}
}

func FuzzParseChat(f *testing.F) {
	parseSeeds(f,
		``, `{`, `[]`, `null`, `{}`,
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url"}]}]}`,
		`{"messages":[{"role":"assistant","content":null}],"max_completion_tokens":3,"max_tokens":2}`,
		`{"messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"messages":[{"role":"user","content":"x"}],"temperature":"hot","top_p":0,"n":2}`,
		`{"messages":[{"role":"user","content":"x"}],"stop":["a",""],"vllm_xargs":{"session_id":"s","k":[1]}}`,
		`{"messages":[{"role":"user","content":"x"}],"session_id":{"a":1},"seed":-1}`,
		`{"messages":[{"role":"user","content":"x"}],"session_id":"a","SESSION_ID":null,"Vllm_Xargs":{"Session_ID":1}}`,
		`{"messages":[{"role":"user","content":"x"}],"vllm_xargs":{"x":[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}}`,
		`{"messages":[{"ROLE":"user","role":"observation","Content":1,"content":[{"TYPE":"x","type":"text","text":"a"}]}],"STREAM":true}`,
		`{"messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"continuous_usage_stats":true,"Include_Usage":false}}`,
		`{"messages":[{"role":"user","content":"x"}],"stream_options":{},"max_tokens":4.0,"seed":-1e3,"n":1.0,"request_id":"r-1"}`,
		`{"messages":[{"role":"user","content":"x"}],"ſtop":[""],"max_tokens":"x","max_tokens":3,"STOP\u005f":1}`,
	)
	f.Fuzz(func(t *testing.T, body []byte) {
		p, err := parseChat(body, parseOptions{})
		if err != nil {
			checkFuzzError(t, err)
			return
		}
		// Keys match as written: the body with its other keys left out
		// reads the same (a case variant hasKeyVariant missed would not).
		q, err := parseChat(exactKeys(body, requestSchema), parseOptions{})
		if err != nil {
			t.Fatalf("accepted, but not with only its exact keys (%s): %v", exactKeys(body, requestSchema), err)
		}
		sameParse(t, p, q)
		if len(p.turns) == 0 {
			t.Fatal("accepted a chat request without messages")
		}
		if p.params.Temperature < 0 || p.params.Temperature > 2 || p.params.TopP <= 0 || p.params.TopP > 1 {
			t.Fatalf("accepted out-of-range sampling params %+v", p.params)
		}
		if p.maxTokensSet && p.params.MaxTokens < 1 {
			t.Fatalf("accepted max_tokens %d", p.params.MaxTokens)
		}
		if p.includeUsage && !p.stream {
			t.Fatal("include_usage without stream")
		}
	})
}

func FuzzParseCompletion(f *testing.F) {
	parseSeeds(f,
		``, `{`, `[]`, `null`, `{}`,
		`{"model":"m","prompt":"hello"}`,
		`{"prompt":["a","b"]}`,
		`{"prompt":[1,2,3]}`,
		`{"prompt":[[1,2],[3]]}`,
		`{"prompt":[[1],[]]}`,
		`{"prompt":[1,null]}`,
		`{"prompt":[999,1000,-1]}`,
		`{"prompt":["a",1]}`,
		`{"prompt":"x","stop":"\n","max_tokens":0}`,
		`{"prompt":"x","stream":true,"stream_options":{"include_usage":true},"vllm_xargs":{"session_id":1}}`,
		`{"prompt":[[1.0,2e0],[3]],"max_tokens":2.0,"min_tokens":1.0,"Prompt":"y","request_id":" a "}`,
		`{"prompt":[1,null],"stop":["a",""],"stream_options":{"Continuous_usage_stats":1}}`,
		`{"PROMPT":"x","prompt":"y","\u006dax_tokens":3,"MAX_TOKENS":9,"KV_TRANSFER_PARAMS":{"a":1}}`,
	)
	f.Fuzz(func(t *testing.T, body []byte) {
		p, err := parseCompletion(body, parseOptions{vocab: testVocab})
		if err != nil {
			checkFuzzError(t, err)
			return
		}
		q, err := parseCompletion(exactKeys(body, requestSchema), parseOptions{vocab: testVocab})
		if err != nil {
			t.Fatalf("accepted, but not with only its exact keys (%s): %v", exactKeys(body, requestSchema), err)
		}
		sameParse(t, p, q)
		if len(p.texts) == 0 && len(p.tokenPrompts) == 0 {
			t.Fatal("accepted a completion request without a prompt")
		}
		for _, ids := range p.tokenPrompts {
			if len(ids) == 0 {
				t.Fatal("accepted an empty token-id prompt")
			}
			for _, id := range ids {
				if id >= testVocab {
					t.Fatalf("accepted token id %d outside the vocabulary", id)
				}
			}
		}
		if !p.maxTokensSet || p.params.MaxTokens < 1 {
			t.Fatalf("max_tokens = %d (set %v)", p.params.MaxTokens, p.maxTokensSet)
		}
	})
}

// TestRequestSchema keeps requestSchema, which decides the keys decoded
// as written, in step with the request structs.
func TestRequestSchema(t *testing.T) {
	t.Parallel()
	tags := func(v any) map[string]bool {
		out := map[string]bool{}
		var walk func(reflect.Type)
		walk = func(rt reflect.Type) {
			for f := range rt.Fields() {
				if f.Anonymous {
					walk(f.Type)
					continue
				}
				out[strings.Split(f.Tag.Get("json"), ",")[0]] = true
			}
		}
		walk(reflect.TypeOf(v))
		return out
	}
	keys := func(s fieldSchema) map[string]bool {
		out := map[string]bool{}
		for k := range s {
			out[k] = true
		}
		return out
	}
	top := tags(chatRequest{})
	for _, v := range []any{completionRequest{}, tokenizeRequest{}, detokenizeRequest{}} {
		for k := range tags(v) {
			top[k] = true
		}
	}
	eq(t, "top-level keys", keys(requestSchema), top)
	eq(t, "stream_options keys", keys(requestSchema["stream_options"]), tags(streamOptions{}))
	eq(t, "message keys", keys(requestSchema["messages"]), tags(chatMessage{}))
	eq(t, "content part keys", keys(requestSchema["messages"]["content"]), map[string]bool{"type": true, "text": true})
	longest := 0
	var walk func(fieldSchema)
	walk = func(s fieldSchema) {
		for k, sub := range s {
			longest = max(longest, len(k))
			if !slices.Contains(requestKeysByLen[len(k)], k) {
				t.Errorf("requestKeysByLen lacks %q", k)
			}
			walk(sub)
		}
	}
	walk(requestSchema)
	eq(t, "maxKeyLen", maxKeyLen, longest)
}

func TestHasKeyVariant(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		body string
		want bool
	}{
		{`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`, false},
		{`{"prompt":"x","max_tokens":3,"stream_options":{"include_usage":true,"continuous_usage_stats":false}}`, false},
		{`{"STREAM":true}`, true},
		{`{"Max_Tokens":1}`, true},
		{`{"messages":[{"Role":"user"}]}`, true},
		{`{"stream_options":{"INCLUDE_USAGE":true}}`, true},
		{`{"Continuous_Usage_Stats":true}`, true},
		{`{"N":1}`, true},
		{`{"STREA\u004d":true}`, true},
		{`{"ſtream":true}`, true},
		{`{"K":1,"top_\u006b":1}`, false}, // K (U+212A) alone is no key; top_k is not one
		{`{"\u0073tream":true}`, false},   // stream, written with an escape
		{`{"content":"Stream"}`, true},    // a value: a false positive, harmless
		{`{"content":"Streams of thought"}`, false},
		{`{"content":"ünïcödé"}`, false},
		{`{"x":"` + strings.Repeat("MODEL", 40) + `"}`, false},
		{`"`, false},
		{`"Model`, false},
		{``, false},
	} {
		if got := hasKeyVariant([]byte(tc.body)); got != tc.want {
			t.Errorf("hasKeyVariant(%s) = %v, want %v", tc.body, got, tc.want)
		}
	}
}

func TestParseWholeNumber(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"4", 4, true}, {"-4", -4, true}, {"4.0", 4, true}, {"4e0", 4, true}, {"4.00E+1", 40, true}, {"-0.0", 0, true},
		{"9223372036854775807", math.MaxInt64, true}, {"-9223372036854775808", math.MinInt64, true},
		{"-9223372036854775808.0", math.MinInt64, true},
		{"4.5", 0, false}, {"1e-1", 0, false}, {"9223372036854775808", 0, false}, {"9223372036854775808.0", 0, false},
		{"1e400", 0, false}, {`"4"`, 0, false}, {"true", 0, false}, {"", 0, false}, {"[4]", 0, false},
	} {
		got, ok := parseWholeNumber([]byte(tc.in))
		if got != tc.want || ok != tc.ok {
			t.Errorf("parseWholeNumber(%s) = %d, %v; want %d, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}
