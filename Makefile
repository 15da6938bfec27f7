# `make serve` and `make test` work on a fresh machine with only Python 3.11+:
# both create .venv and install the project first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_STAMP := $(VENV)/.installed-torch
# The CPU build of torch that lies on this machine's disk; an unpinned torch
# can pull a multi-GB CUDA build. The tests run every engine, so they need it;
# `make serve` does not install it (with torch present, --engine auto uses it).
TORCH_PIN ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test lint typecheck pytest bench clean

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "sluiceway needs Python 3.11 or newer")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

$(TORCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check '$(TORCH_PIN)'
	touch $(TORCH_STAMP)

serve: $(STAMP)
	$(BIN)/sluiceway serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check sluiceway tests bench
	$(BIN)/ruff format --check sluiceway tests bench

# With torch installed, so that mypy sees the same types everywhere.
typecheck: $(TORCH_STAMP)
	$(BIN)/mypy

pytest: $(TORCH_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# pytest's exit code 5 (nothing collected) fails this target like any other.
test: lint typecheck pytest

# The serving benchmark (bench/serve.py); see README for the others.
bench: $(TORCH_STAMP)
	$(BIN)/python bench/serve.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
