# Shared by scripts/bench.sh and scripts/bench-peer.sh: start a server in the background,
# wait for /health, stop it. Sourced, not run.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="${MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
RESULTS="${RESULTS:-$ROOT/bench/results/results.json}"
BENCH="$ROOT/target/release/ferrite-bench"
THREADS="${THREADS:-2}"
WORKLOAD="fixed:128:128"
# Runs of each closed-loop level of the fixed workload (the throughput figures); the median is
# reported with the range. Open-loop rates and the mixed workload run once.
REPEAT="${REPEAT:-3}"
SERVER_PID=""

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_server LOG CMD...: runs CMD in the background and waits for $URL/health.
start_server() {
  local log="$1"; shift
  "$@" > "$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 600); do
    if curl -sf "$URL/health" > /dev/null 2>&1; then return 0; fi
    if ! kill -0 "$SERVER_PID" 2> /dev/null; then echo "server exited; see $log" >&2; tail -20 "$log" >&2; return 1; fi
    sleep 0.5
  done
  echo "server did not become healthy; see $log" >&2
  return 1
}

stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2> /dev/null; then
    kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2> /dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT
