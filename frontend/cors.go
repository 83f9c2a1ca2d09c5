package frontend

import (
	"net/http"
	"slices"
)

// corsMethods are the methods a preflight is told are allowed: every one,
// as vLLM's default (--allowed-methods '*') answers.
const corsMethods = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"

// corsPolicy answers browsers as vLLM's server does (Starlette's
// CORSMiddleware): origins from --allowed-origins ("*": any), every method
// and requested header allowed, no credentials. nil answers none.
type corsPolicy struct {
	any     bool
	origins []string
}

// newCORS returns the policy of origins; nil (CORS off) when there are none.
func newCORS(origins []string) *corsPolicy {
	origins = slices.DeleteFunc(slices.Clone(origins), func(o string) bool { return o == "" })
	if len(origins) == 0 {
		return nil
	}
	return &corsPolicy{any: slices.Contains(origins, "*"), origins: origins}
}

// handle adds the CORS headers to the answer to r and answers a preflight
// itself: it reports whether it did (before authentication, as browsers
// send no credentials in a preflight).
func (c *corsPolicy) handle(w http.ResponseWriter, r *http.Request) (answered bool) {
	origin := r.Header.Get("Origin")
	if c == nil || origin == "" {
		return false
	}
	allowed := c.any || slices.Contains(c.origins, origin)
	h := w.Header()
	if allowed {
		if c.any {
			h.Set("Access-Control-Allow-Origin", "*")
		} else {
			h.Set("Access-Control-Allow-Origin", origin)
			h.Add("Vary", "Origin")
		}
	}
	if r.Method != http.MethodOptions || r.Header.Get("Access-Control-Request-Method") == "" {
		return false // not a preflight: the request goes on
	}
	if !allowed {
		writeError(w, &APIError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Code: "cors_origin_not_allowed",
			Message: "origin " + origin + " is not allowed (--allowed-origins)"})
		return true
	}
	h.Set("Access-Control-Allow-Methods", corsMethods)
	if req := r.Header.Get("Access-Control-Request-Headers"); req != "" {
		h.Set("Access-Control-Allow-Headers", req)
	}
	h.Set("Access-Control-Max-Age", "600")
	w.WriteHeader(http.StatusOK)
	return true
}
