#!/usr/bin/env bash
# Runs the reference experiments of a refactoring check with the fedbayes source under SRC_ROOT/src
# (a checkout or `git worktree` of any commit), writing run folders under OUT; compare two such
# trees with scripts/compare_runs.py. From the repository root, with the environment installed:
#   git worktree add /tmp/before <commit>
#   scripts/reference_runs.sh /tmp/before /tmp/runs_before
#   scripts/reference_runs.sh . /tmp/runs_after
#   .venv/bin/python scripts/compare_runs.py /tmp/runs_before /tmp/runs_after
# The main job's ten methods (8 rounds), FedEP with the disk client store, a sweep with two seeds,
# PVI, the variational networks' rules, FedPA and ADMM; needs Fashion-MNIST for the first and the
# VBNN runs (scikit-learn's bundled data for the rest). About 25 minutes on 2 cores.
set -u
SRC=$(cd "$1" && pwd); OUT=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FB="$ROOT/.venv/bin/python -m fedbayes.cli"
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$SRC" || exit 1
export PYTHONPATH="$SRC/src"
run() { local name=$1; shift; $FB "$@" > "$OUT/$name.log" 2>&1; echo "$name: exit $?"; }
run demo8 compare examples/fmnist_compare.toml --set rounds=8 --out "$OUT/demo8"
run fedep_disk compare examples/digits_fedep_scale.toml --set rounds=8 --set store=disk --out "$OUT/fedep_disk"
run sweep sweep examples/digits_sweep.toml --grid client.lr=0.02,0.1 --grid fedprox.algorithm.mu=0.01,0.1 --seeds 2 --out "$OUT/sweep"
run pvi compare examples/digits_pvi.toml --set rounds=4 --out "$OUT/pvi"
run vbnn compare examples/fmnist_compare_vbnn_rules.toml --set rounds=3 --out "$OUT/vbnn"
run fedpa compare examples/digits_fedpa_compare.toml --set rounds=4 --out "$OUT/fedpa"
run admm run examples/breast_cancer_admm.toml --out "$OUT/admm"
