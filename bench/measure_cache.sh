#!/bin/bash
# The cost of measuring on a model's first request: the built-in demo's first request to
# demo-small right after start, with an empty measure cache (cold: the request waits for
# one measure child) and with the cache from the previous run (warm). Runs N pairs.
#   bash bench/measure_cache.sh [N]     (PORT=18600 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
port=${PORT:-18600}
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
for _ in $(seq "${1:-3}"); do
  rm -rf "${state:?}"/*
  for run in cold warm; do
    XDG_STATE_HOME=$state python supervisor.py serve --port "$port" > "$state/$run.log" 2>&1 &
    pid=$!
    until curl -s -o /dev/null "localhost:$port/health"; do sleep 0.02; done
    start=$(date +%s.%N)
    curl -s -o /dev/null "localhost:$port/v1/chat/completions" \
      -d '{"model": "demo-small", "max_tokens": 2}'
    end=$(date +%s.%N)
    printf '%s: first request %.3f s\n' "$run" "$(echo "$end - $start" | bc)"
    kill "$pid"
    wait "$pid" || true
  done
done
