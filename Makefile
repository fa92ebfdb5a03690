# The two commands of the README. Each creates the environment itself when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test env lint

$(BIN)/fedbayes: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	@touch $@

env: $(BIN)/fedbayes

# Main job: FedAvg, FedAvgM, FedProx, FedDyn, FedPA, FedEP (I) and FedSEP (I) on Fashion-MNIST
# (10 clients, two-level Dirichlet split, MLP); prints a table and writes runs/demo/compare.png.
# scripts/demo installs the dataset where it can (root + apt), else runs the same comparison on
# scikit-learn's digits (runs/demo_digits/); a repeated `make demo` resumes.
demo: env
	BIN=$(BIN) scripts/demo

test: env
	$(BIN)/python -m pytest -q -n 2

# What .ci/run checks besides the tests (ruff settings in pyproject.toml).
lint: env
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/ruff format --check src tests benchmarks docs
