package frontend

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
)

// OpenAI error types.
const (
	typeInvalidRequest = "invalid_request_error"
	typeNotFound       = "not_found_error"
	typeAuthentication = "authentication_error"
	typeRateLimit      = "rate_limit_error"
	typeServer         = "server_error"
	typeUnavailable    = "service_unavailable_error"
	typeTimeout        = "timeout_error"
)

// APIError is an error returned to an HTTP client as OpenAI's error body
// {"error":{"message","type","param","code"}} with Status.
type APIError struct {
	Status     int
	Message    string
	Type       string
	Param      string // empty: null
	Code       string // empty: null
	RetryAfter int    // seconds; 0: no Retry-After header
}

func (e *APIError) Error() string {
	if e.Param != "" {
		return fmt.Sprintf("%d %s (%s): %s", e.Status, e.Type, e.Param, e.Message)
	}
	return fmt.Sprintf("%d %s: %s", e.Status, e.Type, e.Message)
}

type errorBody struct {
	Error errorObject `json:"error"`
}

type errorObject struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func (e *APIError) body() errorBody {
	b := errorBody{Error: errorObject{Message: e.Message, Type: e.Type}}
	if e.Param != "" {
		b.Error.Param = &e.Param
	}
	if e.Code != "" {
		b.Error.Code = &e.Code
	}
	return b
}

func badRequest(param, format string, args ...any) *APIError {
	return &APIError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Param: param, Message: fmt.Sprintf(format, args...)}
}

// writeError writes e as an OpenAI error response.
func writeError(w http.ResponseWriter, e *APIError) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	if e.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(e.RetryAfter))
	}
	w.WriteHeader(e.Status)
	_ = json.NewEncoder(w).Encode(e.body())
}

// outputErrorStatus maps an Output error code from the pipeline to an API
// error.
func outputError(code, msg string) *APIError {
	switch code {
	case "timeout":
		return &APIError{Status: http.StatusGatewayTimeout, Type: typeTimeout, Code: code, Message: msg}
	case "no_ready_group", "group_failed", "output_lost":
		return &APIError{Status: http.StatusServiceUnavailable, Type: typeUnavailable, Code: code, Message: msg, RetryAfter: 1}
	case "overloaded":
		return &APIError{Status: http.StatusTooManyRequests, Type: typeRateLimit, Code: code, Message: msg, RetryAfter: 1}
	case "request_too_large":
		return &APIError{Status: http.StatusRequestEntityTooLarge, Type: typeInvalidRequest, Code: code, Message: msg}
	}
	return &APIError{Status: http.StatusInternalServerError, Type: typeServer, Code: code, Message: msg}
}
