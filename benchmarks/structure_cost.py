"""Seconds per round and bytes per message of FedLap-Cov's covariance structures on a network.

The main job's setting (docs/results/low_rank_fmnist.toml: a random 10% of Fashion-MNIST, 10
clients, the MLP (200, 100), 2 local epochs), one simulator per structure (``diagonal``,
``last_layer``, ``low_rank`` at its default rank 10, ``kron``; ``--structures`` picks some). Each is compiled and run for
``--warmup`` rounds, then the structures' rounds are interleaved (one round of each, ``--repeats``
times, every round blocked on its results), so that the machine's load falls on all of them alike.
Prints, per structure, the median [min, max] seconds per round, the ratio of the medians to the
diagonal's, and the bytes each client sends (the message's arrays). docs/results/low_rank.md,
docs/results/kron.md.

    PYTHONPATH=src python benchmarks/structure_cost.py --repeats 7
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

import jax
import numpy as np

from fedbayes.config.schema import validate
from fedbayes.runs.build import build_experiment

CONFIG = Path(__file__).resolve().parents[1] / "docs" / "results" / "low_rank_fmnist.toml"
STRUCTURES = ("diagonal", "last_layer", "low_rank", "kron")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=4, help="rounds before timing (the low-rank basis rounds are 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--structures", default=",".join(STRUCTURES), help=f"comma-separated, of {', '.join(STRUCTURES)}; diagonal always runs")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        print("--repeats must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    chosen = [s for s in args.structures.split(",") if s]
    if any(s not in STRUCTURES for s in chosen):
        print(f"--structures: allowed {', '.join(STRUCTURES)}; got {args.structures!r}", file=sys.stderr)
        return 2
    structures = tuple(s for s in STRUCTURES if s == "diagonal" or s in chosen)
    base = tomllib.loads(CONFIG.read_text())["base"]
    sims = {}
    for structure in structures:
        raw = {**base, "name": structure, "algorithm": {"name": "fedlap_cov", "delta": 1.0, "covariance": structure}}
        exp = build_experiment(validate(raw))
        sim = exp.simulator
        state = sim.init(exp.params)
        for _ in range(args.warmup):
            state, _ = sim.run_round(state, donate=True)
        jax.block_until_ready(state.server_state)
        sims[structure] = (sim, state)
        print(f"{structure}: compiled and {args.warmup} rounds run", flush=True)
    times = {s: [] for s in structures}
    for _ in range(args.repeats):
        for structure in structures:
            sim, state = sims[structure]
            start = time.perf_counter()
            state, _ = sim.run_round(state, donate=True)
            jax.block_until_ready(state.server_state)
            times[structure].append(time.perf_counter() - start)
            sims[structure] = (sim, state)
    base_median = float(np.median(times["diagonal"]))
    out = {}
    for structure in structures:
        sim, state = sims[structure]
        t = np.asarray(times[structure])
        _, up = sim.message_bytes(state)
        out[structure] = {"seconds": t.tolist(), "median": float(np.median(t)), "ratio": float(np.median(t)) / base_median, "bytes_up": int(up)}
        print(
            f"{structure:>10}: {np.median(t):.2f} s a round [{t.min():.2f}, {t.max():.2f}], x{np.median(t) / base_median:.2f} the diagonal's; "
            f"{up / 1e6:.2f} MB a message"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
