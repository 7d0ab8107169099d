#!/usr/bin/env bash
# make bench-quality: what quantizing costs in perplexity, Ferrite's --quantization beside
# llama.cpp's quantizer on the same weights. The default model ships only in Q4_1, so the
# unquantized model here is that model decoded to F16 (llama-quantize --allow-requantize,
# exact: every Q4_1 value is an f16); each format is then made twice from that F16 file —
# by `ferrite-engine --quantization` while loading, and by `llama-quantize --pure` (for the
# K-quant mixes, llama-quantize without --pure) — and
# scored on the Declaration of Independence (bench/data/declaration.txt, public domain) in
# windows of 512 tokens, as llama.cpp's llama-perplexity scores them, which runs on the same
# files for comparison.
set -euo pipefail
source "$(dirname "$0")/bench-lib.sh"
source "$(dirname "$0")/llamacpp-lib.sh"
need_llamacpp llama-quantize llama-perplexity
OUT="$ROOT/target/bench/quality"; mkdir -p "$OUT"
TEXT="$ROOT/bench/data/declaration.txt"
ENGINE="$ROOT/target/release/ferrite-engine"
F16="$OUT/smollm2-F16.gguf"
[ -f "$F16" ] || "$LLAMA_BIN/llama-quantize" --allow-requantize "$MODEL" "$F16" F16 > "$OUT/quantize-F16.log" 2>&1

ours() { "$ENGINE" perplexity --model "$1" --file "$TEXT" --ctx 512 "${@:2}" 2> /dev/null | awk '/^perplexity/ {print $2}'; }
# llama-perplexity as a user runs it (batches of 512, two threads) and token by token on one
# thread with flash attention (-ub 1 -t 1 -fa on): the configuration whose arithmetic
# Ferrite reproduces. With more threads llama.cpp splits a single token's attention over
# caches of 512 and more among them and its results change with the thread count. Weights
# are not repacked: llama-perplexity crashes on repacked Q4_0/Q8_0 weights on CPUs with AMX.
theirs() {
  "$LLAMA_BIN/llama-perplexity" -m "$1" -f "$TEXT" -c 512 --no-repack "${@:2}" > "$OUT/llama-perplexity.log" 2>&1 || true
  grep -o 'Final estimate: PPL = [0-9.]*' "$OUT/llama-perplexity.log" | awk '{print $NF}'
}
row() {
  echo "| $1 | $2 | $(ours "$3") | $(theirs "$3" -t "$THREADS") | $(theirs "$3" -t 1 -ub 1 -b 512 -fa on) |"
}

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo
echo "| weights | Ferrite, --quantization at load | Ferrite, the file | llama.cpp, the file | llama.cpp, the file token by token on one thread |"
echo "|---|---|---|---|---|"
row "F16 (unquantized)" "—" "$F16"
row "Q4_1 (the file as published)" "—" "$MODEL"
for q in Q8_0 Q6_K Q5_K Q5_1 Q5_0 Q4_K Q4_1 Q4_0 Q3_K Q2_K; do
  FILE="$OUT/smollm2-pure-$q.gguf"
  [ -f "$FILE" ] || "$LLAMA_BIN/llama-quantize" --pure "$F16" "$FILE" "$q" > "$OUT/quantize-$q.log" 2>&1
  row "$q (llama-quantize --pure)" "$(ours "$F16" --quantization "$(echo "$q" | tr 'A-Z' 'a-z')")" "$FILE"
done
# llama.cpp's K-quant mixes: each matrix in the format llama-quantize chooses for it.
for q in Q3_K_M Q4_K_M Q5_K_M; do
  FILE="$OUT/smollm2-$q.gguf"
  [ -f "$FILE" ] || "$LLAMA_BIN/llama-quantize" "$F16" "$FILE" "$q" > "$OUT/quantize-$q.log" 2>&1
  row "$q (llama-quantize)" "$(ours "$F16" --quantization "$(echo "$q" | tr 'A-Z' 'a-z')")" "$FILE"
done
echo
echo "Perplexity on bench/data/declaration.txt, windows of 512 tokens, second halves scored."
echo "The K-quants fall back for the matrices whose rows (576 values) are not whole 256-value"
echo "blocks, in both quantizers: Q6_K to Q8_0, Q5_K to Q5_1, Q4_K to Q5_0, Q3_K and Q2_K to Q4_0."
