package frontend_test

import (
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvbus/kvbus/testenv"
)

// newSDKClient returns an official OpenAI Go SDK client for the cluster, on
// a per-test HTTP client so that its idle connections are closed at cleanup.
func newSDKClient(t *testing.T, c *testenv.Cluster) openai.Client {
	t.Helper()
	return openai.NewClient(
		option.WithBaseURL(c.URL+"/v1/"),
		option.WithAPIKey("x"),
		option.WithHTTPClient(newClient(t)),
		option.WithMaxRetries(0), // a failure must show, not be retried away
	)
}

// TestSDK drives the cluster with the official OpenAI Go SDK.
func TestSDK(t *testing.T) {
	t.Parallel()
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	chatParams := func() openai.ChatCompletionNewParams {
		return openai.ChatCompletionNewParams{
			Model: c.Model,
			Messages: []openai.ChatCompletionMessageParamUnion{
				openai.SystemMessage("You are terse."),
				openai.UserMessage("Say something about caches."),
			},
			MaxTokens: openai.Int(8),
		}
	}

	t.Run("chat", func(t *testing.T) {
		t.Parallel()
		client := newSDKClient(t, c)
		resp, err := client.Chat.Completions.New(t.Context(), chatParams(), option.WithHeader("X-Session-ID", "sdk-chat"))
		if err != nil {
			t.Fatalf("Chat.Completions.New: %v", err)
		}
		if len(resp.Choices) != 1 || resp.Choices[0].Message.Content == "" {
			t.Fatalf("choices = %+v, want one with content", resp.Choices)
		}
		if !strings.HasPrefix(resp.ID, "chatcmpl-") || resp.Model != c.Model {
			t.Errorf("id = %q, model = %q", resp.ID, resp.Model)
		}
		if resp.Choices[0].FinishReason == "" {
			t.Error("empty finish_reason")
		}
		if resp.Usage.PromptTokens <= 0 || resp.Usage.TotalTokens != resp.Usage.PromptTokens+resp.Usage.CompletionTokens {
			t.Errorf("usage = %+v", resp.Usage)
		}
		var raw map[string]any
		if err := json.Unmarshal([]byte(resp.RawJSON()), &raw); err != nil {
			t.Errorf("RawJSON does not parse: %v\n%s", err, resp.RawJSON())
		}
	})

	t.Run("chat streaming with include_usage", func(t *testing.T) {
		t.Parallel()
		client := newSDKClient(t, c)
		p := chatParams()
		p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
		stream := client.Chat.Completions.NewStreaming(t.Context(), p)
		defer stream.Close()
		var acc openai.ChatCompletionAccumulator
		n := 0
		for stream.Next() {
			n++
			if !acc.AddChunk(stream.Current()) {
				t.Fatalf("accumulator rejected chunk %d: %s", n, stream.Current().RawJSON())
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatalf("stream: %v", err)
		}
		if n < 3 {
			t.Errorf("only %d chunks", n)
		}
		if len(acc.Choices) != 1 || acc.Choices[0].Message.Content == "" || acc.Choices[0].Message.Role != "assistant" {
			t.Fatalf("accumulated choices = %+v", acc.Choices)
		}
		if acc.Choices[0].FinishReason == "" {
			t.Error("no finish_reason accumulated")
		}
		if acc.Usage.PromptTokens <= 0 || acc.Usage.CompletionTokens <= 0 {
			t.Errorf("final usage = %+v, want prompt and completion tokens", acc.Usage)
		}
	})

	t.Run("completion", func(t *testing.T) {
		t.Parallel()
		client := newSDKClient(t, c)
		resp, err := client.Completions.New(t.Context(), openai.CompletionNewParams{
			Model:     openai.CompletionNewParamsModel(c.Model),
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
			MaxTokens: openai.Int(8),
		})
		if err != nil {
			t.Fatalf("Completions.New: %v", err)
		}
		if len(resp.Choices) != 1 || resp.Choices[0].Text == "" {
			t.Fatalf("choices = %+v, want one with text", resp.Choices)
		}
		if !strings.HasPrefix(resp.ID, "cmpl-") || resp.Usage.PromptTokens <= 0 {
			t.Errorf("id = %q, usage = %+v", resp.ID, resp.Usage)
		}
	})

	t.Run("completion with token-id prompts", func(t *testing.T) {
		t.Parallel()
		client := newSDKClient(t, c)
		resp, err := client.Completions.New(t.Context(), openai.CompletionNewParams{
			Model:     openai.CompletionNewParamsModel(c.Model),
			Prompt:    openai.CompletionNewParamsPromptUnion{OfArrayOfTokenArrays: [][]int64{{1, 2, 3}, {4, 5}}},
			MaxTokens: openai.Int(4),
		})
		if err != nil {
			t.Fatalf("Completions.New: %v", err)
		}
		if len(resp.Choices) != 2 || resp.Choices[0].Index != 0 || resp.Choices[1].Index != 1 {
			t.Fatalf("choices = %+v, want indexes 0 and 1", resp.Choices)
		}
		if resp.Usage.PromptTokens != 5 {
			t.Errorf("usage.prompt_tokens = %d, want 5", resp.Usage.PromptTokens)
		}
	})

	t.Run("completion streaming", func(t *testing.T) {
		t.Parallel()
		client := newSDKClient(t, c)
		stream := client.Completions.NewStreaming(t.Context(), openai.CompletionNewParams{
			Model:     openai.CompletionNewParamsModel(c.Model),
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
			MaxTokens: openai.Int(8),
		})
		defer stream.Close()
		var text strings.Builder
		finish := ""
		for stream.Next() {
			ch := stream.Current()
			for _, choice := range ch.Choices {
				text.WriteString(choice.Text)
				if choice.FinishReason != "" {
					finish = string(choice.FinishReason)
				}
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatalf("stream: %v", err)
		}
		if text.Len() == 0 || finish == "" {
			t.Errorf("streamed text %q, finish_reason %q", text.String(), finish)
		}
	})

	t.Run("models list", func(t *testing.T) {
		t.Parallel()
		client := newSDKClient(t, c)
		page, err := client.Models.List(t.Context())
		if err != nil {
			t.Fatalf("Models.List: %v", err)
		}
		ids := make([]string, 0, len(page.Data))
		for _, m := range page.Data {
			ids = append(ids, m.ID)
		}
		if !slices.Contains(ids, c.Model) {
			t.Errorf("models = %q, want %q among them", ids, c.Model)
		}
		// Models.Get is OpenAI's GET /v1/models/{model}: 404 before.
		m, err := client.Models.Get(t.Context(), c.Model)
		if err != nil || m.ID != c.Model || m.Object != "model" {
			t.Errorf("Models.Get(%q) = %+v, %v; want its entry", c.Model, m, err)
		}
		_, err = client.Models.Get(t.Context(), "no-such-model")
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound || apiErr.Code != "model_not_found" {
			t.Errorf("Models.Get(no-such-model): %v; want a 404 model_not_found", err)
		}
	})

	t.Run("unknown model is a 404 openai.Error", func(t *testing.T) {
		t.Parallel()
		client := newSDKClient(t, c)
		p := chatParams()
		p.Model = "no-such-model"
		_, err := client.Chat.Completions.New(t.Context(), p)
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) {
			t.Fatalf("err = %v (%T), want *openai.Error", err, err)
		}
		if apiErr.StatusCode != http.StatusNotFound || apiErr.Code != "model_not_found" || apiErr.Param != "model" || apiErr.Type != "not_found_error" {
			t.Errorf("error = {StatusCode: %d, Code: %q, Param: %q, Type: %q}, want {404, model_not_found, model, not_found_error}",
				apiErr.StatusCode, apiErr.Code, apiErr.Param, apiErr.Type)
		}
		if apiErr.Message == "" {
			t.Error("empty error message")
		}
	})
}
