# The two commands of the README. Each creates the environment itself when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-flower env lint docs results

# constraints.txt pins the numeric stack (jax, numpy, flax, optax, ...): the committed results reproduce to the digit.
$(BIN)/fedbayes: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	@touch $@

env: $(BIN)/fedbayes

# Main job, ten methods: FedAvg, FedProx, FedDyn, FedPA, FedEP (I), FedSEP (I), FedLap, FedLap-Cov,
# FedLap-Func and a federated variational BNN (conflation) in the setting of Swaroop et al. 2025 (ADMM and Bayes), Table 1 (10% of Fashion-MNIST, 10 clients,
# two-level Dirichlet split, MLP, 50 rounds); prints a table with the paper's numbers beside ours and
# writes runs/demo/compare.png.
# scripts/demo installs the dataset where it can (root + apt), else runs the same comparison on
# scikit-learn's digits (runs/demo_digits/); a repeated `make demo` resumes.
# DEMO_ARGS: more options for the comparison, e.g. make demo DEMO_ARGS="--seeds 3" (every number as mean±std over three seeds).
DEMO_ARGS ?=
demo: env
	BIN=$(BIN) scripts/demo $(DEMO_ARGS)

# The suite on 2 workers. The tests marked `benchmark` (bounds on wall-clock time and resident
# memory) are left out; they run with nothing beside them: pytest -m benchmark --benchmarks
# A test whose worker process dies runs once more in a fresh worker (pytest-rerunfailures' crash
# recovery: --reruns 1); an ordinary failure is never rerun (--only-rerun with a pattern that matches
# no error). The summary counts the reruns ("1 rerun"), and a test that crashes twice fails. Why:
# until 2026-12-01 a worker died in most full runs, in XLA's deserialize_executable under
# tests/sim/test_pipeline.py. The cause: JAX keeps every compiled program, each in memory mappings
# of its own, and a worker passed Linux's cap of 65,530 mappings; the next program's memory could
# not be mapped, and jaxlib crashed instead of raising (docs/results/suite_time.md, "The crash in
# deserialize_executable"). tests/conftest.py now releases the programs past half the cap
# (fedbayes.sim.compiled); the rerun stays as a net for a crash of another cause.
PYTEST_CRASH_RERUN := --reruns 1 --only-rerun '(?!)'
test: env
	$(BIN)/python -m pytest -q -n 2 --durations=30 $(PYTEST_CRASH_RERUN)

# The Flower adapter's tests, real SuperLink/SuperNode processes included, in a venv of their own:
# flwr pins older typer, rich and protobuf than the main environment's (.ci/run runs this too).
# FLWR_VERSIONS: every flwr release the pin allows (pyproject: flwr>=1.41,<1.43), oldest first; the
# venv ends on the last. The last gets all of tests/flower (about 7 min). Each other one gets what
# can differ between releases, in about 2 min: the wall's test (every private flwr name fedbayes
# uses, checked against that release: fedbayes.flower.internals) and the real-process tests that
# run every patch end to end (the loopback SuperNode, the server's object pulls, the warm executor
# and its loader for another app). The rest of tests/flower goes through Flower's public API only,
# which the pin keeps stable. FLWR=1.41.0 (one release): all of tests/flower on it.
FLOWER_VENV ?= .venv-flower
FLWR_VERSIONS ?= $(or $(FLWR),1.41.0 1.42.0)
FLOWER_WALL_TESTS ?= tests/flower/test_internals.py \
	tests/flower/test_warm.py::test_warm_executors_with_their_own_data_equal_the_simulator_and_survive_a_replaced_executor \
	tests/flower/test_warm.py::test_another_apps_tasks_on_a_warm_node_run_through_flowers_loader_and_then_a_fresh_clientapp
$(FLOWER_VENV)/bin/flwr: pyproject.toml
	$(PY) -m venv $(FLOWER_VENV)
	$(FLOWER_VENV)/bin/pip install -q --upgrade pip
	$(FLOWER_VENV)/bin/pip install -q -e ".[test,flower]"
	@touch $@

test-flower: $(FLOWER_VENV)/bin/flwr
	@set -e; for v in $(FLWR_VERSIONS); do \
	  echo "== flwr $$v"; $(FLOWER_VENV)/bin/pip install -q "flwr==$$v"; \
	  if [ "$$v" = "$(lastword $(FLWR_VERSIONS))" ]; then $(FLOWER_VENV)/bin/python -m pytest -q tests/flower; \
	  else $(FLOWER_VENV)/bin/python -m pytest -q $(FLOWER_WALL_TESTS); fi; \
	done

# The main job's committed results regenerated at this commit: docs/results/fmnist_compare.md's table
# and plot, and fmnist_compare_check.md (the short version that tests/runs/test_main_job_table.py reruns).
results: env
	$(BIN)/python scripts/fmnist_results.py

# The documentation site (mkdocs-material + mkdocstrings, the docs extra) into site/, in strict mode:
# a broken link or a missing reference fails. Nothing is fetched while it builds.
$(BIN)/mkdocs: pyproject.toml constraints.txt | $(BIN)/fedbayes
	$(BIN)/pip install -q -c constraints.txt -e ".[test,docs]"
	@touch $@

docs: $(BIN)/mkdocs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# What .ci/run checks besides the tests (ruff settings in pyproject.toml).
lint: env
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/ruff format --check src tests benchmarks docs
