# Everything the project needs is installed here, into .venv, from PyPI.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)            ## the main job: a burst through the publisher, with stats
	$(BIN)/coalesce demo

test: $(STAMP)            ## the test suite (real ZeroMQ sockets, hypothesis)
	$(BIN)/python -m pytest -q

lint: $(STAMP)            ## ruff + mypy --strict
	$(BIN)/ruff check coalesce tests benchmarks
	$(BIN)/mypy

bench: $(STAMP)           ## benchmarks (not tests); numbers go in docs/benchmarks.md
	$(BIN)/python benchmarks/bench_publish.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
