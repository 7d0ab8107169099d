#!/usr/bin/env bash
# Calls a Ferrite endpoint with curl: list models, a chat completion, then a streamed one.
#   kubectl port-forward svc/smollm2 8000:8000 &   # or run inside the cluster with
#   ./curl.sh                                      # FERRITE_URL=http://smollm2.<ns>.svc:8000
set -euo pipefail
URL="${FERRITE_URL:-http://localhost:8000}"
MODEL="${MODEL:-smollm2}"

curl -sS --fail-with-body "$URL/v1/models"
echo

curl -sS --fail-with-body "$URL/v1/chat/completions" \
  -H 'Content-Type: application/json' \
  -d '{"model": "'"$MODEL"'", "max_tokens": 32, "temperature": 0,
       "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
echo

# Streaming: Server-Sent Events, one chunk per token, then data: [DONE].
curl -sS --fail-with-body -N "$URL/v1/completions" \
  -H 'Content-Type: application/json' \
  -d '{"model": "'"$MODEL"'", "prompt": "Once upon a time", "max_tokens": 16, "stream": true}'
