"""The posterior benchmark's default rows on problems it was not tuned on: every Bayesian method
with only its name set, against NUTS and its family's central optimum, 300 rounds at most
(docs/results/posterior_unseen.md).

    PYTHONPATH=src python benchmarks/posterior_unseen.py --out runs/posterior_unseen

With ``--method fedep_laplace_full`` (and the other ``*_full`` methods of ``FULL_METHODS``) the dense-covariance
rows run instead (docs/results/posterior_full.md); with ``--method fedlap_cov_kron`` or
``fedlap_cov_low_rank`` (``STRUCTURED_METHODS``, with FedEP's ``fedep_laplace_kron`` and ``fedep_laplace_low_rank``), the network structures
(docs/results/kron.md).

Problems (none of them is in ``fedbayes.bench.posterior.PROBLEMS``, where the defaults were
measured):

* ``wine_0v1``: scikit-learn's wine, cultivars 0 and 1 (13 standardised features, 104 training
  examples), 5 Dirichlet(0.5) clients;
* ``correlated_20``: a synthetic logistic regression, 20 features with correlation 0.8 between
  neighbours (an AR(1) design), 1,200 training examples, 20 Dirichlet(0.5) clients.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from fedbayes.bench.posterior import FULL, Problem, run_posterior_bench, write_leaf

METHODS = ("fedep_laplace", "fedep_ngvi", "fedsep_laplace", "fedsep_ngvi", "pvi", "fedlap_cov", "vbnn")
# the dense-covariance rows (algorithm.covariance = "full"), run when named with --method
FULL_METHODS = ("fedep_laplace_full", "fedep_ngvi_full", "fedsep_ngvi_full", "fedlap_cov_full", "pvi_full")
# FedLap-Cov's Kronecker and low-rank structures, run when named with --method
STRUCTURED_METHODS = ("fedlap_cov_kron", "fedlap_cov_low_rank", "fedep_laplace_kron", "fedep_laplace_low_rank")


def _write_wine(folder: Path) -> None:
    from sklearn.datasets import load_wine

    x, y = load_wine(return_X_y=True)
    pick = y < 2
    x, y = x[pick], y[pick]
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    x, y = x[order], y[order]
    n_train = int(0.8 * len(y))
    mean, std = x[:n_train].mean(axis=0), x[:n_train].std(axis=0)
    x = (x - mean) / std
    write_leaf(folder / "data", x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def _write_correlated(folder: Path) -> None:
    rng = np.random.default_rng(1)
    n, d, rho = 1500, 20, 0.8
    z = rng.normal(size=(n, d))
    x = np.empty_like(z)
    x[:, 0] = z[:, 0]
    for j in range(1, d):
        x[:, j] = rho * x[:, j - 1] + np.sqrt(1 - rho**2) * z[:, j]
    w = rng.normal(size=d) * 0.5
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-(x @ w - 0.5)))).astype(int)
    write_leaf(folder / "data", x[:1200], y[:1200], x[1200:], y[1200:])


def _leaf(folder: Path) -> dict:
    return {"dataset": "leaf", "data_dir": str(folder / "data"), "num_classes": 2}


PROBLEMS = {
    "wine_0v1": Problem("wine_0v1", _leaf, split={"num_clients": 5, "partition": "dirichlet", "alpha": 0.5}, write=_write_wine),
    "correlated_20": Problem("correlated_20", _leaf, split={"num_clients": 20, "partition": "dirichlet", "alpha": 0.5}, write=_write_correlated),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/posterior_unseen")
    ap.add_argument("--problem", action="append", default=None, choices=list(PROBLEMS))
    ap.add_argument("--method", action="append", default=None, choices=list(METHODS + FULL_METHODS + STRUCTURED_METHODS))
    ap.add_argument("--max-rounds", type=int, default=300)
    ap.add_argument("--keep-going", action="store_true", help="run every method to the last round, recording where it met the bar")
    ap.add_argument("--client", default="{}", help="[client] settings for every method as JSON (default: the methods' defaults)")
    args = ap.parse_args()
    settings = dataclasses.replace(FULL, max_rounds=args.max_rounds, client=json.loads(args.client), stop_at_bar=not args.keep_going)
    run_posterior_bench(args.out, settings, args.problem or list(PROBLEMS), args.method or list(METHODS), extra_problems=PROBLEMS, log=print)


if __name__ == "__main__":
    main()
