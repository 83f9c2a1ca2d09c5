#!/usr/bin/env bash
# make bench-http: the real binary over loopback, as users run it.
#
# Starts kvbus with its default flags (info logs, the instant sim engine),
# drives it with `kvbus loadgen` at each concurrency in CONCURRENCY,
# non-streaming and streaming, DURATION each, and prints req/s, p50/p99 and
# the CPU every kvbus process spent per request.
#
#   TOPOLOGY=serve    one process: `kvbus serve --time-scale 0 $SERVE_ARGS`
#                     (e.g. SERVE_ARGS="--groups 16")
#   TOPOLOGY=cluster  separate processes: `kvbus nats`, SCHEDULERS schedulers,
#                     WORKER_GROUPS groups of 4 `kvbus worker` ranks, FRONTENDS
#                     frontends (the load is spread over them); each worker
#                     runs with GOMAXPROCS=$WORKER_GOMAXPROCS (default 1, as
#                     in docker-compose.yml; empty: the Go runtime's default);
#                     NATS_GOMAXPROCS, SCHEDULER_GOMAXPROCS and
#                     FRONTEND_GOMAXPROCS do the same for the other roles
#                     (unset: the runtime's default)
#
# With PEER_URL=http://127.0.0.1:PORT (another OpenAI-compatible server, e.g.
# llm-d's simulator built outside the repo) every cell runs A/B/A/B, kvbus and
# the peer alternated, and the ratio of the means is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-bin/kvbus}
DURATION=${DURATION:-8s}
TOPOLOGY=${TOPOLOGY:-serve}
CONCURRENCY=${CONCURRENCY:-1 16 64}
STREAMS=${STREAMS:-no yes}
PORT=${BENCH_HTTP_PORT:-18080}
WORKER_GOMAXPROCS=${WORKER_GOMAXPROCS-1}
NATS=127.0.0.1:${BENCH_NATS_PORT:-18222}
TMP=$(mktemp -d)
PIDS=()
cleanup() {
	for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
	rm -rf "$TMP"
}
trap cleanup EXIT
NAMES=()
start() { # name args...: runs kvbus in the background, logs in $TMP/name.log
	local name=$1
	shift
	"$BIN" "$@" >"$TMP/$name.log" 2>&1 &
	PIDS+=($!)
	NAMES+=("$name")
}
in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for p in "${NATS##*:}" $(seq "$PORT" $((PORT + ${FRONTENDS:-1} - 1))); do # else another server would answer for kvbus
	if in_use "$p"; then
		echo "bench-http: 127.0.0.1:$p is in use (another kvbus?); stop it, or set BENCH_HTTP_PORT / BENCH_NATS_PORT" >&2
		exit 1
	fi
done
URLS=()
METRICS=() # the schedulers' /metrics
case $TOPOLOGY in
serve)
	# shellcheck disable=SC2086 # SERVE_ARGS is a list of flags
	start serve serve --time-scale 0 --http-addr "127.0.0.1:$PORT" --nats-addr "$NATS" ${SERVE_ARGS:-}
	URLS=("http://127.0.0.1:$PORT")
	METRICS=("http://127.0.0.1:$PORT/metrics") # one registry for the process
	;;
cluster)
	bus=(--nats-url "nats://$NATS")
	GOMAXPROCS=${NATS_GOMAXPROCS-} start nats nats --addr "$NATS" --data-dir "$TMP/js"
	sleep 1
	for i in $(seq 0 $((${SCHEDULERS:-1} - 1))); do
		GOMAXPROCS=${SCHEDULER_GOMAXPROCS-} start "scheduler-$i" scheduler "${bus[@]}" --metrics-addr "127.0.0.1:$((19000 + i))"
		METRICS+=("http://127.0.0.1:$((19000 + i))/metrics")
	done
	port=19100
	for g in $(seq 0 $((${WORKER_GROUPS:-1} - 1))); do
		for r in 0 1 2 3; do
			GOMAXPROCS=$WORKER_GOMAXPROCS start "worker-g$g-$r" worker "${bus[@]}" --group "g$g" --tp-rank "$r" --tp-size 4 --time-scale 0 \
				--metrics-addr "127.0.0.1:$port"
			port=$((port + 1))
		done
	done
	for f in $(seq 0 $((${FRONTENDS:-1} - 1))); do
		GOMAXPROCS=${FRONTEND_GOMAXPROCS-} start "frontend-$f" frontend "${bus[@]}" --http-addr "127.0.0.1:$((PORT + f))"
		URLS+=("http://127.0.0.1:$((PORT + f))")
	done
	;;
*)
	echo "TOPOLOGY must be serve or cluster" >&2
	exit 2
	;;
esac
for u in "${URLS[@]}"; do "$BIN" healthcheck --url "$u/healthz" --wait 60s >/dev/null; done
for i in "${!PIDS[@]}"; do # a process that failed to start (a port in use) would leave another server measured
	if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
		echo "bench-http: ${NAMES[$i]} exited at start:" >&2
		tail -n 5 "$TMP/${NAMES[$i]}.log" >&2
		exit 1
	fi
done
URL=$(
	IFS=,
	echo "${URLS[*]}"
)
cpu() { # clock ticks spent by every kvbus process so far
	local t=0 p
	for p in "${PIDS[@]}"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done
	echo "$t"
}
routing() { # sum and count of the schedulers' routing times so far
	local m
	for m in "${METRICS[@]}"; do curl -fsS "$m"; done |
		awk '/^kvbus_scheduler_routing_seconds_sum/ {s += $2} /^kvbus_scheduler_routing_seconds_count/ {n += $2} END {print s, n}'
}
run() { "$BIN" loadgen --url "$1" -c "$2" -d "$DURATION" $3 --json; }
field() { sed -E "s/.*\"$1\":([0-9.]+).*/\\1/"; }
printf '%-4s %-6s %12s %9s %9s %11s %11s' c stream "kvbus req/s" "p50 ms" "p99 ms" "cpu us/req" "routing us"
[ -n "${PEER_URL:-}" ] && printf ' %12s %8s' "peer req/s" ratio
echo
for stream in $STREAMS; do
	flag=""
	[ "$stream" = yes ] && flag=--stream
	for c in $CONCURRENCY; do
		t0=$(cpu)
		r0=$(routing)
		a1=$(run "$URL" "$c" "$flag")
		t1=$(cpu)
		r1=$(routing)
		rt=$(echo "$r0 $r1" | awk '{printf "%.0f", ($4 > $2) ? ($3 - $1) / ($4 - $2) * 1e6 : 0}')
		n=$(echo "$a1" | field requests)
		us=$(awk -v a="$t0" -v b="$t1" -v n="$n" -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.0f", n ? (b - a) * 1e6 / hz / n : 0}')
		printf '%-4s %-6s %12.0f %9.2f %9.2f %11s %11s' "$c" "$stream" "$(echo "$a1" | field rps)" "$(echo "$a1" | field p50_ms)" \
			"$(echo "$a1" | field p99_ms)" "$us" "$rt"
		if [ -n "${PEER_URL:-}" ]; then
			b1=$(run "$PEER_URL" "$c" "$flag")
			a2=$(run "$URL" "$c" "$flag")
			b2=$(run "$PEER_URL" "$c" "$flag")
			ka=$(printf '%s\n%s\n' "$a1" "$a2" | field rps | awk '{s += $1} END {print s / NR}')
			kb=$(printf '%s\n%s\n' "$b1" "$b2" | field rps | awk '{s += $1} END {print s / NR}')
			printf ' %12.0f %8.2f' "$kb" "$(awk -v a="$ka" -v b="$kb" 'BEGIN {print a / b}')"
		fi
		echo
	done
done
if [ -n "${BREAKDOWN:-}" ]; then # CPU seconds of each process over the whole run
	for i in "${!PIDS[@]}"; do
		awk -v n="${NAMES[$i]}" -v hz="$(getconf CLK_TCK)" '{printf "%-16s %6.2f s\n", n, ($14 + $15) / hz}' "/proc/${PIDS[$i]}/stat"
	done
fi
