#!/usr/bin/env bash
# Part of make bench-peer (or alone: make bench-formats): Ferrite beside llama.cpp's
# llama-server on a ~1B Llama-shaped model with random weights (hidden 2048, FFN 8192, 16
# layers, 32 query heads on 8 KV heads, a 32000-token vocabulary: 1.1B parameters; its text
# is noise, its speed is real), written once as F16 by scripts/ggml-reference/tiny_model.py
# and quantized by llama.cpp's llama-quantize, all cached in ~/.cache/ferrite/models. Per
# format, each server in turn (one at a time, 2 threads): short prompts at concurrency 1
# and 16, and ~1000-token prompts at concurrency 1. Each format's tables and Ferrite /
# llama.cpp ratios go to bench/results/formats-<FORMAT>.md, the CPU and Ferrite's kernel
# tiers in its report's machine line (ferrite-bench report).
set -euo pipefail
source "$(dirname "$0")/bench-lib.sh"
source "$(dirname "$0")/llamacpp-lib.sh"
# ROUNDS=N runs the servers in turn N times and keeps each one's last round: a VM whose speed
# drifts by phases then gives every server a turn after each phase change, not one phase each.
ROUNDS="${ROUNDS:-1}"
if ! [[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]]; then
  echo "ROUNDS=$ROUNDS: the number of rounds must be a whole number, 1 or more" >&2; exit 2
fi
need_llamacpp llama-server llama-quantize
# VEC_DOT=0 skips the second llama.cpp (on its vec_dot arithmetic) and its build.
VEC_DOT="${VEC_DOT:-1}"
if [ "$VEC_DOT" = 1 ]; then need_llamacpp_vec_dot llama-server; fi
FORMATS="${FORMATS:-Q4_K_M Q8_0 F16 BF16}"
MODELS="${XDG_CACHE_HOME:-$HOME/.cache}/ferrite/models"; mkdir -p "$MODELS"
LOGS="$ROOT/target/bench"; mkdir -p "$LOGS"
ENGINE="$ROOT/target/release/ferrite-engine"
F16="$MODELS/random-1b-F16.gguf"
if [ ! -f "$F16" ]; then
  PYTHONPATH="$LLAMA_DIR/gguf-py" "$("$ROOT/scripts/python-env.sh")" "$ROOT/scripts/ggml-reference/tiny_model.py" \
    "$F16.part" --hidden 2048 --ffn 8192 --heads 32 --kv-heads 8 --layers 16 --vocab 32000 --ctx 4096 --f16
  mv "$F16.part" "$F16"
fi
for f in $FORMATS; do
  FILE="$MODELS/random-1b-$f.gguf"
  if [ ! -f "$FILE" ]; then
    "$LLAMA_BIN/llama-quantize" "$F16" "$FILE.part" "$f" > "$LOGS/quantize-random-1b-$f.log" 2>&1
    mv "$FILE.part" "$FILE"
  fi
  OUT="$ROOT/bench/results/formats-$f.json"; rm -f "$OUT"
  runs() {
    "$BENCH" run "$@" --results "$OUT" --model random-1b --workload fixed:64:32 --concurrency 1,16 --requests 16 --no-progress
    "$BENCH" run "$@" --results "$OUT" --model random-1b --workload fixed:1000:16 --concurrency 1 --requests 2 --no-progress
  }
  # llama-server 0.3.36 crashes (SIGSEGV) loading these models with its CPU repacking on a CPU
  # with AMX (a Xeon) and is slower with it on a Zen 5; --no-repack keeps the weights as
  # stored. Set REPACK=1 to try.
  NOREPACK=(--no-repack); [ "${REPACK:-0}" = 1 ] && NOREPACK=()
  llama() {
    PORT=$(free_port); URL="http://127.0.0.1:$PORT"
    start_server "$LOGS/llama-server-random-1b-$f-$1.log" "$2/llama-server" -m "$FILE" --host 127.0.0.1 \
      --port "$PORT" -t "$THREADS" -tb "$THREADS" -np 16 --cont-batching -c $((16 * 2048)) --no-warmup "${NOREPACK[@]}"
    runs --url "$URL" --label "$1" --extra-body '{"cache_prompt": false}'
    stop_server
  }
  for _ in $(seq "$ROUNDS"); do
    PORT=$(free_port); URL="http://127.0.0.1:$PORT"
    start_server "$LOGS/ferrite-random-1b-$f.log" "$ENGINE" serve --model "$FILE" --served-model-name random-1b \
      --host 127.0.0.1 --port "$PORT" --max-model-len 2048 --no-enable-prefix-caching --max-num-seqs 16
    runs --url "$URL" --label ferrite
    stop_server
    llama llama.cpp "$LLAMA_BIN"
    # From 2 rows up llama.cpp 0.3.36 multiplies F16, BF16, Q8_0 and Q4_0 weights with
    # llamafile's sgemm, and from 8 rows up K-quant weights with its tiled kernel; both give
    # other bits than the one-row vec_dot arithmetic it uses otherwise, which Ferrite
    # reproduces at every batch size. This run is llama.cpp computing what Ferrite computes:
    # built without llamafile, the tiled kernel turned off.
    if [ "$VEC_DOT" = 1 ]; then GGML_CPU_TILED_MM=0 llama llama.cpp-vec_dot "$LLAMA_VEC_DOT_BIN"; fi
  done
  {
    echo "# random 1.1B Llama-shaped model, $f"
    echo
    echo "$THREADS threads each; llama-server ${NOREPACK[*]:-with repacking}; the servers in turn, the last of $ROUNDS round(s) kept."
    if [ "$VEC_DOT" = 1 ]; then
      echo
      echo "llama.cpp-vec_dot: llama-server built with GGML_LLAMAFILE=OFF and run with GGML_CPU_TILED_MM=0, so it multiplies batches with its one-row vec_dot arithmetic (the one Ferrite reproduces bit for bit) instead of llamafile's sgemm (F16, BF16, Q8_0, Q4_0; 2 rows up) or its tiled K-quant kernel (8 rows up)."
    fi
    echo
    "$BENCH" report --results "$OUT"
  } > "$ROOT/bench/results/formats-$f.md"
  cat "$ROOT/bench/results/formats-$f.md"
done
