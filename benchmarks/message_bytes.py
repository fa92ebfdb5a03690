"""Bytes per message per structure: one client's message in round 0 of each site method, with
``algorithm.covariance = "diagonal"`` and ``"full"``, on the posterior benchmark's problems
(docs/results/posterior_full.md) and the conformance suite's digits logistic regression.

Each message is one the simulator's client phase computes on the client's data
(:meth:`fedbayes.sim.simulator.Simulator.client_phase`), measured by
:func:`fedbayes.tree.tree_bytes`; the script checks that its natural-parameter difference is
:func:`fedbayes.algorithms.sites.natural_bytes` and that the whole message is what a run counts
(``Simulator.message_bytes``, ``summary.json``'s ``message_bytes.up``).

    PYTHONPATH=src python benchmarks/message_bytes.py --out runs/message_bytes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import posterior_unseen  # noqa: E402

from fedbayes import tree  # noqa: E402
from fedbayes.algorithms import sites  # noqa: E402
from fedbayes.bench.posterior import PROBLEMS, Problem  # noqa: E402
from fedbayes.config.schema import validate  # noqa: E402
from fedbayes.runs.build import build_experiment  # noqa: E402
from fedbayes.runs.report import bytes_text  # noqa: E402

# the conformance suite's problem: digits, 10 classes, 650 parameters
DIGITS = Problem("digits", lambda folder: {"dataset": "digits"}, split={"num_clients": 5, "partition": "dirichlet", "alpha": 0.5})
# the nuts method's message is FedEP-full's; the sampler at its smallest, since only the shape counts here
SMALL_NUTS = {"method": "nuts", "nuts_warmup": 10, "nuts_draws": 4, "nuts_curvature_draws": 2, "nuts_max_doublings": 3}
METHODS = (
    ("fedep", "diagonal", {}),
    ("fedep", "full", {}),
    ("fedep nuts", "full", SMALL_NUTS),
    ("pvi", "diagonal", {}),
    ("pvi", "full", {}),
    ("fedlap_cov", "diagonal", {}),
    ("fedlap_cov", "full", {}),
)


def measure(problem: Problem, folder: Path, method: str, covariance: str, settings: dict) -> dict:
    """One client's round-0 message of ``method`` on ``problem``: its bytes, its natural parameters' and the broadcast's."""
    raw = {
        "name": f"{method}_{covariance}",
        "rounds": 1,
        "checkpoint_every": 0,
        "data": {**problem.data(folder), **problem.split},
        "model": {"name": "logreg"},
        "algorithm": {"name": method.split()[0], "covariance": covariance, **settings},
        "server": {"clients_per_round": problem.split["num_clients"]},
    }
    exp = build_experiment(validate(raw))
    sim, alg = exp.simulator, exp.simulator.algorithm
    state = sim.init(exp.params)
    prepared = sim.prepare_round(0)
    a = prepared.args
    messages, _, _ = jax.jit(sim.client_phase)(
        alg.broadcast(state.server_state), sim.cohort_states(state, prepared), a.client_ids, a.offsets, a.num_examples, a.round_idx, a.x, a.y, a.order
    )
    slot = int(np.argmax(prepared.slots >= 0))  # a real client's slot (not padding)
    message = jax.tree.map(lambda m: m[slot], messages)
    d = sum(np.size(p) for p in jax.tree.leaves(exp.params))
    up, natural = tree.tree_bytes(message), tree.tree_bytes(message.difference)
    down_counted, up_counted = sim.message_bytes(state)
    assert natural == sites.natural_bytes(d, covariance), (natural, d, covariance)
    assert up == up_counted, (up, up_counted)  # what a run's bytes_up and summary.json count
    assert bool(message.ok), f"{method} {covariance}: the measured message was rejected by its own client"
    return {"D": d, "up": up, "natural": natural, "down": down_counted, "dtype": str(jax.tree.leaves(message.difference)[0].dtype)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/message_bytes", help="where the generated problems' data are written")
    args = ap.parse_args(argv)
    out = Path(args.out)
    problems = {**PROBLEMS, **posterior_unseen.PROBLEMS, "digits": DIGITS}
    print("| problem | D | method | covariance | message (bytes) | of which natural parameters | broadcast (bytes) | up per message |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, problem in problems.items():
        folder = out / name
        if problem.write is not None and not (folder / "data").exists():
            problem.write(folder)
        for method, covariance, settings in METHODS:
            m = measure(problem, folder, method, covariance, settings)
            print(
                f"| {name} | {m['D']} | {method} | {covariance} | {m['up']:,} | {m['natural']:,} ({m['dtype']}) | {m['down']:,} | {bytes_text(m['up'])} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
