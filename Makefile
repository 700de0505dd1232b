# The two commands of the README: `make run` (dvc repro of the default experiment) and `make test`.
VENV := .venv
BIN := $(VENV)/bin

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
	$(BIN)/python -m pytest

test-quick: setup-test
	$(BIN)/python -m pytest -m "not slow and not slurm"

lint:
	$(BIN)/ruff check --no-cache . && $(BIN)/ruff format --no-cache --check . && $(BIN)/lint-imports

format:
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .
