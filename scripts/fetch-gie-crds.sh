#!/usr/bin/env bash
# Copies the Gateway API Inference Extension's InferencePool CRD (inference.networking.k8s.io/v1)
# out of its Go module, fetched from the Go module proxy, into a cache folder outside the
# checkout (~/.cache/ferrite/k8s/gie-<version>/inferencepools.yaml), for the cluster tests that
# render InferencePools. Does nothing when it is there.
#
# The version is pinned by tests/cluster/gie/go.mod (and go.sum).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
mod="$root/tests/cluster/gie"
module=sigs.k8s.io/gateway-api-inference-extension

version="$(cd "$mod" && GOFLAGS=-mod=readonly go list -m -f '{{.Version}}' "$module")"
dest="${FERRITE_GIE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrite/k8s/gie-$version}"

if [[ ! -f "$dest/inferencepools.yaml" ]]; then
    src="$(cd "$mod" && GOFLAGS=-mod=readonly go mod download -json "$module" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')"
    mkdir -p "$dest"
    cp "$src/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" \
        "$dest/inferencepools.yaml.tmp"
    mv "$dest/inferencepools.yaml.tmp" "$dest/inferencepools.yaml"
    echo "fetched the InferencePool CRD of $module $version into $dest" >&2
fi
[[ "${1:-}" == "--print-dir" ]] && echo "$dest"
exit 0
