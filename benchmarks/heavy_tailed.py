"""Heavy-tailed federations: round time against the number of clients.

LEAF Synthetic(1, 1) clients with log-normal sizes (mean about 400, std about 1,300: Guo et al. 2023 (FedEP)
Table 1's StackOverflow statistics), generated from their ids on demand, never materialised.
For federations of 1,000 and 342,477 clients and cohorts of 10, 100 and 1,000 clients per round,
FedAvg with logistic regression (1 local epoch, batch 32, client SGD) runs a first (compile)
round and then ``--rounds`` steady rounds. Reported per setting: the median steady round time,
the median time per client example (cohorts differ in size from round to round, so this is the
number to compare across federations), the host share of a round (cohort sampling, data
generation, order buffer), and the cohort's padding waste. Rounds whose cohort needed a new
buffer size class compile once (then the class is cached); they are counted apart and left out
of the steady-state medians. ``round_s`` is the whole ``run_round`` call, host work included.

    .venv/bin/python benchmarks/heavy_tailed.py --rounds 60 [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from fedbayes.sim import hostdevices  # noqa: E402  (no JAX: sets XLA_FLAGS before JAX starts)

hostdevices.configure()  # laid out as the CLI lays itself out

import jax  # noqa: E402
import optax  # noqa: E402

from fedbayes.algorithms.fedavg import fedavg  # noqa: E402
from fedbayes.data import synthetic_heavy_tailed_federation  # noqa: E402
from fedbayes.inference import LocalTrainer  # noqa: E402
from fedbayes.models import init_params, loss_fn, make_model  # noqa: E402
from fedbayes.sim.simulator import Simulator  # noqa: E402


def measure(num_clients: int, per_round: int, rounds: int, seed: int = 0) -> dict:
    fed = synthetic_heavy_tailed_federation(num_clients, seed)
    model = make_model("logreg", 10)
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(0.01), 1, 32)
    sim = Simulator(fedavg(trainer, optax.sgd(1.0)), fed, clients_per_round=per_round, seed=seed)
    state = sim.init(init_params(model, jax.random.key(0), (60,)))
    times, per_example, host, waste, examples = [], [], [], [], []
    compiles = 0
    for r in range(rounds + 1):
        cached = sim.num_compiled_rounds()
        t0 = time.perf_counter()
        cohort = sim.sample_cohort(state.round)
        sim.gather(state.round, sim.layout_cohort(cohort))  # host work alone, timed apart
        t1 = time.perf_counter()
        state, info = sim.run_round(state)
        jax.block_until_ready(state.server_state)
        t2 = time.perf_counter()
        if sim.num_compiled_rounds() > cached:
            compiles += 1  # a new size class of the cohort's buffers: compiled once, then cached
            continue
        n = int(fed.sizes[info.cohort].sum())
        round_s = t2 - t1
        times.append(round_s)
        per_example.append(round_s / n * 1e6)
        host.append((t1 - t0) / round_s)
        waste.append(info.padding_waste)
        examples.append(n)
    return {
        "num_clients": num_clients,
        "clients_per_round": per_round,
        "round_s": statistics.median(times),
        "us_per_example": statistics.median(per_example),
        "host_share": statistics.median(host),
        "padding_waste": statistics.median(waste),
        "padding_waste_max": max(waste),
        "examples_per_round": statistics.median(examples),
        "steady_rounds": len(times),
        "compile_rounds": compiles,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--per-round", type=int, nargs="*", default=[10, 100, 1000])
    p.add_argument("--clients", type=int, nargs="*", default=[1000, 342_477])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = {}
    for m in args.per_round:
        for k in args.clients:
            res = measure(k, m, args.rounds if m < 1000 else max(8, args.rounds // 6))
            out[f"K{k}_M{m}"] = res
            if not args.json:
                print(
                    f"K={k:>7} M={m:>5}  round {res['round_s'] * 1e3:8.1f} ms  {res['us_per_example']:6.2f} us/example  "
                    f"host {100 * res['host_share']:5.1f}%  padding {100 * res['padding_waste']:5.1f}% (max {100 * res['padding_waste_max']:5.1f}%)  "
                    f"examples/round {res['examples_per_round']:,.0f}  steady/compile rounds {res['steady_rounds']}/{res['compile_rounds']}",
                    flush=True,
                )
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()


if __name__ == "__main__":
    main()
