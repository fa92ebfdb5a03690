"""FedEP's Laplace and NGVI clients through the paper's ResNet-18 (GroupNorm), end to end.

    PYTHONPATH=src .venv/bin/python benchmarks/resnet_fedep.py [--variant fedep_l] [--width 64] [--rounds 3] [--json]

Runs ``examples/papers/fedep_cifar100.toml``'s variant (Guo et al. 2023 (FedEP), Table 2: ResNet-18
with GroupNorm, 11.2M parameters at width 64, the paper preset, Laplace epochs 10 or NGVI's 5 x 5
samples) on small synthetic files in TFF's CIFAR-100 layout (8 training clients of 4 images, 2 test
clients; :func:`fedbayes.data.writers.write_fed_cifar100`), 2 clients per round, 2 local epochs,
burn-in cut to one round, client states in device memory. Round 1 is the burn-in's FedAvg round;
from round 2 the EP rounds run the variant's client method. Each round's wall time is printed,
compilation included (XLA's persistent cache is off for this process: ``FEDBAYES_CACHE=off`` is
the caller's to set). This is the check that the methods run through the network at its real size,
and what they cost to compile and run on this machine; it is no accuracy measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="fedep_l", help="a variant of examples/papers/fedep_cifar100.toml (fedep_l, fedep_v, ...)")
    parser.add_argument("--width", type=int, default=64, help="the ResNet's first-stage channels (64: the paper's 11.2M parameters)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds to run (the first is the burn-in's FedAvg round)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    import jax
    import numpy as np

    from fedbayes.config.schema import deep_merge, read_toml, validate
    from fedbayes.data import writers
    from fedbayes.runs.build import build_experiment

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        writers.write_fed_cifar100(folder, np.random.default_rng(0), train_clients=8, test_clients=2, per_client=4)
        raw = read_toml(ROOT / "examples" / "papers" / "fedep_cifar100.toml")
        merged = deep_merge(raw["base"], raw["variants"][args.variant])
        over = {
            "rounds": args.rounds,
            "checkpoint_every": 0,
            "store": "device",
            "data": {"data_dir": str(folder), "num_clients": 8},
            "server": {"clients_per_round": 2},
            "client": {"epochs": 2},
            "model": {"width": args.width},
        }
        if "burn_in_rounds" in merged.get("algorithm", {}):
            over["algorithm"] = {"burn_in_rounds": 1}
        cfg = validate({**deep_merge(merged, over), "name": args.variant})
        start = time.perf_counter()
        exp = build_experiment(cfg, store_dir=folder)
        sim = exp.simulator
        state = sim.init(exp.params)
        row = {
            "variant": args.variant,
            "width": args.width,
            "params": int(sum(np.prod(p.shape) for p in jax.tree.leaves(exp.params))),
            "build_s": round(time.perf_counter() - start, 1),
            "rounds_s": [],
            "rejected": 0,
        }
        print(f"{args.variant}: {row['params']:,} parameters, built in {row['build_s']} s", file=sys.stderr, flush=True)
        for r in range(args.rounds):
            start = time.perf_counter()
            state, info = sim.run_round(state)
            jax.block_until_ready(sim.server_params(state))
            row["rounds_s"].append(round(time.perf_counter() - start, 1))
            row["rejected"] += len(info.rejected)
            print(f"  round {r + 1}: {row['rounds_s'][-1]} s, {len(info.rejected)} rejected", file=sys.stderr, flush=True)
        finite = all(bool(np.all(np.isfinite(np.asarray(leaf)))) for leaf in jax.tree.leaves(sim.server_params(state)))
        row["finite"] = finite
    print(json.dumps(row) if args.json else f"{row['variant']} width {row['width']}: rounds {row['rounds_s']} s, finite {finite}")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
