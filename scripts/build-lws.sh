#!/usr/bin/env bash
# Builds LeaderWorkerSet's controller (which serves its webhooks too) from the Go module proxy
# and copies its CustomResourceDefinitions beside it, into a cache folder outside the checkout
# (~/.cache/ferrite/k8s/lws-<version>/), for the cluster tests and `make cluster`. Does
# nothing when they are there.
#
# The version is pinned by tests/cluster/lws/go.mod; the folder is stamped with a hash of it,
# its go.sum and this script.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
mod="$root/tests/cluster/lws"

version="$(cd "$mod" && go list -m -f '{{.Version}}' sigs.k8s.io/lws)"
dest="${FERRITE_LWS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrite/k8s/lws-$version}"
stamp="$(cat "$mod/go.mod" "$mod/go.sum" "$0" | sha256sum | cut -d' ' -f1)"

if [[ -f "$dest/.stamp" && "$(cat "$dest/.stamp")" == "$stamp" && -x "$dest/lws-controller" \
    && -f "$dest/crds.yaml" ]]; then
    [[ "${1:-}" == "--print-dir" ]] && echo "$dest"
    exit 0
fi

echo "building LeaderWorkerSet $version into $dest (first time only; about 3 min on 2 cores)" >&2
start=$(date +%s)
mkdir -p "${dest%/*}"
tmp="$(mktemp -d "${dest%/*}/.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
(cd "$mod" && go build -trimpath -ldflags "-s -w" -o "$tmp/lws-controller" sigs.k8s.io/lws/cmd)
src="$(cd "$mod" && go list -m -f '{{.Dir}}' sigs.k8s.io/lws)"
for crd in "$src"/config/crd/bases/*.yaml; do
    echo "---"
    cat "$crd"
done > "$tmp/crds.yaml"

echo "$stamp" > "$tmp/.stamp"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "built in $(( $(date +%s) - start )) s: $(ls "$dest" | tr '\n' ' ')" >&2
[[ "${1:-}" == "--print-dir" ]] && echo "$dest"
exit 0
