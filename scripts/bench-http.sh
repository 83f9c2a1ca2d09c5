#!/usr/bin/env bash
# make bench-http: the real binary over loopback, as users run it.
# Starts `kvbus serve --time-scale 0` (default flags, info logs), drives it with
# `kvbus loadgen` at c=1/16/64, non-streaming and streaming, DURATION each, and
# prints req/s and p50/p99. With PEER_URL=http://127.0.0.1:PORT (another
# OpenAI-compatible server, e.g. llm-d's simulator built outside the repo) every
# cell runs A/B/A/B, kvbus and the peer alternated, and the ratio is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-bin/kvbus}
DURATION=${DURATION:-8s}
HTTP=127.0.0.1:${BENCH_HTTP_PORT:-18080}
NATS=127.0.0.1:${BENCH_NATS_PORT:-18222}
"$BIN" serve --time-scale 0 --http-addr "$HTTP" --nats-addr "$NATS" > /tmp/kvbus-bench-http.log 2>&1 &
SERVE=$!
trap 'kill $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
"$BIN" healthcheck --url "http://$HTTP/healthz" --wait 60s >/dev/null
run() { "$BIN" loadgen --url "$1" -c "$2" -d "$DURATION" $3 --json; }
rps() { sed -E 's/.*"rps":([0-9.]+).*/\1/'; }
printf '%-4s %-6s %12s %10s %10s' c stream "kvbus req/s" "p50 ms" "p99 ms"
[ -n "${PEER_URL:-}" ] && printf ' %12s %8s' "peer req/s" ratio
echo
for stream in "" "--stream"; do
  for c in 1 16 64; do
    a1=$(run "http://$HTTP" $c "$stream")
    if [ -n "${PEER_URL:-}" ]; then
      b1=$(run "$PEER_URL" $c "$stream"); a2=$(run "http://$HTTP" $c "$stream"); b2=$(run "$PEER_URL" $c "$stream")
      ka=$(echo "$a1 $a2" | tr ' ' '\n' | rps | awk '{s+=$1} END {print s/NR}')
      kb=$(echo "$b1 $b2" | tr ' ' '\n' | rps | awk '{s+=$1} END {print s/NR}')
    fi
    p50=$(echo "$a1" | sed -E 's/.*"p50_ms":([0-9.]+).*/\1/'); p99=$(echo "$a1" | sed -E 's/.*"p99_ms":([0-9.]+).*/\1/')
    printf '%-4s %-6s %12.0f %10.2f %10.2f' "$c" "${stream:+yes}" "$(echo "$a1" | rps)" "$p50" "$p99"
    [ -n "${PEER_URL:-}" ] && printf ' %12.0f %8.2f' "$kb" "$(awk -v a="$ka" -v b="$kb" 'BEGIN {print a/b}')"
    echo
  done
done
