#!/usr/bin/env bash
# Builds Prometheus and promtool from the Go module proxy into a cache folder outside the
# checkout (~/.cache/ferrite/k8s/prometheus-<version>/), for the monitoring tests: promtool
# checks and unit-tests the chart's alert rules, and Prometheus scrapes real engines, the
# operator and the router while every dashboard query is asked of it. Does nothing when they
# are there.
#
# The version is pinned by tests/cluster/prometheus/go.mod; the folder is stamped with a hash
# of it, its go.sum and this script. Built with `remove_all_sd` (static and file discovery
# only: the tests name their targets) and without the web UI's assets (the HTTP API is all
# the tests use).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
mod="$root/tests/cluster/prometheus"

version="$(cd "$mod" && go list -m -f '{{.Version}}' github.com/prometheus/prometheus)"
dest="${FERRITE_PROMETHEUS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrite/k8s/prometheus-$version}"
stamp="$(cat "$mod/go.mod" "$mod/go.sum" "$0" | sha256sum | cut -d' ' -f1)"

if [[ -f "$dest/.stamp" && "$(cat "$dest/.stamp")" == "$stamp" && -x "$dest/prometheus" \
    && -x "$dest/promtool" ]]; then
    [[ "${1:-}" == "--print-dir" ]] && echo "$dest"
    exit 0
fi

echo "building Prometheus $version into $dest (first time only; about 10 min on 2 cores)" >&2
start=$(date +%s)
mkdir -p "${dest%/*}"
tmp="$(mktemp -d "${dest%/*}/.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
(cd "$mod" && go build -tags remove_all_sd -trimpath -ldflags "-s -w" -o "$tmp/" \
    github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool)

echo "$stamp" > "$tmp/.stamp"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "built in $(( $(date +%s) - start )) s: $(ls "$dest" | tr '\n' ' ')" >&2
[[ "${1:-}" == "--print-dir" ]] && echo "$dest"
exit 0
