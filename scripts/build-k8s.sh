#!/usr/bin/env bash
# Builds the control plane the cluster tests run — kube-apiserver, kube-controller-manager,
# kube-scheduler, etcd, kwok and kubectl (for people using `make cluster`) — from the Go module proxy into a cache folder outside the
# checkout, so a fresh clone on the same machine reuses them. Does nothing when they are there.
#
# The versions are pinned by tests/cluster/k8s/go.mod and tests/cluster/kwok/go.mod; the cache
# folder is named after the Kubernetes version and stamped with a hash of both go.sum files.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
k8s_mod="$root/tests/cluster/k8s"
kwok_mod="$root/tests/cluster/kwok"

version="$(cd "$k8s_mod" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
dest="${FERRITE_K8S_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrite/k8s/$version}"
stamp="$(cat "$k8s_mod/go.mod" "$k8s_mod/go.sum" "$kwok_mod/go.mod" "$kwok_mod/go.sum" \
    "$0" | sha256sum | cut -d' ' -f1)"
bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok)

if [[ -f "$dest/.stamp" && "$(cat "$dest/.stamp")" == "$stamp" ]]; then
    all=1
    for b in "${bins[@]}"; do [[ -x "$dest/$b" ]] || all=0; done
    if [[ $all == 1 ]]; then
        [[ "${1:-}" == "--print-dir" ]] && echo "$dest"
        exit 0
    fi
fi

echo "building Kubernetes $version control plane into $dest (first time only; about 9 min on 2 cores)" >&2
start=$(date +%s)
tmp="$(mktemp -d "${dest%/*}.tmp.XXXXXX" 2>/dev/null || { mkdir -p "${dest%/*}"; mktemp -d "${dest%/*}/.tmp.XXXXXX"; })"
trap 'rm -rf "$tmp"' EXIT

minor="${version#v1.}"; minor="${minor%%.*}"
vpkg=k8s.io/component-base/version
ldflags="-s -w -X $vpkg.gitVersion=$version -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$minor"
ldflags+=" -X $vpkg.gitTreeState=clean -X $vpkg.buildDate=1970-01-01T00:00:00Z"
ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$version"

export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
(cd "$k8s_mod" && go build -trimpath -ldflags "$ldflags" -o "$tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl)
(cd "$k8s_mod" && go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3)
(cd "$kwok_mod" && go build -trimpath -ldflags "-s -w" -o "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok)

echo "$stamp" > "$tmp/.stamp"
mkdir -p "${dest%/*}"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "built in $(( $(date +%s) - start )) s: $(ls "$dest" | tr '\n' ' ')" >&2
[[ "${1:-}" == "--print-dir" ]] && echo "$dest"
exit 0
