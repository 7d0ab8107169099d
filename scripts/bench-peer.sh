#!/usr/bin/env bash
# make bench-peer: the same workloads against what a user would run instead, on the same
# machine, model and thread count:
#  - llama.cpp's llama-server, built once from the llama.cpp vendored in the PyPI sdist of
#    llama-cpp-python (cached in ~/.cache/ferrite/llamacpp), restarted per concurrency with
#    -np equal to it, --cont-batching, 2048 context per slot (Ferrite's --max-model-len);
#  - naive Hugging Face Transformers generate, one request at a time, fp32
#    (scripts/hf_server.py in a venv with torch and transformers from PyPI).
# Then prints Ferrite / peer ratios for every figure both measured.
set -euo pipefail
source "$(dirname "$0")/bench-lib.sh"
source "$(dirname "$0")/llamacpp-lib.sh"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/ferrite"
LLAMA_SERVER="$LLAMA_BIN/llama-server"
LOGS="$ROOT/target/bench"; mkdir -p "$LOGS"
need_llamacpp llama-server

VENV="$CACHE/peer-venv"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import torch, transformers, gguf, accelerate' 2> /dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet torch==2.9.1 transformers==4.57.3 gguf==0.17.1 accelerate==1.12.0 numpy
fi
PORT=$(free_port); URL="http://127.0.0.1:$PORT"
start_server "$LOGS/transformers.log" "$VENV/bin/python" "$ROOT/scripts/hf_server.py" --gguf "$MODEL" --port "$PORT" --threads "$THREADS"
"$BENCH" run --url "$URL" --label transformers --results "$RESULTS" --workload "$WORKLOAD" --concurrency 1,16 --requests 8
stop_server


for c in 1 4 16 64; do
  PORT=$(free_port); URL="http://127.0.0.1:$PORT"
  start_server "$LOGS/llama-server-$c.log" "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$PORT" \
    -t "$THREADS" -tb "$THREADS" -np "$c" --cont-batching -c $((c * 2048)) --no-warmup
  # Ferrite runs with prefix caching off; llama-server's prompt cache goes off per request.
  LLAMA=(--url "$URL" --label llama.cpp --results "$RESULTS" --extra-body '{"cache_prompt": false}')
  "$BENCH" run "${LLAMA[@]}" --workload "$WORKLOAD" --concurrency "$c" --repeat "$REPEAT"
  if [ "$c" = 16 ]; then
    "$BENCH" run "${LLAMA[@]}" --workload mixed --concurrency 16
    "$BENCH" run "${LLAMA[@]}" --workload "$WORKLOAD" --request-rate 0.25,0.5,1 --requests 16
  fi
  stop_server
done

"$BENCH" report --results "$RESULTS" --markdown "$ROOT/bench/results/README.md" --plot "$ROOT/bench/results"
