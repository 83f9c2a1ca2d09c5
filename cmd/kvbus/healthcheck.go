package main

import (
	"context"
	"fmt"
	"net/http"
	"time"
)

// healthcheckCmd probes a role's /healthz: a container HEALTHCHECK for an
// image that has no shell and no curl.
type healthcheckCmd struct {
	URL     string        `name:"url" default:"http://127.0.0.1:9090/healthz" help:"The /healthz to probe (the frontend's is on its --http-addr)."`
	Timeout time.Duration `name:"timeout" default:"2s" help:"How long to wait for the answer."`
}

func (c *healthcheckCmd) Run(ctx context.Context) error {
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
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("unhealthy: %s answered %d", c.URL, resp.StatusCode)
	}
	return nil
}
