# The commands people type. Every target is idempotent; downloads and tools are cached
# under ${XDG_CACHE_HOME:-~/.cache}/ferrite so fresh clones on the same machine reuse them.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
CARGO ?= cargo
MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf
export FERRITE_TEST_MODEL := $(CURDIR)/$(MODEL)

.PHONY: all model pyenv k8s cluster build run crds dashboards test fmt fmt-check lint bench bench-peer bench-formats bench-quality clean

all: build

## model: fetch the default model (SmolLM2-135M-Instruct Q4_1) into models/
model: $(MODEL)
$(MODEL): scripts/fetch-model.sh
	scripts/fetch-model.sh models

## pyenv: the Python environment the tests use (numpy reference model)
pyenv:
	@scripts/python-env.sh >/dev/null

## k8s: build the test control plane (kube-apiserver, controller-manager, scheduler, etcd,
## kwok, kubectl), LeaderWorkerSet's controller, and Prometheus with promtool from the Go
## module proxy into ~/.cache/ferrite/k8s/, with the Inference Extension's InferencePool CRD
## (once)
k8s:
	@scripts/build-k8s.sh >/dev/null
	@scripts/build-lws.sh >/dev/null
	@scripts/build-prometheus.sh >/dev/null
	@scripts/fetch-gie-crds.sh >/dev/null

## cluster: run that control plane in the foreground with the LLMService CRD installed
cluster: k8s
	FERRITE_K8S_DIR="$$(scripts/build-k8s.sh --print-dir)" FERRITE_LWS_DIR="$$(scripts/build-lws.sh --print-dir)" \
	  $(CARGO) run --quiet -p ferrite-testcluster --bin ferrite-cluster -- crds/llmservice.yaml

build:
	$(CARGO) build --release

## run: serve the default model on localhost:8000 with the OpenAI API (model name smollm2)
run: model build
	./target/release/ferrite-engine serve --model $(MODEL) --served-model-name smollm2 --port 8000

## crds: regenerate crds/llmservice.yaml and the chart's copy from the Rust types (tests fail
## when either drifts)
crds:
	$(CARGO) run --quiet -p ferrite-crds --bin crdgen > crds/llmservice.yaml
	cp crds/llmservice.yaml charts/ferrite/crds/llmservice.yaml

## dashboards: regenerate the chart's Grafana dashboards from scripts/dashboards.py (tests fail
## when the committed JSON drifts)
dashboards:
	python3 scripts/dashboards.py

## test: the whole suite (fetches the model and test tools first). The API tests run the
## binaries `cargo test --workspace` just put in target/debug/: the optimized test-profile
## builds (cargo copies them there on every run, over any plain `cargo build` output).
test: model pyenv k8s
	FERRITE_PYTHON="$$(scripts/python-env.sh)" FERRITE_K8S_DIR="$$(scripts/build-k8s.sh --print-dir)" \
	  FERRITE_LWS_DIR="$$(scripts/build-lws.sh --print-dir)" FERRITE_GIE_DIR="$$(scripts/fetch-gie-crds.sh --print-dir)" \
	  FERRITE_PROMETHEUS_DIR="$$(scripts/build-prometheus.sh --print-dir)" \
	  $(CARGO) test --workspace --all-targets
	$(CARGO) test --workspace --doc
	# llama.cpp parity again on each lower instruction-set tier: every tier computes the same.
	# A tier this CPU lacks (its /proc/cpuinfo flag absent) is skipped, not run again as the one below.
	# --workspace, not -p ferrite-engine: the same features as the build above, so nothing rebuilds.
	for tier in portable avx2 avx-vnni; do \
	  if [ $$tier != portable ] && ! grep -qw "$$(echo $$tier | tr - _)" /proc/cpuinfo; then \
	    echo "llama.cpp parity: no $$tier on this CPU, not run"; continue; \
	  fi; \
	  FERRITE_CPU_TIER=$$tier $(CARGO) test --quiet --workspace --test llamacpp_parity; \
	done
	FERRITE_BIN=$(CURDIR)/target/debug/ferrite-engine FERRITE_PROMETHEUS_DIR="$$(scripts/build-prometheus.sh --print-dir)" \
	  "$$(scripts/python-env.sh)" -m pytest -q tests/api tests/chart
	# The kernels and the tiny-model tests cross-built for arm64 and run under qemu-user.
	FERRITE_PYTHON="$$(scripts/python-env.sh)" scripts/test-arm64.sh

fmt:
	$(CARGO) fmt --all

fmt-check:
	$(CARGO) fmt --all -- --check

## lint: formatting and clippy with warnings as errors
lint: fmt-check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## bench: in-process figures (prompt processing, decode vs the memory-bandwidth bound, batching,
## KV waste), then Ferrite over HTTP with ferrite-bench at concurrency 1/4/16/64, Poisson
## rates, mixed lengths, a JSON schema, --max-num-seqs 1, and through ferrite-router; tables and
## plots in bench/results/
bench: model k8s
	$(CARGO) build --release -p ferrite-engine -p ferrite-bench -p ferrite-router -p ferrite-testcluster
	./target/release/ferrite-engine bench --model $(MODEL)
	scripts/bench.sh

## bench-peer: the same workloads against llama.cpp's llama-server and naive Transformers
## generate (both built or installed once into ~/.cache/ferrite), with Ferrite / peer ratios
bench-peer: model
	$(CARGO) build --release -p ferrite-engine -p ferrite-bench
	scripts/bench-peer.sh
	scripts/bench-formats.sh

## bench-formats: Ferrite beside llama-server on a random ~1B model in Q4_K_M, Q8_0, F16 and BF16
## (short prompts at 1 and 16, ~1000-token prompts at 1), and beside a second llama-server held to
## its one-row (vec_dot) arithmetic at every batch size (VEC_DOT=0 skips it); also run by bench-peer
bench-formats: model
	$(CARGO) build --release -p ferrite-engine -p ferrite-bench
	scripts/bench-formats.sh

## bench-quality: perplexity of the default model decoded to F16 and requantized, by
## --quantization at load and by llama.cpp's quantizer, with llama.cpp's own perplexity beside
bench-quality: model
	$(CARGO) build --release -p ferrite-engine
	scripts/bench-quality.sh

clean:
	$(CARGO) clean
