#!/usr/bin/env bash
# make bench, over HTTP: Ferrite serving the default model, measured by ferrite-bench at
# concurrency 1, 4, 16 and 64 (128-token prompts, 128 output tokens), at Poisson request
# rates, on the mixed chat-like workload, with every output held to a JSON schema at
# concurrency 1 and 16, as two pipeline stages and as three tensor-parallel ranks at
# concurrency 1 and 16,
# and with --max-num-seqs 1 (no batching: the naive baseline), and straight against through
# ferrite-router at concurrency 1 and 16 (scripts/bench-router.sh); closed-loop levels of the fixed workload run $REPEAT times (median and range).
# Results go to bench/results/results.json; the report and plots next to it.
set -euo pipefail
source "$(dirname "$0")/bench-lib.sh"
PORT=$(free_port); URL="http://127.0.0.1:$PORT"
ENGINE="$ROOT/target/release/ferrite-engine"
SERVE=("$ENGINE" serve --model "$MODEL" --served-model-name smollm2 --host 127.0.0.1 --port "$PORT"
       --max-model-len 2048 --no-enable-prefix-caching)
LOGS="$ROOT/target/bench"; mkdir -p "$LOGS"

start_server "$LOGS/ferrite.log" "${SERVE[@]}" --max-num-seqs 64
"$BENCH" run --url "$URL" --label ferrite --results "$RESULTS" --workload "$WORKLOAD" --concurrency 1,4,16,64 --repeat "$REPEAT"
"$BENCH" run --url "$URL" --label ferrite --results "$RESULTS" --workload "$WORKLOAD" --request-rate 0.25,0.5,1 --requests 16
"$BENCH" run --url "$URL" --label ferrite --results "$RESULTS" --workload mixed --concurrency 16
# Structured output: the same requests, each held to a JSON schema (at least 100 short
# strings, so no answer can end early), beside the unconstrained rows at 1 and 16 above.
SCHEMA='{"structured_outputs": {"json": {"type": "object", "required": ["words"], "properties": {"words": {"type": "array", "minItems": 100, "items": {"type": "string", "maxLength": 12}}}}}}'
"$BENCH" run --url "$URL" --label "ferrite json_schema" --results "$RESULTS" --workload "$WORKLOAD" --concurrency 1,16 --repeat "$REPEAT" --extra-body "$SCHEMA"
stop_server

# Pipeline parallel: two stages on this host, the threads divided between them (on two
# cores parallelism cannot make a model faster; the figure is how close it stays to one
# process). Per-stage compute and transfer seconds from its /metrics go to the log.
start_server "$LOGS/ferrite-pp2.log" "${SERVE[@]}" --max-num-seqs 64 --pipeline-parallel-size 2
"$BENCH" run --url "$URL" --label "ferrite --pipeline-parallel-size 2" --results "$RESULTS" --workload "$WORKLOAD" --concurrency 1,16 --repeat "$REPEAT"
curl -s "$URL/metrics" | grep '^ferrite:pipeline_stage' >> "$LOGS/ferrite-pp2.log" || true
stop_server

# Tensor parallel: the default model's 3 KV heads split among 3 ranks (its only split), the
# two cores' threads among them; the leader's collective seconds go to the log.
start_server "$LOGS/ferrite-tp3.log" "${SERVE[@]}" --max-num-seqs 64 --tensor-parallel-size 3
"$BENCH" run --url "$URL" --label "ferrite --tensor-parallel-size 3" --results "$RESULTS" --workload "$WORKLOAD" --concurrency 1,16 --repeat "$REPEAT"
curl -s "$URL/metrics" | grep -E '^ferrite:(pipeline_stage|tensor_parallel)' >> "$LOGS/ferrite-tp3.log" || true
stop_server

start_server "$LOGS/ferrite-naive.log" "${SERVE[@]}" --max-num-seqs 1
"$BENCH" run --url "$URL" --label "ferrite --max-num-seqs 1" --results "$RESULTS" --workload "$WORKLOAD" --concurrency 16 --repeat "$REPEAT"
stop_server

# The router's overhead: the same engine straight and through ferrite-router (needs the test
# control plane and a local route; skipped, saying why, where that cannot be made).
"$ROOT/scripts/bench-router.sh"

"$BENCH" report --results "$RESULTS" --markdown "$ROOT/bench/results/README.md" --plot "$ROOT/bench/results"
