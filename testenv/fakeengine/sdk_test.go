package fakeengine_test

import (
	"errors"
	"net/http"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvbus/kvbus/testenv/fakeengine"
)

// TestOpenAISDK drives the fake with the official OpenAI Go SDK, as a
// client of vLLM would: responses, streams with usage and errors parse.
func TestOpenAISDK(t *testing.T) {
	e := newEngine(t, fakeengine.Config{APIKey: "sk-test", ModelName: "fake/sdk"})
	hc := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(hc.CloseIdleConnections)
	client := openai.NewClient(option.WithBaseURL(e.URL()+"/v1/"), option.WithAPIKey("sk-test"),
		option.WithHTTPClient(hc), option.WithMaxRetries(0))
	params := openai.ChatCompletionNewParams{
		Model:    "fake/sdk",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say something about caches.")},
	}

	resp, err := client.Chat.Completions.New(t.Context(), params)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Choices) != 1 || resp.Choices[0].Message.Content == "" || resp.Choices[0].FinishReason != "stop" ||
		resp.Usage.CompletionTokens != fakeengine.DefaultReplyTokens+1 || resp.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("response %+v", resp)
	}

	params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	stream := client.Chat.Completions.NewStreaming(t.Context(), params)
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		if !acc.AddChunk(stream.Current()) {
			t.Fatal("the accumulator refused a chunk")
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	_ = stream.Close()
	if acc.Choices[0].Message.Content != resp.Choices[0].Message.Content || acc.Usage.TotalTokens != resp.Usage.TotalTokens {
		t.Fatalf("accumulated %+v, want %+v", acc.ChatCompletion, resp)
	}

	comp, err := client.Completions.New(t.Context(), openai.CompletionNewParams{
		Model:  "fake/sdk",
		Prompt: openai.CompletionNewParamsPromptUnion{OfArrayOfTokens: []int64{7, 200_007, 250_000}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if comp.Usage.PromptTokens != 3 || comp.Choices[0].Text == "" {
		t.Fatalf("completion %+v", comp)
	}

	// (stream_options without stream would be refused first, as vLLM's
	// request validation does.)
	params.StreamOptions = openai.ChatCompletionStreamOptionsParam{}
	params.Model = "other"
	_, err = client.Chat.Completions.New(t.Context(), params)
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Type != "NotFoundError" {
		t.Fatalf("unknown model: %v", err)
	}
}
