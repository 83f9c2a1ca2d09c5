package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/auth"
	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
)

// authCmd manages the roles' identities on the bus.
type authCmd struct {
	Init  authInitCmd  `cmd:"" help:"Write one nkey seed per role (frontend, scheduler, worker, observer, admin) and nats-auth.conf, the nats-server authorization block giving each role only its subjects."`
	Show  authShowCmd  `cmd:"" help:"Print who may publish and subscribe where, for the keys in DIR."`
	Probe authProbeCmd `cmd:"" help:"Publish once with a key and report whether the server allowed it (exit 0) or refused it with a permissions violation (exit 3)."`
}

type authInitCmd struct {
	Dir    string   `arg:"" name:"dir" help:"Directory for the seeds (<role>.nk, mode 0600) and nats-auth.conf."`
	Groups []string `name:"groups" sep:"," help:"Also write one worker key per group (worker-<group>.nk), allowed only that group's ReqMetas, dumps, pool, KV events and heartbeats."`
	Force  bool     `name:"force" help:"Overwrite existing keys (rotation: every role then needs its new seed, and NATS the new config)."`
	Rotate string   `name:"rotate" help:"Give only this key (a role, or worker-<group>) a new seed and rewrite nats-auth.conf; the other keys stay. --rotate cluster-password replaces the routes' password (then send every kvbus nats of the cluster SIGHUP: each reads --cluster-password-file again)."`
	Prefix string   `name:"subject-prefix" help:"First token of every kvbus subject (default kvbus; with --rotate, the one DIR was written for)."`
}

func (c *authInitCmd) Run() error {
	s := messages.Subjects{Prefix: c.Prefix}
	// A group named twice (--groups g0,g0) is one key: it failed writing
	// the second ("rename …worker-g0.nk.tmp: no such file or directory").
	var groups []string
	for _, g := range c.Groups {
		if !slices.Contains(groups, g) {
			groups = append(groups, g)
		}
	}
	c.Groups = groups
	if c.Rotate != "" && (c.Force || len(c.Groups) > 0) {
		// --rotate did its one key alone: --groups wrote no group key and
		// --force replaced no other, without a word.
		return fmt.Errorf("--rotate %s gives one key a new seed and keeps the others: drop --force (it replaces every key) and --groups "+
			"(add group keys with kvbus auth init %s --groups … on its own)", c.Rotate, c.Dir)
	}
	if c.Rotate != "" {
		if err := auth.Rotate(c.Dir, s, c.Rotate); err != nil {
			return err
		}
		if c.Rotate == auth.ClusterPasswordFile {
			fmt.Printf("new %s/%s; reload every kvbus nats of the cluster within a minute (kill -HUP, make reload-nats in compose): each reads --cluster-password-file again, routes already up stay, and a new route between a server with the old password and one with the new is refused\n", c.Dir, c.Rotate)
			return nil
		}
		warnStrayKeys(c.Dir)
		fmt.Printf("new key %s/%s.nk; reload NATS (kill -HUP the kvbus nats process, make reload-nats in compose, or nats-server --signal reload), then restart the %s role with it\n", c.Dir, c.Rotate, c.Rotate)
		return nil
	}
	written, err := auth.Init(c.Dir, s, c.Groups, c.Force)
	if errors.Is(err, auth.ErrExists) && !c.Force {
		// Every key is there: a directory written by an older kvbus gets
		// this one's permissions (each role's own reply inbox), keys kept.
		if changed, rerr := auth.RewriteConfig(c.Dir, s); rerr == nil && changed {
			fmt.Printf("rewrote %s/%s with this kvbus's permissions (an older kvbus auth init wrote it); the keys are unchanged: "+
				"reload NATS (kill -HUP the kvbus nats process, make reload-nats in compose, or nats-server --signal reload), then the roles\n", c.Dir, auth.ConfigFile)
			return nil
		}
	}
	if err != nil {
		return err
	}
	if len(written) == 0 { // only the cluster password was missing
		fmt.Printf("wrote %s/%s (the routes' password: kvbus nats --cluster-password-file); the keys are unchanged\n", c.Dir, auth.ClusterPasswordFile)
		return nil
	}
	fmt.Printf("wrote %s/{%s}.nk and %s/%s\n", c.Dir, strings.Join(names(written), ","), c.Dir, auth.ConfigFile)
	warnStrayKeys(c.Dir)
	if len(written) < len(auth.Identities(c.Groups)) { // added to a directory of keys
		fmt.Println("the other keys are unchanged; reload NATS (kill -HUP the kvbus nats process, make reload-nats in compose, or nats-server --signal reload) before the new keys connect")
		return nil
	}
	fmt.Printf("start NATS with: kvbus nats --auth-config %s/%s (and, clustered, --cluster-password-file %s/%s)\n", c.Dir, auth.ConfigFile, c.Dir, auth.ClusterPasswordFile)
	fmt.Println("and each role with: --nats-nkey <dir>/<role>.nk (observer.nk for top and tap; admin.nk for capture and replay)")
	return nil
}

// warnStrayKeys names the *.nk files of dir that are no kvbus identity:
// nats-auth.conf gives them no permissions.
func warnStrayKeys(dir string) {
	_, stray, _ := auth.Keys(dir)
	known := strings.Join(append(names(auth.Identities(nil)), "worker-<group>"), ", ")
	for _, f := range stray {
		fmt.Fprintf(os.Stderr, "ignored %s: not a kvbus key name (%s), so it has no permissions; move it out of %s\n",
			filepath.Join(dir, f), known, dir)
	}
}

func names(ids []auth.Identity) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.Name()
	}
	return out
}

type authShowCmd struct {
	Dir    string `arg:"" name:"dir" help:"Directory written by kvbus auth init."`
	Prefix string `name:"subject-prefix" help:"First token of every kvbus subject (default: the one DIR was written for)."`
}

func (c *authShowCmd) Run() error {
	m, err := auth.Matrix(c.Dir, messages.Subjects{Prefix: c.Prefix})
	if err != nil {
		return err
	}
	fmt.Print(m)
	warnStrayKeys(c.Dir)
	warnConfigNotCurrent(c.Dir, messages.Subjects{Prefix: c.Prefix})
	return nil
}

// warnConfigNotCurrent says when dir's nats-auth.conf, which NATS
// enforces, is not what `kvbus auth show` lists for the keys there.
func warnConfigNotCurrent(dir string, s messages.Subjects) {
	current, err := auth.ConfigIsCurrent(dir, s)
	if err != nil || current {
		return
	}
	conf := filepath.Join(dir, auth.ConfigFile)
	what := "does not give these keys the permissions above (an older kvbus auth init wrote it, it was edited, " +
		"or a key was added, removed or replaced since): NATS enforces that file, not this list"
	if _, err := os.Stat(conf); err != nil {
		what = "is missing: no NATS can enforce this list without it"
	}
	fmt.Fprintf(os.Stderr, "%s %s. Run `kvbus auth init %s` to rewrite it (every key kept), then reload NATS "+
		"(kill -HUP the kvbus nats process, make reload-nats in compose, or nats-server --signal reload)\n", conf, what, dir)
}

type authProbeCmd struct {
	natsFlags `embed:""`
	Publish   string `name:"publish" required:"" help:"Subject to publish one empty message to."`
}

func (c *authProbeCmd) Run(ctx context.Context) error {
	// Checked before connecting: a subject that is none was reported only
	// by the publish, after the connection (10 s of retries without NATS).
	if !server.IsValidSubject(c.Publish) || !server.IsValidLiteralSubject(c.Publish) {
		return fmt.Errorf("--publish %q is not a subject one can publish to: give dot-separated tokens, none empty or with spaces, and no * or > wildcard (kvbus.req.kvbus-sim)", c.Publish)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cfg := c.config("kvbus-auth-probe", "", nil)
	cfg.Logger = logFlags{LogLevel: "error"}.logger()
	nc, err := bus.Connect(ctx, cfg)
	if err != nil {
		return err
	}
	defer nc.Close()
	if err := nc.Publish(c.Publish, nil); err != nil {
		return err
	}
	if err := nc.FlushTimeout(5 * time.Second); err != nil {
		return err
	}
	if err := nc.LastError(); errors.Is(err, nats.ErrPermissionViolation) {
		fmt.Printf("refused: %v\n", err)
		os.Exit(3)
	}
	fmt.Printf("allowed: publish %s\n", c.Publish)
	return nil
}
