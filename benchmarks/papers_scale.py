"""StackOverflow scale: one round's cost at 342,477 clients against 1,000, for the tag-prediction
table's methods (Guo et al. 2023 (FedEP), Table 3; Al-Shedivat et al. 2021 (FedPA), Table 3c).

Clients of StackOverflow's sizes (log-normal, mean about 400, std about 1,300: Guo et al.'s
Table 1), generated from their ids on demand (:func:`fedbayes.data.synthetic_heavy_tailed_federation`,
never materialised), 10 clients per round as in both papers, logistic regression on 60 features
(the model's size does not change how the cost scales with the clients not sampled). The methods
are built from a config through the registry, as ``fedbayes run`` builds them: FedAvg, FedSEP
(identity; stateless, the paper's choice for 342k clients) and stateful FedEP (identity) with its
sites in the disk client store (``store = "disk"``). Per federation size: ``Simulator.init``
(for FedEP: creating the store of every client's site), then the median of ``--rounds`` steady
rounds (after the first, compiling, round; a round that compiles a new size class is left out) and
the median time per example of the cohort (cohorts differ in size: the number to compare).

    .venv/bin/python benchmarks/papers_scale.py --rounds 20 [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fedbayes.sim import hostdevices  # noqa: E402  (no JAX: sets XLA_FLAGS before JAX starts)

hostdevices.configure()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fedbayes.algorithms import registry  # noqa: E402
from fedbayes.config.schema import validate  # noqa: E402
from fedbayes.data import synthetic_heavy_tailed_federation  # noqa: E402
from fedbayes.runs.build import DataSpec, build_algorithm_and_aggregator, build_model  # noqa: E402
from fedbayes.sim.simulator import Simulator  # noqa: E402

METHODS = {
    "fedavg": {"name": "fedavg"},
    "fedsep_i": {"name": "fedsep", "preset": "paper", "method": "identity"},
    "fedep_i_disk": {"name": "fedep", "preset": "paper", "method": "identity"},
}


def measure(method: str, num_clients: int, rounds: int, folder: Path) -> dict:
    fed = synthetic_heavy_tailed_federation(num_clients, 0)
    store = "disk" if method.endswith("_disk") else "memory"
    cfg = validate(
        {
            "name": method,
            "data": {"dataset": "synthetic_leaf", "num_clients": num_clients, "partition": "natural"},
            "model": {"name": "logreg"},
            "client": {"epochs": 2, "batch_size": 32, "lr": 0.01},
            "server": {"clients_per_round": 10},
            "algorithm": METHODS[method],
        }
    )
    spec = DataSpec(10, (60,), np.float32, "classification")
    model = build_model(cfg, spec)
    algorithm, _ = build_algorithm_and_aggregator(cfg, registry.FederationInfo.from_sizes(fed.sizes), spec, model)
    t0 = time.perf_counter()
    sim = Simulator(algorithm, fed, clients_per_round=10, seed=0, store=store, store_dir=str(folder / f"{method}_{num_clients}") if store == "disk" else None)
    state = sim.init(model.params)
    init_s = time.perf_counter() - t0
    times, per_example, compiles = [], [], 0
    for _ in range(rounds + 1):
        cached = sim.num_compiled_rounds()
        t1 = time.perf_counter()
        state, info = sim.run_round(state, donate=True)
        jax.block_until_ready(sim.server_params(state))
        if sim.num_compiled_rounds() > cached:
            compiles += 1
            continue
        times.append(time.perf_counter() - t1)
        per_example.append(times[-1] / int(fed.sizes[info.cohort].sum()) * 1e6)
    disk = sum(p.stat().st_blocks * 512 for p in (folder / f"{method}_{num_clients}").rglob("*") if p.is_file()) if store == "disk" else 0
    return {
        "method": method,
        "num_clients": num_clients,
        "init_s": init_s,
        "round_s": statistics.median(times),
        "round_s_min": min(times),
        "round_s_max": max(times),
        "us_per_example": statistics.median(per_example),
        "steady_rounds": len(times),
        "disk_mb": disk / 2**20,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--clients", type=int, nargs="*", default=[1000, 342_477])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            for k in args.clients:  # the sizes interleaved per method: the same machine state for both
                res = measure(method, k, args.rounds, Path(tmp))
                out.append(res)
                print(_line(res), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(out, indent=2))


def _line(res: dict) -> str:
    return (
        f"{res['method']:>13} K={res['num_clients']:>7}  init {res['init_s']:6.2f} s  round {1e3 * res['round_s']:7.1f} ms "
        f"({1e3 * res['round_s_min']:.1f}-{1e3 * res['round_s_max']:.1f}, {res['steady_rounds']} rounds)  {res['us_per_example']:.1f} us/example  store on disk {res['disk_mb']:,.0f} MB"
    )


if __name__ == "__main__":
    main()
