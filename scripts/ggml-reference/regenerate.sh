#!/usr/bin/env bash
# Regenerates tests/fixtures/ggml-reference.json: ggml's quantizers, activation quantizers,
# dot products and dequantizers on deterministic inputs, from the llama.cpp vendored in the
# PyPI sdist llama-cpp-python==0.3.36 (the one make bench-peer builds, GGML_NATIVE on), so
# the kernel tests can hold Ferrite's arithmetic to ggml's bit for bit. make test never runs
# this; it reads the committed file.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
source "$ROOT/scripts/llamacpp-lib.sh"
need_llamacpp llama-server llama-quantize
OUT="$(mktemp -d)"
cc -O2 -o "$OUT/ggml_reference" "$ROOT/scripts/ggml-reference/ggml_reference.c" \
  -I "$LLAMA_DIR/ggml/include" -L "$LLAMA_DIR/build/bin" -lggml-cpu -lggml-base -lggml \
  -Wl,-rpath,"$LLAMA_DIR/build/bin"
"$OUT/ggml_reference" > "$ROOT/tests/fixtures/ggml-reference.json"
echo "wrote tests/fixtures/ggml-reference.json"

# Tiny random Llama-shaped models quantized by llama.cpp's own quantizer, and llama-server's
# greedy outputs on them: weights not repacked, flash attention on, 2 threads, and one token
# per micro-batch (-ub 1). llama.cpp gives the same logits whether a prompt goes through in
# one batch or token by token, except when a batched prompt is followed by decoding steps
# on K-quant weights, where its decoding steps come out slightly different (up to ~0.2 nats
# on these models); token by token is the configuration in which it agrees with itself.
PY="$("$ROOT/scripts/python-env.sh")"
FIX="$ROOT/tests/fixtures/tiny"
mkdir -p "$FIX"
PYTHONPATH="$LLAMA_DIR/gguf-py" "$PY" "$ROOT/scripts/ggml-reference/tiny_model.py" "$OUT/tiny-f32.gguf"
PROMPTS='[[10, 20, 30, 40, 50], [104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100], [7, 100, 13, 99, 130, 1, 45, 45, 45, 120, 3, 77, 88, 127, 0, 12, 110, 60, 61, 62, 63, 64], [129, 33], [65]]'
CASES="[]"
for q in Q2_K Q3_K_M Q4_K_M Q5_K_M Q6_K Q5_0 Q5_1 F16; do
  "$LLAMA_DIR/build/bin/llama-quantize" "$OUT/tiny-f32.gguf" "$FIX/tiny-$q.gguf" "$q" > /dev/null 2>&1
  PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  "$LLAMA_DIR/build/bin/llama-server" -m "$FIX/tiny-$q.gguf" --no-repack -fa on -t 2 -ub 1 -c 512 \
    --port "$PORT" > "$OUT/server-$q.log" 2>&1 &
  SERVER=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 0.2; done
  MORE=$(echo "$PROMPTS" | "$PY" "$ROOT/scripts/ggml-reference/greedy.py" "http://127.0.0.1:$PORT" "tiny-$q.gguf" 24)
  kill "$SERVER"; wait "$SERVER" 2> /dev/null || true
  CASES=$("$PY" -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1]) + json.loads(sys.argv[2])))' "$CASES" "$MORE")
done
echo "$CASES" | "$PY" -m json.tool --indent 1 > "$ROOT/tests/fixtures/tiny-llamacpp-greedy.json"

# The F16 model quantized by llama-quantize, every matrix in one format (--pure): what
# --quantization must reproduce block for block from the same F16 weights.
for q in Q8_0 Q4_K; do
  "$LLAMA_DIR/build/bin/llama-quantize" --pure "$FIX/tiny-F16.gguf" "$FIX/tiny-F16-pure-$q.gguf" "$q" > /dev/null 2>&1
done
# One matrix of the F16 model in each format --quantization writes (Q4_0 the rest): what its
# quantizers must reproduce byte for byte.
"$LLAMA_DIR/build/bin/llama-quantize" --pure \
  --tensor-type 'blk\.0\.attn_q=q2_k' --tensor-type 'blk\.0\.attn_k=q3_k' \
  --tensor-type 'blk\.0\.attn_v=q4_1' --tensor-type 'blk\.0\.attn_output=q5_0' \
  --tensor-type 'blk\.0\.ffn_gate=q5_1' --tensor-type 'blk\.0\.ffn_up=q5_k' \
  --tensor-type 'blk\.0\.ffn_down=q6_k' --tensor-type 'blk\.1\.attn_q=q8_0' \
  --tensor-type 'blk\.1\.attn_k=q4_k' --output-tensor-type q6_k --token-embedding-type q3_k \
  "$FIX/tiny-F16.gguf" "$FIX/tiny-F16-every-format.gguf" Q4_0 > /dev/null 2>&1
echo "wrote tests/fixtures/tiny/*.gguf and tests/fixtures/tiny-llamacpp-greedy.json"

# The types llama-quantize's K-quant mixes (Q3_K_S … Q5_K_M) choose for every tensor of three
# model shapes (--dry-run: types only): 32 layers with GQA 4; SmolLM2's widths (576, rows no
# whole 256-value block: the fallbacks), tied embeddings; 80 layers with GQA (llama.cpp's
# 70B rule). What --quantization q4_k_m and the others must choose.
MIXES="$OUT/mixes"; mkdir -p "$MIXES"
MODELS='[{"name": "deep", "layers": 32, "hidden": 256, "ffn": 768, "heads": 8, "kv_heads": 2, "tied": false},
 {"name": "narrow-tied", "layers": 12, "hidden": 576, "ffn": 512, "heads": 9, "kv_heads": 3, "tied": true},
 {"name": "seventy", "layers": 80, "hidden": 256, "ffn": 256, "heads": 8, "kv_heads": 2, "tied": false}]'
echo "$MODELS" > "$MIXES/models.json"
echo "$MODELS" | "$PY" -c 'import json,sys; [print(m["name"], m["layers"], m["hidden"], m["ffn"], m["heads"], m["kv_heads"], int(m["tied"])) for m in json.load(sys.stdin)]' |
while read -r name layers hidden ffn heads kv tied; do
  TIED=""; [ "$tied" = 1 ] && TIED="--tied"
  PYTHONPATH="$LLAMA_DIR/gguf-py" "$PY" "$ROOT/scripts/ggml-reference/tiny_model.py" "$MIXES/$name.gguf" --f16 $TIED \
    --layers "$layers" --hidden "$hidden" --ffn "$ffn" --heads "$heads" --kv-heads "$kv"
  for mix in Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M; do
    "$LLAMA_DIR/build/bin/llama-quantize" --dry-run "$MIXES/$name.gguf" "$mix" > "$MIXES/$name-$(echo "$mix" | tr 'A-Z' 'a-z').log" 2>&1
  done
done
"$PY" "$ROOT/scripts/ggml-reference/quant_mixes.py" "$MIXES/models.json" "$MIXES" > "$ROOT/tests/fixtures/llama-quantize-mixes.json"
echo "wrote tests/fixtures/llama-quantize-mixes.json"
