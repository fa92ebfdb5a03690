"""Distance per round of a method's server posterior to the central references (docs/results/posterior_defaults.md).

The study's setting: breast cancer, ``logreg``, Dirichlet(0.5) over 10 clients, seed 0, prior N(0, 1)
(every method's default). The references are :func:`fedbayes.evaluation.reference.references`:
the diagonal Laplace at the MAP (``lap``; FedEP/FedSEP with laplace or ngvi clients, FedLap-Cov)
and the exact mean-field VI optimum (``vi``; PVI). Each printed line: round, then per reference the
mean's relative L2 distance ``d`` and the variance ratio's median ``v`` [min, max].

    PYTHONPATH=src .venv/bin/python scripts/posterior_trajectory.py NAME ROUNDS EVERY ALGORITHM_JSON [CLIENT_JSON] [CLIENTS_PER_ROUND]

e.g. ``scripts/posterior_trajectory.py fedep_l 200 20 '{"name": "fedep"}' '{"epochs": 3, "batch_size": 8, "momentum": 0.5}'``.
It goes through the public API (``build_experiment`` from a config dict, then the simulator round
by round) and writes ``NAME.json`` (the trajectory) in the working directory.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from jax.flatten_util import ravel_pytree

from fedbayes.config.schema import validate
from fedbayes.evaluation.reference import references
from fedbayes.runs.build import build_experiment


def main(argv: list[str]) -> None:
    name, rounds, every = argv[0], int(argv[1]), int(argv[2])
    algorithm = json.loads(argv[3])
    client = json.loads(argv[4]) if len(argv) > 4 else {}
    cohort = int(argv[5]) if len(argv) > 5 else 10
    raw = {
        "name": name, "seed": 0, "rounds": rounds, "model": {"name": "logreg"}, "client": client, "server": {"clients_per_round": cohort},
        "data": {"dataset": "breast_cancer", "num_clients": 10, "partition": "dirichlet", "alpha": 0.5}, "algorithm": algorithm,
    }  # fmt: skip
    exp = build_experiment(validate(raw))
    order = np.concatenate(exp.federation.client_indices)
    x, y = np.asarray(exp.federation.x)[order], np.asarray(exp.federation.y)[order]
    refs = references(lambda p, xx: exp.model.apply({"params": p}, xx), exp.params, x, y, 1.0)

    def flat(tree):
        return np.asarray(ravel_pytree(tree)[0], np.float64)

    targets = {"lap": tuple(map(flat, refs.diag_laplace)), "vi": tuple(map(flat, refs.mfvi))}
    sim = exp.simulator
    state = sim.init(exp.params)
    trajectory = []
    for r in range(1, rounds + 1):
        state, _ = sim.run_round(state)
        if r % every and r != rounds:
            continue
        mean, var = (flat(t) for t in exp.algorithm.server_posterior(state.server_state))
        row: dict = {"round": r}
        for key, (m_ref, v_ref) in targets.items():
            ratio = var / v_ref
            row[key] = [float(np.linalg.norm(mean - m_ref) / np.linalg.norm(m_ref)), float(np.median(ratio)), float(ratio.min()), float(ratio.max())]
        trajectory.append(row)
        print(name, r, " ".join(f"{k}: d={row[k][0]:.4f} v={row[k][1]:.3f} [{row[k][2]:.2f},{row[k][3]:.2f}]" for k in targets), flush=True)
    with open(f"{name}.json", "w") as f:
        json.dump({"name": name, "algorithm": algorithm, "client": client, "clients_per_round": cohort, "trajectory": trajectory}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
