#!/usr/bin/env bash
# Every run behind docs/results/fedlap_table1.md, in the order they were run, then the table.
#   scripts/fedlap_table1.sh [--with-100] [--with-lr1e-4]   # from the repository root; 2-3 hours on 2 shared cores
# Resumable: rerun it after an interruption and finished runs are skipped (sweeps and comparisons
# get --resume when their folder exists). The run folders go to runs/t1/ (ignored by git).
set -euo pipefail
FB=${FB:-.venv/bin/fedbayes}
PY=${PY:-.venv/bin/python}
OUT=runs/t1
CFG=examples/fedlap_table1
mkdir -p "$OUT"

resume() { [ -e "$1" ] && echo --resume || true; }

# One seed (0), every cell of the grid, selection on a validation split (10% of each client's data).
sweep_bc() {
  $FB sweep $CFG/breast_cancer_het.toml \
    --grid client.epochs=1,2,5 \
    --grid fedprox.algorithm.mu=0.001,0.01,0.1 \
    --grid feddyn.algorithm.alpha=0.001,0.01,0.1 --grid feddyn.algorithm.weight_decay=0,1e-4 \
    --grid fedlap.algorithm.delta=0.1,1,10 \
    --grid fedlap_cov.algorithm.delta=0.1,1,10 \
    --grid fedlap_func.algorithm.tau=0.001,0.01,0.1 \
    --select-on validation --out $OUT/bc_sweep $(resume $OUT/bc_sweep)
}

# FedLap-Func: delta only, at FedLap's selected value (1; see the results file), tau = 1e-3 fixed.
sweep_fmnist() {  # $1: het (the homogeneous split reuses its selection)
  $FB sweep $CFG/fmnist_$1.toml \
    --grid fedavg.client.epochs=1,2,5 \
    --grid fedprox.algorithm.mu=0.001,0.01,0.1 \
    --grid feddyn.algorithm.alpha=0.001,0.01,0.1 \
    --grid fedlap.algorithm.delta=1,10,100 \
    --grid fedlap_cov.algorithm.delta=0.01,1,100 \
    --grid fedlap_func.algorithm.delta=1 \
    --select-on validation --out $OUT/fmnist_$1_sweep $(resume $OUT/fmnist_$1_sweep)
}

# The selected cells, three seeds (0, 1, 2), on the full training data (no validation split); seed
# by seed, so that an interrupted comparison has every method on the seeds it finished. FedLap-Cov's
# marginalised prediction (not in the table) on FMNIST with 1 sample instead of 10 ($M): it is
# evaluation only, and on this machine half of FedLap-Cov's time.
M="--set fedlap_cov.evaluation.marginal_samples=1"
final() {  # $1: sweep folder, $2: base config, $3: selected config to write, $4: output folder, then compare options
  $PY scripts/fedlap_table1.py winners "$1" "$2" "$3"
  for n in 1 2 3; do $FB compare "$3" "${@:5}" --seeds $n --out "$4" --resume; done
}

sweep_bc
final $OUT/bc_sweep $CFG/breast_cancer_het.toml $CFG/breast_cancer_het_selected.toml $OUT/bc_final
sweep_fmnist het
final $OUT/fmnist_het_sweep $CFG/fmnist_het.toml $CFG/fmnist_het_selected.toml $OUT/fmnist_het_final $M
final $OUT/fmnist_het_sweep $CFG/fmnist_homog.toml $CFG/fmnist_homog_selected.toml $OUT/fmnist_homog_final $M
ROWS="fmnist_het=$OUT/fmnist_het_final:$OUT/fmnist_het_sweep fmnist_homog=$OUT/fmnist_homog_final:$OUT/fmnist_het_sweep"
# 100 clients, full data, the heterogeneous 10% selection, seed by seed as above (about an hour per
# seed on 2 cores): pass --with-100 to run it and add its row.
case " $* " in *" --with-100 "*) WITH_100=1 ;; *) WITH_100=0 ;; esac
if [ "$WITH_100" = 1 ]; then
  final $OUT/fmnist_het_sweep $CFG/fmnist100_het.toml $CFG/fmnist100_het_selected.toml $OUT/fmnist100_het_final $M
  ROWS="$ROWS fmnist100_het=$OUT/fmnist100_het_final:$OUT/fmnist_het_sweep"
fi

# The heterogeneous 10% row's selected cells at Adam 1e-4 (seed 0; the results file's learning-rate
# section): pass --with-lr1e-4. Its table is runs/t1/fmnist_het_lr1e-4/compare.md.
case " $* " in *" --with-lr1e-4 "*)
  $FB compare $CFG/fmnist_het_selected.toml --set client.lr=0.0001 $M --seeds 1 --out $OUT/fmnist_het_lr1e-4 --resume ;;
esac

$PY scripts/fedlap_table1.py table $ROWS breast_cancer_het=$OUT/bc_final:$OUT/bc_sweep \
  --md docs/results/fedlap_table1_tables.md --json docs/results/fedlap_table1.json
