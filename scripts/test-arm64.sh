#!/usr/bin/env bash
# Part of make test: the kernels and the engine cross-built for aarch64-unknown-linux-gnu
# (generic arm64: the NEON tier, and the portable one it must equal bit for bit) and their
# kernel tests, the tiny-model tests and the quantize-at-load tests run under qemu-user.
# Speed on arm64 is not measured here: qemu emulates, it does not time. Needs the rustup
# target (added here), Debian's gcc-aarch64-linux-gnu and qemu-user (installed here when
# running as root, which CI does).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TARGET=aarch64-unknown-linux-gnu
if ! rustup target list --installed | grep -qx "$TARGET"; then
  rustup target add "$TARGET"
fi
if ! command -v aarch64-linux-gnu-gcc > /dev/null || ! command -v qemu-aarch64 > /dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "arm64 tests need gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user:" >&2
    echo "  sudo apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user" >&2
    exit 1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user > /dev/null
fi
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
# The workspace builds for this machine's CPU; arm64 builds for every arm64 CPU.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-cpu=generic"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
cd "$ROOT"
# The arm64 profile (Cargo.toml): Ferrite's crates optimized as in the test profile, their
# dependencies not; the tests exercise Ferrite's kernels and engine, not the dependencies.
CARGO=(cargo test --quiet --profile arm64 --target "$TARGET" --target-dir target/aarch64)
echo "arm64 under qemu-user: the kernels' NEON tier against the portable one and ggml's results, and the tiny models"
"${CARGO[@]}" -p ferrite-kernels
"${CARGO[@]}" -p ferrite-engine --test tiny_models --test quantize_at_load
