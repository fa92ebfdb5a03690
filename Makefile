# The two commands of the README. Each creates the environment itself when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test env

$(BIN)/fedbayes: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	@touch $@

env: $(BIN)/fedbayes

# Main job: FedAvg, FedAvgM, FedProx, FedDyn, FedPA, FedEP (I) and FedSEP (I) on Fashion-MNIST
# (10 clients, two-level Dirichlet split, MLP); prints a table and writes runs/demo/compare.png.
demo: env
	$(BIN)/fedbayes compare examples/fmnist_compare.toml --out runs/demo

test: env
	$(BIN)/python -m pytest -q -n 2
