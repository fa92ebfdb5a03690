"""Each Bayesian method with ONLY ITS NAME SET trains a small network as well as FedAvg does, and
ends near its own best round (a default is a promise on a network too, not only on the logistic
regressions of test_posterior_defaults.py).

The problem: scikit-learn's digits (bundled with it, no download), 5 clients of a Dirichlet(0.5)
label split, all of them every round, an MLP with one hidden layer of 32 units, 10 rounds. Only the
data, the model, the rounds and the method's name are set. The bars are the ones the methods'
network checks use (docs/results/posterior_defaults.md, "A network, only the method's name set"):
the final test accuracy at most 0.02 below FedAvg's at its defaults, and at most 0.03 below the
method's own best round. The full-size checks (Fashion-MNIST, two federations, three seeds) are in
that file.
"""

from __future__ import annotations

import json
import math

import pytest

from fedbayes.config.schema import validate
from fedbayes.runs.loggers import PlainReporter
from fedbayes.runs.loop import run_experiment

ROUNDS = 10
BELOW_FEDAVG, BELOW_BEST = 0.02, 0.03
METHODS = {
    "fedep": {"name": "fedep"},
    "fedep-ngvi": {"name": "fedep", "method": "ngvi"},
    "fedsep": {"name": "fedsep"},
    "fedsep-ngvi": {"name": "fedsep", "method": "ngvi"},
    "pvi": {"name": "pvi"},
    "fedlap_cov": {"name": "fedlap_cov"},
    "vbnn": {"name": "vbnn"},
}


def _accuracies(tmp_path, name: str, algorithm: dict) -> list[float]:
    """Test accuracy after each round of the method with only its name set."""
    raw = {
        "name": name,
        "rounds": ROUNDS,
        "checkpoint_every": 0,
        "data": {"dataset": "digits", "num_clients": 5, "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "mlp", "hidden": [32], **({"variational": True} if algorithm["name"] == "vbnn" else {})},
        "server": {"clients_per_round": 5},
        "algorithm": algorithm,
    }
    summary = run_experiment(validate(raw), tmp_path / name, reporter=PlainReporter(lambda line: None))
    assert summary["rounds"] == ROUNDS
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["nll"]) for r in rows)
    return [r["accuracy"] for r in rows[1:]]


@pytest.fixture(scope="module")
def fedavg_final(tmp_path_factory) -> float:
    return _accuracies(tmp_path_factory.mktemp("fedavg"), "fedavg", {"name": "fedavg"})[-1]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(METHODS))
def test_only_the_name_set_trains_a_network_as_well_as_fedavg(tmp_path, fedavg_final, case):
    accuracy = _accuracies(tmp_path, case, METHODS[case])
    assert accuracy[-1] >= fedavg_final - BELOW_FEDAVG, (case, accuracy, fedavg_final)
    assert accuracy[-1] >= max(accuracy) - BELOW_BEST, (case, accuracy)
