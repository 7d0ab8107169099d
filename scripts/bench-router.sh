#!/usr/bin/env bash
# make bench, the router's overhead: one engine serving the default model, measured by
# ferrite-bench at concurrency 1 and 16 straight to the engine and through ferrite-router
# ($REPEAT runs of each level, median kept). The router runs against the test control
# plane (ferrite-cluster), which holds an LLMService and an EndpointSlice naming the engine at
# an address this host answers for (a `local` route on lo, which needs root or CAP_NET_ADMIN;
# without it these rows are skipped, saying so). Results join bench/results/results.json.
set -euo pipefail
source "$(dirname "$0")/bench-lib.sh"
ENGINE="${ENGINE:-$ROOT/target/release/ferrite-engine}"
ROUTER="${ROUTER:-$ROOT/target/release/ferrite-router}"
CLUSTER="${CLUSTER:-$ROOT/target/release/ferrite-cluster}"
BENCH="${BENCH_BIN:-$BENCH}"
CIDR=10.231.99.0/24
ADDR=10.231.99.1
LOGS="$ROOT/target/bench"; mkdir -p "$LOGS"

if ! ip route replace local "$CIDR" dev lo 2> "$LOGS/route.err"; then
  echo "skipping the router rows: routing $CIDR to this host needs root or CAP_NET_ADMIN ($(cat "$LOGS/route.err"))" >&2
  exit 0
fi
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2> /dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2> /dev/null || true; done
  ip route del local "$CIDR" dev lo 2> /dev/null || true
}
trap cleanup EXIT

export FERRITE_K8S_DIR="$("$ROOT/scripts/build-k8s.sh" --print-dir)"
export FERRITE_LWS_DIR="$("$ROOT/scripts/build-lws.sh" --print-dir)"
"$CLUSTER" "$ROOT/crds/llmservice.yaml" > "$LOGS/cluster.log" 2> "$LOGS/cluster.err" &
PIDS+=($!)
for _ in $(seq 1 240); do grep -q '^kubeconfig:' "$LOGS/cluster.log" 2> /dev/null && break; sleep 0.5; done
KUBECONFIG="$(sed -n 's/^kubeconfig: //p' "$LOGS/cluster.log")"
[ -n "$KUBECONFIG" ] || { echo "the test control plane did not start; see $LOGS/cluster.err" >&2; exit 1; }
export KUBECONFIG
KUBECTL="$FERRITE_K8S_DIR/kubectl"
"$KUBECTL" create namespace bench > /dev/null
"$KUBECTL" apply -n bench -f - > /dev/null <<EOF
apiVersion: serving.ferrite.dev/v1alpha1
kind: LLMService
metadata: {name: smollm2}
spec:
  model: {source: "file://$MODEL", servedName: smollm2}
  replicas: 0
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: smollm2-bench
  labels:
    kubernetes.io/service-name: smollm2
    serving.ferrite.dev/llmservice: smollm2
    endpointslice.kubernetes.io/managed-by: bench.ferrite.dev
addressType: IPv4
ports: [{name: http, port: 8000, protocol: TCP}]
endpoints: [{addresses: ["$ADDR"], conditions: {ready: true}}]
EOF

URL="http://$ADDR:8000"
start_server "$LOGS/ferrite-router-engine.log" "$ENGINE" serve --model "$MODEL" --served-model-name smollm2 \
  --host "$ADDR" --port 8000 --max-model-len 2048 --no-enable-prefix-caching --max-num-seqs 64
PIDS+=("$SERVER_PID"); SERVER_PID=""
RPORT=$(free_port)
"$ROUTER" --namespace bench --listen "127.0.0.1:$RPORT" > "$LOGS/router.log" 2>&1 &
PIDS+=($!)
RURL="http://127.0.0.1:$RPORT"
for _ in $(seq 1 240); do
  curl -sf "$RURL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "prompt": "hi", "max_tokens": 1}' > /dev/null 2>&1 && break
  sleep 0.5
done
"$BENCH" run --url "$URL" --label "ferrite (router A/B: direct)" --results "$RESULTS" --workload "$WORKLOAD" --concurrency 1,16 --repeat "$REPEAT" --no-progress
"$BENCH" run --url "$RURL" --label "ferrite via ferrite-router" --results "$RESULTS" --workload "$WORKLOAD" --concurrency 1,16 --repeat "$REPEAT" --no-progress
