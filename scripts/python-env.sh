#!/usr/bin/env bash
# Creates (once) the Python environment the tests use: numpy for the reference model.
# It lives outside the checkout so fresh clones on the same machine reuse it.
set -euo pipefail
VENV="${XDG_CACHE_HOME:-$HOME/.cache}/ferrite/venv"
REQ="$(dirname "$0")/../tests/requirements.txt"
STAMP="$VENV/.requirements.sha256"
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  echo "$VENV/bin/python"; exit 0
fi
python3 -m venv "$VENV" >&2
"$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
"$VENV/bin/python" -m pip install --quiet -r "$REQ" >&2
echo "$want" > "$STAMP"
echo "$VENV/bin/python"
