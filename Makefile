# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STATE  ?= ./var
# Compile llama.cpp with both cores; pip caches the built wheel afterwards.
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: run test check unit bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.run-deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[default-model]'
	touch $@

$(VENV)/.test-deps: pyproject.toml $(VENV)/.run-deps
	$(BIN)/pip install --quiet -e '.[default-model,gemma,test]'
	touch $@

run: $(VENV)/.run-deps
	$(BIN)/edge-agent serve --state-dir $(STATE)

check: $(VENV)/.test-deps
	$(BIN)/ruff check edge_agent tests
	$(BIN)/mypy edge_agent
	$(BIN)/lint-imports

test: check
	$(BIN)/pytest

unit: $(VENV)/.test-deps
	$(BIN)/pytest -m "not integration"

$(VENV)/.bench-deps: pyproject.toml $(VENV)/.run-deps
	$(BIN)/pip install --quiet -e '.[default-model,bench]'
	touch $@

bench: $(VENV)/.bench-deps
	$(BIN)/edge-agent bench --state-dir $(STATE)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
