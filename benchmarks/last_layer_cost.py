"""Seconds per round of the last-layer structure against the diagonal one, interleaved.

The setting of ``examples/fmnist_last_layer.toml`` (the main job's network on 10% of
Fashion-MNIST): each variant is built and its round compiled first, then the variants' rounds
alternate ``--reps`` times, each timed to ``jax.block_until_ready``, so that a noisy machine slows
them alike. Prints each variant's median [min, max] seconds per round, its message bytes and the
ratio of medians against its diagonal twin (docs/results/last_layer.md).

    PYTHONPATH=src python benchmarks/last_layer_cost.py --reps 6
"""

from __future__ import annotations

import argparse
import statistics
import time
import tomllib
from pathlib import Path

import jax

from fedbayes.config.schema import validate
from fedbayes.runs.build import build_experiment

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fmnist_last_layer.toml"
# variant -> its diagonal twin
PAIRS = {"fedlap_cov_last_layer": "fedlap_cov", "fedep_last_layer": "fedep"}


def _config(table: dict, name: str) -> dict:
    base, variant = table["base"], table["variants"][name]
    merged = {**base, **{k: v for k, v in variant.items() if not isinstance(v, dict)}}
    for key in set(base) | set(variant):
        if isinstance(base.get(key), dict) or isinstance(variant.get(key), dict):
            merged[key] = {**base.get(key, {}), **variant.get(key, {})}
    return {**merged, "name": name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6, help="timed rounds per variant (interleaved)")
    parser.add_argument("--variants", default=",".join([*PAIRS.values(), *PAIRS]), help="comma-separated variants of the example")
    args = parser.parse_args()
    table = tomllib.loads(EXAMPLE.read_text())
    names = args.variants.split(",")
    runs = {}
    for name in names:
        exp = build_experiment(validate(_config(table, name)))
        sim = exp.simulator
        state, _ = sim.run_round(sim.init(exp.params))  # compiles the round
        jax.block_until_ready(state.server_state)
        runs[name] = [sim, state, []]
        print(f"{name}: compiled; message {sim.message_bytes(state)[1]:,} bytes up", flush=True)
    for _ in range(args.reps):
        for name in names:
            sim, state, times = runs[name]
            start = time.perf_counter()
            state, _ = sim.run_round(state)
            jax.block_until_ready(state.server_state)
            times.append(time.perf_counter() - start)
            runs[name][1] = state
    medians = {name: statistics.median(times) for name, (_, _, times) in runs.items()}
    for name, (_, _, times) in runs.items():
        line = f"{name}: {medians[name]:.2f} s per round [{min(times):.2f}, {max(times):.2f}] over {len(times)} rounds"
        twin = PAIRS.get(name)
        if twin in medians:
            line += f"; {medians[name] / medians[twin]:.1f}x {twin}'s"
        print(line)


if __name__ == "__main__":
    main()
