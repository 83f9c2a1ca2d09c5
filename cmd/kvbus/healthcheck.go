package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// healthcheckCmd probes a role's /healthz: a container HEALTHCHECK for an
// image that has no shell and no curl, and with --wait what `make up` uses
// to return only once the cluster is ready.
type healthcheckCmd struct {
	URL     string        `name:"url" default:"http://127.0.0.1:9090/healthz" help:"The /healthz to probe (the frontend's is on its --http-addr)."`
	Timeout time.Duration `name:"timeout" positive:"" default:"2s" help:"How long to wait for one answer."`
	Wait    time.Duration `name:"wait" help:"Probe every 250 ms until healthy or this long has passed (0: probe once)."`
}

func (c *healthcheckCmd) Run(ctx context.Context) error {
	// A URL that cannot be probed fails at once, naming the flag (it said
	// "unhealthy: ... unsupported protocol scheme", as if the role were down).
	if u, err := url.Parse(c.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("--url %q: give an http:// or https:// URL, e.g. http://127.0.0.1:9090/healthz", c.URL)
	} else if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("--url %q: port %s is out of range: give a port from 1 to 65535, e.g. http://127.0.0.1:9090/healthz", c.URL, p)
		}
	}
	deadline := time.Now().Add(c.Wait)
	for {
		err := c.probe(ctx)
		if err == nil || c.Wait <= 0 || time.Now().After(deadline) {
			if err != nil && c.Wait > 0 {
				return fmt.Errorf("%w (still unhealthy after %s)", err, c.Wait)
			}
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func (c *healthcheckCmd) probe(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.URL, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("unhealthy: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		return fmt.Errorf("unhealthy: %s answered %d: %s", c.URL, resp.StatusCode, strings.TrimSpace(string(body)))
	}
	return nil
}
