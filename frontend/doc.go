// Package frontend is kvbus's OpenAI-compatible HTTP server. It resolves a
// request's session id (body session_id, then vllm_xargs.session_id, then the
// configured headers), tokenizes the prompt, publishes a messages.Request to
// the JetStream request log and streams the driver rank's Outputs back to the
// client as JSON or server-sent events.
package frontend
