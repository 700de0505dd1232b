# The two commands of the README: `make run` (dvc repro of the default experiment) and `make test`.
VENV := .venv
BIN := $(VENV)/bin
# pytest-xdist workers of `make test`: the SLURM, Ray and DVC tests wait much of the time, and run beside the
# CPU-bound ones (tests/conftest.py: each worker takes its share of the cores, the tests that share a cluster or
# a module's fixture run in one worker; docs/testing.md: 3 workers on 2 cores were slower). TEST_WORKERS=0: one
# process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS)

.PHONY: setup setup-test run test test-quick lint format bench

setup:
	@bash scripts/setup.sh

setup-test:
	@bash scripts/setup.sh --test

run: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro

test: setup-test
	$(BIN)/ruff check --no-cache .
	$(BIN)/ruff format --no-cache --check .
	$(BIN)/lint-imports
	$(PYTEST)

test-quick: setup-test
	$(PYTEST) -m "not slow and not slurm"

lint:
	$(BIN)/ruff check --no-cache . && $(BIN)/ruff format --no-cache --check . && $(BIN)/lint-imports

format:
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .
