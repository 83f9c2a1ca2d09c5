# kvbus — see README.md. `make run` starts everything in one process;
# `make test` is what CI runs.
GO      ?= go
BIN     ?= bin/kvbus
PKGS    ?= ./...
# Extra flags for `kvbus serve` in `make run`, e.g. ARGS="--groups 2 --log-format json".
ARGS    ?=
BENCHTIME ?= 1s
# What `kvbus --version` and the frontend's /version say: the checkout's
# git describe (a commit, "-dirty" with uncommitted changes), else "devel".
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null)
VERSION_LDFLAGS := -X main.version=$(VERSION)

# The images `make image*` build are the ones the compose files run: IMAGE
# defaults to the compose files' KVBUS_IMAGE and is exported as it (likewise
# PROMETHEUS_IMAGE and KVBUS_PROMETHEUS_IMAGE), so `make up IMAGE=kvbus:test`
# runs kvbus:test. ENGINE_IMAGE (the engines) defaults to FAKEENGINE_IMAGE.
IMAGE   := $(or $(IMAGE),$(KVBUS_IMAGE),kvbus:dev)
export KVBUS_IMAGE := $(IMAGE)

# docker compose (the plugin) when present, else docker-compose (1.29).
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
COMPOSE_FILES ?= -f docker-compose.yml
# docker-compose v1 gives up on a Docker API call after this many seconds
# plus the container's stop grace period; its 60 s default made `down` fail
# on a loaded host, leaving containers running. The plugin ignores it.
export COMPOSE_HTTP_TIMEOUT ?= 180
# Prometheus (docker-compose.monitoring.yml) joins COMPOSE_FILES for `up` and
# `logs` with MONITORING=1 (`make up-monitoring`), and by itself while the
# project's Prometheus container exists, so that `make up WORKERS=12` on a
# monitored cluster keeps Prometheus instead of leaving it an orphan. Adding
# the file changes no other service's config hash (TestComposeConfigHashes),
# so switching never recreates NATS or a role. MONITORING=0 leaves it out.
MONITORING_FILE := docker-compose.monitoring.yml
MONITORING ?= $(if $(shell $(COMPOSE) $(COMPOSE_FILES) -f $(MONITORING_FILE) ps -q prometheus 2>/dev/null),1,0)
UP_FILES = $(COMPOSE_FILES)$(if $(findstring $(MONITORING_FILE),$(COMPOSE_FILES)),,$(if $(filter 1,$(MONITORING)), -f $(MONITORING_FILE)))
WORKERS ?= 8
SCHEDULERS ?= 2

.PHONY: bench-http image-prometheus check-prometheus up-monitoring purge build run test test-browser test-short bench lint fmt fuzz clean image image-fakeengine auth-keys up down logs smoke up-engine up-engine-monitoring down-engine top top-engine reload-nats

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(VERSION_LDFLAGS)' -o $(BIN) ./cmd/kvbus

run: build
	./$(BIN) serve $(ARGS)

# Test binaries run at once: at least 3. The long packages (testenv,
# cmd/kvbus, workers) mostly wait on their clusters, so a third beside
# them cut the test phase on 2 cores from 9 min 19 s to 6 min 59 s.
TEST_P ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 3 ] && n=3; echo $$n)
test:
	$(GO) test -race -shuffle=on -p $(TEST_P) $(PKGS)

# Renders the HTML report and kvbus top's screen in headless Chromium;
# SCREENSHOTS=docs keeps the PNGs (the README's).
test-browser:
	KVBUS_SCREENSHOT_DIR=$(if $(SCREENSHOTS),$(abspath $(SCREENSHOTS))) $(GO) test -tags browser -count=1 -run 'Chromium|Screenshot' ./cmd/kvbus

test-short:
	$(GO) test -short $(PKGS)

# The policy table needs ../shared/traces (not part of the repository).
TRACE ?= ../shared/traces/mooncake_synthetic_head1000.jsonl
bench: build
	$(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) $(PKGS)
	@if [ -f $(TRACE) ]; then \
	  echo "== kvbus bench on $(TRACE)"; \
	  ./$(BIN) bench --trace $(TRACE) --policies kv,session,round-robin,random --groups 4 --ranks 4 \
	    --kv-capacity 8Mtok --speed 10 --infer-sessions --json bench-policies.json; \
	else echo "skipping the policy table: $(TRACE) not found"; fi

# The real binary over loopback at c=1/16/64, streaming and not (PEER_URL=… for an A/B).
bench-http: build
	scripts/bench-http.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	CGO_ENABLED=0 $(GO) vet -trimpath $(PKGS) # the images' build settings: what vet compiles, they reuse
	@$(GO) generate ./messages && git diff --exit-code --stat messages/types_gen.go || { echo "messages/types_gen.go is stale: run go generate ./messages and commit it"; exit 1; }
	@if command -v staticcheck >/dev/null 2>&1; then staticcheck $(PKGS); else echo "staticcheck not installed (go install honnef.co/go/tools/cmd/staticcheck@latest); skipped"; fi

fmt:
	gofmt -w $$(git ls-files '*.go')

# Runs every fuzz target for FUZZTIME each.
FUZZTIME ?= 20s
fuzz:
	@for pkg in $$($(GO) list $(PKGS)); do \
	  for f in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
	    echo "== $$pkg $$f"; $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	  done; \
	done

# A FROM scratch image of the static binary (no image is pulled).
image:
	mkdir -p build/docker/empty
	chmod 1777 build/docker/empty # /tmp and /data: writable by whichever user runs the container
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '-s -w $(VERSION_LDFLAGS)' -o build/docker/kvbus ./cmd/kvbus
	docker build -f Dockerfile -t $(IMAGE) build/docker

# The fake vLLM engine image of docker-compose.engine.yml (a test tool).
FAKEENGINE_IMAGE ?= kvbus-fakeengine:dev
export ENGINE_IMAGE ?= $(FAKEENGINE_IMAGE)
image-fakeengine: image
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '-s -w' -o build/docker/kvbus-fakeengine ./cmd/kvbus-fakeengine
	docker build -f Dockerfile.fakeengine -t $(FAKEENGINE_IMAGE) build/docker

# Prometheus from Debian's package (apt-get download, once: `make clean`
# fetches it again; the binary links only glibc, copied along) for
# docker-compose.monitoring.yml, with the static kvbus binary of `make image`
# for its health check. The package's promtool checks deploy/prometheus/
# first: the config, the rules and their unit tests (rules_test.yml).
PROMETHEUS_IMAGE := $(or $(PROMETHEUS_IMAGE),$(KVBUS_PROMETHEUS_IMAGE),kvbus-prometheus:dev)
export KVBUS_PROMETHEUS_IMAGE := $(PROMETHEUS_IMAGE)
PROMETHEUS_DEB := build/prometheus-deb
PROMTOOL := $(PROMETHEUS_DEB)/x/usr/bin/promtool
$(PROMTOOL):
	rm -rf $(PROMETHEUS_DEB) && mkdir -p $(PROMETHEUS_DEB)
	cd $(PROMETHEUS_DEB) && apt-get download prometheus
	dpkg-deb -x $(PROMETHEUS_DEB)/prometheus_*.deb $(PROMETHEUS_DEB)/x

check-prometheus: $(PROMTOOL)
	$(PROMTOOL) check config deploy/prometheus/prometheus.yml
	cd deploy/prometheus && $(CURDIR)/$(PROMTOOL) test rules rules_test.yml

image-prometheus: image check-prometheus
	rm -rf build/prometheus && mkdir -p build/prometheus/empty
	cp $(PROMETHEUS_DEB)/x/usr/bin/prometheus build/docker/kvbus build/prometheus/
	cp -L /lib/x86_64-linux-gnu/libc.so.6 /lib64/ld-linux-x86-64.so.2 build/prometheus/
	cp deploy/prometheus/prometheus.yml deploy/prometheus/rules.yml build/prometheus/
	docker build -f Dockerfile.prometheus -t $(PROMETHEUS_IMAGE) build/prometheus

# The cluster with Prometheus (on 127.0.0.1:$(PROMETHEUS_PORT)); from then on
# `make up` keeps it (MONITORING above).
PROMETHEUS_PORT ?= $(or $(KVBUS_PROMETHEUS_PORT),9091)
up-monitoring: image-prometheus
	$(MAKE) up MONITORING=1
	@build/docker/kvbus healthcheck --url http://127.0.0.1:$(PROMETHEUS_PORT)/-/ready --wait 60s && echo "Prometheus is ready on http://127.0.0.1:$(PROMETHEUS_PORT)"

# kvbus in front of two (fake) vLLM engines; ENGINE_IMAGE=your vLLM image
# for GPUs (then change the engines' command, see the file). ENGINE_WAIT:
# how long to wait for the frontend's /healthz (give it the engines' load
# time, e.g. ENGINE_WAIT=15m). Keys per role and per group in
# KVBUS_ENGINE_AUTH_DIR, written once. `make up-engine-monitoring` adds
# Prometheus; later `make up-engine`s keep it (ENGINE_MONITORING=0 leaves it
# out).
ENGINE_WAIT ?= 120s
KVBUS_ENGINE_AUTH_DIR ?= .kvbus-auth-engine
export KVBUS_ENGINE_AUTH_DIR
ENGINE_MONITORING ?= $(if $(shell $(COMPOSE) -f docker-compose.engine.yml -f $(MONITORING_FILE) ps -q prometheus 2>/dev/null),1,0)
ENGINE_FILES = -f docker-compose.engine.yml$(if $(filter 1,$(ENGINE_MONITORING)), -f $(MONITORING_FILE))
up-engine: image-fakeengine
	@if test -f $(KVBUS_ENGINE_AUTH_DIR)/nats-auth.conf; then \
		out=$$(build/docker/kvbus auth init $(KVBUS_ENGINE_AUTH_DIR) --groups g0,g1 2>/dev/null); \
		case "$$out" in rewrote*) echo "$$out"; $(COMPOSE) $(ENGINE_FILES) kill -s SIGHUP nats 2>/dev/null || true;; esac; \
	else build/docker/kvbus auth init $(KVBUS_ENGINE_AUTH_DIR) --groups g0,g1; fi
	$(COMPOSE) $(ENGINE_FILES) up -d
	@build/docker/kvbus healthcheck --url http://127.0.0.1:$(HTTP_PORT)/healthz --wait $(ENGINE_WAIT) && echo "kvbus (engines) is ready on http://127.0.0.1:$(HTTP_PORT)"

up-engine-monitoring: image-prometheus
	$(MAKE) up-engine ENGINE_MONITORING=1
	@build/docker/kvbus healthcheck --url http://127.0.0.1:$(PROMETHEUS_PORT)/-/ready --wait 60s && echo "Prometheus is ready on http://127.0.0.1:$(PROMETHEUS_PORT)"

top-engine: # kvbus top on `make up-engine`'s cluster (see top)
	@test -f $(KVBUS_ENGINE_AUTH_DIR)/observer.nk || { build/docker/kvbus auth init $(KVBUS_ENGINE_AUTH_DIR) && $(COMPOSE) $(ENGINE_FILES) kill -s SIGHUP nats; }
	@t=; [ -t 0 ] || t=-T; $(COMPOSE) $(ENGINE_FILES) run --rm --no-deps $$t top top $(ARGS)

down-engine:
	$(COMPOSE) -f docker-compose.engine.yml down -v --remove-orphans

# Returns once the cluster is ready: the frontend's /healthz answers 200 only
# when a scheduler is ready, i.e. consumes requests and places them on a
# group whose KV index is synced (polled: docker-compose 1.29 has no --wait).
HTTP_PORT ?= $(or $(KVBUS_HTTP_PORT),8000)
# One NATS key per role (kvbus auth init), written once, and the routes'
# password of docker-compose.cluster.yml (cluster-password, written into a
# key directory that lacks it, keys unchanged); a directory of an older
# kvbus gets this one's permissions (nats-auth.conf rewritten, NATS
# reloaded); the containers run as the caller so that they can read their
# 0600 seed.
KVBUS_AUTH_DIR ?= .kvbus-auth
export KVBUS_AUTH_DIR
export KVBUS_UID := $(shell id -u)
export KVBUS_GID := $(shell id -g)
auth-keys: image
	@if { test -f $(KVBUS_AUTH_DIR)/nats-auth.conf && test -f $(KVBUS_AUTH_DIR)/cluster-password && test -f $(KVBUS_AUTH_DIR)/observer.nk; }; then \
		out=$$(build/docker/kvbus auth init $(KVBUS_AUTH_DIR) 2>/dev/null); \
		case "$$out" in rewrote*) echo "$$out"; $(MAKE) --no-print-directory reload-nats;; esac; \
	else build/docker/kvbus auth init $(KVBUS_AUTH_DIR) && $(MAKE) --no-print-directory reload-nats; fi

# kvbus top on the running cluster, from inside its network, with the
# observer key (it reads every kvbus subject and can publish nothing);
# ARGS="--once" prints one plain snapshot, ARGS="--once --json" one for
# scripts. A key directory made before the observer key existed gets it
# here; NATS loads it when restarted ($(COMPOSE) restart nats).
top:
	@test -f $(KVBUS_AUTH_DIR)/observer.nk || $(MAKE) --no-print-directory auth-keys
	@t=; [ -t 0 ] || t=-T; $(COMPOSE) $(UP_FILES) run --rm --no-deps $$t top top $(ARGS)

# Makes the running NATS containers read nats-auth.conf and their TLS files
# again (SIGHUP): keys added or rotated by `kvbus auth init` take effect
# without a restart.
reload-nats:
	$(COMPOSE) $(UP_FILES) kill -s SIGHUP $$($(COMPOSE) $(UP_FILES) config --services | grep '^nats')

up: image auth-keys
	$(COMPOSE) $(UP_FILES) up -d --scale scheduler=$(SCHEDULERS) --scale worker=$(WORKERS)
	@build/docker/kvbus healthcheck --url http://127.0.0.1:$(HTTP_PORT)/healthz --wait 120s && echo "kvbus is ready on http://127.0.0.1:$(HTTP_PORT)"

# Removes every container (Prometheus too) and the cluster's volumes, the
# second and third NATS servers' of docker-compose.cluster.yml included
# (it is added when COMPOSE_FILES leaves it out), but keeps Prometheus's
# data (the volume prometheus-data, declared only in
# docker-compose.monitoring.yml) for the next `make up-monitoring`; `make
# purge` deletes it as well.
CLUSTER_FILE := docker-compose.cluster.yml
DOWN_FILES = $(COMPOSE_FILES)$(if $(findstring $(CLUSTER_FILE),$(COMPOSE_FILES)),, -f $(CLUSTER_FILE))
down:
	$(COMPOSE) $(DOWN_FILES) down -v --remove-orphans

purge:
	$(COMPOSE) $(DOWN_FILES)$(if $(findstring $(MONITORING_FILE),$(COMPOSE_FILES)),, -f $(MONITORING_FILE)) down -v --remove-orphans

logs:
	$(COMPOSE) $(UP_FILES) logs -f --tail=100

# Builds, starts, checks a conversation, scaling and a killed worker, tears down.
smoke: image image-fakeengine auth-keys
	@$(MAKE) $(PROMTOOL) || echo "NOTICE: cannot fetch Debian's prometheus package (apt-get download prometheus failed): TestSmokeMonitoring will skip"
	@if [ -x $(PROMTOOL) ]; then $(MAKE) image-prometheus; fi
	COMPOSE="$(COMPOSE)" COMPOSE_FILES="$(COMPOSE_FILES)" CGO_ENABLED=0 $(GO) test -trimpath -tags smoke -count=1 -v -timeout 15m ./smoke

clean:
	rm -rf bin build
